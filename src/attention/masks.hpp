// Masking for tiled kernels: which keys a block of queries can reach at all, whether a logits tile
// needs per-element masking, and applying the masks to a tile.
//
// Legend: B batch, h heads, L queries, S keys; a tile is rows [i0, i0 + rows) x keys [j0, j0 + cols).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <limits>

#include "attention/params.hpp"

namespace mha::detail {

// How far right of its position i' = i + query_shift a query may see: 0 under causal, window_right with a
// window (the smaller of the two with both), -1 for no bound.
template <class T>
std::int64_t right_extent(const AttentionInputs<T>& p) {
  if (p.causal) return p.window_right >= 0 ? std::min<std::int64_t>(0, p.window_right) : 0;
  return p.window_right;
}

// The key range [0, end) that query rows [i0, i0 + rows) of batch b may attend to at all.
template <class T>
std::int64_t key_range_end(const AttentionInputs<T>& p, std::int64_t b, std::int64_t i0, std::int64_t rows) {
  std::int64_t end = p.S;
  if (p.key_lengths) end = std::min(end, p.key_lengths[b]);
  if (right_extent(p) >= 0)  // the last row sees j <= i' + right
    end = std::min(end, std::max<std::int64_t>(0, p.query_position(i0 + rows - 1) + right_extent(p) + 1));
  return end;
}

// The first key block (a multiple of block) that query rows from i0 on may see: a sliding window's
// left bound hides the keys before i0' - window_left from all of them.
template <class T>
std::int64_t key_block_begin(const AttentionInputs<T>& p, std::int64_t i0, std::int64_t block) {
  if (p.window_left < 0) return 0;
  return std::max<std::int64_t>(0, p.query_position(i0) - p.window_left) / block * block;
}

// Whether logits tiles need per-element masking by the masks given as data (key padding, boolean and
// additive masks, ALiBi's bias, a window's left bound). The causal rule, a window's right bound and
// key_lengths need none: key_range_end cuts the key range, and causal_visible gives each row's visible
// prefix of a tile, which the row operations mask with vector compares.
template <class T>
bool needs_data_masks(const AttentionInputs<T>& p) {
  return p.key_padding || p.bool_mask || p.additive_mask || p.key_bias || p.alibi_slopes || p.window_left >= 0;
}

// How many of the keys [j0, j0 + cols) query i may see by the causal rule and a window's right bound
// (a prefix of them; all without either).
template <class T>
std::int64_t causal_visible(const AttentionInputs<T>& p, std::int64_t i, std::int64_t j0, std::int64_t cols) {
  if (right_extent(p) < 0) return cols;
  return std::clamp<std::int64_t>(p.query_position(i) + right_extent(p) - j0 + 1, 0, cols);
}

// The row bands of a logits tile of query rows [i0, i0 + rows) and keys [j0, j0 + cols): a tile the causal
// rule (or a window's right bound) cuts diagonally, so that its first rows see fewer keys than its last
// row, is computed in bands of rows, each as wide as its own last row sees: two bands of rows / 2 for a
// tile of fewer than 192 rows (a diagonal 128 x 128 tile as 64 x 64 and 64 x 128: 18 us of products
// against 21 whole, docs/PERFORMANCE.md), rows / 64 bands (at most kMaxRowBands) for taller ones; adjacent
// bands that see as much are merged, and a tile of fewer than 32 rows, or one no band of which sees less
// than its last row, is computed whole. Each band's cols is what its last row sees of the tile; unused
// entries are bands of 0 rows. A band of 0 rows or 0 cols has nothing to compute. The forward and the
// backward band alike and compute each band's logits by the same product, so the backward's recomputed
// P = exp(S - lse) sees the forward's S bit for bit.
struct RowBand {
  std::int64_t first, rows, cols;  // tile rows [first, first + rows), keys [j0, j0 + cols)
  bool empty() const { return rows == 0 || cols == 0; }
};
inline constexpr std::size_t kMaxRowBands = 4;
template <class T>
std::array<RowBand, kMaxRowBands> tile_row_bands(const AttentionInputs<T>& p, std::int64_t i0, std::int64_t rows,
                                                 std::int64_t j0, std::int64_t cols) {
  std::array<RowBand, kMaxRowBands> bands;
  bands.fill(RowBand{rows, 0, 0});
  const std::int64_t n = rows < 32 ? 1 : std::clamp<std::int64_t>(rows / 64, 2, kMaxRowBands);
  std::size_t used = 0;
  std::int64_t first = 0;
  for (std::int64_t k = 1; k <= n; ++k) {
    const std::int64_t end = rows * k / n, sees = causal_visible(p, i0 + end - 1, j0, cols);
    if (used > 0 && bands[used - 1].cols == sees) {  // sees as much as the band before it: one band
      bands[used - 1].rows = end - bands[used - 1].first;
    } else {
      bands[used++] = RowBand{first, end - first, sees};
    }
    first = end;
  }
  return bands;
}

// Applies the masks to a logits tile s [rows, cols] (row stride ld): forbidden -> -inf, additive added.
template <class T>
void apply_masks(const AttentionInputs<T>& p, std::int64_t b, std::int64_t head, std::int64_t i0, std::int64_t rows,
                 std::int64_t j0, std::int64_t cols, float* s, std::int64_t ld) {
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      float& x = s[r * ld + c];
      const float added = p.added(b, head, i0 + r, j0 + c);
      x = (!p.allowed(b, head, i0 + r, j0 + c) || added == kMinusInf) ? kMinusInf : x + added;
    }
}

// Whether query i of (b, head) may attend to some key in [0, end): not forbidden by the boolean masks
// nor by an additive -inf. A row with no such key attends to nothing (output 0, lse -inf); a row whose
// allowed keys all have -inf logits (overflow, -inf in the data) is 0 / 0, NaN.
template <class T>
bool has_allowed_key(const AttentionInputs<T>& p, std::int64_t b, std::int64_t head, std::int64_t i, std::int64_t end) {
  for (std::int64_t j = 0; j < end; ++j)
    if (!p.forbidden(b, head, i, j)) return true;
  return false;
}

}  // namespace mha::detail
