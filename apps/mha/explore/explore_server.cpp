// The HTTP side of `mha explore` (explore_server.hpp).
#include "explore/explore_server.hpp"

#include <signal.h>
#include <strings.h>
#include <sys/socket.h>

#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <optional>
#include <stdexcept>
#include <thread>

#include <fmt/core.h>
#include <httplib.h>

#include "explore/guarded_connection.hpp"
#include "explore/page_files.hpp"
#include "explore/request_error.hpp"
#include "explore/stop_signals.hpp"

namespace mha_cli::explore {

namespace {

constexpr int kNotFound = 404, kMethodNotAllowed = 405, kLengthRequired = 411, kPayloadTooLarge = 413,
              kUnsupportedMediaType = 415, kServerError = 500;

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
    case kBadRequest:
      return fmt::format("a malformed request, or one over {} KiB with its headers, or sent over {} s",
                         kMaxRequestBytes / 1024, kRequestTime.count());
    default: return fmt::format("HTTP {}", status);
  }
}

bool header_is(const httplib::Request& req, const char* name, const char* value) {
  return strcasecmp(req.get_header_value(name).c_str(), value) == 0;
}

// Why a request is refused as soon as its headers are read, before any of its body (nothing when it
// is not): a body must have one plain length within kMaxBodyBytes, or come in chunks (counted as they
// are read, read_body); one without a length would be read until the client closes. Not compressed:
// httplib would inflate it past any limit.
std::optional<RequestError> refusal(const httplib::Request& req) {
  const bool chunked = req.has_header("Transfer-Encoding");
  if (chunked &&
      (req.get_header_value_count("Transfer-Encoding") != 1 || !header_is(req, "Transfer-Encoding", "chunked")))
    return RequestError("Transfer-Encoding: only \"chunked\" is accepted");
  if (chunked && req.has_header("Content-Length"))
    return RequestError("a request has a Content-Length or Transfer-Encoding: chunked, not both");
  if (req.has_header("Content-Encoding") && !header_is(req, "Content-Encoding", "identity"))
    return RequestError("Content-Encoding: not accepted; send the JSON uncompressed", kUnsupportedMediaType);
  if (req.is_multipart_form_data())
    return RequestError("Content-Type: multipart/form-data is not accepted; send JSON", kUnsupportedMediaType);
  if (req.has_header("Content-Length")) {
    const std::string length = req.get_header_value("Content-Length");
    std::uint64_t bytes = 0;
    const auto [end, error] = std::from_chars(length.data(), length.data() + length.size(), bytes);
    if (req.get_header_value_count("Content-Length") != 1 || length.empty() ||
        length.find_first_not_of("0123456789") != std::string::npos)
      return RequestError("Content-Length: expected one decimal number of bytes");
    if (error == std::errc::result_out_of_range || bytes > kMaxBodyBytes)
      return RequestError(fmt::format("the request's body is over {} bytes", kMaxBodyBytes), kPayloadTooLarge);
  } else if (!chunked &&
             (req.method == "POST" || req.method == "PUT" || req.method == "PATCH" || req.method == "PRI")) {
    return RequestError(fmt::format("a {} needs a Content-Length header (or Transfer-Encoding: chunked)", req.method),
                        kLengthRequired);
  }
  return std::nullopt;
}

// Answers the request's refusal, if it has one.
bool refused(const httplib::Request& req, httplib::Response& res) {
  const std::optional<RequestError> refused = refusal(req);
  if (refused) reply_json(res, refused->status(), {{"error", refused->what()}});
  return refused.has_value();
}

// Whether the request's body may stay unread, in part or whole, once it is answered: refused, chunked
// (read only up to the limit), or a body on a method httplib does not read one for. The connection
// then closes after the answer: what follows on it is not a request.
bool body_left_unread(const httplib::Request& req) {
  const bool read_by_httplib = req.method == "POST" || req.method == "PUT" || req.method == "PATCH" ||
                               req.method == "DELETE" || req.method == "PRI";
  return req.has_header("Transfer-Encoding") || refusal(req).has_value() ||
         (!read_by_httplib && req.has_header("Content-Length") && req.get_header_value("Content-Length") != "0");
}

// The body, through a running count: httplib's payload_max_length is checked against a Content-Length
// only, and a chunked body would be read whole.
std::string read_body(const httplib::ContentReader& reader) {
  std::string body;
  bool over = false;
  const bool read = reader([&](const char* data, std::size_t size) {
    over = body.size() + size > kMaxBodyBytes;
    if (!over) body.append(data, size);
    return !over;
  });
  if (over) throw RequestError(fmt::format("the request's body is over {} bytes", kMaxBodyBytes), kPayloadTooLarge);
  if (!read) throw RequestError("the request's body could not be read (cut short, sent too slowly, or bad chunks)");
  return body;
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
  server.Post("/api/translate",
              [&api](const httplib::Request&, httplib::Response& res, const httplib::ContentReader& reader) {
                answer(res, [&] { return api.translate(read_body(reader)); });
              });
  server.Post("/api/accuracy",
              [&api](const httplib::Request&, httplib::Response& res, const httplib::ContentReader& reader) {
                answer(res, [&] { return api.accuracy(read_body(reader)); });
              });
  for (const char* path : {"/api/translate", "/api/accuracy"}) {
    server.Get(path, [path](const httplib::Request&, httplib::Response& res) {
      reply_json(res, kMethodNotAllowed, {{"error", fmt::format("{} takes POST with a JSON body", path)}});
    });
  }
}

void add_error_handlers(httplib::Server& server) {
  // A refusal is answered before routing, and before "100 Continue" to a client that waits for it.
  server.set_pre_routing_handler([](const httplib::Request& req, httplib::Response& res) {
    return refused(req, res) ? httplib::Server::HandlerResponse::Handled : httplib::Server::HandlerResponse::Unhandled;
  });
  server.set_expect_100_continue_handler(
      [](const httplib::Request& req, httplib::Response& res) { return refused(req, res) ? res.status : 100; });
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
  GuardedServer server(options.workers, body_left_unread);
  server.set_payload_max_length(kMaxBodyBytes);
  // GuardedServer keeps a connection open for kKeepAliveRequests requests (httplib's default, 5, would
  // send every sixth request through the listen queue, which Debian's build sizes at 5
  // (CPPHTTPLIB_LISTEN_BACKLOG); a connection refused there waits a second for its SYN to be sent
  // again) and kIdleTime between them; httplib writes these two in its Keep-Alive header.
  server.set_keep_alive_max_count(kKeepAliveRequests);
  server.set_keep_alive_timeout(kIdleTime.count());
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
  server.deepen_listen_queue();
  std::atomic<bool> finished{false};
  StopSignalWatcher watcher([&](int signal) {
    fmt::print(stderr, "mha explore: {} received, stopping\n", signal == SIGINT ? "SIGINT" : "SIGTERM");
    // A signal that comes before listen_after_bind has started waits for it: stop() does nothing before.
    while (!server.is_running() && !finished) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    server.stop();
    // Connections idle or still sending close within kTick, answers that wait on their client within a
    // tick of the stop; a request still computing after kStopTime (many queued for the model copies)
    // is dropped: the process ends here.
    const auto until = std::chrono::steady_clock::now() + kStopTime;
    while (!finished && std::chrono::steady_clock::now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (finished) return;
    fmt::print("mha explore: stopped ({} s after the signal; the requests still computing were dropped)\n",
               kStopTime.count());
    std::fflush(stdout);
    std::_Exit(0);
  });
  on_listening(port);
  server.listen_after_bind();
  finished = true;
}

}  // namespace mha_cli::explore
