// The connections of `mha explore` (explore_server.cpp), guarded against clients that are slow, idle or
// send too much (issue 30). cpp-httplib 0.11 (Debian's libcpp-httplib-dev, compiled as a library, so its
// CPPHTTPLIB_* settings cannot be changed from here) does not bound them on its own:
// - its read timeout is per read: a client sending a header byte every few seconds holds a thread for
//   as long as it likes; one that sends nothing holds a thread for the keep-alive timeout; and the
//   connections accepted meanwhile queue, unbounded, behind all of them;
// - its payload_max_length is checked against a Content-Length only: a chunked body, or a body without
//   a length (read until the client closes), is read whole into memory; a header line grows without
//   bound before its length is checked;
// - on stop it joins every connection's thread, so a slow client delays the exit for as long as it trickles.
// GuardedServer therefore serves each connection itself (it overrides httplib's virtual
// process_and_close_socket, as httplib's own SSLServer does) through a GuardedStream, which gives each
// request a deadline and a byte budget and stops waiting when the server stops. Header-only: it has
// one user, explore_server.cpp.
#pragma once

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>

#include <fmt/core.h>
#include <httplib.h>

namespace mha_cli::explore {

// The limits on connections (docs/EXPLORE.md states them). A browser or a script on loopback sends a
// request in one write and reads its answer at once: each limit is far above what one needs.
// (The connections served at once, one thread each, are ServerOptions::workers: 64.)
using std::chrono::milliseconds, std::chrono::seconds;
inline constexpr std::size_t kMaxWaitingConnections = 256;  // waiting for a thread; more: 503, closed at once
inline constexpr seconds kRequestTime{5};                   // a request's line, headers and body, from its first byte
inline constexpr seconds kRequestTimeBusy{1};               // the same while connections wait for a thread
inline constexpr seconds kIdleTime{5};                      // a connection waiting for its first or next request
inline constexpr milliseconds kIdleTimeBusy{100};           // the same while connections wait for a thread
inline constexpr seconds kAnswerTime{5};                    // an answer's bytes, from the first, to a client that reads
inline constexpr std::size_t kMaxRequestBytes = 64 * 1024;  // line + headers + body (+ chunk sizes), as read
inline constexpr int kListenBacklog = 128;                  // connections not yet accepted (httplib's: 5)
inline constexpr std::size_t kKeepAliveRequests = 1000;     // requests per connection (httplib's default: 5)
inline constexpr milliseconds kTick{100};        // how often a waiting connection looks at the clock and the stop
inline constexpr milliseconds kLingerTime{500};  // after a refusal that left a body unread ...
inline constexpr std::size_t kLingerBytes = 256 * 1024;  // ... what is read and dropped, at most

// The socket of one connection as httplib reads and writes it, with the limits above: a read fails
// once the request is over its deadline or its budget, or the server stops; a write fails once the
// answer is over its time, or when it would wait while the server stops.
class GuardedStream final : public httplib::Stream {
 public:
  using Clock = std::chrono::steady_clock;

  // busy(): connections wait for a thread; stopping(): the server stops.
  GuardedStream(socket_t sock, std::function<bool()> busy, std::function<bool()> stopping)
      : sock_(sock), busy_(std::move(busy)), stopping_(std::move(stopping)) {}

  // Waits for the next request's first byte: false after kIdleTime (kIdleTimeBusy while busy), on stop,
  // or when the connection is to close. True also when the client hung up (process_request sees it).
  bool wait_for_request() {
    if (close_ || cut_ || stopping_()) return false;
    if (off_ < len_) return true;  // a pipelined request is here already
    const auto since = Clock::now();
    return wait(POLLIN, [&] { return stopping_() || Clock::now() - since > (busy_() ? kIdleTimeBusy : kIdleTime); });
  }
  void start_request() { request_start_ = Clock::now(), request_bytes_ = 0, answer_start_.reset(); }
  void close_after_request() { close_ = true; }
  bool close_requested() const { return close_; }

  // After an answer that left request bytes unread: the answer ended (FIN), then what the client still
  // sends is read and dropped for a moment, so that closing does not reset the connection (and discard
  // the answer) before a client that writes its whole body before reading has read it.
  void linger() {
    ::shutdown(sock_, SHUT_WR);
    const auto until = Clock::now() + kLingerTime;
    char sink[4096];
    for (std::size_t dropped = 0; dropped < kLingerBytes && Clock::now() < until;) {
      if (!wait(POLLIN, [&] { return Clock::now() >= until; })) return;
      const ssize_t n = ::recv(sock_, sink, sizeof(sink), MSG_DONTWAIT);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return;
      dropped += n > 0 ? static_cast<std::size_t>(n) : 0;
    }
  }

  bool is_readable() const override { return off_ < len_ || ready(POLLIN); }
  bool is_writable() const override { return ready(POLLOUT); }

  ssize_t read(char* ptr, std::size_t size) override {
    // Checked on every read, not only when waiting: a client that trickles keeps the socket readable.
    if (cut_ || request_overdue() || stopping_()) return cut();
    while (off_ == len_) {
      if (!wait(POLLIN, [this] { return request_overdue() || stopping_(); })) return cut();
      const ssize_t n = ::recv(sock_, buffer_, sizeof(buffer_), MSG_DONTWAIT);
      if (n == 0) return 0;  // the client closed
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
      if (n < 0) return -1;
      off_ = 0, len_ = static_cast<std::size_t>(n);
    }
    const std::size_t n = std::min(size, len_ - off_);
    if ((request_bytes_ += n) > kMaxRequestBytes) return cut();
    std::memcpy(ptr, buffer_ + off_, n);
    off_ += n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, std::size_t size) override {
    if (!answer_start_) answer_start_ = Clock::now();
    const auto over = [this] { return Clock::now() - *answer_start_ > kAnswerTime; };
    while (!over()) {  // checked on every write: a client that reads a byte at a time keeps the socket writable
      const ssize_t n = ::send(sock_, ptr, size, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n >= 0) return n;
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return -1;
      if (!wait(POLLOUT, [&] { return stopping_() || over(); })) return -1;
    }
    return -1;
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override { address(::getpeername, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { address(::getsockname, ip, port); }
  socket_t socket() const override { return sock_; }

 private:
  bool request_overdue() const { return Clock::now() - request_start_ > (busy_() ? kRequestTimeBusy : kRequestTime); }
  ssize_t cut() {
    cut_ = true;
    return -1;
  }
  bool ready(short events) const {
    pollfd p{sock_, events, 0};
    return ::poll(&p, 1, 0) > 0;
  }
  // Waits until the socket is ready for `events` (or has an error, which the next recv / send reports),
  // looking at give_up() every kTick.
  bool wait(short events, const std::function<bool()>& give_up) const {
    pollfd p{sock_, events, 0};
    for (;;) {
      const int n = ::poll(&p, 1, static_cast<int>(kTick.count()));
      if (n > 0) return true;
      if ((n < 0 && errno != EINTR) || give_up()) return false;
    }
  }
  void address(int (*get)(int, sockaddr*, socklen_t*), std::string& ip, int& port) const {
    sockaddr_storage storage{};
    socklen_t length = sizeof(storage);
    char host[NI_MAXHOST], service[NI_MAXSERV];
    ip.clear(), port = 0;
    auto* addr = reinterpret_cast<sockaddr*>(&storage);
    if (get(sock_, addr, &length) == 0 &&
        getnameinfo(addr, length, host, sizeof(host), service, sizeof(service), NI_NUMERICHOST | NI_NUMERICSERV) == 0)
      ip = host, port = std::atoi(service);
  }

  socket_t sock_;
  std::function<bool()> busy_, stopping_;
  char buffer_[4096];
  std::size_t off_ = 0, len_ = 0;                  // buffer_[off_, len_): read from the socket, not yet by httplib
  Clock::time_point request_start_;                // the current request's first byte
  std::size_t request_bytes_ = 0;                  // what httplib has read of it
  std::optional<Clock::time_point> answer_start_;  // the current answer's first write
  bool cut_ = false;                               // a read failed a limit: the connection closes
  bool close_ = false;                             // the connection closes after the current answer
};

// httplib's thread pool, counting the connections accepted that no thread has taken yet. The accepting
// thread hands a connection over as a closure on the socket, which it does not show: beyond
// kMaxWaitingConnections the closure is run right there with refusing() set, and GuardedServer answers 503.
class CountingThreadPool final : public httplib::TaskQueue {
 public:
  CountingThreadPool(std::size_t threads, std::atomic<std::size_t>& waiting) : pool_(threads), waiting_(waiting) {}
  void enqueue(std::function<void()> fn) override {
    if (waiting_ >= kMaxWaitingConnections) {
      refusing() = true;
      fn();
      refusing() = false;
      return;
    }
    ++waiting_;
    pool_.enqueue([this, fn = std::move(fn)] {
      --waiting_;
      fn();
    });
  }
  void shutdown() override { pool_.shutdown(); }
  static bool& refusing() {
    thread_local bool on = false;
    return on;
  }

 private:
  httplib::ThreadPool pool_;
  std::atomic<std::size_t>& waiting_;
};

// httplib::Server whose connections are served through GuardedStream by `threads` threads, and closed
// after a request for which body_left_unread(request) holds (what follows it on the connection is not
// a request). stop() as httplib's: listen_after_bind() then returns once the requests already read are
// answered; connections idle or still sending are closed within kTick.
class GuardedServer : public httplib::Server {
 public:
  GuardedServer(std::size_t threads, std::function<bool(const httplib::Request&)> body_left_unread)
      : threads_(threads), body_left_unread_(std::move(body_left_unread)) {
    new_task_queue = [this, threads] { return new CountingThreadPool(threads, waiting_); };
  }

  // Once bound. Debian's httplib listens with a queue of 5 (CPPHTTPLIB_LISTEN_BACKLOG, compiled in): a
  // burst of connections overflows it, and each one dropped there waits a second for its SYN to be
  // sent again. listen() again on the listening socket sets a deeper queue (Linux takes the new backlog).
  void deepen_listen_queue() { ::listen(svr_sock_, kListenBacklog); }

 private:
  bool stopping() const { return svr_sock_ == INVALID_SOCKET; }
  // Every thread holds a connection and more connections wait (not merely one just handed over).
  bool busy() const { return waiting_ > 0 && active_ >= threads_; }

  bool process_and_close_socket(socket_t sock) override {
    if (CountingThreadPool::refusing()) {
      const std::string body =
          fmt::format("{{\"error\": \"the server has {} connections waiting; try again\"}}", kMaxWaitingConnections);
      const std::string answer =
          fmt::format("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {}\r\n"
                      "Connection: close\r\n\r\n{}",
                      body.size(), body);
      ::send(sock, answer.data(), answer.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    } else {
      ++active_;
      serve_connection(sock);
      --active_;
    }
    ::shutdown(sock, SHUT_RDWR);
    ::close(sock);
    return true;
  }

  void serve_connection(socket_t sock) {
    GuardedStream stream(
        sock, [this] { return busy(); }, [this] { return stopping(); });
    const auto mark = [&](httplib::Request& req) {  // once the headers are read, before the body
      if (!body_left_unread_(req)) return;
      req.headers.erase("Connection");
      req.set_header("Connection", "close");  // the answer says so
      stream.close_after_request();
    };
    for (std::size_t served = 0; served < kKeepAliveRequests && stream.wait_for_request(); ++served) {
      stream.start_request();
      bool closed = false;
      if (!process_request(stream, served + 1 == kKeepAliveRequests, closed, mark) || closed) break;
    }
    if (stream.close_requested() && !stopping() && !busy()) stream.linger();
  }

  std::size_t threads_;
  std::function<bool(const httplib::Request&)> body_left_unread_;
  std::atomic<std::size_t> waiting_{0};  // connections accepted that no thread has taken yet
  std::atomic<std::size_t> active_{0};   // connections a thread serves
};

}  // namespace mha_cli::explore
