// Linear projections, y = x W^T + b, as in torch.nn.Linear. float32 goes through oneDNN's matmul;
// float64 (the verification dtype, which oneDNN's CPU matmul does not support) through plain loops.
#pragma once

#include <cstdint>

namespace mha::detail {

// x: [M, K] rows `ldx` elements apart; w: [N, K] contiguous; bias: [N] or null;
// y: [M, N] rows `ldy` elements apart (y may be a column slice of a wider matrix).
template <class T>
void linear_forward(const T* x, std::int64_t ldx, std::int64_t M, std::int64_t K, const T* w, std::int64_t N,
                    const T* bias, T* y, std::int64_t ldy);

}  // namespace mha::detail
