// LabelSmoothedCrossEntropy<T> (section 5.4; Szegedy et al. 2016): cross-entropy against the target
// distribution q = (1 - eps) * onehot(y) + eps / V, averaged over the rows, as PyTorch's
// F.cross_entropy(..., label_smoothing=eps).
//     loss = -(1/R) sum_r sum_k q_rk log p_rk,   p = softmax(logits)
//     dloss/dlogits = (p - q) / R
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "transformer/matrix.hpp"

namespace transformer {

template <class T>
class LabelSmoothedCrossEntropy {
 public:
  explicit LabelSmoothedCrossEntropy(double smoothing = 0.1) : eps_(smoothing) {}

  // logits [R, V], targets [R] -> the mean loss. Keeps p and the targets for backward.
  double forward(const Matrix<T>& logits, const std::vector<int>& targets) {
    const std::int64_t R = logits.rows, V = logits.cols;
    probabilities_ = Matrix<T>(R, V);
    targets_ = targets;
    double total = 0.0;
    for (std::int64_t r = 0; r < R; ++r) {
      const T* z = logits.row(r);
      const double m = *std::max_element(z, z + V);
      double sum_exp = 0.0, sum_logits = 0.0;
      for (std::int64_t k = 0; k < V; ++k) {
        sum_exp += std::exp(z[k] - m);
        sum_logits += z[k];
      }
      const double log_z = m + std::log(sum_exp);  // log p_k = z_k - log_z
      for (std::int64_t k = 0; k < V; ++k) probabilities_(r, k) = static_cast<T>(std::exp(z[k] - log_z));
      const double log_p_target = z[targets[static_cast<std::size_t>(r)]] - log_z;
      const double mean_log_p = sum_logits / static_cast<double>(V) - log_z;
      total += -(1.0 - eps_) * log_p_target - eps_ * mean_log_p;
    }
    return R > 0 ? total / static_cast<double>(R) : 0.0;
  }

  // -> dlogits [R, V] = (p - q) / R.
  Matrix<T> backward() const {
    Matrix<T> d = probabilities_;
    const std::int64_t R = d.rows, V = d.cols;
    const T inv_rows = static_cast<T>(1.0 / static_cast<double>(R));
    for (std::int64_t r = 0; r < R; ++r) {
      for (std::int64_t k = 0; k < V; ++k) d(r, k) -= static_cast<T>(eps_ / static_cast<double>(V));
      d(r, targets_[static_cast<std::size_t>(r)]) -= static_cast<T>(1.0 - eps_);
      for (std::int64_t k = 0; k < V; ++k) d(r, k) *= inv_rows;
    }
    return d;
  }

 private:
  double eps_;
  Matrix<T> probabilities_;
  std::vector<int> targets_;
};

}  // namespace transformer
