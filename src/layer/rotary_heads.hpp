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

// The same with every row's own position: row t of batch b at positions[t] ([T], shared by the batch
// rows: packed sequences, each counting from 0) or positions[b T + t] ([B, T]: explicit positions).
void rotate_heads_at(const TensorView& heads, const MultiHeadAttentionConfig& c,
                     const std::vector<std::int64_t>& positions, bool inverse);

// A forward's explicit positions (MultiHeadAttentionInputs::positions / key_positions), copied: query
// [1 or B, L] and key [1 or B, S], flattened. Not given: the default places (query i at i + S - L, key j at j).
struct RotaryPositions {
  bool given = false;
  std::vector<std::int64_t> query, key;
};

// The explicit positions of a forward over B batch rows of L queries and S keys, checked against the
// layer (rotary_dim > 0, no packed sequences) and those sizes: mha::Error naming positions or
// key_positions otherwise.
RotaryPositions rotary_positions(const MultiHeadAttentionInputs& in, const MultiHeadAttentionConfig& c, std::int64_t B,
                                 std::int64_t L, std::int64_t S);

// For the calls that place each position themselves (`call`: forward_cached, forward_paged): mha::Error
// naming positions when the inputs give any.
void refuse_rotary_positions(const MultiHeadAttentionInputs& in, const char* call);

}  // namespace mha::detail
