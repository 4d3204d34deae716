// Linear projections and products through oneDNN's sgemm (float32) or plain loops (float64).
#include "linear.hpp"

#include "parallel.hpp"

#include <oneapi/dnnl/dnnl.h>

#include <algorithm>

namespace mha::detail {

namespace {

// Fills y [M, N] with the bias (or 0): the result of a product with K = 0.
template <class T>
void fill_bias(std::int64_t M, std::int64_t N, const T* bias, T* y, std::int64_t ldy) {
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < N; ++n) y[m * ldy + n] = bias ? bias[n] : T(0);
}

// Rows of C per work item. Every float32 product is split into blocks of C rows, each computed whole
// (its full K reduction) by one thread with oneDNN's sgemm, which then runs single-threaded. So the
// result does not depend on the number of threads: oneDNN's own threading may split K and sum the
// parts in an order that does (measured: the layer's out differed in 546 of 19,200 elements between
// 1 and 2 threads). 128 rows keep each call large enough to run at the GEMM's full rate.
constexpr std::int64_t kRowsPerBlock = 128;

// C [M, N] (=|+=) A' B' in blocks of C rows (see kRowsPerBlock); arguments as gemm's.
void blocked_sgemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, const float* A,
                   std::int64_t lda, const float* B, std::int64_t ldb, bool accumulate, float* C, std::int64_t ldc) {
  const std::int64_t blocks = (M + kRowsPerBlock - 1) / kRowsPerBlock;
  const SerialIfSmall serial_if_small(2.0 * M * N * K);
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t block = 0; block < blocks; ++block) {
    const std::int64_t m0 = block * kRowsPerBlock, rows = std::min(kRowsPerBlock, M - m0);
    const float* A_rows = trans_a ? A + m0 : A + m0 * lda;  // rows of A' = columns of A when transposed
    dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', rows, N, K, 1.0f, A_rows, lda, B, ldb,
               accumulate ? 1.0f : 0.0f, C + m0 * ldc, ldc);
  }
}

}  // namespace

template <>
void linear_forward<float>(const float* x, std::int64_t ldx, std::int64_t M, std::int64_t K, const float* w,
                           std::int64_t N, const float* bias, float* y, std::int64_t ldy) {
  if (M == 0 || N == 0) return;
  fill_bias(M, N, bias, y, ldy);  // y = b, then y += x W^T
  if (K > 0) blocked_sgemm(false, true, M, N, K, x, ldx, w, K, true, y, ldy);
}

template <>
void linear_forward<double>(const double* x, std::int64_t ldx, std::int64_t M, std::int64_t K, const double* w,
                            std::int64_t N, const double* bias, double* y, std::int64_t ldy) {
  const SerialIfSmall serial_if_small(2.0 * M * N * K);
#pragma omp parallel for schedule(static)
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (std::int64_t c = 0; c < K; ++c) acc += x[m * ldx + c] * w[n * K + c];
      y[m * ldy + n] = acc + (bias ? bias[n] : 0.0);
    }
}

template <>
void gemm<float>(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, const float* A,
                 std::int64_t lda, const float* B, std::int64_t ldb, bool accumulate, float* C, std::int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (!accumulate) fill_bias<float>(M, N, nullptr, C, ldc);
    return;
  }
  blocked_sgemm(trans_a, trans_b, M, N, K, A, lda, B, ldb, accumulate, C, ldc);
}

template <>
void gemm<double>(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, const double* A,
                  std::int64_t lda, const double* B, std::int64_t ldb, bool accumulate, double* C, std::int64_t ldc) {
  const SerialIfSmall serial_if_small(2.0 * M * N * K);
#pragma omp parallel for schedule(static)
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (std::int64_t c = 0; c < K; ++c)
        acc += (trans_a ? A[c * lda + m] : A[m * lda + c]) * (trans_b ? B[n * ldb + c] : B[c * ldb + n]);
      C[m * ldc + n] = accumulate ? C[m * ldc + n] + acc : acc;
    }
}

template <class T>
void column_sums(const T* dy, std::int64_t ldy, std::int64_t M, std::int64_t N, T* bias_grad) {
  for (std::int64_t n = 0; n < N; ++n) bias_grad[n] = 0;
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < N; ++n) bias_grad[n] += dy[m * ldy + n];
}

template void column_sums<float>(const float*, std::int64_t, std::int64_t, std::int64_t, float*);
template void column_sums<double>(const double*, std::int64_t, std::int64_t, std::int64_t, double*);

}  // namespace mha::detail
