// Checking an analytic gradient against finite differences of a scalar loss, for the gradient tests
// of the kernels (attention/gradients_test.cpp) and of the layer (layer/backward_test.cpp).
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "support/kernel_compare.hpp"
#include "support/test_util.hpp"

namespace mha_test {

// FNV-1a, so a case's seed depends on its name only.
inline std::uint64_t name_seed(const std::string& name) {
  std::uint64_t x = 0xcbf29ce484222325ULL;
  for (unsigned char ch : name) x = (x ^ ch) * 0x100000001b3ULL;
  return x;
}

inline double dot(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double s = 0.0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) s += a[i] * b[i];
  return s;
}

// Under sanitizers every kFdStride-th element is differenced (the analytic backward still runs whole).
inline constexpr std::size_t kFdStride = kSanitized ? 5 : 1;

// d loss / d values[i] by the fourth-order central difference
//   (-f(x + 2e) + 8 f(x + e) - 8 f(x - e) + f(x - 2e)) / 12e,
// whose error (about e^4 |f^(5)| + eps |f| / e, ~1e-12 here) is far below the tolerance, for every
// kFdStride-th i, against analytic[i]: |analytic - numeric| <= 1e-9 + 1e-7 |numeric|.
template <class Loss>
::testing::AssertionResult matches_finite_differences(const std::vector<double>& analytic, std::vector<double>& values,
                                                      Loss&& loss, const Shape& shape = {}) {
  constexpr double e = 1e-3, atol = 1e-9, rtol = 1e-7;
  if (analytic.size() != values.size())
    return ::testing::AssertionFailure() << "gradient has " << analytic.size() << " elements, input " << values.size();
  std::vector<double> got, want;
  for (std::size_t i = 0; i < values.size(); i += kFdStride) {
    const double x = values[i];
    double f[4];
    const double offsets[4] = {2 * e, e, -e, -2 * e};
    for (int s = 0; s < 4; ++s) {
      values[i] = x + offsets[s];
      f[s] = loss();
    }
    values[i] = x;
    want.push_back((-f[0] + 8 * f[1] - 8 * f[2] + f[3]) / (12 * e));
    got.push_back(analytic[i]);
  }
  return all_close(got, want, atol, rtol, kFdStride == 1 ? shape : Shape{});  // sampled: flat indices
}

}  // namespace mha_test
