// Linear<T>: y = x W^T + b, the position-wise linear map (PyTorch's nn.Linear layout: W [out, in]);
// its products in the model's compute precision (linear_products.hpp), the bias and its sum in T.
#pragma once

#include <string>

#include "transformer/linear_products.hpp"
#include "transformer/parameter.hpp"

namespace transformer {

template <class T>
class Linear {
 public:
  Linear(const std::string& name, std::int64_t in, std::int64_t out, Rng& rng, Compute compute = Compute::Native)
      : weight_(name + ".weight", {out, in}), bias_(name + ".bias", {out}), products_(compute) {
    xavier_uniform(weight_, rng);
  }

  // x [R, in] -> y [R, out]. Keeps x (in the compute precision) for backward.
  Matrix<T> forward(const Matrix<T>& x) {
    Matrix<T> y = bias_rows(x.rows);
    products_.forward(x, weight_view(), y, /*accumulate=*/true);
    return y;
  }
  // The same without keeping anything (inference).
  Matrix<T> apply(const Matrix<T>& x) const {
    Matrix<T> y = bias_rows(x.rows);
    products_.apply(x, weight_view(), y, /*accumulate=*/true);
    return y;
  }

  // dy [R, out] -> dx [R, in];  dW += dy^T x,  db += sum over rows of dy.
  Matrix<T> backward(const Matrix<T>& dy) {
    Matrix<T> dw(out_features(), in_features()), dx(dy.rows, in_features());
    products_.backward(dy, dw, dx);
    for (std::size_t i = 0; i < dw.data.size(); ++i) weight_.grad[i] += dw.data[i];
    for (std::int64_t r = 0; r < dy.rows; ++r)
      for (std::int64_t j = 0; j < dy.cols; ++j) bias_.grad[static_cast<std::size_t>(j)] += dy(r, j);
    return dx;
  }

  void collect(ParameterRefs<T>& out) { out.insert(out.end(), {&weight_, &bias_}); }
  std::int64_t in_features() const { return weight_.shape[1]; }
  std::int64_t out_features() const { return weight_.shape[0]; }

 private:
  MatrixView<T> weight_view() const { return {weight_.value.data(), out_features(), in_features()}; }  // [out, in]
  // [rows, out], every row the bias.
  Matrix<T> bias_rows(std::int64_t rows) const {
    Matrix<T> y(rows, out_features());
    for (std::int64_t r = 0; r < y.rows; ++r)
      for (std::int64_t j = 0; j < y.cols; ++j) y(r, j) = bias_.value[static_cast<std::size_t>(j)];
    return y;
  }

  Parameter<T> weight_, bias_;
  LinearProducts<T> products_;
};

}  // namespace transformer
