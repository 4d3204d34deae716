// The fused attention kernel: FlashAttention-2 (Dao 2023) on the CPU, float32.
#pragma once

#include "attention/params.hpp"

namespace mha::detail {

// Requirements (checked by the caller): q, k, v have unit stride in their last dimension.
void flash_attention_forward(const AttentionParams<float>& p);
// dq, dk, dv must be zero on entry; they need unit stride in their last dimension.
void flash_attention_backward(const AttentionBackwardParams<float>& p);

// Highway's exp as the kernel evaluates it on the best target of this machine (for tests).
float flash_exp(float x);

}  // namespace mha::detail
