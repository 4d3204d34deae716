// Dropout<T> (Srivastava et al. 2014), inverted: in training, each element is kept with probability
// 1 - p and scaled by 1 / (1 - p); in evaluation, identity. Section 5.4 of the paper applies it to each
// sub-layer's output before the residual sum and to the sums of embeddings and positional encodings.
#pragma once

#include "transformer/matrix.hpp"
#include "transformer/parameter.hpp"

namespace transformer {

template <class T>
class Dropout {
 public:
  Dropout(double p, std::uint64_t seed) : p_(p), rng_(seed) {}

  void train(bool on) { training_ = on; }
  bool active() const { return training_ && p_ > 0.0; }

  // x -> x * mask; the mask (0 or 1 / (1 - p)) is drawn anew per call and kept for backward.
  Matrix<T> forward(const Matrix<T>& x) {
    if (!active()) return x;
    scale_.resize(x.data.size());
    Matrix<T> y = x;
    const T keep_scale = static_cast<T>(1.0 / (1.0 - p_));
    for (std::size_t i = 0; i < y.data.size(); ++i) {
      scale_[i] = rng_.uniform() < p_ ? T(0) : keep_scale;
      y.data[i] *= scale_[i];
    }
    return y;
  }

  // dy -> dy * mask (the same mask).
  Matrix<T> backward(const Matrix<T>& dy) {
    if (!active()) return dy;
    Matrix<T> dx = dy;
    for (std::size_t i = 0; i < dx.data.size(); ++i) dx.data[i] *= scale_[i];
    return dx;
  }

 private:
  double p_;
  Rng rng_;
  bool training_ = true;
  std::vector<T> scale_;
};

}  // namespace transformer
