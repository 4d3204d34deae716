// What `mha WORD` says when WORD is not one of its commands: the word itself and the nearest command,
// instead of CLI11's "A subcommand is required".
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace mha_cli {

// The command among `commands` nearest to `word` (edit distance at most 2, or `word` a prefix of it);
// none when nothing is that close.
std::optional<std::string> nearest_command(const std::string& word, const std::vector<std::string>& commands);

// The one-line error for an unknown command: "unknown command 'translat'; did you mean 'translate'?
// (commands: ...; `mha --help` says more)".
std::string unknown_command_message(const std::string& word, const std::vector<std::string>& commands);

}  // namespace mha_cli
