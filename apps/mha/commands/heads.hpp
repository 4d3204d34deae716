// `mha heads`: multi-head attention with hand-built heads that each attend by a different rule
// (previous token, next token, same symbol, first token), measured, checked, and drawn.
#pragma once

#include <string>

namespace mha_cli {

struct HeadsOptions {
  std::string out_dir = "mha-heads";            // where the attention maps and index.html go
  int threads = 0;                              // 0: the library's default
  std::string text = "the cat sat on the mat";  // one token per character
};

// Runs `mha heads`, printing to stdout. Returns 0 when every head follows its rule, 1 (after saying why
// on stderr) when one does not. Throws mha::Error or std::runtime_error on other failures.
int run_heads(const HeadsOptions& options);

}  // namespace mha_cli
