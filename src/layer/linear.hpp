// Linear projections, y = x W^T + b, as in torch.nn.Linear, and the bias gradient; the products go
// through gemm.hpp.
#pragma once

#include <cstdint>

namespace mha::detail {

// x: [M, K] rows `ldx` elements apart; w: [N, K] contiguous; bias: [N] or null;
// y: [M, N] rows `ldy` elements apart (y may be a column slice of a wider matrix).
template <class T>
void linear_forward(const T* x, std::int64_t ldx, std::int64_t M, std::int64_t K, const T* w, std::int64_t N,
                    const T* bias, T* y, std::int64_t ldy);

// bias_grad [N] = sum over the M rows of dy [M, N] (row stride ldy), in row order.
template <class T>
void column_sums(const T* dy, std::int64_t ldy, std::int64_t M, std::int64_t N, T* bias_grad);

}  // namespace mha::detail
