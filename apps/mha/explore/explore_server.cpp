// The HTTP side of `mha explore` (explore_server.hpp).
#include "explore/explore_server.hpp"

#include <signal.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <thread>

#include <fmt/core.h>
#include <httplib.h>

#include "explore/page_files.hpp"
#include "explore/request_error.hpp"
#include "explore/stop_signals.hpp"

namespace mha_cli::explore {

namespace {

constexpr std::size_t kKeepAliveRequests = 1000;  // requests per connection before httplib closes it
constexpr int kNotFound = 404, kMethodNotAllowed = 405, kPayloadTooLarge = 413, kServerError = 500;

// JSON text safe for any message: bytes that are not UTF-8 (from a request) become U+FFFD.
std::string json_text(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

void reply_json(httplib::Response& res, int status, const nlohmann::json& body) {
  res.status = status;
  res.set_header("Cache-Control", "no-store");
  res.set_content(json_text(body), "application/json");
}

// Runs an API call for a POST: its answer (200), or its RequestError's status and message.
void answer(httplib::Response& res, const std::function<nlohmann::json()>& call) {
  try {
    reply_json(res, 200, call());
  } catch (const RequestError& e) {
    reply_json(res, e.status(), {{"error", e.what()}});
  }
}

// The message of an error status httplib set itself (no handler ran, or none wrote a body).
std::string status_message(const httplib::Request& req, int status) {
  switch (status) {
    case kNotFound: return fmt::format("no such path: {} {}", req.method, req.path);
    case kPayloadTooLarge: return fmt::format("the request's body is over {} bytes", kMaxBodyBytes);
    default: return fmt::format("HTTP {}", status);
  }
}

void add_routes(httplib::Server& server, ExploreApi& api) {
  for (const PageFile& file : page_files()) {
    server.Get(std::string(file.path), [file](const httplib::Request&, httplib::Response& res) {
      res.set_header("Content-Security-Policy", "default-src 'self'");  // nothing from elsewhere, no inline code
      res.set_content(file.body.data(), file.body.size(), fmt::format("{}; charset=utf-8", file.content_type));
    });
  }
  server.Get("/api/model",
             [&api](const httplib::Request&, httplib::Response& res) { reply_json(res, 200, api.model()); });
  server.Post("/api/translate", [&api](const httplib::Request& req, httplib::Response& res) {
    answer(res, [&] { return api.translate(req.body); });
  });
  server.Post("/api/accuracy", [&api](const httplib::Request& req, httplib::Response& res) {
    answer(res, [&] { return api.accuracy(req.body); });
  });
  for (const char* path : {"/api/translate", "/api/accuracy"}) {
    server.Get(path, [path](const httplib::Request&, httplib::Response& res) {
      reply_json(res, kMethodNotAllowed, {{"error", fmt::format("{} takes POST with a JSON body", path)}});
    });
  }
}

void add_error_handlers(httplib::Server& server) {
  server.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (res.body.empty()) reply_json(res, res.status, {{"error", status_message(req, res.status)}});
  });
  server.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    fmt::print(stderr, "mha explore: error while answering a request: {}\n", what);
    reply_json(res, kServerError, {{"error", fmt::format("the server failed: {}", what)}});
  });
}

}  // namespace

void serve(ExploreApi& api, const ServerOptions& options, const std::function<void(int)>& on_listening) {
  httplib::Server server;
  server.new_task_queue = [workers = options.workers] { return new httplib::ThreadPool(workers); };
  server.set_payload_max_length(kMaxBodyBytes);
  // httplib closes a keep-alive connection after 5 requests by default; every reconnect then goes
  // through the listen queue, which Debian's build sizes at 5 (CPPHTTPLIB_LISTEN_BACKLOG), and a
  // connection refused there waits a second for its SYN to be sent again.
  server.set_keep_alive_max_count(kKeepAliveRequests);
  // SO_REUSEADDR (a restart may bind while old connections linger): httplib's default sets SO_REUSEPORT
  // instead, with which a second server binds the same port and the kernel shares the connections
  // between the two, silently.
  server.set_socket_options([](socket_t sock) {
    const int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  add_routes(server, api);
  add_error_handlers(server);
  const int port = options.port == 0 ? server.bind_to_any_port(options.host)
                                     : (server.bind_to_port(options.host, options.port) ? options.port : -1);
  if (port < 0)
    throw std::runtime_error(
        fmt::format("cannot listen on {}:{} (in use, or not an address of this machine)", options.host, options.port));
  std::atomic<bool> finished{false};
  StopSignalWatcher watcher([&](int signal) {
    fmt::print(stderr, "mha explore: {} received, stopping\n", signal == SIGINT ? "SIGINT" : "SIGTERM");
    // A signal that comes before listen_after_bind has started waits for it: stop() does nothing before.
    while (!server.is_running() && !finished) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    server.stop();
  });
  on_listening(port);
  server.listen_after_bind();
  finished = true;
}

}  // namespace mha_cli::explore
