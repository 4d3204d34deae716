// The per-head gate (MultiHeadAttentionInputs::head_gate): g [h] or [B, h] multiplies each head's
// attention output before the concatenation that W^O projects,
//
//     out = Concat(g_1 head_1, ..., g_h head_h) W^O + b_O,
//
// and its backward: dHead_i = g_i dConcat_i, dg_i = sum over (l, c) of dConcat_i[l, c] head_i[l, c]
// (the head-importance score of Michel et al. 2019, "Are Sixteen Heads Really Better than One?").
//
// Legend: B batch, h heads, L queries, d_v the per-head value width. The heads are read through a
// [B, h, L, d_v] view of the concatenated heads [rows of query, h*d_v] (layer/attend.hpp's HeadViews).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "mha/multi_head_attention.hpp"

namespace mha::detail {

// A validated gate, expanded to [B, h] and converted to the layer's compute dtype (float32 for a
// float32 or bfloat16 layer, float64 for a float64 one), together with how it was given (for its
// gradient's shape and dtype).
struct HeadGate {
  bool given = false;
  std::vector<double> values;    // [B, h]: g[b, i] (a [h] gate repeated per batch), each a compute-dtype value
  Shape shape;                   // as given: [h] or [B, h]
  DType dtype = DType::Float32;  // as given: float32 or float64
};

// Validates inputs.head_gate against the layer (h heads) and a batch of B (batched: the input had a
// batch dimension; unbatched inputs take [h] only) and converts it. Throws mha::Error naming the
// problem. Not given: a HeadGate with given = false.
HeadGate head_gate_of(const std::optional<TensorView>& gate, const MultiHeadAttentionConfig& c, bool batched,
                      std::int64_t B);

// Forward: gated[b, i] = g[b, i] * heads[b, i], computed in the compute dtype and rounded to T once.
// heads: [B, h, L, d_v], a strided view of the concatenated heads; gated: memory laid out as heads'
// (heads' own memory gates in place).
template <class T>
void apply_head_gate(const HeadGate& gate, const TensorView& heads, T* gated);

// Backward, from d_gated (dLoss/d of what apply_head_gate wrote, laid out as `heads`): returns dLoss/dg,
// shaped and typed like the gate as given (a [h] gate's gradient summed over b in order), and
// overwrites d_gated with dLoss/d heads = g * d_gated. Sums run in float64, each (b, i) in one fixed
// order, so results do not depend on the thread count.
template <class T>
Tensor head_gate_backward(const HeadGate& gate, const TensorView& heads, T* d_gated);

}  // namespace mha::detail
