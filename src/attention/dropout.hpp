// Counter-based dropout: whether attention weight (b, head, i, j) is dropped is a pure function of
// (seed, b, head, i, j), so a backward pass can regenerate the mask without storing it and the result
// does not depend on how rows are split among threads.
#pragma once

#include <cstdint>

#include "attention/params.hpp"
#include "splitmix64.hpp"

namespace mha::detail {

// A uniform number in [0, 1) keyed by the position of one attention weight.
inline double dropout_uniform(std::uint64_t seed, std::int64_t b, std::int64_t head, std::int64_t i, std::int64_t j) {
  std::uint64_t x = mix64(seed);
  for (std::int64_t coordinate : {b, head, i, j}) x = mix64(x ^ static_cast<std::uint64_t>(coordinate));
  return static_cast<double>(x >> 11) * 0x1.0p-53;  // the top 53 bits
}

// Whether weight (b, head, i, j) of these inputs is dropped (i, j: row and key of this call).
template <class T>
bool dropped(const AttentionInputs<T>& p, std::int64_t b, std::int64_t head, std::int64_t i, std::int64_t j) {
  return dropout_uniform(p.dropout_seed, b, head, i + p.dropout_query_offset, j + p.dropout_key_offset) <
         static_cast<double>(p.dropout_p);
}

// A tile of weights s [rows, cols] (row stride ld) for rows i0.. and keys j0.. times its dropout
// factors: 0 where dropped, 1 / (1 - dropout_p) where kept.
template <class T>
void apply_dropout(const AttentionInputs<T>& p, std::int64_t b, std::int64_t head, std::int64_t i0, std::int64_t rows,
                   std::int64_t j0, std::int64_t cols, float* s, std::int64_t ld) {
  const float keep_scale = 1.0f / (1.0f - p.dropout_p);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      float& x = s[r * ld + c];
      x = dropped(p, b, head, i0 + r, j0 + c) ? 0.0f : x * keep_scale;
    }
}

}  // namespace mha::detail
