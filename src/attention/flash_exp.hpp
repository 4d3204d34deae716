// Row operations of the fused kernel exposed for tests, on the best SIMD target of this machine, evaluated
// exactly as the kernel evaluates them: the exponentials of its softmax. (Its rounding of P and dS to
// bfloat16 where the CPU has no AVX512-BF16 is bf16_conversion.hpp's round_to_bfloat16.)
#pragma once

namespace mha::detail {

// exp(x) as the fused kernel computes it, for x in the kernel's range (x <= 0, or -inf): float32
// kernels (within 2 ULP), and the bfloat16 kernel's, whose probabilities are rounded to bfloat16 (within
// 4e-7 relative; online_softmax-inl.h ExpInRangeForBfloat16).
float flash_exp(float x);
float flash_exp_bfloat16(float x);

}  // namespace mha::detail
