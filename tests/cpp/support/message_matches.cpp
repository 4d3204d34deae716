#include "support/message_matches.hpp"

#include <regex>

namespace mha_test {

bool message_matches(const char* message, const char* pattern) {
  return std::regex_search(message, std::regex(pattern));
}

}  // namespace mha_test
