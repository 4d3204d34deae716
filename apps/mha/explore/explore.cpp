// `mha explore` (explore.hpp): loads the model, then serves the page and the API.
#include "explore/explore.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <thread>

#include <fmt/core.h>

#include "explore/explore_api.hpp"
#include "explore/explore_server.hpp"
#include "explore/model_pool.hpp"
#include "explore/stop_signals.hpp"
#include "render/terminal_text.hpp"

namespace mha_cli {

namespace {

bool is_loopback(const std::string& host) {
  return host == "127.0.0.1" || host == "localhost" || host == "::1" || host.starts_with("127.");
}

}  // namespace

int run_explore(const ExploreOptions& options) {
  // First, before any thread starts: Ctrl-C and SIGTERM go to the server's watcher thread alone.
  explore::block_stop_signals();
  if (!std::filesystem::exists(options.checkpoint))
    throw std::runtime_error(fmt::format(
        "no checkpoint at {}: train one with `mha demo` (about 2 minutes; it writes mha-demo/checkpoint.safetensors), "
        "or pass --checkpoint FILE",
        quoted_printable(options.checkpoint)));
  if (!is_loopback(options.host))
    fmt::print(stderr,
               "mha explore: warning: listening on {}, not on loopback: anyone who can reach this machine can use the "
               "page and the API (there is no authentication)\n",
               terminal_safe(options.host));
  // One model copy per request running at a time: as many as the cores (requests beyond wait their turn).
  const std::size_t copies = std::clamp<std::size_t>(std::thread::hardware_concurrency(), 2, 16);
  explore::ModelPool pool(options.checkpoint, copies);
  explore::ExploreApi api(pool, options.checkpoint, options.threads);
  explore::ServerOptions server;
  server.host = options.host;
  server.port = options.port;
  explore::serve(api, server, [&](int port) {
    const bool v6 = options.host.find(':') != std::string::npos;
    fmt::print("mha explore: http://{}:{}/ ({}; Ctrl-C stops)\n", v6 ? "[" + options.host + "]" : options.host, port,
               terminal_safe(options.checkpoint));
    std::fflush(stdout);
  });
  fmt::print("mha explore: stopped\n");
  return 0;
}

}  // namespace mha_cli
