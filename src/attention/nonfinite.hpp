// Isolating NaN and Inf in the blocks of tiled kernels. A block product mixes every row of the block
// into every output (0 * NaN is NaN), so one NaN stored at a padded key, at a key a row does not attend
// to, or in a query row whose gradient coefficient for a key is 0, would poison outputs that do not
// depend on it. Before a block is used whole, its rows of padded keys and its rows holding NaN or Inf
// are zeroed in a copy; the kernel then adds the exact contribution of the non-finite rows where their
// coefficient is not 0, so a NaN or Inf reaches exactly the outputs that depend on it.
#pragma once

#include <algorithm>
#include <cstdint>

#include "attention/params.hpp"

namespace mha::detail {

// Rows [0, count) of `block` (row stride ld, `width` floats each), adjacent: in place when they are
// (ld == width), else copied into `scratch` [count, width]. Returns where they are (row stride width).
template <class E>
const E* adjacent_rows(const E* block, std::int64_t ld, std::int64_t count, std::int64_t width, E* scratch) {
  if (ld == width) return block;
  for (std::int64_t c = 0; c < count; ++c) std::copy_n(block + c * ld, width, scratch + c * width);
  return scratch;
}

// A block of rows (of float or bfloat16) ready for whole-block products.
template <class E>
struct SafeBlock {
  const E* data;  // [count, width], row stride ld
  std::int64_t ld;
  std::int64_t nonfinite_count;  // entries written to the caller's list
};

// Which rows of the arrays a kernel reads whole hold NaN or Inf, found once per call (one vectorised
// pass over each array, flash_tiles-inl.h) rather than per tile: one byte per row, a bit per array.
enum NonfiniteBit : std::uint8_t {
  kKeyRow = 1,    // per key row: its k
  kValueRow = 2,  //              its v
  kQueryRow = 1,  // per query row: its q
  kDoutRow = 2,   //                its dout
};

// Rows [0, count) of `block` (row stride ld, `width` floats each, unit inner stride) made safe: used in
// place when no row is skipped, none holds NaN or Inf (flags[c] & bit) and the rows are adjacent
// (ld == width), else copied into `scratch` [count, width], adjacent, with the skipped and the
// non-finite rows zeroed. (Products read adjacent rows faster: the layer's [B, N, h, d] heads have
// ld = h d.) The non-finite rows that are not
// skipped are listed (as row indices) in `nonfinite` [count], for the caller to add their exact
// contribution where their coefficient is not 0. skip(c): whether row c is padding that no output may
// read.
template <class E, class Skip>
SafeBlock<E> safe_rows(const E* block, std::int64_t ld, std::int64_t count, std::int64_t width, Skip skip,
                       const std::uint8_t* flags, std::uint8_t bit, E* scratch, std::int64_t* nonfinite) {
  std::int64_t listed = 0;
  bool any_skipped = false;
  for (std::int64_t c = 0; c < count; ++c) {
    if (skip(c)) any_skipped = true;
    else if (flags[c] & bit) nonfinite[listed++] = c;
  }
  if (!any_skipped && listed == 0 && ld == width) return {block, ld, 0};
  for (std::int64_t c = 0, next = 0; c < count; ++c) {
    bool zero = skip(c);
    if (next < listed && nonfinite[next] == c) zero = true, ++next;
    if (zero) std::fill_n(scratch + c * width, width, E(0.0f));
    else std::copy_n(block + c * ld, width, scratch + c * width);
  }
  return {scratch, width, listed};
}

// The block of keys [j0, j0 + cols) of a K or V head made safe: `head_rows` holds the head's keys
// [S, width] with row stride ld (the caller's rows or an adjacent copy of them); rows of padded keys
// (key_padding_mask) skipped, non-finite rows listed (column indices within the block). key_flags:
// the flags of (b, head)'s keys [S].
template <class T>
SafeBlock<T> safe_block(const AttentionInputs<T>& p, const T* head_rows, std::int64_t ld, std::int64_t b,
                        std::int64_t head, std::int64_t j0, std::int64_t cols, std::int64_t width,
                        const std::uint8_t* key_flags, std::uint8_t bit, T* scratch, std::int64_t* nonfinite) {
  auto padded = [&](std::int64_t c) { return p.key_padding && p.key_padding(b, head, 0, j0 + c); };
  return safe_rows(head_rows + j0 * ld, ld, cols, width, padded, key_flags + j0, bit, scratch, nonfinite);
}

// The rows [i0, i0 + rows) of a query-side head (Q or dO of one (b, head): head_rows [L, width], row
// stride ld) made safe: nothing skipped, non-finite rows listed (row indices within the block).
// query_flags: (b, head)'s [L].
template <class E>
SafeBlock<E> safe_query_rows(const E* head_rows, std::int64_t ld, std::int64_t i0, std::int64_t rows,
                             std::int64_t width, const std::uint8_t* query_flags, std::uint8_t bit, E* scratch,
                             std::int64_t* nonfinite) {
  return safe_rows(
      head_rows + i0 * ld, ld, rows, width, [](std::int64_t) { return false; }, query_flags + i0, bit, scratch,
      nonfinite);
}

}  // namespace mha::detail
