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
  mha::detail::gemm<T>(M, N, K, {a.data, a.cols, transpose_a}, {b.data, b.cols, transpose_b},
                       {c.data.data(), c.cols, accumulate});
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
