// Matrix<T>: the row-major 2-D array every block of the Transformer passes around, and the products
// and small helpers the blocks share.
//
// Activations are [R, d] with R = B * T rows (batch-first: row b * T + t), so a Matrix is also a
// [B, T, d] tensor whenever the block knows B and T.
#pragma once

#include <cstdint>
#include <vector>

#include "mha/bfloat16.hpp"

namespace transformer {

// A read-only [rows, cols] window on row-major memory owned elsewhere (a Matrix, a parameter's values).
template <class T>
struct MatrixView {
  const T* data;
  std::int64_t rows, cols;
  T operator()(std::int64_t i, std::int64_t j) const { return data[i * cols + j]; }
};

template <class T>
struct Matrix {
  std::int64_t rows = 0, cols = 0;
  std::vector<T> data;  // [rows, cols]

  Matrix() = default;
  Matrix(std::int64_t r, std::int64_t c) : rows(r), cols(c), data(static_cast<std::size_t>(r * c), T(0)) {}

  T* row(std::int64_t i) { return data.data() + i * cols; }
  const T* row(std::int64_t i) const { return data.data() + i * cols; }
  T& operator()(std::int64_t i, std::int64_t j) { return data[static_cast<std::size_t>(i * cols + j)]; }
  T operator()(std::int64_t i, std::int64_t j) const { return data[static_cast<std::size_t>(i * cols + j)]; }
  std::int64_t size() const { return rows * cols; }
  operator MatrixView<T>() const { return {data.data(), rows, cols}; }  // NOLINT: a Matrix is a view
};

// C = op(A) op(B) (+ C when accumulate), where op(X) is X or X^T. A, B, C row-major with their own
// widths. Through the library's one product entry (src/gemm.hpp): float32 runs oneDNN's sgemm in
// fixed row blocks (results independent of the thread count); float64 (the gradient checks) plain loops.
void matmul(MatrixView<float> a, bool transpose_a, MatrixView<float> b, bool transpose_b, Matrix<float>& c,
            bool accumulate = false);
void matmul(MatrixView<double> a, bool transpose_a, MatrixView<double> b, bool transpose_b, Matrix<double>& c,
            bool accumulate = false);
// The same on bfloat16 operands, accumulating and writing float32 (oneDNN's bf16 matmul; the mixed
// precision of linear_products.hpp).
void matmul(MatrixView<mha::bfloat16> a, bool transpose_a, MatrixView<mha::bfloat16> b, bool transpose_b,
            Matrix<float>& c, bool accumulate = false);

// m rounded to bfloat16 (to nearest, ties to even).
Matrix<mha::bfloat16> to_bfloat16(MatrixView<float> m);

// a += b (same shape).
template <class T>
void add_to(Matrix<T>& a, const Matrix<T>& b) {
  for (std::int64_t i = 0; i < a.size(); ++i)
    a.data[static_cast<std::size_t>(i)] += b.data[static_cast<std::size_t>(i)];
}

template <class T>
Matrix<T> sum(const Matrix<T>& a, const Matrix<T>& b) {
  Matrix<T> c = a;
  add_to(c, b);
  return c;
}

}  // namespace transformer
