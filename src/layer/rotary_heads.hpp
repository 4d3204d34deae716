// The layer's rotary position embeddings (MultiHeadAttentionConfig::rotary_dim, mha/rotary.hpp): each
// query and key head rotated in place inside its projection, after the projection and before the
// attention; the backward rotates the gradients back (R^T). Positions are the sequence's own: row t of
// batch b sits at first[b] + t (the layer's bottom-right alignment puts query i at i + S - L; the
// caches at their lengths).
//
// Legend: B batch, heads h or h_kv, T rows per batch, d_k head width.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "mha/multi_head_attention.hpp"

namespace mha::detail {

// Whether the layer rotates its queries and keys.
inline bool has_rotary(const MultiHeadAttentionConfig& c) { return c.rotary_dim > 0; }

// Rotates heads [B, heads, T, d_k], a view into a projection the caller owns (any strides), in place:
// R when !inverse, R^T (the backward) when inverse. first: one position for every batch row, or B of them.
void rotate_heads(const TensorView& heads, const MultiHeadAttentionConfig& c, std::span<const std::int64_t> first,
                  bool inverse);

// The same for one batch row (heads [1, heads, T, d_k]) whose row t sits at positions[t] (packed
// sequences, each counting from 0).
void rotate_heads_at(const TensorView& heads, const MultiHeadAttentionConfig& c,
                     const std::vector<std::int64_t>& positions, bool inverse);

}  // namespace mha::detail
