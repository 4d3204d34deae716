// `mha explore`: a local web page on the Transformer `mha demo` trained. Type a date: the translation,
// the decoder's confidence and the checks of `mha translate`, and the attention maps of every layer x
// head x kind; switch heads off and watch the answer, the other maps and the held-out accuracy change.
#pragma once

#include <string>

namespace mha_cli {

struct ExploreOptions {
  std::string checkpoint = "mha-demo/checkpoint.safetensors";  // as `mha translate`
  std::string host = "127.0.0.1";                              // loopback: only this machine's users can reach the page
  int port = 8765;                                             // 0: any free port (printed)
  int threads = 1;                                             // OpenMP threads per request; requests run side by side
};

// Serves until Ctrl-C (SIGINT) or SIGTERM, then returns 0. Prints the page's address on standard output
// once it listens. Throws std::runtime_error for a missing or unreadable checkpoint, or an address it
// cannot listen on.
int run_explore(const ExploreOptions& options);

}  // namespace mha_cli
