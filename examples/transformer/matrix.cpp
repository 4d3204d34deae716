// The products behind every linear map of the Transformer (see matrix.hpp).
#include "transformer/matrix.hpp"

#include <cassert>

#include <dnnl.h>

namespace transformer {

void matmul(MatrixView<float> a, bool transpose_a, MatrixView<float> b, bool transpose_b, Matrix<float>& c,
            float beta) {
  const std::int64_t M = transpose_a ? a.cols : a.rows, K = transpose_a ? a.rows : a.cols;
  const std::int64_t N = transpose_b ? b.rows : b.cols;
  assert((transpose_b ? b.cols : b.rows) == K && c.rows == M && c.cols == N);
  if (M == 0 || N == 0) return;
  dnnl_sgemm(transpose_a ? 'T' : 'N', transpose_b ? 'T' : 'N', M, N, K, 1.0f, a.data, a.cols, b.data, b.cols, beta,
             c.data.data(), c.cols);
}

void matmul(MatrixView<double> a, bool transpose_a, MatrixView<double> b, bool transpose_b, Matrix<double>& c,
            double beta) {
  const std::int64_t M = transpose_a ? a.cols : a.rows, K = transpose_a ? a.rows : a.cols;
  const std::int64_t N = transpose_b ? b.rows : b.cols;
  assert((transpose_b ? b.cols : b.rows) == K && c.rows == M && c.cols == N);
  for (std::int64_t i = 0; i < M; ++i) {
    for (std::int64_t j = 0; j < N; ++j) {
      double acc = 0.0;
      for (std::int64_t k = 0; k < K; ++k)
        acc += (transpose_a ? a(k, i) : a(i, k)) * (transpose_b ? b(j, k) : b(k, j));
      c(i, j) = acc + beta * c(i, j);
    }
  }
}

}  // namespace transformer
