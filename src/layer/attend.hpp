// The attention step shared by forward() and forward_cached(): the buffers of the query side, the
// kernel run per head writing straight into the concatenated heads, the output projection, and the
// weights in the shape forward() returns.
//
// Legend: B batch, L queries, S' keys (with the extra positions), h heads, E = d_model.
#pragma once

#include <cstdint>
#include <utility>

#include "attention/attention_core.hpp"
#include "dtype_dispatch.hpp"
#include "layer/head_gate.hpp"
#include "layer/linear.hpp"
#include "layer/packed.hpp"
#include "layer/projections.hpp"
#include "mha/multi_head_attention.hpp"

namespace mha::detail {

// The projections viewed per head, and the concatenated heads the kernel writes.
struct HeadViews {
  TensorView q, k, v;  // [B, h, L, d_k], [B, h, S', d_k], [B, h, S', d_v]
  TensorView context;  // [B, h, L, d_v]
};

// What every forward allocates for its B * L query rows.
struct QuerySide {
  Tensor q_proj;   // [rows of query, h*d_k]
  Tensor context;  // [rows of query, h*d_v]: the concatenated heads
  Tensor out;      // shaped like query, last dimension E
};

inline QuerySide allocate_query_side(const TensorView& query, std::int64_t rows, const MultiHeadAttentionConfig& c) {
  Shape out_shape = query.shape();
  out_shape.back() = c.d_model;
  return {Tensor::uninitialized(c.dtype, {rows, c.num_heads * c.d_k}),  // each written whole
          Tensor::uninitialized(c.dtype, {rows, c.num_heads * c.d_v}), Tensor::uninitialized(c.dtype, out_shape)};
}

// The weights as forward returns them, from the kernel's per-head [B, h, L, S']: averaged over the
// heads to [B, L, S'] when `average`, without the batch dimension (of 1) when the input was unbatched.
template <class T>
Tensor output_weights(Tensor per_head, bool average, bool batched) {
  Tensor weights = std::move(per_head);
  if (average) {  // mean over heads: [B, h, L, S'] -> [B, L, S']
    const std::int64_t B = weights.size(0), h = weights.size(1), L = weights.size(2), S2 = weights.size(3);
    Tensor mean(weights.dtype(), {B, L, S2});
    const T* p = weights.data_as<T>();
    T* m = mean.data_as<T>();
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t i = 0; i < L * S2; ++i) {
        compute_t<T> sum = 0;
        for (std::int64_t head = 0; head < h; ++head) sum += p[(b * h + head) * L * S2 + i];
        m[b * L * S2 + i] = T(sum / static_cast<compute_t<T>>(h));
      }
    weights = std::move(mean);
  }
  if (!batched) {  // drop the batch dimension of 1
    Shape s(weights.shape().begin() + 1, weights.shape().end());
    weights = std::move(weights).reshaped(s);
  }
  return weights;
}

// The second half of forward: attends per head, writing heads.context into `context` [rows of query,
// h*d_v] (the concatenated heads), then projects back, out [rows of query, E] = context W_o^T + b_o.
// With a head gate, the gated heads are written to `gated` (laid out as context; context's own memory
// gates in place) and projected instead: out = Concat(g_1 head_1, ..., g_h head_h) W_o^T + b_o.
// weights ([B, h, L, S']) and lse ([B, h, L]) are filled when the options ask for them.
// Packed sequences (packed.rows given) attend each to its own keys (packed.hpp).
template <class T>
void attend_and_project_out(const HeadViews& heads, const AttentionOptions& o, const ProjectionWeights<T>& w,
                            const HeadGate& gate, Tensor& context, T* gated, Tensor& out, Tensor& weights, Tensor& lse,
                            const PackedRows& packed = {}) {
  const std::int64_t rows = context.size(0), vw = context.size(1), E = out.shape().back();
  if (packed.packed()) packed_attention(heads.q, heads.k, heads.v, o, packed, context, lse);
  else run_attention(heads.q, heads.k, heads.v, o, {context.data(), heads.context.strides()}, weights, lse);
  const T* concat = context.data_as<T>();  // [rows of query, h*d_v]
  if (gate.given) {
    apply_head_gate<T>(gate, heads.context, gated);  // heads.context views `context`
    concat = gated;
  }
  linear_forward(concat, vw, rows, vw, w.out, E, w.out_bias, out.data_as<T>(), E);
}

}  // namespace mha::detail
