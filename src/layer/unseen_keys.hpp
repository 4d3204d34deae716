// Key positions that no query attends to (every head and every query of their batch masked out), and
// the key and value rows the parameter gradients must therefore not read.
//
// Why: a parameter gradient is a sum over rows, dW_k = dK^T X_k (likewise dW_v); a masked key's row of
// dK is 0, but 0 * NaN is NaN, so a NaN or Inf in a padded key's input would reach dW_k and dW_v
// although the key changes nothing in the forward. The backward reads such rows as 0 instead: a copy
// of the input is made only when a row no query sees holds a non-finite value (otherwise this is one
// scan of the input for non-finite values).
//
// Legend: B batch, h heads, L queries, S input keys, S' = S + the layer's extra key positions (the
// kernel's key count, which the masks in kernel terms cover).
#pragma once

#include <cstdint>

#include "layer/inputs.hpp"
#include "layer/packed.hpp"
#include "mha/attention.hpp"

namespace mha::detail {

// Whether no query of batch b may attend to key j (j < S), in any head, by the masks of `masks` (the
// layer's masks in kernel terms over [B, h, L, S']): padding, key lengths, causal, window, a boolean
// attn_mask or an additive -inf.
bool unseen_key(const AttentionOptions& masks, std::int64_t b, std::int64_t j, std::int64_t h, std::int64_t L,
                std::int64_t S_kernel);

// x: a key or value input of the layer, contiguous rows, row (b, t) at b * rows.batch + t * rows.position
// for t < S. Returns x when no row that no query sees holds a NaN or Inf; else a view of `storage`, a
// copy of x with those rows zeroed. Packed sequences (packed.packed(), B = 1): key row t of sequence i is
// seen only by sequence i's queries, as causal and the window place them within it (a sequence without
// queries sees none of its keys).
TensorView without_unseen_nonfinite_rows(const TensorView& x, RowLayout rows, std::int64_t B, std::int64_t S,
                                         const AttentionOptions& masks, std::int64_t h, std::int64_t L,
                                         std::int64_t S_kernel, const PackedRows& packed, Tensor& storage);

}  // namespace mha::detail
