// LayerNorm<T> (Ba et al. 2016) over the last dimension: y = (x - mean) / sqrt(var + eps) * gamma + beta,
// with the biased variance, as PyTorch's nn.LayerNorm (eps 1e-5).
#pragma once

#include <cmath>
#include <string>

#include "transformer/matrix.hpp"
#include "transformer/parameter.hpp"

namespace transformer {

template <class T>
class LayerNorm {
 public:
  static constexpr double kEps = 1e-5;

  LayerNorm(const std::string& name, std::int64_t d) : gamma_(name + ".weight", {d}), beta_(name + ".bias", {d}) {
    gamma_.value.assign(static_cast<std::size_t>(d), T(1));
  }

  // x [R, d] -> y [R, d]. Keeps x_hat = (x - mean) * rstd and rstd per row for backward.
  Matrix<T> forward(const Matrix<T>& x) {
    x_hat_ = Matrix<T>(x.rows, x.cols);
    rstd_.assign(static_cast<std::size_t>(x.rows), T(0));
    Matrix<T> y(x.rows, x.cols);
    for (std::int64_t r = 0; r < x.rows; ++r) {
      const T* xr = x.row(r);
      double mean = 0.0, var = 0.0;
      for (std::int64_t j = 0; j < x.cols; ++j) mean += xr[j];
      mean /= static_cast<double>(x.cols);
      for (std::int64_t j = 0; j < x.cols; ++j) var += (xr[j] - mean) * (xr[j] - mean);
      var /= static_cast<double>(x.cols);
      const T rstd = static_cast<T>(1.0 / std::sqrt(var + kEps));
      rstd_[static_cast<std::size_t>(r)] = rstd;
      for (std::int64_t j = 0; j < x.cols; ++j) {
        const T h = static_cast<T>(xr[j] - mean) * rstd;
        x_hat_(r, j) = h;
        y(r, j) = h * gamma_.value[static_cast<std::size_t>(j)] + beta_.value[static_cast<std::size_t>(j)];
      }
    }
    return y;
  }

  // dy [R, d] -> dx [R, d]:  g = dy * gamma,  dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat));
  // dgamma += sum over rows of dy * x_hat, dbeta += sum of dy.
  Matrix<T> backward(const Matrix<T>& dy) {
    Matrix<T> dx(dy.rows, dy.cols);
    const double d = static_cast<double>(dy.cols);
    for (std::int64_t r = 0; r < dy.rows; ++r) {
      double mean_g = 0.0, mean_gx = 0.0;
      for (std::int64_t j = 0; j < dy.cols; ++j) {
        const double g = dy(r, j) * gamma_.value[static_cast<std::size_t>(j)];
        mean_g += g;
        mean_gx += g * x_hat_(r, j);
        gamma_.grad[static_cast<std::size_t>(j)] += dy(r, j) * x_hat_(r, j);
        beta_.grad[static_cast<std::size_t>(j)] += dy(r, j);
      }
      mean_g /= d;
      mean_gx /= d;
      const double rstd = rstd_[static_cast<std::size_t>(r)];
      for (std::int64_t j = 0; j < dy.cols; ++j) {
        const double g = dy(r, j) * gamma_.value[static_cast<std::size_t>(j)];
        dx(r, j) = static_cast<T>(rstd * (g - mean_g - x_hat_(r, j) * mean_gx));
      }
    }
    return dx;
  }

  void collect(ParameterRefs<T>& out) { out.insert(out.end(), {&gamma_, &beta_}); }

 private:
  Parameter<T> gamma_, beta_;
  Matrix<T> x_hat_;
  std::vector<T> rstd_;
};

}  // namespace transformer
