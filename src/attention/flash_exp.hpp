// Row operations of the fused kernel exposed for tests, on the best SIMD target of this machine, evaluated
// exactly as the kernel evaluates them: the exponentials of its softmax, and its rounding of P and dS to
// bfloat16 by hand (where the CPU has no AVX512-BF16: bf16_rounding.hpp).
#pragma once

#include <cstdint>

#include "mha/bfloat16.hpp"

namespace mha::detail {

// exp(x) as the fused kernel computes it, for x in the kernel's range (x <= 0, or -inf): float32
// kernels (within 2 ULP), and the bfloat16 kernel's, whose probabilities are rounded to bfloat16 (within
// 4e-7 relative; online_softmax-inl.h ExpInRangeForBfloat16).
float flash_exp(float x);
float flash_exp_bfloat16(float x);

// x[0, n) rounded to bfloat16 as the kernels round by hand (nearest even, subnormals kept, NaN quiet); n a
// multiple of 16.
void flash_round_by_hand(const float* x, std::int64_t n, bfloat16* out);

}  // namespace mha::detail
