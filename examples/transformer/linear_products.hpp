// LinearProducts<T>: the three products of a linear map y = x W^T, in the model's compute precision
// (TransformerConfig::compute): the forward y = x W^T, and the backward dx = dy W and dW = dy^T x.
// Linear uses it for its weight, SharedEmbedding for the pre-softmax map h E^T.
//
// Native: the products in T on x and W themselves, as every block computed before mixed precision.
// BFloat16 (T = float only): the forward rounds x and W to bfloat16 (W's rounding is this step's
// compute copy of the float32 master) and keeps both for the backward, which rounds dy; each product
// multiplies bf16 operands and accumulates and writes float32, so y, dx and dW are float32.
//
// Legend: R rows, in / out features; W [out, in] (PyTorch's nn.Linear layout).
#pragma once

#include <stdexcept>
#include <type_traits>

#include "transformer/matrix.hpp"
#include "transformer/transformer_config.hpp"

namespace transformer {

template <class T>
class LinearProducts {
 public:
  explicit LinearProducts(Compute compute = Compute::Native) : compute_(compute) {
    if (compute == Compute::BFloat16 && !std::is_same_v<T, float>)
      throw std::invalid_argument("LinearProducts: bfloat16 compute needs float32 master weights (T = float)");
  }

  // y [R, out] = x [R, in] W^T (+ y when accumulate). Keeps nothing (inference).
  void apply(const Matrix<T>& x, MatrixView<T> w, Matrix<T>& y, bool accumulate) const {
    if (compute_ == Compute::Native) return matmul(x, false, w, true, y, accumulate);
    if constexpr (std::is_same_v<T, float>) matmul(to_bfloat16(x), false, to_bfloat16(w), true, y, accumulate);
  }

  // The same, keeping x and W (Native: a copy of x and a view of W, which stays unchanged until the
  // backward; BFloat16: their roundings) for backward.
  void forward(const Matrix<T>& x, MatrixView<T> w, Matrix<T>& y, bool accumulate) {
    if (compute_ == Compute::Native) {
      x_ = x;
      w_ = w;
      return matmul(x, false, w, true, y, accumulate);
    }
    if constexpr (std::is_same_v<T, float>) {
      x_bf16_ = to_bfloat16(x);
      w_bf16_ = to_bfloat16(w);
      matmul(x_bf16_, false, w_bf16_, true, y, accumulate);
    }
  }

  // dy [R, out] -> dw [out, in] = dy^T x and dx [R, in] = dy W, both overwritten, from what forward kept.
  void backward(const Matrix<T>& dy, Matrix<T>& dw, Matrix<T>& dx) const {
    if (compute_ == Compute::Native) {
      matmul(dy, true, x_, false, dw);
      return matmul(dy, false, w_, false, dx);
    }
    if constexpr (std::is_same_v<T, float>) {
      const Matrix<mha::bfloat16> dy_bf16 = to_bfloat16(dy);
      matmul(dy_bf16, true, x_bf16_, false, dw);
      matmul(dy_bf16, false, w_bf16_, false, dx);
    }
  }

 private:
  Compute compute_;
  Matrix<T> x_;                            // Native: x [R, in]
  MatrixView<T> w_{nullptr, 0, 0};         // Native: W [out, in]
  Matrix<mha::bfloat16> x_bf16_, w_bf16_;  // BFloat16: their roundings
};

}  // namespace transformer
