// The layer's inputs: where their batch and position dimensions lie, where their rows live in memory,
// and the checks forward(), append_to_cache() and forward_cached() share (messages name the argument
// and the shape expected).
//
// Legend: B batch, T positions (L queries or S keys), E = d_model. "Rows" are the flattened (batch,
// position) pairs of an input in its own order: batch_first [B, T, *] has row b*T + t, sequence-first
// [T, B, *] row t*B + b.
#pragma once

#include <cstdint>
#include <string>

#include "mha/multi_head_attention.hpp"

namespace mha::detail {

// Where the rows of an input with T positions live: row (b, t) = b * batch + t * position.
struct RowLayout {
  std::int64_t batch, position;
};

// Where the batch and position dimensions of an input lie in the layer's layout: rank 3 is batched
// ([B, T, *] batch_first, else [T, B, *]), rank 2 unbatched [T, *] with B = 1.
struct InputDims {
  bool batched, seq_first;
  int batch_dim, pos_dim;

  InputDims(const MultiHeadAttentionConfig& c, std::int64_t rank)
      : batched(rank == 3),
        seq_first(batched && !c.batch_first),
        batch_dim(seq_first ? 1 : 0),
        pos_dim(batched && c.batch_first ? 1 : 0) {}
  std::int64_t batch(const TensorView& t) const { return batched ? t.size(batch_dim) : 1; }
  std::int64_t positions(const TensorView& t) const { return t.size(pos_dim); }
  RowLayout rows(std::int64_t B, std::int64_t T) const { return seq_first ? RowLayout{1, B} : RowLayout{T, 1}; }
};

// The key positions the layer appends after the S input keys: bias_k / bias_v (add_bias_kv), then a
// zero position (add_zero_attn). S' = S + extra_positions.
inline std::int64_t extra_positions(const MultiHeadAttentionConfig& c) {
  return (c.add_bias_kv ? 1 : 0) + (c.add_zero_attn ? 1 : 0);
}

// Throws unless t has rank 3 (batched) or 2 (unbatched); `positions` and `width` name its dimensions
// in the message ("L", "E").
void check_input_rank(const TensorView& t, const char* name, bool batch_first, const std::string& positions,
                      const std::string& width);
// Throws unless t has the layer's dtype.
void check_dtype(const TensorView& t, const char* name, DType dtype);
// Throws unless t's last dimension is `width` (named width_name in the message).
void check_width(const TensorView& t, const char* name, std::int64_t width, const char* width_name);
// Throws unless t has the rank of `like`.
void check_same_rank(const TensorView& t, const char* name, const TensorView& like, const char* like_name);
// Throws unless batched t has batch size B, that of `like`.
void check_same_batch(const TensorView& t, const char* name, const InputDims& dims, std::int64_t B,
                      const TensorView& like, const char* like_name);

// x when contiguous, else a contiguous copy held in `storage` (the GEMMs read plain [rows, width]).
TensorView contiguous_view(const TensorView& x, Tensor& storage);

}  // namespace mha::detail
