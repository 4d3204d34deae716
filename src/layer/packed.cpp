// The layer's packed input (packed.hpp): the checks, the per-sequence positions, and the attention core
// through varlen_attention on views of the projections, [1, heads, T, d] viewed as packed [T, heads, d].
#include "layer/packed.hpp"

#include <cstring>
#include <string>

#include "attention/varlen_checks.hpp"
#include "mha/error.hpp"
#include "mha/varlen.hpp"

namespace mha::detail {

namespace {

[[noreturn]] void fail(const std::string& message) { throw Error(message); }

// Heads [1, heads, T, d] (strided) viewed as packed rows [T, heads, d].
TensorView as_packed(const TensorView& heads) {
  return TensorView(heads.data(), heads.dtype(), {heads.size(2), heads.size(1), heads.size(3)},
                    {heads.stride(2), heads.stride(1), heads.stride(3)});
}

// src (contiguous) into dst (contiguous, as many bytes).
void copy_bytes(const Tensor& src, Tensor& dst) {
  if (src.nbytes() > 0) std::memcpy(dst.data(), src.data(), src.nbytes());
}

}  // namespace

PackedRows packed_rows(const MultiHeadAttentionInputs& in, const MultiHeadAttentionConfig& c, bool batched,
                       std::int64_t L, std::int64_t S) {
  PackedRows rows;
  if (in.cu_seqlens.empty()) {
    if (!in.cu_seqlens_k.empty())
      fail("cu_seqlens_k: given without cu_seqlens (the queries' offsets); give both, or cu_seqlens alone for "
           "self-attention");
    return rows;
  }
  if (batched)
    fail("cu_seqlens: packed sequences are unbatched rows [total, E] (the offsets say where each sequence starts), "
         "got a batched input");
  if (c.add_bias_kv || c.add_zero_attn)
    fail("cu_seqlens: not available with add_bias_kv / add_zero_attn (one appended key per sequence is not built)");
  AttentionOptions masks;
  static_cast<ScoreSpec&>(masks) = in;
  refuse_batch_options(masks);
  rows.cu_q = in.cu_seqlens;
  rows.cu_k = in.cu_seqlens_k.empty() ? in.cu_seqlens : in.cu_seqlens_k;
  validate_offsets(rows.cu_q, "cu_seqlens", L, "the query rows", "query's rows");
  if (rows.cu_k.size() != rows.cu_q.size())
    fail("cu_seqlens_k: expected n + 1 = " + std::to_string(rows.cu_q.size()) + " offsets like cu_seqlens, got " +
         std::to_string(rows.cu_k.size()));
  validate_offsets(rows.cu_k, in.cu_seqlens_k.empty() ? "cu_seqlens" : "cu_seqlens_k", S, "the key rows", "key's rows");
  return rows;
}

std::vector<std::int64_t> packed_query_positions(const PackedRows& rows) {
  std::vector<std::int64_t> positions;
  for (std::size_t i = 0; i + 1 < rows.cu_q.size(); ++i) {
    const std::int64_t L_i = rows.cu_q[i + 1] - rows.cu_q[i], S_i = rows.cu_k[i + 1] - rows.cu_k[i];
    for (std::int64_t r = 0; r < L_i; ++r) positions.push_back(r + S_i - L_i);
  }
  return positions;
}

std::vector<std::int64_t> packed_key_positions(const PackedRows& rows) {
  std::vector<std::int64_t> positions;
  for (std::size_t i = 0; i + 1 < rows.cu_k.size(); ++i)
    for (std::int64_t j = 0; j < rows.cu_k[i + 1] - rows.cu_k[i]; ++j) positions.push_back(j);
  return positions;
}

void packed_attention(const TensorView& q, const TensorView& k, const TensorView& v, const AttentionOptions& o,
                      const PackedRows& rows, Tensor& context, Tensor& lse) {
  VarlenResult r = varlen_attention(as_packed(q), as_packed(k), as_packed(v), rows.cu_q, rows.cu_k, o);
  copy_bytes(r.out, context);  // [L, h, d_v] is context's [L, h*d_v]
  if (o.need_lse) lse = std::move(r.lse).reshaped({1, r.lse.size(0), r.lse.size(1)});  // [h, L] -> [1, h, L]
}

void packed_attention_backward(const TensorView& dcontext, const TensorView& q, const TensorView& k,
                               const TensorView& v, const TensorView& context, const TensorView& lse,
                               const AttentionOptions& o, const PackedRows& rows, Tensor& dq_proj, Tensor& dk_proj,
                               Tensor& dv_proj) {
  const TensorView lse_packed(lse.data(), lse.dtype(), {lse.size(1), lse.size(2)}, {lse.stride(1), lse.stride(2)});
  AttentionOptions core = o;
  core.sinks.reset();  // the layer takes the sinks' gradient itself (forward_backward.cpp)
  const AttentionGradients g = varlen_attention_backward(as_packed(dcontext), as_packed(q), as_packed(k), as_packed(v),
                                                         as_packed(context), lse_packed, rows.cu_q, rows.cu_k, core);
  copy_bytes(g.dq, dq_proj);  // [L, h, d_k] is dq_proj's [L, h*d_k]; likewise dk, dv
  copy_bytes(g.dk, dk_proj);
  copy_bytes(g.dv, dv_proj);
}

}  // namespace mha::detail
