// The layer's packed input (MultiHeadAttentionInputs::cu_seqlens): unbatched rows [total, E] holding n
// sequences one after another, each attending only to its own keys through varlen_attention
// (mha/varlen.hpp). The projections run over all rows at once, as for any unbatched input; only the
// attention core and the rotary positions are per sequence.
//
// Legend: n sequences, h query heads, h_kv key/value heads, L = total query rows, S = total key rows,
// d_k, d_v per-head widths.
#pragma once

#include <cstdint>
#include <vector>

#include "mha/multi_head_attention.hpp"

namespace mha::detail {

// The packed offsets of a call (empty when it is not packed).
struct PackedRows {
  std::vector<std::int64_t> cu_q, cu_k;  // [n + 1] each: queries' and keys' prefix sums
  bool packed() const { return !cu_q.empty(); }
};

// Checks a packed call (mha::Error naming the argument) and returns its offsets: the input unbatched,
// cu_seqlens over the L query rows, cu_seqlens_k (or cu_seqlens again, for self-attention) over the S
// key rows, no mask laid over a [B, S] batch, no appended positions (add_bias_kv / add_zero_attn).
PackedRows packed_rows(const MultiHeadAttentionInputs& in, const MultiHeadAttentionConfig& c, bool batched,
                       std::int64_t L, std::int64_t S);

// The sequence's own positions of each packed row: query r of sequence i at r + S_i - L_i (the
// bottom-right alignment), key j at j; [L] for queries, [S] for keys.
std::vector<std::int64_t> packed_query_positions(const PackedRows& rows);
std::vector<std::int64_t> packed_key_positions(const PackedRows& rows);

// The attention core over packed heads, views into the projections q [1, h, L, d_k], k [1, h_kv, S, d_k]
// and v [1, h_kv, S, d_v]: writes context [L, h*d_v] (the concatenated heads) and, with o.need_lse, lse
// [1, h, L].
void packed_attention(const TensorView& q, const TensorView& k, const TensorView& v, const AttentionOptions& o,
                      const PackedRows& rows, Tensor& context, Tensor& lse);

// Its backward, given dcontext [1, h, L, d_v] and the forward's context [1, h, L, d_v] and lse [1, h, L]:
// writes dq_proj [L, h*d_k], dk_proj [S, h_kv*d_k] and dv_proj [S, h_kv*d_v].
void packed_attention_backward(const TensorView& dcontext, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView& context, const TensorView& lse,
                               const AttentionOptions& o, const PackedRows& rows, Tensor& dq_proj, Tensor& dk_proj,
                               Tensor& dv_proj);

}  // namespace mha::detail
