// Linear<T>: y = x W^T + b, the position-wise linear map (PyTorch's nn.Linear layout: W [out, in]).
#pragma once

#include <string>

#include "transformer/matrix.hpp"
#include "transformer/parameter.hpp"

namespace transformer {

template <class T>
class Linear {
 public:
  Linear(const std::string& name, std::int64_t in, std::int64_t out, Rng& rng)
      : weight_(name + ".weight", {out, in}), bias_(name + ".bias", {out}) {
    xavier_uniform(weight_, rng);
  }

  // x [R, in] -> y [R, out]. Keeps x for backward.
  Matrix<T> forward(const Matrix<T>& x) {
    x_ = x;
    return apply(x);
  }
  // The same without keeping anything (inference).
  Matrix<T> apply(const Matrix<T>& x) const {
    Matrix<T> y(x.rows, out_features());
    for (std::int64_t r = 0; r < y.rows; ++r)
      for (std::int64_t j = 0; j < y.cols; ++j) y(r, j) = bias_.value[static_cast<std::size_t>(j)];
    matmul(x, false, weight_view(), true, y, /*accumulate=*/true);
    return y;
  }

  // dy [R, out] -> dx [R, in];  dW += dy^T x,  db += sum over rows of dy.
  Matrix<T> backward(const Matrix<T>& dy) {
    Matrix<T> dw(out_features(), in_features());
    matmul(dy, true, x_, false, dw);
    for (std::size_t i = 0; i < dw.data.size(); ++i) weight_.grad[i] += dw.data[i];
    for (std::int64_t r = 0; r < dy.rows; ++r)
      for (std::int64_t j = 0; j < dy.cols; ++j) bias_.grad[static_cast<std::size_t>(j)] += dy(r, j);
    Matrix<T> dx(dy.rows, in_features());
    matmul(dy, false, weight_view(), false, dx);
    return dx;
  }

  void collect(ParameterRefs<T>& out) { out.insert(out.end(), {&weight_, &bias_}); }
  std::int64_t in_features() const { return weight_.shape[1]; }
  std::int64_t out_features() const { return weight_.shape[0]; }

 private:
  MatrixView<T> weight_view() const { return {weight_.value.data(), out_features(), in_features()}; }  // [out, in]

  Parameter<T> weight_, bias_;
  Matrix<T> x_;
};

}  // namespace transformer
