// The exponential of the fused kernel's softmax, exposed for tests: Highway's exp on the best SIMD
// target of this machine, evaluated exactly as the kernel's row operations evaluate it.
#pragma once

namespace mha::detail {

// exp(x) as the fused kernel computes it, for x in the kernel's range (x <= 0, or -inf).
float flash_exp(float x);

}  // namespace mha::detail
