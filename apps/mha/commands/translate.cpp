// `mha translate` (translate.hpp).
#include "commands/translate.hpp"

#include <filesystem>
#include <iostream>
#include <stdexcept>

#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include "commands/translate_checks.hpp"
#include "mha/attention.hpp"
#include "mha/paged_kv_cache.hpp"
#include "render/terminal_text.hpp"
#include "transformer/checkpoint.hpp"
#include "transformer/dates.hpp"
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

// Why `text` cannot be translated (empty, too long, outside the vocabulary), naming the input (its
// position, and "line" when it came from standard input) and quoting it with its non-printable bytes as
// \xNN: a NUL would cut the message short, an ESC drive the terminal. Empty when it can be.
std::string input_problem(const std::string& text, std::size_t index, bool from_stdin,
                          const transformer::Vocabulary& vocab) {
  const std::string where = fmt::format("{} {}", from_stdin ? "line" : "input", index + 1);
  if (text.empty()) return where + " is empty: expected a date such as \"Friday, 5 March 2021\"";
  if (text.size() > kMaxInputLength)
    return fmt::format("{} has {} characters; at most {} are accepted", where, text.size(), kMaxInputLength);
  try {
    vocab.encode(text);
  } catch (const std::invalid_argument& e) {
    return fmt::format("{} {}: {}", where, quoted_printable(text), e.what());
  }
  return "";
}

// --kv-cache's values, and the storage each names.
mha::KVStorage kv_storage(const std::string& kv_cache) {
  if (kv_cache == "int8") return mha::KVStorage::Int8;
  if (kv_cache == "fp8") return mha::KVStorage::Float8E4M3;
  if (kv_cache == "float32") return mha::KVStorage::Native;
  throw std::invalid_argument("--kv-cache: expected float32, int8 or fp8, got " + quoted_printable(kv_cache));
}

}  // namespace

void add_kv_cache_option(CLI::App& translate, TranslateOptions& o) {
  translate
      .add_option("--kv-cache", o.kv_cache,
                  "The decoder's self-attention cache: float32 (the model's own), or int8 / fp8 (e4m3), each "
                  "(position, head) row of keys and values stored in one byte per element with a float32 scale; "
                  "int8 and fp8 decode through beam search with --beam beams (1: greedy)")
      ->check(CLI::IsMember({"float32", "int8", "fp8"}))
      ->capture_default_str();
}

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
  // Each input gets its own answer or its own error: a bad line never costs the good ones theirs. The
  // model reads the input as the trained formats write it (spacing, trailing periods, names' case).
  std::vector<std::string> normalized(texts.size()), problems(texts.size()), readable;
  for (std::size_t i = 0; i < texts.size(); ++i) {
    normalized[i] = transformer::normalize_date_text(texts[i]);
    problems[i] = input_problem(normalized[i], i, from_stdin, vocab);
    if (problems[i].empty()) readable.push_back(normalized[i]);
    else fmt::print(stderr, "mha: error: {}\n", problems[i]);
  }
  std::vector<transformer::Translation> answers;
  double unsure_below = 0.0;  // a checkpoint from before the threshold was stored: no confidence check
  if (!readable.empty()) {
    transformer::Checkpoint checkpoint = transformer::load_checkpoint(options.checkpoint);
    if (const auto it = checkpoint.metadata.find("unsure_below"); it != checkpoint.metadata.end())
      unsure_below = confidence_threshold(it->second, options.checkpoint);
    const mha::KVStorage storage = kv_storage(options.kv_cache);
    answers = options.beams == 1 && storage == mha::KVStorage::Native
                  ? transformer::translate_with_confidence(*checkpoint.model, vocab, readable)
                  : transformer::beam_translate(*checkpoint.model, vocab, readable, options.beams, 250, storage);
  }
  bool failed = false, unsure = false;
  for (std::size_t i = 0, next = 0; i < texts.size(); ++i) {
    if (!problems[i].empty()) {
      fmt::print("? not translated: {}\n", problems[i]);
      failed = true;
      continue;
    }
    const transformer::Translation& translation = answers[next++];
    const std::string why = translation_doubt(normalized[i], translation, unsure_below);
    fmt::print("{}\n", answer_line(terminal_safe(translation.text), why));
    unsure = unsure || !why.empty();
  }
  return failed ? kTranslateFailed : unsure ? kTranslateUnsure : 0;
}

}  // namespace mha_cli
