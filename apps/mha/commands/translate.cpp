// `mha translate` (translate.hpp).
#include "commands/translate.hpp"

#include <filesystem>
#include <iostream>
#include <stdexcept>

#include <fmt/core.h>

#include "mha/attention.hpp"
#include "render/terminal_text.hpp"
#include "transformer/checkpoint.hpp"
#include "transformer/training.hpp"
#include "transformer/vocabulary.hpp"

namespace mha_cli {

namespace {

constexpr std::size_t kMaxInputLength = 256;  // the model saw at most 36 characters; this bounds memory

std::vector<std::string> read_lines(std::istream& in) {
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(line);
  }
  return lines;
}

// Throws naming the input (its position, and "line" when it came from standard input) and quoting it
// with its non-printable bytes as \xNN: a NUL would cut the message short, an ESC drive the terminal.
void check_input(const std::string& text, std::size_t index, bool from_stdin, const transformer::Vocabulary& vocab) {
  const std::string where = fmt::format("{} {}", from_stdin ? "line" : "input", index + 1);
  if (text.empty()) throw std::runtime_error(where + " is empty: expected a date such as \"Friday, 5 March 2021\"");
  if (text.size() > kMaxInputLength)
    throw std::runtime_error(
        fmt::format("{} has {} characters; at most {} are accepted", where, text.size(), kMaxInputLength));
  try {
    vocab.encode(text);
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(fmt::format("{} {}: {}", where, quoted_printable(text), e.what()));
  }
}

}  // namespace

int run_translate(const TranslateOptions& options) {
  if (options.threads > 0) mha::set_num_threads(options.threads);
  if (!std::filesystem::exists(options.checkpoint))
    throw std::runtime_error(fmt::format(
        "no checkpoint at {}: train one with `mha demo` (about 2 minutes; it writes mha-demo/checkpoint.safetensors), "
        "or pass --checkpoint FILE",
        quoted_printable(options.checkpoint)));
  const bool from_stdin = options.texts.empty();
  const std::vector<std::string> texts = from_stdin ? read_lines(std::cin) : options.texts;
  const transformer::Vocabulary vocab;
  for (std::size_t i = 0; i < texts.size(); ++i) check_input(texts[i], i, from_stdin, vocab);

  transformer::Checkpoint checkpoint = transformer::load_checkpoint(options.checkpoint);
  for (const std::string& iso : transformer::translate(*checkpoint.model, vocab, texts)) fmt::print("{}\n", iso);
  return 0;
}

}  // namespace mha_cli
