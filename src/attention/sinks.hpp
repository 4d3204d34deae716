// Attention sinks (mha/score.hpp's ScoreSpec::sinks): their check at the public boundary and their
// gradient. The forward folds each head's sink into every row's softmax (online_softmax.hpp's
// fold_sink and LseMerge::add_sink), so the log-sum-exp includes it; the backward's dq, dk and dv then
// need nothing else: P = exp(S - lse) is the weight with the sink. The sink's own gradient:
//
//   p_sink(b, h, i) = exp(sink_h - lse(b, h, i))           the weight the sink takes from row i
//   d out_i / d sink_h = -p_sink out_i                      (every weight of the row shrinks by p_sink)
//   d sinks_h = -sum_b sum_i p_sink(b, h, i) D(b, h, i),    D = dout_i . out_i
//
// Legend: B batch, h query heads, L queries, d_v value width.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "mha/tensor.hpp"

namespace mha::detail {

// Throws mha::Error naming `sinks` unless it is float32 or float64 [h] and every finite value fits the
// logit dtype of `inputs` (logit_scalars.hpp: 1e39 would be inf in float32). NaN and +-inf are data:
// the NaN rule decides them (-inf is no sink).
void validate_sinks(const TensorView& sinks, DType inputs, std::int64_t h);

// dsinks [h] (float64, in order) += the sinks' gradient over a forward's rows: dout, out [B, h, L, d_v]
// (any floating dtype, any strides), lse [B, h, L] (the forward's, with the sink), sinks [h]. Rows are
// taken in order b, then i, per head, in float64. A row whose output is exactly 0 adds nothing (its
// output does not depend on the sink), so a NaN in its dout stays out; in a row of nonzero output only
// its nonzero entries enter D.
void accumulate_sink_gradient(const TensorView& dout, const TensorView& out, const TensorView& lse,
                              const TensorView& sinks, std::vector<double>& dsinks);

// The sinks' gradient as a tensor of the sinks' dtype, from the float64 sums.
Tensor sink_gradient_tensor(const std::vector<double>& dsinks, DType dtype);

}  // namespace mha::detail
