// Finite-difference gradient checks in float64 for the Transformer's blocks.
//
// Every check has the same shape: a scalar loss = sum(w * block(x)) with a fixed random w, the block's
// backward given dy = w, and central differences (f(v + h) - f(v - h)) / 2h for a spread of the entries
// of each input and parameter. With h = 1e-6 in float64 the difference quotient is good to ~1e-9
// relative (truncation h^2 f''' ~ 1e-12, rounding eps / h ~ 1e-10), so 1e-6 relative can only fail
// on a wrong gradient.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "transformer/matrix.hpp"
#include "transformer/parameter.hpp"

namespace transformer::testing {

struct Slot {
  std::string name;
  std::vector<double>* values;   // perturbed in place
  std::vector<double> analytic;  // the backward's gradient for these values
};

inline Matrix<double> random_matrix(std::int64_t rows, std::int64_t cols, Rng& rng, double scale = 1.0) {
  Matrix<double> m(rows, cols);
  for (auto& v : m.data) v = scale * rng.uniform(-1.0, 1.0);
  return m;
}

inline double weighted_sum(const Matrix<double>& y, const Matrix<double>& w) {
  double s = 0.0;
  for (std::size_t i = 0; i < y.data.size(); ++i) s += y.data[i] * w.data[i];
  return s;
}

// Slots for every parameter's current gradient (call after backward()).
inline void add_parameter_slots(const ParameterRefs<double>& params, std::vector<Slot>& slots) {
  for (Parameter<double>* p : params) slots.push_back({p->name, &p->value, p->grad});
}

// Compares each slot's analytic gradient with central differences of loss() at up to
// `per_slot` entries spread over the slot. loss() must not depend on earlier calls (no dropout).
inline void expect_matches_finite_differences(const std::function<double()>& loss, std::vector<Slot>& slots,
                                              std::size_t per_slot = 24) {
  constexpr double h = 1e-6, rel = 1e-6;
  std::size_t checked = 0;
  for (Slot& slot : slots) {
    std::vector<double>& v = *slot.values;
    ASSERT_EQ(v.size(), slot.analytic.size()) << slot.name;
    const std::size_t stride = std::max<std::size_t>(1, v.size() / per_slot);
    for (std::size_t i = 0; i < v.size(); i += stride) {
      const double saved = v[i];
      v[i] = saved + h;
      const double up = loss();
      v[i] = saved - h;
      const double down = loss();
      v[i] = saved;
      const double numeric = (up - down) / (2 * h);
      EXPECT_NEAR(slot.analytic[i], numeric, rel * std::max(1.0, std::abs(numeric))) << slot.name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_GT(checked, 0u);
}

}  // namespace transformer::testing
