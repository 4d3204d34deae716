// The operators with mha's own semantics (mha/attention.hpp, mha/score.hpp) on 4-D torch tensors:
// mha::attention_forward and mha::attention_backward. Registered for the CPU (no autograd of their own:
// mha::scaled_dot_product_attention, sdpa.cpp, is the differentiable entry).
//
// Legend: B batch, h query heads, h_kv key/value heads, L queries, S keys, d_k, d_v head widths.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <tuple>

namespace mha::torch_ops {

// The score and the call's dropout, as the operators take them (mha's semantics: a bool attn_mask True
// means "may not attend", causal and window are bottom-right aligned).
struct ScoreArguments {
  c10::optional<at::Tensor> attn_mask;         // bool or float, [L, S] or [B*h, L, S]
  c10::optional<at::Tensor> key_padding_mask;  // bool (True = padding) or float (added to key j's logits), [B, S]
  bool causal = false;
  c10::optional<double> scale;
  std::int64_t window_left = -1, window_right = -1;
  c10::optional<at::Tensor> alibi_slopes;  // [h] float32 / float64
  double softcap = 0.0;
  c10::optional<at::Tensor> sinks;  // [h] float32 / float64
  double dropout_p = 0.0;
  std::int64_t dropout_seed = 0;  // read as the 64 bits of mha's uint64 seed
};

// q: [B, h, L, d_k], k: [B, h_kv, S, d_k], v: [B, h_kv, S, d_v], any strides (read in place).
// Returns (out [B, h, L, d_v] in q's dtype, lse [B, h, L]: float32 for bfloat16 q, else q's dtype).
std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const ScoreArguments& score);

// The backward of attention_forward with the same inputs and arguments; dout, out: [B, h, L, d_v], lse as
// returned. Returns new tensors (dq, dk, dv, dsinks): dsinks [h] in the sinks' dtype, or an empty tensor
// [0] when there are no sinks.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const ScoreArguments& score);

}  // namespace mha::torch_ops
