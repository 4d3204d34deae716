// The layer's masks in kernel terms: the user's key_padding_mask / key_lengths / attn_mask / causal
// over S keys, validated and turned into AttentionOptions over [B, h, L, S'] (S' = S + the extra
// positions of add_bias_kv / add_zero_attn, which every query may attend to).
#pragma once

#include <cstdint>

#include "layer/packed.hpp"
#include "mha/attention.hpp"
#include "mha/multi_head_attention.hpp"

namespace mha::detail {

// The masks in kernel terms, owning any tensor built for them.
struct KernelMasks {
  AttentionOptions options;
  Tensor attn_mask, key_padding_mask, alibi_slopes, sinks;  // storage for masks built here
  PackedRows packed;  // the offsets of packed sequences (inputs.cu_seqlens), or none

  // Points the options at copies owned here, so the masks outlive the caller's arrays.
  void own_views();
};

// The user's masks over S keys in kernel terms, [B, h, L, S'] with S' = S + the extra positions:
// validated, a float attn_mask of the other float dtype converted, padded for the extra positions.
// sinks: the layer's sinks parameter [h] (config.sinks), or null; copied (in float32 for a bfloat16
// layer, the dtype its logits are computed in) into the options.
KernelMasks kernel_masks(const MultiHeadAttentionInputs& in, const MultiHeadAttentionConfig& c, bool batched,
                         std::int64_t B, std::int64_t L, std::int64_t S, const Tensor* sinks);

}  // namespace mha::detail
