// The public attention call: validate once, allocate the outputs, run the chosen kernel.
#include "attention/attention_core.hpp"
#include "attention/sinks.hpp"

#include <vector>

namespace mha {

AttentionResult scaled_dot_product_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                                             const AttentionOptions& options) {
  detail::validate_attention(q, k, v, options);
  AttentionResult result;
  // out: [B, h, L, d_v], written whole by the kernel
  result.out = Tensor::uninitialized(q.dtype(), {q.size(0), q.size(1), q.size(2), v.size(3)});
  detail::run_attention(q, k, v, options, {result.out.data(), result.out.strides()}, result.weights, result.lse);
  return result;
}

AttentionGradients scaled_dot_product_attention_backward(const TensorView& dout, const TensorView& q,
                                                         const TensorView& k, const TensorView& v,
                                                         const TensorView& out, const TensorView& lse,
                                                         const AttentionOptions& options) {
  detail::validate_attention_backward(dout, q, k, v, out, lse, options);
  // written whole by the kernel
  AttentionGradients grads{Tensor::uninitialized(q.dtype(), q.shape()), Tensor::uninitialized(q.dtype(), k.shape()),
                           Tensor::uninitialized(q.dtype(), v.shape())};
  detail::run_attention_backward(dout, q, k, v, out, lse, options, {grads.dq.data(), grads.dq.strides()},
                                 {grads.dk.data(), grads.dk.strides()}, {grads.dv.data(), grads.dv.strides()});
  if (options.sinks) {
    std::vector<double> dsinks(static_cast<std::size_t>(q.size(1)), 0.0);
    detail::accumulate_sink_gradient(dout, out, lse, *options.sinks, dsinks);
    grads.dsinks = detail::sink_gradient_tensor(dsinks, options.sinks->dtype());
  }
  return grads;
}

}  // namespace mha
