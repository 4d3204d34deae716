// `mha translate`: normalises dates with the Transformer checkpoint that `mha demo` trains.
#pragma once

#include <string>
#include <vector>

namespace mha_cli {

struct TranslateOptions {
  std::vector<std::string> texts;  // empty: read lines from standard input
  std::string checkpoint = "mha-demo/checkpoint.safetensors";
  int threads = 0;
};

// Prints one ISO date per input, in order. Every input is checked before anything is printed; throws
// std::runtime_error for a missing checkpoint (saying how to make one) or an input that cannot be read.
int run_translate(const TranslateOptions& options);

}  // namespace mha_cli
