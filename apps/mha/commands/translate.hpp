// `mha translate`: normalises dates with the Transformer checkpoint that `mha demo` trains.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace mha_cli {

struct TranslateOptions {
  std::vector<std::string> texts;  // empty: read lines from standard input
  std::string checkpoint = "mha-demo/checkpoint.safetensors";
  std::int64_t beams = 1;  // 1: greedy decoding; K > 1: beam search with K beams (transformer::beam_translate)
  // The decoder's self-attention cache: "float32" (the model's own), or "int8" / "fp8" (mha::KVStorage
  // Int8 / Float8E4M3), which decode through beam search with `beams` beams (1: greedy).
  std::string kv_cache = "float32";
  int threads = 0;
};

// Adds --kv-cache (TranslateOptions::kv_cache) to the `mha translate` subcommand: its help, and the
// refusal of any other value (CLI11's message, which names the option), exit status 2.
void add_kv_cache_option(CLI::App& translate, TranslateOptions& options);

// Exit statuses of run_translate besides 0 (every answer confident).
inline constexpr int kTranslateFailed = 1;  // some inputs could not be translated (errors on standard error)
inline constexpr int kTranslateUnsure = 3;  // every input translated, some answers marked unsure

// Prints one line per input, in order: the ISO date ("2021-03-05", exactly) when the answer passes the
// checks; "? ANSWER  REASON" when it does not (not yyyy-mm-dd, not a calendar date, outside the years
// the model knows, not the year the input states in four digits or two, or a confidence below the
// checkpoint's "unsure_below"); "? not translated: REASON" for an
// input that cannot be read (empty, too long, characters outside the vocabulary), whose error also goes
// to standard error. Throws std::runtime_error for a missing checkpoint (saying how to make one) or one
// that cannot be read.
int run_translate(const TranslateOptions& options);

}  // namespace mha_cli
