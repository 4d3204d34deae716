// The checks of varlen_attention (mha/varlen.hpp) that other packed callers share (the layer's packed
// forward): the offsets as prefix sums, and the options a packed batch cannot take.
#pragma once

#include <cstdint>

#include "mha/varlen.hpp"

namespace mha::detail {

// Throws mha::Error naming `name` unless cu ([n + 1]) holds prefix sums from 0 to `total` (the number of
// `rows`, e.g. "q's rows", called `total_name` in the message).
void validate_offsets(const CuSeqlens& cu, const char* name, std::int64_t total, const char* total_name,
                      const char* rows);

// Throws mha::Error naming attn_mask, key_padding_mask, key_lengths or need_weights when the options
// give them: laid out over a [B, S] batch, which a packed batch does not have.
void refuse_batch_options(const AttentionOptions& o);

}  // namespace mha::detail
