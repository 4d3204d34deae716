// The decode kernel's parameter object (what decode_attention.cpp validated and resolved: pointers,
// strides, page pointers) and its internal entry, with the per-head mode the benchmark compares against.
//
// Legend: n sequences, Lq new queries per sequence, h query heads, h_kv key/value heads, g = h / h_kv
// query heads per group, d_k, d_v, P tokens per page, T a sequence's length.
#pragma once

#include <cstdint>
#include <type_traits>
#include <vector>

#include "decode/quantize.hpp"
#include "mha/bfloat16.hpp"
#include "mha/decode.hpp"

namespace mha::detail {

// How query heads share the reads of a key/value head.
enum class DecodeMode {
  GroupPacked,  // one work item per (sequence, kv head, chunk) for its g query heads: K/V read once per group
  PerHead,      // one work item per (sequence, query head, chunk): K/V read g times (for the benchmark only)
};

// One float8 e4m3 value of a quantized cache (PagedKVCacheConfig::storage): its bits, widened exactly.
struct Float8E4M3 {
  std::uint8_t bits;
  explicit operator float() const { return e4m3_to_float(bits); }
};

// Whether pages of T hold quantized rows, each with its float32 scale (int8 or float8 e4m3).
template <class T>
constexpr bool kQuantized = std::is_same_v<T, std::int8_t> || std::is_same_v<T, Float8E4M3>;

// The queries' and results' type for pages of T: float32 for quantized pages, else T itself.
template <class T>
using query_t = std::conditional_t<kQuantized<T>, float, T>;

// T the element type of the pages (float, double, bfloat16, or int8 / float8 e4m3 rows with a scale
// each); A the type results are computed in (float for all but double).
template <class T, class A>
struct DecodeParams {
  using Q = query_t<T>;
  const Q* q = nullptr;           // [n, Lq, h, d_k] through q_stride
  std::int64_t q_stride[4] = {};  // in elements
  Q* out = nullptr;               // [n, Lq, h, d_v], contiguous
  A* lse = nullptr;               // [n, Lq, h], contiguous; nullptr when not asked for
  std::int64_t n = 0, q_len = 0, h = 0, h_kv = 0, d_k = 0, d_v = 0, page_size = 0;
  A scale = 0;
  std::vector<std::int64_t> lengths;     // [n]: T of each sequence, >= Lq
  std::vector<std::int64_t> first_page;  // [n]: where sequence s's pages start in k_pages and v_pages
  std::vector<const T*> k_pages;         // per page of each sequence in turn: keys [h_kv, P, d_k]
  std::vector<const T*> v_pages;         // likewise: values [h_kv, P, d_v]
  // Quantized pages only: each row's scale, per page [h_kv, P] (dequantized row = float(q) * scale).
  std::vector<const float*> k_scale_pages, v_scale_pages;
  // The score's variants (mha/score.hpp), in the sequence's positions: query i at i' = T - Lq + i.
  bool causal = true;                                // query i sees positions <= i' (false: all T)
  std::int64_t window_left = -1, window_right = -1;  // i' - window_left <= t <= i' + window_right; -1 unbounded
  std::vector<A> alibi_slopes;                       // [h], or empty: logit (i, t) gets -slope[head] |i' - t|
  A softcap = 0;                                     // > 0: each scaled logit x becomes softcap tanh(x / softcap)
  std::vector<A> sinks;  // [h], or empty: each row's sink logit, added once by the merge (split_kv.hpp)
  bool has_variants() const { return window_left >= 0 || !alibi_slopes.empty() || softcap > 0; }

  std::int64_t group_size() const { return h / h_kv; }
  // Query row (s, i, head): [d_k] elements, q_stride[3] apart.
  const Q* query_row(std::int64_t s, std::int64_t i, std::int64_t head) const {
    return q + s * q_stride[0] + i * q_stride[1] + head * q_stride[2];
  }
};

// The kernel (decode_kernel.cpp): fills p.out (and p.lse). Inputs already validated.
void decode_attention_kernel(const DecodeParams<float, float>& p, DecodeMode mode);
void decode_attention_kernel(const DecodeParams<bfloat16, float>& p, DecodeMode mode);
void decode_attention_kernel(const DecodeParams<double, double>& p, DecodeMode mode);
void decode_attention_kernel(const DecodeParams<std::int8_t, float>& p, DecodeMode mode);
void decode_attention_kernel(const DecodeParams<Float8E4M3, float>& p, DecodeMode mode);

// decode_attention (mha/decode.hpp) with the mode chosen: the public function is this with GroupPacked.
DecodeResult decode_attention_with_mode(const TensorView& q, const PagedKVCache& cache,
                                        std::span<const PagedKVCache::SequenceId> sequences,
                                        const DecodeOptions& options, DecodeMode mode);

}  // namespace mha::detail
