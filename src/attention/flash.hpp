// The fused attention kernel: FlashAttention-2 (Dao 2023) on the CPU, float32 and bfloat16. The forward and
// the backward take the parameter objects of params.hpp; attention_core.cpp builds and validates them.
#pragma once

#include "attention/params.hpp"

namespace mha::detail {

// Requirements (checked by the caller): q, k, v have unit stride in their last dimension.
void flash_attention_forward(const AttentionParams<float>& p);
// bfloat16 inputs and outputs: bfloat16 products with float32 accumulation, float32 softmax and
// log-sum-exp, P rounded to bfloat16 for the P V product.
void flash_attention_forward(const AttentionParams<bfloat16>& p);
// Accumulates into dq, dk, dv, which must be zero on entry; they need unit stride in their last
// dimension.
void flash_attention_backward(const AttentionBackwardParams<float>& p);
// bfloat16 inputs and outputs: bfloat16 products (P and dS rounded) with float32 accumulation.
void flash_attention_backward(const AttentionBackwardParams<bfloat16>& p);

}  // namespace mha::detail
