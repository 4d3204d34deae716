/// \file
/// The score's description: which keys a query sees and how its logit is formed, held once. Every
/// entry that attends takes it as it is: AttentionOptions (scaled_dot_product_attention and its
/// backward, both kernels) and MultiHeadAttentionInputs (the layer's forward, backward and
/// forward_cached) are a ScoreSpec plus what concerns that call alone (dropout, which results to
/// return, the head gate); each boundary (the Python bindings, the layer) converts to it once.
///
/// Legend: B batch, h query heads, L queries, S keys.
///
/// Positions: query i sits at i' = i + S - L (bottom-right aligned, as causal decoding after a prefix
/// needs). The masking rules and the NaN rule are attention.hpp's.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "mha/tensor.hpp"

namespace mha {

struct ScoreSpec {
  /// The logits' scale: default 1 / sqrt(d_k); otherwise 0 or a normal finite number of the logit dtype
  /// (float32 for float32 and bfloat16 inputs, float64 for float64; attention.hpp).
  std::optional<double> scale{};
  bool causal = false;                           ///< key j allowed for query i only when j <= i'
  std::optional<TensorView> key_padding_mask{};  ///< bool [B, S], true = padding; or float, added to key j's logits
  std::vector<std::int64_t> key_lengths{};       ///< alternative to key_padding_mask: B lengths in [0, S]
  std::optional<TensorView> attn_mask{};  ///< bool (true = may not attend) or float (added), [L, S] or [B*h, L, S]
  /// A sliding window (FlashAttention-2's window_size): query i may see key j only when
  /// i' - window_left <= j <= i' + window_right; -1 leaves that side unbounded. Combines with causal and
  /// every mask; key blocks wholly outside it are skipped.
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;  ///< see window_left
  /// ALiBi (Press et al., 2022): [h] slopes, float32 or float64; adds -slope[head] * |i' - j| to logit
  /// (i, j), after the scale (and after softcap), like an additive mask. Each slope 0 or a normal number
  /// of the logit dtype.
  std::optional<TensorView> alibi_slopes{};
  /// Logit soft-capping (Gemma 2's, in FlashAttention-2's order): > 0 replaces each scaled logit x by
  /// softcap * tanh(x / softcap) before ALiBi and the masks are added; 0 (the default) leaves logits
  /// alone. IEEE arithmetic decides infinite logits (+inf caps to softcap). 0 or a normal positive
  /// number of the logit dtype: 5e-324 is refused, not read as 0.
  double softcap = 0.0;
  /// Attention sinks (gpt-oss; Xiao et al., 2024): [h] logits, float32 or float64, in the units of the
  /// scaled logits, one per query head, that join every row's softmax and bring no value:
  /// p_j = exp(s_j) / (exp(sinks[head]) + sum_k exp(s_k)). A row's weights then sum to less than 1, and
  /// a row whose keys are all forbidden gets output 0 and log-sum-exp sinks[head]. The log-sum-exp
  /// returned (and taken by the backward) includes the sink. Data, not a setting: a NaN sink makes its
  /// head's rows NaN, as a NaN logit would; -inf is no sink.
  std::optional<TensorView> sinks{};
};

}  // namespace mha
