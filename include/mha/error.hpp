/// \file
/// mha::Error: the one exception type of the public API.
#pragma once

#include <stdexcept>
#include <string>

namespace mha {

/// Thrown by every public call on bad input. The message names the argument, what was expected and
/// what was received, e.g. "key: expected rank 3 like query [B, L, E], got rank 2 [5, 16]".
class Error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

}  // namespace mha
