// What the explore server answers a request it refuses: an HTTP status and a message for the page.
#pragma once

#include <stdexcept>
#include <string>

namespace mha_cli::explore {

inline constexpr int kBadRequest = 400;

// Thrown while a request is read or checked; the server answers {"error": what()} with `status`.
class RequestError : public std::runtime_error {
 public:
  explicit RequestError(const std::string& message, int status = kBadRequest)
      : std::runtime_error(message), status_(status) {}
  int status() const { return status_; }

 private:
  int status_;
};

}  // namespace mha_cli::explore
