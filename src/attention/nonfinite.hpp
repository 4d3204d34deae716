// Isolating NaN and Inf in K and V blocks of tiled kernels. A block product mixes every key of the
// block into every output, so one NaN stored at a padded key, or at a key a row does not attend to,
// would poison outputs that do not depend on it. Before a block is used whole, its rows of padded keys
// and its rows holding NaN or Inf are zeroed in a copy; the kernel then adds the exact contribution of
// the non-finite rows to the outputs that attend to them, so a NaN or Inf reaches exactly the outputs
// that depend on it.
#pragma once

#include <cmath>
#include <cstdint>

#include "attention/params.hpp"

namespace mha::detail {

// A K or V block ready for whole-block products.
struct SafeBlock {
  const float* data;  // [cols, width], row stride ld
  std::int64_t ld;
  std::int64_t nonfinite_count;  // entries written to the caller's list
};

// The block of keys [j0, j0 + cols) of x (a K or V [B, h, S, width] with unit inner stride) made safe:
// used in place when it has neither padded keys nor NaN/Inf, else copied into `scratch` [cols, width]
// with those rows zeroed. The non-finite rows of keys that are not padding (some query may still
// attend to them) are listed, as column indices within the block, in `nonfinite` [cols].
inline SafeBlock safe_block(const AttentionInputs<float>& p, const Strided4<const float>& x, std::int64_t b,
                            std::int64_t head, std::int64_t j0, std::int64_t cols, std::int64_t width, float* scratch,
                            std::int64_t* nonfinite) {
  const float* block = &x(b, head, j0, 0);
  const std::int64_t ld = x.stride[2];
  std::int64_t count = 0;
  bool any_padding = false;
  for (std::int64_t c = 0; c < cols; ++c) {
    if (p.key_padding && p.key_padding(b, head, 0, j0 + c)) {
      any_padding = true;
      continue;
    }
    for (std::int64_t e = 0; e < width; ++e)
      if (!std::isfinite(block[c * ld + e])) {
        nonfinite[count++] = c;
        break;
      }
  }
  if (!any_padding && count == 0) return {block, ld, 0};
  for (std::int64_t c = 0, next = 0; c < cols; ++c) {
    bool zero = p.key_padding && p.key_padding(b, head, 0, j0 + c);
    if (next < count && nonfinite[next] == c) zero = true, ++next;
    for (std::int64_t e = 0; e < width; ++e) scratch[c * width + e] = zero ? 0.0f : block[c * ld + e];
  }
  return {scratch, width, count};
}

}  // namespace mha::detail
