// Dropout in scaled_dot_product_attention: each weight is either zeroed or scaled by 1 / (1 - p)
// relative to the weights without dropout, about a fraction p are zeroed, out == weights @ v, the
// lse ignores dropout, the mask is a function of the seed only (not of the thread count), and
// set_num_threads / num_threads round-trip.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "attention/flash_config.hpp"
#include "support/naive_attention.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::AttentionOptions;
using mha::AttentionResult;
using mha::scaled_dot_product_attention;

struct DropoutCase {
  const char* name;
  DType dtype;
  double p;
  bool masked;  // key padding + causal as well
};

void PrintTo(const DropoutCase& c, std::ostream* os) { *os << c.name; }

class AttentionDropout : public KernelParamTest<DropoutCase> {};

TEST_P(AttentionDropout, ZeroesAboutPAndRescalesTheRest) {
  const DropoutCase& c = param();
  const DType dt = c.dtype;
  const std::int64_t B = 2, h = 3, L = 32, S = 40, d_k = 8, d_v = 5;
  Rng rng(21);
  Tensor q = random_tensor(dt, {B, h, L, d_k}, rng);
  Tensor k = random_tensor(dt, {B, h, S, d_k}, rng);
  Tensor v = random_tensor(dt, {B, h, S, d_v}, rng);
  AttentionOptions o = options();
  o.need_weights = true;
  o.need_lse = true;
  Tensor kpm(DType::Bool, {B, S});
  if (c.masked) {
    o.causal = true;
    for (std::int64_t j = 30; j < S; ++j) kpm.data_as<bool>()[1 * S + j] = true;
    o.key_padding_mask = kpm.view();
  }
  const AttentionResult ref = scaled_dot_product_attention(q, k, v, o);
  o.dropout_p = c.p;
  o.dropout_seed = 1234;
  const AttentionResult drop = scaled_dot_product_attention(q, k, v, o);

  const double keep_scale = 1.0 / (1.0 - c.p);
  const double tol = dt == DType::Float64 ? 1e-12 : 1e-5;
  const auto w0 = to_doubles(ref.weights), w1 = to_doubles(drop.weights);
  ASSERT_EQ(w0.size(), w1.size());
  std::size_t candidates = 0, zeroed = 0, wrong = 0;
  for (std::size_t i = 0; i < w0.size(); ++i) {
    if (w0[i] == 0.0) {
      EXPECT_EQ(w1[i], 0.0) << "a masked weight must stay 0, at "
                            << index_str(ref.weights.shape(), static_cast<std::int64_t>(i));
      continue;
    }
    ++candidates;
    if (w1[i] == 0.0) {
      ++zeroed;
    } else if (std::fabs(w1[i] - keep_scale * w0[i]) > tol * (1.0 + keep_scale * w0[i])) {
      if (wrong++ < 5)
        ADD_FAILURE() << "kept weight " << w1[i] << " != " << keep_scale << " * " << w0[i] << " at "
                      << index_str(ref.weights.shape(), static_cast<std::int64_t>(i));
    }
  }
  EXPECT_EQ(wrong, 0u);
  ASSERT_GT(candidates, 2000u);
  const double frac = static_cast<double>(zeroed) / static_cast<double>(candidates);
  // Binomial: the standard deviation of frac is below 0.011 here; allow about 5 of them.
  EXPECT_NEAR(frac, c.p, 0.055) << zeroed << " of " << candidates << " zeroed";

  // out == weights (after dropout) @ v, row by row in fp64.
  const auto vv = to_doubles(v), out = to_doubles(drop.out);
  std::vector<double> expect(out.size(), 0.0);
  for (std::int64_t bh = 0; bh < B * h; ++bh)
    for (std::int64_t i = 0; i < L; ++i)
      for (std::int64_t j = 0; j < S; ++j)
        for (std::int64_t cc = 0; cc < d_v; ++cc)
          expect[static_cast<std::size_t>((bh * L + i) * d_v + cc)] +=
              w1[static_cast<std::size_t>((bh * L + i) * S + j)] *
              vv[static_cast<std::size_t>((bh * S + j) * d_v + cc)];
  EXPECT_TRUE(all_close(out, expect, tol, tol, drop.out.shape())) << "out vs weights @ v";

  // The lse is taken before dropout.
  EXPECT_TRUE(all_close(to_doubles(drop.lse), to_doubles(ref.lse), tol, tol)) << "lse";

  // Same seed, same bits; another seed, another mask.
  const AttentionResult again = scaled_dot_product_attention(q, k, v, o);
  EXPECT_TRUE(bitwise_equal(again.out, drop.out));
  EXPECT_TRUE(bitwise_equal(again.weights, drop.weights));
  o.dropout_seed = 1235;
  const AttentionResult other = scaled_dot_product_attention(q, k, v, o);
  EXPECT_FALSE(bitwise_equal(other.weights, drop.weights)) << "a new seed must change the mask";
  EXPECT_FALSE(bitwise_equal(other.out, drop.out));

  // Without need_weights the output is the same.
  o.dropout_seed = 1234;
  o.need_weights = false;
  const AttentionResult plain = scaled_dot_product_attention(q, k, v, o);
  EXPECT_TRUE(all_close(to_doubles(plain.out), out, tol, tol)) << "out without weights";
}

TEST_P(AttentionDropout, IndependentOfThreadCount) {
  const DropoutCase& c = param();
  const DType dt = c.dtype;
  ThreadCountGuard guard;
  Rng rng(22);
  Tensor q = random_tensor(dt, {3, 2, 29, 7}, rng);
  Tensor k = random_tensor(dt, {3, 2, 31, 7}, rng);
  Tensor v = random_tensor(dt, {3, 2, 31, 6}, rng);
  AttentionOptions o = options();
  o.need_weights = true;
  o.dropout_p = c.p;
  o.dropout_seed = 99;
  o.causal = c.masked;
  mha::set_num_threads(1);
  EXPECT_EQ(mha::num_threads(), 1);
  const AttentionResult one = scaled_dot_product_attention(q, k, v, o);
  mha::set_num_threads(2);
  EXPECT_EQ(mha::num_threads(), 2);
  const AttentionResult two = scaled_dot_product_attention(q, k, v, o);
  mha::set_num_threads(3);
  const AttentionResult three = scaled_dot_product_attention(q, k, v, o);
  EXPECT_TRUE(bitwise_equal(one.out, two.out)) << "1 vs 2 threads";
  EXPECT_TRUE(bitwise_equal(one.weights, two.weights)) << "1 vs 2 threads";
  EXPECT_TRUE(bitwise_equal(one.out, three.out)) << "1 vs 3 threads";
  EXPECT_TRUE(bitwise_equal(one.weights, three.weights)) << "1 vs 3 threads";
}

const DropoutCase kDropoutCases[] = {
    {"f64_p0_5", DType::Float64, 0.5, false},
    {"f64_p0_5_causal_padding", DType::Float64, 0.5, true},
    {"f64_p0_2", DType::Float64, 0.2, false},
    {"f32_p0_5", DType::Float32, 0.5, false},
    {"f32_p0_8_causal_padding", DType::Float32, 0.8, true},
};
INSTANTIATE_TEST_SUITE_P(Dropout, AttentionDropout,
                         ::testing::Combine(::testing::ValuesIn(kDropoutCases), ::testing::ValuesIn(kAllKernels)),
                         [](const ::testing::TestParamInfo<AttentionDropout::ParamType>& info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  kernel_name(std::get<1>(info.param));
                         });

class AttentionPerKernel : public ::testing::TestWithParam<mha::Kernel> {};
INSTANTIATE_TEST_SUITE_P(Kernels, AttentionPerKernel, ::testing::ValuesIn(kAllKernels),
                         [](const ::testing::TestParamInfo<mha::Kernel>& info) {
                           return std::string(kernel_name(info.param));
                         });

// dropout_p = 0 ignores the seed.
TEST_P(AttentionPerKernel, SeedIsIgnoredWhenDropoutIsZero) {
  Rng rng(23);
  Tensor q = random_tensor(DType::Float32, {1, 2, 5, 3}, rng);
  Tensor k = random_tensor(DType::Float32, {1, 2, 6, 3}, rng);
  Tensor v = random_tensor(DType::Float32, {1, 2, 6, 3}, rng);
  AttentionOptions a, b;
  a.kernel = b.kernel = GetParam();
  a.dropout_seed = 1;
  b.dropout_seed = 2;
  a.need_weights = b.need_weights = true;
  const AttentionResult ra = scaled_dot_product_attention(q, k, v, a);
  const AttentionResult rb = scaled_dot_product_attention(q, k, v, b);
  EXPECT_TRUE(bitwise_equal(ra.out, rb.out));
  EXPECT_TRUE(bitwise_equal(ra.weights, rb.weights));
}

// Without dropout the result does not depend on the thread count either (sizes large enough to be
// split into several blocks of queries and keys).
TEST_P(AttentionPerKernel, ResultIndependentOfThreadCount) {
  constexpr std::int64_t L = 260, S = 300;
  static_assert(L > mha::detail::flash::kBlockQTall && S > mha::detail::flash::kBlockK, "several blocks each way");
  ThreadCountGuard guard;
  Rng rng(24);
  Tensor q = random_tensor(DType::Float32, {2, 3, L, 13}, rng);
  Tensor k = random_tensor(DType::Float32, {2, 3, S, 13}, rng);
  Tensor v = random_tensor(DType::Float32, {2, 3, S, 5}, rng);
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    AttentionOptions o;
    o.kernel = GetParam();
    o.causal = causal;
    o.need_weights = true;
    o.need_lse = true;
    mha::set_num_threads(1);
    const AttentionResult one = scaled_dot_product_attention(q, k, v, o);
    mha::set_num_threads(2);
    const AttentionResult two = scaled_dot_product_attention(q, k, v, o);
    mha::set_num_threads(3);
    const AttentionResult three = scaled_dot_product_attention(q, k, v, o);
    EXPECT_TRUE(bitwise_equal(one.out, two.out));
    EXPECT_TRUE(bitwise_equal(one.weights, two.weights));
    EXPECT_TRUE(bitwise_equal(one.lse, two.lse));
    EXPECT_TRUE(bitwise_equal(one.out, three.out));
  }
}

// The dropout mask is a function of (seed, b, h, i, j) only, so every kernel drops the same weights.
TEST(AttentionDropoutKernels, EveryKernelDropsTheSameWeights) {
  Rng rng(25);
  Tensor q = random_tensor(DType::Float32, {2, 2, 150, 8}, rng);
  Tensor k = random_tensor(DType::Float32, {2, 2, 270, 8}, rng);
  Tensor v = random_tensor(DType::Float32, {2, 2, 270, 4}, rng);
  AttentionOptions o;
  o.need_weights = true;
  o.dropout_p = 0.3;
  o.dropout_seed = 77;
  o.causal = true;
  o.kernel = mha::Kernel::Reference;
  const AttentionResult ref = scaled_dot_product_attention(q, k, v, o);
  const auto wr = to_doubles(ref.weights);
  for (mha::Kernel kernel : kAllKernels) {
    SCOPED_TRACE(kernel_name(kernel));
    o.kernel = kernel;
    const AttentionResult r = scaled_dot_product_attention(q, k, v, o);
    const auto w = to_doubles(r.weights);
    ASSERT_EQ(w.size(), wr.size());
    std::size_t differ = 0;
    for (std::size_t i = 0; i < w.size(); ++i) differ += (w[i] == 0.0) != (wr[i] == 0.0);
    EXPECT_EQ(differ, 0u) << "positions zeroed by one kernel and not the other";
    EXPECT_TRUE(all_close(w, wr, 1e-5, 1e-5, r.weights.shape()));
    EXPECT_TRUE(all_close(to_doubles(r.out), to_doubles(ref.out), 1e-5, 1e-5, r.out.shape()));
  }
}

}  // namespace
}  // namespace mha_test
