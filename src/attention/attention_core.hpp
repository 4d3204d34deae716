// Between the public boundary and the kernels: validation of attention arguments, and runs that write
// their results through given strides (so the layer can write heads straight into [B, L, h*d_v] and
// read their gradients from there).
//
// Legend: B batch, h heads, L queries, S keys, d_k query/key width, d_v value width.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "mha/attention.hpp"

namespace mha::detail {

// Throws mha::Error naming the argument when q, k, v or options are invalid (see attention.hpp).
void validate_attention(const TensorView& q, const TensorView& k, const TensorView& v, const AttentionOptions& options);

// The checks of validate_attention on the score's description alone (scale, masks, key lengths,
// window, ALiBi slopes, softcap), for callers that build q, k, v themselves; `dtype` is the inputs' (it
// decides the logit dtype the scale, slopes and softcap must fit, see logit_scalars.hpp).
void validate_score(const ScoreSpec& score, DType dtype, std::int64_t B, std::int64_t h, std::int64_t L,
                    std::int64_t S);

// validate_attention, plus the checks of the backward's extra arguments (dout, out, lse).
void validate_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                                 const TensorView& out, const TensorView& lse, const AttentionOptions& options);

// Where a kernel writes one [B, h, T, d] result: memory of q's dtype and its strides in elements.
struct StridedOutput {
  void* data;
  Shape strides;
};

// Runs the kernel chosen by options.kernel on validated arguments, writing out [B, h, L, d_v].
// weights / lse: allocated and filled when the options ask for them (else left undefined).
// partial_over_keys: k and v are some of the keys a caller merges results over (the ring): a row whose
// allowed logits are all -inf has no weight in this part, lse -inf, marked by a NaN output row (not
// 0 / 0 already: the other parts may give it weight), see AttentionParams; the kernel then leaves
// options.sinks to the caller, whose merge adds each sink once (LseMerge::add_sink).
// query_shift: the position of query row 0 minus that of key 0 (query i sits at i + query_shift, key j
// at j), by which causal, the window and ALiBi's distances are taken; nullopt: S - L, the public
// calls' bottom-right alignment. The ring passes a chunk pair's offset in the whole sequence.
void run_attention(const TensorView& q, const TensorView& k, const TensorView& v, const AttentionOptions& options,
                   const StridedOutput& out, Tensor& weights, Tensor& lse, bool partial_over_keys = false,
                   std::optional<std::int64_t> query_shift = std::nullopt);

// Runs the backward of the kernel chosen by options.kernel on validated arguments, writing
// dq [B, h, L, d_k], dk [B, h, S, d_k], dv [B, h, S, d_v]; they must be zero on entry. query_shift as
// for run_attention (the forward's).
void run_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& out, const TensorView& lse, const AttentionOptions& options,
                            const StridedOutput& dq, const StridedOutput& dk, const StridedOutput& dv,
                            std::optional<std::int64_t> query_shift = std::nullopt);

// How the fused kernel computes bfloat16 attention in this process (attention.hpp: as float32 where the
// bfloat16 products run on sgemm), in words, for `mha bench --dtype bf16`.
std::string fused_bf16_attention_kernel();

}  // namespace mha::detail
