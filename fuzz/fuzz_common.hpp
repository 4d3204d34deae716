// Shared by the libFuzzer targets: the checks every accepted file must pass.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "mha/tensor.hpp"

namespace mha_fuzz {

// Aborts (a crash to libFuzzer, which saves the input) with a message.
[[noreturn]] inline void violated(const char* what) {
  std::fprintf(stderr, "fuzz invariant violated: %s\n", what);
  std::abort();
}

// Same dtype, shape and bytes.
inline bool same(const mha::Tensor& a, const mha::Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         (a.nbytes() == 0 || std::memcmp(a.data(), b.data(), a.nbytes()) == 0);
}

}  // namespace mha_fuzz
