// The products behind every linear map of the Transformer (see matrix.hpp).
#include "transformer/matrix.hpp"

#include <cassert>

#include "gemm.hpp"

namespace transformer {

namespace {

template <class T>
void product(MatrixView<T> a, bool transpose_a, MatrixView<T> b, bool transpose_b, Matrix<T>& c, bool accumulate) {
  const std::int64_t M = transpose_a ? a.cols : a.rows, K = transpose_a ? a.rows : a.cols;
  const std::int64_t N = transpose_b ? b.rows : b.cols;
  assert((transpose_b ? b.cols : b.rows) == K && c.rows == M && c.cols == N);
  mha::detail::gemm<T>({.trans_a = transpose_a,
                        .trans_b = transpose_b,
                        .M = M,
                        .N = N,
                        .K = K,
                        .A = a.data,
                        .lda = a.cols,
                        .B = b.data,
                        .ldb = b.cols,
                        .accumulate = accumulate,
                        .C = c.data.data(),
                        .ldc = c.cols});
}

}  // namespace

void matmul(MatrixView<float> a, bool transpose_a, MatrixView<float> b, bool transpose_b, Matrix<float>& c,
            bool accumulate) {
  product(a, transpose_a, b, transpose_b, c, accumulate);
}

void matmul(MatrixView<double> a, bool transpose_a, MatrixView<double> b, bool transpose_b, Matrix<double>& c,
            bool accumulate) {
  product(a, transpose_a, b, transpose_b, c, accumulate);
}

}  // namespace transformer
