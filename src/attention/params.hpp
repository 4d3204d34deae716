// The parameter objects every attention kernel takes: pointers with explicit strides, sizes, and the
// masks in a common form. Built and validated by attention_core.cpp; kernels only read them.
//
// Legend: B batch, h query heads, h_kv key/value heads (h_kv divides h: grouped-query attention, query
// head i reads key/value head i / (h / h_kv)), L queries, S keys, d_k query/key width, d_v value width.
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>

#include "dtype_dispatch.hpp"

namespace mha::detail {

// A strided 4-D array indexed (b, head, row, col); a stride of 0 broadcasts that dimension.
template <class T>
struct Strided4 {
  T* data = nullptr;
  std::int64_t stride[4] = {0, 0, 0, 0};

  T& operator()(std::int64_t b, std::int64_t head, std::int64_t row, std::int64_t col) const {
    return data[b * stride[0] + head * stride[1] + row * stride[2] + col * stride[3]];
  }
  // Where element (b, head, row, col) is, or null for an array without elements (no data at all).
  T* pointer(std::int64_t b, std::int64_t head, std::int64_t row, std::int64_t col) const {
    return data ? &(*this)(b, head, row, col) : nullptr;
  }
  explicit operator bool() const { return data != nullptr; }
};

// What the forward and the backward both read: sizes, q, k, v, the scale, the masks and dropout.
template <class T>
struct AttentionInputs {
  using Acc = compute_t<T>;
  std::int64_t B = 0, h = 0, h_kv = 0, L = 0, S = 0, d_k = 0, d_v = 0;

  Strided4<const T> q;  // [B, h, L, d_k]
  Strided4<const T> k;  // [B, h_kv, S, d_k]
  Strided4<const T> v;  // [B, h_kv, S, d_v]

  // Query heads per key/value head (1 without grouping), and the key/value head query head `head` reads.
  std::int64_t group() const { return h_kv > 0 ? h / h_kv : 1; }
  std::int64_t kv_head(std::int64_t head) const { return head / group(); }

  // Positions: key j sits at j, query i at i' = i + query_shift. The public calls align the queries
  // bottom-right, query_shift = S - L (fill_common); the ring passes a chunk pair's offset in the whole
  // sequence (its query chunk's first position minus its key chunk's), which may be negative or exceed S.
  std::int64_t query_shift = 0;
  std::int64_t query_position(std::int64_t i) const { return i + query_shift; }

  Acc scale = 1;
  bool causal = false;  // key j allowed for query i iff j <= i'
  // A sliding window (FlashAttention-2's window_size; -1: unbounded on that side): query i sees key j
  // only when i' - window_left <= j <= i' + window_right.
  std::int64_t window_left = -1, window_right = -1;
  const Acc* alibi_slopes = nullptr;  // [h] or null: ALiBi adds -slope[head] * |i' - j| to logit (i, j)
  Acc softcap = 0;                    // > 0: the scaled logit x becomes softcap * tanh(x / softcap), first
  // [h] or null: attention sinks, one logit per query head in each row's softmax, with no value
  // (online_softmax.hpp's fold_sink); the log-sum-exp includes it. Null in a part whose results are
  // merged by the caller (partial_over_keys): the merge adds the sink once.
  const Acc* sinks = nullptr;

  // Masks, each viewed as [B, h, L, S] through broadcast strides; null when absent.
  Strided4<const std::uint8_t> key_padding;   // nonzero = padded key (strides: b, 0, 0, s)
  const std::int64_t* key_lengths = nullptr;  // [B]: keys j >= key_lengths[b] are padding
  Strided4<const std::uint8_t> bool_mask;     // nonzero = may not attend
  Strided4<const Acc> additive_mask;          // added to the logits; -inf forbids
  Strided4<const Acc> key_bias;               // a float key_padding_mask, added to key s's logits (strides: b, 0, 0, s)

  Acc dropout_p = 0;  // in [0, 1)
  std::uint64_t dropout_seed = 0;
  std::int64_t dropout_query_offset = 0, dropout_key_offset = 0;  // positions of row 0 and key 0 in dropout's hash

  // Whether query i may attend to key j by the boolean masks (the additive mask is applied apart).
  bool allowed(std::int64_t b, std::int64_t head, std::int64_t i, std::int64_t j) const {
    const std::int64_t position = query_position(i);
    if (causal && j > position) return false;
    if (window_left >= 0 && j < position - window_left) return false;
    if (window_right >= 0 && j > position + window_right) return false;
    if (key_lengths && j >= key_lengths[b]) return false;
    if (key_padding && key_padding(b, head, i, j)) return false;
    if (bool_mask && bool_mask(b, head, i, j)) return false;
    return true;
  }

  // What the additive masks add to logit (i, j): ALiBi's bias + attn_mask + key_bias, 0 without them.
  Acc added(std::int64_t b, std::int64_t head, std::int64_t i, std::int64_t j) const {
    Acc sum = alibi_slopes ? alibi_bias(head, i, j) : Acc(0);
    if (additive_mask) sum += additive_mask(b, head, i, j);
    if (key_bias) sum += key_bias(b, head, i, j);
    return sum;
  }
  Acc alibi_bias(std::int64_t head, std::int64_t i, std::int64_t j) const {
    const std::int64_t distance = query_position(i) - j;
    return -alibi_slopes[head] * static_cast<Acc>(distance < 0 ? -distance : distance);
  }

  // Whether query i may not attend to key j: by the boolean masks, or by an additive -inf. A forbidden
  // key's weight is exactly 0 and its k and v are never read into a result.
  bool forbidden(std::int64_t b, std::int64_t head, std::int64_t i, std::int64_t j) const {
    return !allowed(b, head, i, j) ||
           ((additive_mask || key_bias || alibi_slopes) && added(b, head, i, j) == -infinity());
  }

 private:
  static constexpr Acc infinity() { return std::numeric_limits<Acc>::infinity(); }
};

// The forward: the inputs and where the results go.
template <class T>
struct AttentionParams : AttentionInputs<T> {
  Strided4<T> out;              // [B, h, L, d_v]
  T* weights = nullptr;         // [B, h, L, S] contiguous, or null
  compute_t<T>* lse = nullptr;  // [B, h, L] contiguous, or null
  // A row whose allowed logits are all -inf is 0 / 0: output and lse NaN. With partial_over_keys (k and
  // v are part of the keys, the rest merged in later by lse, as the ring does) it has no weight in this
  // part instead: lse -inf, its output NaN to tell it from a row with no allowed key (output 0).
  bool partial_over_keys = false;
};

// The backward: the forward's inputs, what the forward produced, and the gradient buffers.
template <class T>
struct AttentionBackwardParams : AttentionInputs<T> {
  Strided4<const T> dout;               // [B, h, L, d_v]
  Strided4<const T> o;                  // [B, h, L, d_v]: the forward's output
  Strided4<const compute_t<T>> lse_in;  // [B, h, L, (1)]: the forward's log-sum-exp; column stride unused
  Strided4<T> dq;                       // [B, h, L, d_k]
  Strided4<T> dk;                       // [B, h_kv, S, d_k]: summed over each group's query heads
  Strided4<T> dv;                       // [B, h_kv, S, d_v], likewise
};

}  // namespace mha::detail
