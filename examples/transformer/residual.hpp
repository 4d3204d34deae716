// Residual<T>: the connection around every sub-layer (section 3.1), with dropout on the sub-layer's
// output (section 5.4) and layer normalisation either after the sum, as in the paper (post-norm),
//     y = LayerNorm(x + Dropout(Sublayer(x))),
// or before the sub-layer (pre-norm, Xiong et al. 2020; the stack then ends with one more LayerNorm),
//     y = x + Dropout(Sublayer(LayerNorm(x))).
#pragma once

#include <string>

#include "transformer/dropout.hpp"
#include "transformer/layer_norm.hpp"

namespace transformer {

template <class T>
class Residual {
 public:
  Residual(const std::string& name, std::int64_t d_model, double dropout, bool pre_norm, std::uint64_t seed)
      : norm_(name, d_model), dropout_(dropout, seed), pre_norm_(pre_norm) {}

  void train(bool on) { dropout_.train(on); }

  // x [R, d] -> [R, d]; sublayer: Matrix -> Matrix (its own forward, which keeps what it needs).
  template <class Sublayer>
  Matrix<T> forward(const Matrix<T>& x, Sublayer&& sublayer) {
    if (pre_norm_) return sum(x, dropout_.forward(sublayer(norm_.forward(x))));
    return norm_.forward(sum(x, dropout_.forward(sublayer(x))));
  }

  // dy [R, d] -> dx [R, d]; sublayer_backward: d(sublayer output) -> d(sublayer input).
  template <class SublayerBackward>
  Matrix<T> backward(const Matrix<T>& dy, SublayerBackward&& sublayer_backward) {
    if (pre_norm_) return sum(dy, norm_.backward(sublayer_backward(dropout_.backward(dy))));
    const Matrix<T> dz = norm_.backward(dy);  // z = x + Dropout(Sublayer(x))
    return sum(dz, sublayer_backward(dropout_.backward(dz)));
  }

  void collect(ParameterRefs<T>& out) { norm_.collect(out); }

 private:
  LayerNorm<T> norm_;
  Dropout<T> dropout_;
  bool pre_norm_;
};

}  // namespace transformer
