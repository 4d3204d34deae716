// The HTTP side of `mha explore` (cpp-httplib, Debian's libcpp-httplib-dev): the page's files, the
// JSON API (explore_api.hpp), the limits on requests, and an orderly stop on SIGINT / SIGTERM.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <string>

#include "explore/explore_api.hpp"

namespace mha_cli::explore {

inline constexpr std::size_t kMaxBodyBytes = 16 * 1024;  // a request's body; larger ones get 413
inline constexpr std::chrono::seconds kStopTime{5};      // from SIGINT / SIGTERM to the exit, at most

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8765;           // 0: any free port
  std::size_t workers = 64;  // threads: one per open connection (keep-alive holds one); the limits on
                             // connections are in guarded_connection.hpp
};

// Serves until SIGINT or SIGTERM (block_stop_signals() must have been called before any thread was
// started). `on_listening(port)` is called once the socket is bound. Returns when stopped, after the
// requests already read are answered; throws std::runtime_error when it cannot bind. When requests
// still compute kStopTime after the signal, it prints "mha explore: stopped (...)" and ends the
// process itself (status 0).
void serve(ExploreApi& api, const ServerOptions& options, const std::function<void(int)>& on_listening);

}  // namespace mha_cli::explore
