// Rotary position embeddings inside the library (mha/rotary.hpp states the math): the table of cos and sin a
// call rotates by, built once, and the strided rotation the public functions and the layer share.
//
// Legend: B batch, h heads, L positions, d head width, r rotary_dim, P rows of positions (1 or B).
#pragma once

#include <cstdint>
#include <vector>

#include "dtype_dispatch.hpp"
#include "mha/rotary.hpp"
#include "mha/tensor.hpp"

namespace mha::detail {

// The cos and sin of every angle one call rotates by, in the compute type C (float for float32 and
// bfloat16 data, double for float64): cos[(p, l, i)] = cos(position(p, l) * base^(-2i / r)), the angle
// and its cos and sin computed in float64 and rounded to C once. P = 1 when the positions are absent
// (0..L-1) or [L], shared by every batch row; P = B for [B, L] positions (batch row b reads row b).
// Built once per call and read by every head.
template <class C>
struct RotaryTable {
  std::int64_t rows = 0;     // P: 1 or B
  std::int64_t L = 0;        // positions per row
  std::int64_t half = 0;     // r / 2: the number of pairs
  bool interleaved = false;  // pairs (2i, 2i + 1); else (i, i + r/2)
  std::vector<C> cos;        // [P, L, r/2]
  std::vector<C> sin;        // [P, L, r/2]

  // The r/2 values of (batch row b, position index l): [r/2].
  const C* cos_at(std::int64_t b, std::int64_t l) const { return cos.data() + offset(b, l); }
  const C* sin_at(std::int64_t b, std::int64_t l) const { return sin.data() + offset(b, l); }

 private:
  std::size_t offset(std::int64_t b, std::int64_t l) const {
    return static_cast<std::size_t>(((rows == 1 ? 0 : b) * L + l) * half);
  }
};

// The table for B batch rows of L positions: `positions` (nullptr for 0..L-1; else validated, [L] or [B, L],
// values >= 0), rotary_dim r (even, resolved: not 0 for "d"), options.base and options.interleaved.
template <class C>
RotaryTable<C> make_rotary_table(const PositionsView* positions, std::int64_t B, std::int64_t L,
                                 std::int64_t rotary_dim, const RotaryOptions& options);

// y = R x for x, y: [B, h, L, d], element (b, head, l, c) at b * stride[0] + head * stride[1] + l * stride[2]
// + c * stride[3] (any signed strides, in elements): each pair (a, b') of row (b, head, l) is rotated by the
// table's angle for (b, l), by its negative when `inverse` (R^T, the backward), computed in compute_t<T> and
// rounded to T once. Components c >= r are copied from x to y. x and y may be the same memory with the same
// strides (see rotate_in_place) but must not otherwise overlap; y's elements must not alias one another
// (no 0 strides in y over a size > 1). OpenMP-parallel over the B h L rows when the call is large
// (parallel.hpp's SerialIfSmall); the result does not depend on the thread count.
template <class T>
void rotate(const T* x, const std::int64_t (&x_strides)[4], T* y, const std::int64_t (&y_strides)[4], std::int64_t B,
            std::int64_t h, std::int64_t L, std::int64_t d, const RotaryTable<compute_t<T>>& table, bool inverse);

// x = R x in place, as rotate with y = x: for q and k kept as [B, L, h, d] inside a larger buffer, pass the
// strides of the (b, head, l, c) order, {stride of b, stride of head, stride of l, stride of c}. Components
// c >= r are not touched. table: built for these B (or shared) and L.
template <class T>
void rotate_in_place(T* x, const std::int64_t (&strides)[4], std::int64_t B, std::int64_t h, std::int64_t L,
                     std::int64_t d, const RotaryTable<compute_t<T>>& table, bool inverse);

}  // namespace mha::detail
