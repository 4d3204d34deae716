// MultiHeadAttention::backward, the two promises of its header comment not covered by
// gradients_test.cpp: with one tensor as query, key and value the three input gradients sum to the
// gradient of that tensor; and gradients come back in new tensors, nothing accumulates across calls.
// (Bad dout and backward without a training forward are in bad_input_test.cpp.)
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "support/naive_mha.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::MultiHeadAttentionInputs;

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// One tensor as query, key and value: the three returned gradients sum to the total gradient.
TEST(MhaBackwardSelf, SumOfInputGradientsMatchesCentralDifferences) {
  MultiHeadAttentionConfig cfg;
  cfg.d_model = 4, cfg.num_heads = 2, cfg.dtype = DType::Float64;
  MultiHeadAttention m(cfg, 9);
  Rng rng(61);
  RandomState rs = random_state(4, 2, 2, 2, 4, 4, true, false, false, DType::Float64, rng);
  m.load_state_dict(rs.views());
  Tensor x = random_tensor(DType::Float64, {2, 3, 4}, rng);
  MultiHeadAttentionInputs in;
  in.causal = true;
  const auto out = m.forward(x, x, x, in).out;
  Tensor dout = random_tensor(DType::Float64, out.shape(), rng);
  const auto g = m.backward(dout);
  std::vector<double> total = to_doubles(g.query);
  const auto gk = to_doubles(g.key), gv = to_doubles(g.value);
  for (std::size_t i = 0; i < total.size(); ++i) total[i] += gk[i] + gv[i];
  const auto douts = to_doubles(dout);
  std::vector<double> numeric(total.size());
  const double eps = 1e-6;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const double x0 = x.data_as<double>()[i];
    x.data_as<double>()[i] = x0 + eps;
    const double up = dot(douts, to_doubles(m.forward(x, x, x, in).out));
    x.data_as<double>()[i] = x0 - eps;
    const double down = dot(douts, to_doubles(m.forward(x, x, x, in).out));
    x.data_as<double>()[i] = x0;
    numeric[static_cast<std::size_t>(i)] = (up - down) / (2 * eps);
  }
  EXPECT_TRUE(all_close(total, numeric, 1e-7, 1e-6, x.shape()));
}

// Gradients are returned in new tensors: the same forward and backward again give the same values
// (nothing accumulates across calls).
TEST(MhaBackwardSelf, BackwardDoesNotAccumulate) {
  MultiHeadAttentionConfig cfg;
  cfg.d_model = 4, cfg.num_heads = 2, cfg.dtype = DType::Float64;
  MultiHeadAttention m(cfg, 10);
  Rng rng(62);
  Tensor x = random_tensor(DType::Float64, {2, 3, 4}, rng);
  Tensor dout = random_tensor(DType::Float64, {2, 3, 4}, rng);
  (void)m.forward(x, x, x);
  const auto a = m.backward(dout);
  (void)m.forward(x, x, x);
  const auto b = m.backward(dout);
  EXPECT_TRUE(bitwise_equal(a.query, b.query));
  for (const auto& [name, t] : a.parameters) EXPECT_TRUE(bitwise_equal(t, b.parameters.at(name))) << name;
}

}  // namespace
}  // namespace mha_test
