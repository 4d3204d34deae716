// Adam (Kingma & Ba 2015) with the paper's settings (section 5.3): beta1 = 0.9, beta2 = 0.98,
// eps = 1e-9, and the learning rate
//     lrate = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
// (linear warm-up for `warmup` steps, then decay with the inverse square root of the step).
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "transformer/parameter.hpp"

namespace transformer {

struct AdamConfig {
  double beta1 = 0.9, beta2 = 0.98, eps = 1e-9;
  double factor = 1.0;         // the paper: 1
  std::int64_t warmup = 4000;  // the paper: 4000
  std::int64_t d_model = 512;
};

inline double learning_rate(const AdamConfig& c, std::int64_t step) {
  const double s = static_cast<double>(std::max<std::int64_t>(step, 1));
  return c.factor / std::sqrt(static_cast<double>(c.d_model)) *
         std::min(1.0 / std::sqrt(s), s * std::pow(static_cast<double>(c.warmup), -1.5));
}

template <class T>
class Adam {
 public:
  Adam(const AdamConfig& config, const ParameterRefs<T>& params) : c_(config), params_(params) {
    for (const Parameter<T>* p : params_) {
      m_.emplace_back(p->value.size(), 0.0);
      v_.emplace_back(p->value.size(), 0.0);
    }
  }

  std::int64_t steps() const { return step_; }

  // One update from the gradients in Parameter::grad (which it then zeroes). Returns the rate used.
  double step() {
    ++step_;
    const double lr = learning_rate(c_, step_);
    const double correction1 = 1.0 - std::pow(c_.beta1, static_cast<double>(step_));
    const double correction2 = 1.0 - std::pow(c_.beta2, static_cast<double>(step_));
    for (std::size_t i = 0; i < params_.size(); ++i) {
      Parameter<T>& p = *params_[i];
      std::vector<double>& m = m_[i];
      std::vector<double>& v = v_[i];
      for (std::size_t j = 0; j < p.value.size(); ++j) {
        const double g = p.grad[j];
        m[j] = c_.beta1 * m[j] + (1.0 - c_.beta1) * g;
        v[j] = c_.beta2 * v[j] + (1.0 - c_.beta2) * g * g;
        p.value[j] -= static_cast<T>(lr * (m[j] / correction1) / (std::sqrt(v[j] / correction2) + c_.eps));
        p.grad[j] = T(0);
      }
    }
    return lr;
  }

 private:
  AdamConfig c_;
  ParameterRefs<T> params_;
  std::vector<std::vector<double>> m_, v_;  // first and second moments
  std::int64_t step_ = 0;
};

}  // namespace transformer
