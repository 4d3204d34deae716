// mha::attention_forward and mha::attention_backward (attention_ops.hpp): torch tensors viewed in place,
// mha's kernels called, mha's results handed to torch without a copy. Also defines the library's
// schemas (TORCH_LIBRARY(mha)), the torch-semantics function's among them (implemented in sdpa.cpp).
#include "attention_ops.hpp"

#include <ATen/Functions.h>
#include <torch/library.h>

#include <optional>
#include <utility>

#include "mha/attention.hpp"
#include "mha/error.hpp"
#include "tensor_views.hpp"

namespace mha::torch_ops {

namespace {

AttentionOptions options_of(const ScoreArguments& score) {
  AttentionOptions o;
  o.attn_mask = optional_view_of(score.attn_mask, "attn_mask");
  o.key_padding_mask = optional_view_of(score.key_padding_mask, "key_padding_mask");
  o.causal = score.causal;
  if (score.scale) o.scale = *score.scale;
  o.window_left = score.window_left;
  o.window_right = score.window_right;
  o.alibi_slopes = optional_view_of(score.alibi_slopes, "alibi_slopes");
  o.softcap = score.softcap;
  o.sinks = optional_view_of(score.sinks, "sinks");
  o.dropout_p = score.dropout_p;
  o.dropout_seed = static_cast<std::uint64_t>(score.dropout_seed);
  return o;
}

// Runs `call`, turning mha::Error (a bad argument the library found) into torch's error type.
template <class Call>
auto torch_errors(Call&& call) -> decltype(call()) {
  try {
    return call();
  } catch (const Error& e) {
    TORCH_CHECK(false, "mha: ", e.what());
  }
}

ScoreArguments score_of(c10::optional<at::Tensor> attn_mask, c10::optional<at::Tensor> key_padding_mask, bool causal,
                        c10::optional<double> scale, std::int64_t window_left, std::int64_t window_right,
                        c10::optional<at::Tensor> alibi_slopes, double softcap, c10::optional<at::Tensor> sinks,
                        double dropout_p, std::int64_t dropout_seed) {
  return {std::move(attn_mask),
          std::move(key_padding_mask),
          causal,
          scale,
          window_left,
          window_right,
          std::move(alibi_slopes),
          softcap,
          std::move(sinks),
          dropout_p,
          dropout_seed};
}

std::tuple<at::Tensor, at::Tensor> forward_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                              c10::optional<at::Tensor> attn_mask,
                                              c10::optional<at::Tensor> key_padding_mask, bool causal,
                                              c10::optional<double> scale, std::int64_t window_left,
                                              std::int64_t window_right, c10::optional<at::Tensor> alibi_slopes,
                                              double softcap, c10::optional<at::Tensor> sinks, double dropout_p,
                                              std::int64_t dropout_seed) {
  return attention_forward(
      q, k, v,
      score_of(std::move(attn_mask), std::move(key_padding_mask), causal, scale, window_left, window_right,
               std::move(alibi_slopes), softcap, std::move(sinks), dropout_p, dropout_seed));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_op(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, c10::optional<at::Tensor> attn_mask, c10::optional<at::Tensor> key_padding_mask, bool causal,
    c10::optional<double> scale, std::int64_t window_left, std::int64_t window_right,
    c10::optional<at::Tensor> alibi_slopes, double softcap, c10::optional<at::Tensor> sinks, double dropout_p,
    std::int64_t dropout_seed) {
  return attention_backward(
      dout, q, k, v, out, lse,
      score_of(std::move(attn_mask), std::move(key_padding_mask), causal, scale, window_left, window_right,
               std::move(alibi_slopes), softcap, std::move(sinks), dropout_p, dropout_seed));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const ScoreArguments& score) {
  const TensorView q_view = view_of(q, "q"), k_view = view_of(k, "k"), v_view = view_of(v, "v");
  AttentionOptions options = options_of(score);
  options.need_lse = true;
  AttentionResult result = torch_errors([&] { return scaled_dot_product_attention(q_view, k_view, v_view, options); });
  return {tensor_of(std::move(result.out)), tensor_of(std::move(result.lse))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const ScoreArguments& score) {
  const TensorView dout_view = view_of(dout, "dout"), q_view = view_of(q, "q"), k_view = view_of(k, "k"),
                   v_view = view_of(v, "v"), out_view = view_of(out, "out"), lse_view = view_of(lse, "lse");
  const AttentionOptions options = options_of(score);
  AttentionGradients grads = torch_errors([&] {
    return scaled_dot_product_attention_backward(dout_view, q_view, k_view, v_view, out_view, lse_view, options);
  });
  at::Tensor dsinks = grads.dsinks.defined() ? tensor_of(std::move(grads.dsinks)) : at::empty({0}, q.options());
  return {tensor_of(std::move(grads.dq)), tensor_of(std::move(grads.dk)), tensor_of(std::move(grads.dv)),
          std::move(dsinks)};
}

}  // namespace mha::torch_ops

// The schemas. attention_forward / attention_backward: mha's semantics, 4-D, not differentiable
// themselves. scaled_dot_product_attention: PyTorch 2.5's function with its autograd (sdpa.cpp).
TORCH_LIBRARY(mha, m) {
  m.def("attention_forward(Tensor q, Tensor k, Tensor v, Tensor? attn_mask=None, Tensor? key_padding_mask=None, "
        "bool causal=False, "
        "float? scale=None, int window_left=-1, int window_right=-1, Tensor? alibi_slopes=None, float softcap=0., "
        "Tensor? sinks=None, float dropout_p=0., int dropout_seed=0) -> (Tensor out, Tensor lse)");
  m.def("attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor? attn_mask=None, Tensor? key_padding_mask=None, bool causal=False, float? scale=None, "
        "int window_left=-1, int window_right=-1, "
        "Tensor? alibi_slopes=None, float softcap=0., Tensor? sinks=None, float dropout_p=0., int dropout_seed=0) "
        "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dsinks)");
  m.def("scaled_dot_product_attention(Tensor query, Tensor key, Tensor value, Tensor? attn_mask=None, "
        "float dropout_p=0., bool is_causal=False, float? scale=None, bool enable_gqa=False, int[]? window=None, "
        "Tensor? alibi_slopes=None, float? softcap=None, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(mha, CPU, m) {
  m.impl("attention_forward", &mha::torch_ops::forward_op);
  m.impl("attention_backward", &mha::torch_ops::backward_op);
}
