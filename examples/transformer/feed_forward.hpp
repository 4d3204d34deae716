// FeedForward<T>: the position-wise feed-forward network of section 3.3,
//     FFN(x) = max(0, x W1 + b1) W2 + b2,   W1: d_model -> d_ff, W2: d_ff -> d_model.
#pragma once

#include <string>

#include "transformer/linear.hpp"

namespace transformer {

template <class T>
class FeedForward {
 public:
  FeedForward(const std::string& name, std::int64_t d_model, std::int64_t d_ff, Rng& rng,
              Compute compute = Compute::Native)
      : linear1_(name + ".linear1", d_model, d_ff, rng, compute),
        linear2_(name + ".linear2", d_ff, d_model, rng, compute) {}

  // x [R, d_model] -> [R, d_model]. Keeps the pre-activation's sign for backward.
  Matrix<T> forward(const Matrix<T>& x) {
    Matrix<T> h = linear1_.forward(x);  // [R, d_ff]
    relu_in_place(h);
    active_ = h;
    return linear2_.forward(h);
  }
  Matrix<T> apply(const Matrix<T>& x) const {
    Matrix<T> h = linear1_.apply(x);
    relu_in_place(h);
    return linear2_.apply(h);
  }

  // dy [R, d_model] -> dx [R, d_model]; ReLU passes the gradient where its output was positive.
  Matrix<T> backward(const Matrix<T>& dy) {
    Matrix<T> dh = linear2_.backward(dy);
    for (std::size_t i = 0; i < dh.data.size(); ++i)
      if (!(active_.data[i] > T(0))) dh.data[i] = T(0);
    return linear1_.backward(dh);
  }

  void collect(ParameterRefs<T>& out) {
    linear1_.collect(out);
    linear2_.collect(out);
  }

 private:
  static void relu_in_place(Matrix<T>& h) {
    for (auto& v : h.data) v = v > T(0) ? v : T(0);
  }

  Linear<T> linear1_, linear2_;
  Matrix<T> active_;  // ReLU's output [R, d_ff]
};

}  // namespace transformer
