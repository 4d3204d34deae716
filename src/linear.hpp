// Linear projections, y = x W^T + b, as in torch.nn.Linear. float32 goes through oneDNN's sgemm;
// float64 (the verification dtype, which oneDNN's CPU matmul does not support) through plain loops.
#pragma once

#include <cstdint>

namespace mha::detail {

// x: [M, K] rows `ldx` elements apart; w: [N, K] contiguous; bias: [N] or null;
// y: [M, N] rows `ldy` elements apart (y may be a column slice of a wider matrix).
template <class T>
void linear_forward(const T* x, std::int64_t ldx, std::int64_t M, std::int64_t K, const T* w, std::int64_t N,
                    const T* bias, T* y, std::int64_t ldy);

// C [M, N] = A' B' (+ C when accumulate), row-major; A' = A [M, K] or, with trans_a, A^T for A [K, M];
// B' = B [K, N] or, with trans_b, B^T for B [N, K]. lda, ldb, ldc: row strides in elements.
// float32 through oneDNN's sgemm; float64 through plain loops.
template <class T>
void gemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, const T* A, std::int64_t lda,
          const T* B, std::int64_t ldb, bool accumulate, T* C, std::int64_t ldc);

// bias_grad [N] = sum over the M rows of dy [M, N] (row stride ldy), in row order.
template <class T>
void column_sums(const T* dy, std::int64_t ldy, std::int64_t M, std::int64_t N, T* bias_grad);

}  // namespace mha::detail
