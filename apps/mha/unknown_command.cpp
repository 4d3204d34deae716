#include "unknown_command.hpp"

#include <algorithm>
#include <cstddef>

namespace mha_cli {

namespace {

// Levenshtein distance: insertions, deletions and substitutions of one character each.
std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];  // row[i - 1][j - 1]
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

}  // namespace

std::optional<std::string> nearest_command(const std::string& word, const std::vector<std::string>& commands) {
  std::optional<std::string> best;
  std::size_t best_distance = 3;  // farther than 2 edits is no suggestion
  for (const std::string& command : commands) {
    const std::size_t distance =
        !word.empty() && command.compare(0, word.size(), word) == 0 ? 1 : edit_distance(word, command);
    if (distance < best_distance) best = command, best_distance = distance;
  }
  return best;
}

std::string unknown_command_message(const std::string& word, const std::vector<std::string>& commands) {
  std::string message = "unknown command '" + word + "'";
  if (const auto nearest = nearest_command(word, commands)) message += "; did you mean '" + *nearest + "'?";
  message += " (commands:";
  for (std::size_t i = 0; i < commands.size(); ++i) message += (i ? ", " : " ") + commands[i];
  return message + "; `mha --help` says more)";
}

}  // namespace mha_cli
