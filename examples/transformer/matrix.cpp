// The products behind every linear map of the Transformer (see matrix.hpp).
#include "transformer/matrix.hpp"

#include <cassert>
#include <type_traits>

#include "gemm.hpp"

namespace transformer {

namespace {

// In: the operands' element type; Out: C's (float32 for bf16 operands).
template <class In, class Out>
void product(MatrixView<In> a, bool transpose_a, MatrixView<In> b, bool transpose_b, Matrix<Out>& c, bool accumulate) {
  const std::int64_t M = transpose_a ? a.cols : a.rows, K = transpose_a ? a.rows : a.cols;
  const std::int64_t N = transpose_b ? b.rows : b.cols;
  assert((transpose_b ? b.cols : b.rows) == K && c.rows == M && c.cols == N);
  const mha::detail::GemmInput<In> A{a.data, a.cols, transpose_a}, B{b.data, b.cols, transpose_b};
  const mha::detail::GemmOutput<Out> C{c.data.data(), c.cols, accumulate};
  if constexpr (std::is_same_v<In, Out>) mha::detail::gemm<In>(M, N, K, A, B, C);
  else mha::detail::gemm(M, N, K, A, B, C);
}

}  // namespace

Matrix<mha::bfloat16> to_bfloat16(MatrixView<float> m) {
  Matrix<mha::bfloat16> out(m.rows, m.cols);
  for (std::int64_t i = 0; i < m.rows * m.cols; ++i) out.data[static_cast<std::size_t>(i)] = m.data[i];
  return out;
}

void matmul(MatrixView<float> a, bool transpose_a, MatrixView<float> b, bool transpose_b, Matrix<float>& c,
            bool accumulate) {
  product(a, transpose_a, b, transpose_b, c, accumulate);
}

void matmul(MatrixView<double> a, bool transpose_a, MatrixView<double> b, bool transpose_b, Matrix<double>& c,
            bool accumulate) {
  product(a, transpose_a, b, transpose_b, c, accumulate);
}

void matmul(MatrixView<mha::bfloat16> a, bool transpose_a, MatrixView<mha::bfloat16> b, bool transpose_b,
            Matrix<float>& c, bool accumulate) {
  product(a, transpose_a, b, transpose_b, c, accumulate);
}

}  // namespace transformer
