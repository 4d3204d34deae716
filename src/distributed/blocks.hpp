// What travels around the ring (ring_attention.cpp): one rank's keys and values, packed contiguously
// with their padding mask, and the views of one chunk of them that a kernel call takes; and the
// arithmetic of partial results (merging by log-sum-exp, adding gradients).
//
// Legend: as in mha/distributed.hpp; S_src the key rows of the rank whose block this is.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "attention/online_softmax.hpp"
#include "mha/tensor.hpp"

namespace mha::distributed::detail {

// Rows [start, start + count) of a view along dimension `dim`, as a view (same strides).
inline TensorView rows_along(const TensorView& t, std::int64_t dim, std::int64_t start, std::int64_t count) {
  Shape shape = t.shape();
  shape[static_cast<std::size_t>(dim)] = count;
  const auto* base = static_cast<const std::byte*>(t.data());
  const std::ptrdiff_t offset = count == 0 ? 0 : start * t.stride(dim) * std::ptrdiff_t(dtype_size(t.dtype()));
  return TensorView(base ? base + offset : base, t.dtype(), std::move(shape), t.strides());
}

// Rows of a [B, h, rows, ...] view (q, k, v, out, lse) along the sequence, dimension 2.
inline TensorView rows_of(const TensorView& t, std::int64_t start, std::int64_t count) {
  return rows_along(t, 2, start, count);
}

// The layout of one rank's block in a buffer of T: k [B, h, S_src, d_k], v [B, h, S_src, d_v], then
// (with padding) the mask [B, S_src] as bytes, rounded up to whole elements.
template <class T>
struct BlockLayout {
  std::int64_t B, h, d_k, d_v;
  bool padding;

  std::int64_t k_elements(std::int64_t S_src) const { return B * h * S_src * d_k; }
  std::int64_t v_elements(std::int64_t S_src) const { return B * h * S_src * d_v; }
  std::int64_t mask_elements(std::int64_t S_src) const {
    return padding ? (B * S_src + std::int64_t(sizeof(T)) - 1) / std::int64_t(sizeof(T)) : 0;
  }
  std::int64_t elements(std::int64_t S_src) const {
    return k_elements(S_src) + v_elements(S_src) + mask_elements(S_src);
  }

  // Views of rows [start, start + count) of the block of S_src rows at `block`.
  TensorView k(const T* block, std::int64_t S_src, std::int64_t start, std::int64_t count) const {
    return rows_of(TensorView(block, dtype_of<T>(), {B, h, S_src, d_k}), start, count);
  }
  TensorView v(const T* block, std::int64_t S_src, std::int64_t start, std::int64_t count) const {
    return rows_of(TensorView(block + k_elements(S_src), dtype_of<T>(), {B, h, S_src, d_v}), start, count);
  }
  TensorView mask(const T* block, std::int64_t S_src, std::int64_t start, std::int64_t count) const {
    const auto* bytes = reinterpret_cast<const std::uint8_t*>(block + k_elements(S_src) + v_elements(S_src));
    return TensorView(bytes + start, DType::Bool, {B, count}, {S_src, 1});
  }

  // Packs this rank's k, v (any strides) and mask into block (elements(S_r) long).
  void pack(T* block, const TensorView& k_r, const TensorView& v_r, const TensorView* mask_r) const {
    const std::int64_t S = k_r.size(2);
    copy4(k_r, block);
    copy4(v_r, block + k_elements(S));
    if (!padding) return;
    auto* bytes = reinterpret_cast<std::uint8_t*>(block + k_elements(S) + v_elements(S));
    const auto* m = static_cast<const std::uint8_t*>(mask_r->data());
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t s = 0; s < S; ++s) bytes[b * S + s] = m[b * mask_r->stride(0) + s * mask_r->stride(1)] != 0;
  }

  // A [B, h, n, d] view of T (any strides) into dst, contiguous.
  static void copy4(const TensorView& t, T* dst) {
    const T* src = static_cast<const T*>(t.data());
    for (std::int64_t b = 0; b < t.size(0); ++b)
      for (std::int64_t head = 0; head < t.size(1); ++head)
        for (std::int64_t i = 0; i < t.size(2); ++i)
          for (std::int64_t c = 0; c < t.size(3); ++c)
            *dst++ = src[b * t.stride(0) + head * t.stride(1) + i * t.stride(2) + c * t.stride(3)];
  }
};

// Merges a partial result (out_part [B, h, n, d_v] and lse_part [B, h, n], contiguous, from some of
// the keys) into rows [start, start + n) of the running result (out [B, h, L_r, d_v], lse [B, h, L_r],
// contiguous, from the keys before): the softmax over both key sets, by their log-sum-exp. A part
// whose row had no weight (lse -inf) leaves the row as it is; such a part row whose output is NaN had
// allowed keys, all at -inf (mha::detail::run_attention's partial_over_keys) and is marked in
// `all_minus_inf` [B, h, L_r] (finish_merged_rows then makes the row 0 / 0 if no part gave it weight).
// NaN and +inf propagate as one kernel call's would (an overflowing logit makes the row NaN).
template <class T>
void merge_partial(Tensor& out, Tensor& lse, std::int64_t start, const Tensor& out_part, const Tensor& lse_part,
                   std::vector<std::uint8_t>& all_minus_inf) {
  const std::int64_t B = out.size(0), h = out.size(1), L_r = out.size(2), d_v = out.size(3), n = out_part.size(2);
  constexpr T kMinusInf = -std::numeric_limits<T>::infinity();
  T* o = out.data_as<T>();
  T* l = lse.data_as<T>();
  const T* po = out_part.data_as<T>();
  const T* pl = lse_part.data_as<T>();
  std::vector<T> merged(static_cast<std::size_t>(d_v));  // the running row, read while it is rewritten
  for (std::int64_t bh = 0; bh < B * h; ++bh)
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t row = bh * L_r + start + i, part_row = bh * n + i;
      const T l1 = l[row], l2 = pl[part_row];
      T* o1 = o + row * d_v;
      const T* o2 = po + part_row * d_v;
      if (l2 == kMinusInf) {
        if (d_v > 0 && std::isnan(o2[0])) all_minus_inf[static_cast<std::size_t>(row)] = 1;
        continue;
      }
      if (l1 == kMinusInf) {
        std::copy(o2, o2 + d_v, o1);
        l[row] = l2;
        continue;
      }
      // Both normalised: the partials (lse, 1, out) of online_softmax.hpp's merge.
      mha::detail::LseMerge<T> merge;
      merge.see_max(l1);
      merge.see_max(l2);
      std::copy(o1, o1 + d_v, merged.begin());
      std::fill(o1, o1 + d_v, T(0));
      merge.add(l1, T(1), merged.data(), d_v, o1);
      merge.add(l2, T(1), o2, d_v, o1);
      l[row] = merge.finish(d_v, o1);
    }
}

// After the last merge: each row's attention sink (sinks [h], or empty) joins the row as a partial of no
// value, once; then a row that no part nor sink gave weight (lse -inf) but that had allowed keys, all at
// -inf, is 0 / 0, NaN in output and lse, as one call over every key gives it.
template <class T>
void finish_merged_rows(Tensor& out, Tensor& lse, const std::vector<std::uint8_t>& all_minus_inf,
                        const std::vector<T>& sinks) {
  const std::int64_t h = out.size(1), L_r = out.size(2), d_v = out.size(3);
  T* o = out.data_as<T>();
  T* l = lse.data_as<T>();
  std::vector<T> merged(static_cast<std::size_t>(d_v));
  for (std::int64_t row = 0; row < lse.numel() && !sinks.empty(); ++row) {
    const T sink = sinks[static_cast<std::size_t>(row / L_r % h)];
    mha::detail::LseMerge<T> merge;
    merge.see_max(l[row]);
    merge.see_max(sink);
    if (merge.no_weight()) continue;
    T* o_row = o + row * d_v;
    std::copy(o_row, o_row + d_v, merged.begin());
    std::fill(o_row, o_row + d_v, T(0));
    merge.add(l[row], T(1), merged.data(), d_v, o_row);  // no weight (and o_row stays 0) when l is -inf
    merge.add_sink(sink);
    l[row] = merge.finish(d_v, o_row);
  }
  for (std::int64_t row = 0; row < lse.numel(); ++row)
    if (all_minus_inf[static_cast<std::size_t>(row)] && l[row] == -std::numeric_limits<T>::infinity()) {
      l[row] = std::numeric_limits<T>::quiet_NaN();
      std::fill(o + row * d_v, o + (row + 1) * d_v, std::numeric_limits<T>::quiet_NaN());
    }
}

// Adds part ([B, h, n, d], contiguous) into rows [start, start + n) of acc ([B, h, rows, d] at acc,
// contiguous).
template <class T>
void add_rows(T* acc, std::int64_t rows, std::int64_t start, const Tensor& part) {
  const std::int64_t d = part.size(3), n = part.size(2);
  const T* p = part.data_as<T>();
  for (std::int64_t bh = 0; bh < part.size(0) * part.size(1); ++bh)
    for (std::int64_t i = 0; i < n * d; ++i) acc[(bh * rows + start) * d + i] += p[bh * n * d + i];
}

}  // namespace mha::distributed::detail
