// Checked arithmetic on sizes. Every product of sizes that comes from an argument or a file (a shape's
// element count, a byte size, num_heads * d_k) goes through these, so an overflow is refused instead of
// wrapping to a negative or zero size.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>

#include "mha/tensor.hpp"

namespace mha::detail {

// The most elements a tensor (or a view) may have: INT64_MAX / 8, so that its byte size in any dtype
// (at most 8 bytes an element) stays below 2^63 and every element offset fits std::int64_t.
inline constexpr std::int64_t kMaxElements = std::numeric_limits<std::int64_t>::max() / 8;

// a * b, or std::nullopt when the product does not fit std::int64_t.
inline std::optional<std::int64_t> checked_mul(std::int64_t a, std::int64_t b) {
  std::int64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

// a + b, or std::nullopt when the sum does not fit std::int64_t.
inline std::optional<std::int64_t> checked_add(std::int64_t a, std::int64_t b) {
  std::int64_t sum = 0;
  if (__builtin_add_overflow(a, b, &sum)) return std::nullopt;
  return sum;
}

// The product of the nonzero sizes of `shape` (entries >= 0), or std::nullopt when it exceeds
// kMaxElements. NumPy's rule: [0, 2^62, 2^62] is refused although it holds no element, so that
// strides and offsets computed from the sizes cannot overflow either.
inline std::optional<std::int64_t> nonzero_size_product(const Shape& shape) {
  std::int64_t product = 1;
  for (const std::int64_t d : shape) {
    if (d == 0) continue;
    const auto next = checked_mul(product, d);
    if (!next || *next > kMaxElements) return std::nullopt;
    product = *next;
  }
  return product;
}

}  // namespace mha::detail
