// scaled_dot_product_attention (every kernel) against the tests' fp64 oracle over a sweep of
// shapes (B, h in 1..3; L, S in 1..40, mostly L != S; d_k != d_v; odd widths 1, 5, 13; and a few
// shapes past the fused kernel's blocks of 128 or 256 queries and kBlockK keys) and of masks,
// alone and combined, in float64 (to ~1e-12) and float32 (to ~1e-5). Each case checks out, weights
// and lse, and that out does not change when weights and lse are not requested.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "attention/flash_config.hpp"
#include "support/naive_attention.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::detail::flash::kBlockK;
using mha::detail::flash::kBlockQShort;

enum MaskBits : unsigned {
  kKeyPadding = 1u << 0,  // bool [B, S]
  kLengths = 1u << 1,     // key_lengths
  kBool2d = 1u << 2,      // bool attn_mask [L, S]
  kBool3d = 1u << 3,      // bool attn_mask [B*h, L, S]
  kFloat2d = 1u << 4,     // additive attn_mask [L, S], some -inf
  kFloat3d = 1u << 5,     // additive attn_mask [B*h, L, S], some -inf
  kCausal = 1u << 6,
  kScale = 1u << 7,  // an explicit scale instead of 1/sqrt(d_k)
};

struct SweepShape {
  std::int64_t B, h, L, S, d_k, d_v;
};

struct SweepCase {
  DType dtype;
  SweepShape s;
  unsigned masks;
};

std::string case_name(const SweepCase& c) {
  std::string n = std::string(short_name(c.dtype)) + "_B" + std::to_string(c.s.B) + "_h" + std::to_string(c.s.h) +
                  "_L" + std::to_string(c.s.L) + "_S" + std::to_string(c.s.S) + "_dk" + std::to_string(c.s.d_k) +
                  "_dv" + std::to_string(c.s.d_v);
  if (c.masks == 0) n += "_nomask";
  if (c.masks & kKeyPadding) n += "_kpm";
  if (c.masks & kLengths) n += "_lengths";
  if (c.masks & kBool2d) n += "_bool2d";
  if (c.masks & kBool3d) n += "_bool3d";
  if (c.masks & kFloat2d) n += "_float2d";
  if (c.masks & kFloat3d) n += "_float3d";
  if (c.masks & kCausal) n += "_causal";
  if (c.masks & kScale) n += "_scale";
  return n;
}

std::vector<SweepCase> sweep_cases() {
  // Small shapes, each with every mask combination.
  const SweepShape small[] = {
      {1, 1, 1, 1, 1, 1},   {2, 3, 5, 13, 13, 5}, {3, 2, 13, 5, 5, 1},    {1, 3, 40, 37, 8, 13},
      {3, 3, 17, 1, 1, 13}, {2, 2, 1, 40, 13, 8}, {2, 1, 24, 24, 16, 16}, {1, 2, 33, 40, 5, 7},
  };
  const unsigned all_combos[] = {
      0u,
      kKeyPadding,
      kLengths,
      kBool2d,
      kBool3d,
      kFloat2d,
      kFloat3d,
      kCausal,
      kCausal | kKeyPadding,
      kCausal | kBool3d,
      kKeyPadding | kFloat2d,
      kLengths | kBool2d | kCausal,
      kKeyPadding | kFloat3d | kCausal,
      kScale | kLengths,
  };
  // Shapes larger than a tiled kernel's blocks (partial last blocks, several blocks per row), with a
  // few combinations; one of them under sanitizers.
  const std::vector<SweepShape> large =
      kUnderSanitizers
          ? std::vector<SweepShape>{{1, 1, kBlockQShort + 1, kBlockK + 1, 5, 3}}
          : std::vector<SweepShape>{
                {1, 2, 150, 270, 64, 32}, {2, 1, 200, 130, 16, 24}, {1, 1, kBlockQShort + 1, kBlockK + 1, 13, 7}};
  const unsigned some_combos[] = {0u, kCausal, kCausal | kKeyPadding, kLengths | kFloat3d, kBool2d | kCausal};
  std::vector<SweepCase> cases;
  for (DType dtype : {DType::Float64, DType::Float32}) {
    for (const auto& s : small)
      for (unsigned m : all_combos) cases.push_back({dtype, s, m});
    for (const auto& s : large)
      for (unsigned m : some_combos) cases.push_back({dtype, s, m});
  }
  return cases;
}

void PrintTo(const SweepCase& c, std::ostream* os) { *os << case_name(c); }

class AttentionSweep : public KernelParamTest<SweepCase> {};

TEST_P(AttentionSweep, MatchesFp64Oracle) {
  const SweepCase& c = param();
  const auto [B, h, L, S, d_k, d_v] = c.s;
  Rng rng(std::hash<std::string>{}(case_name(c)));

  Tensor q = random_tensor(c.dtype, {B, h, L, d_k}, rng);
  Tensor k = random_tensor(c.dtype, {B, h, S, d_k}, rng);
  Tensor v = random_tensor(c.dtype, {B, h, S, d_v}, rng);

  NaiveMaskSpec m;
  m.B = B, m.h = h, m.L = L, m.S = S;
  m.causal = (c.masks & kCausal) != 0;
  if (c.masks & kKeyPadding)
    for (std::int64_t i = 0; i < B * S; ++i) m.key_padding.push_back(rng.bernoulli(0.3));
  if (c.masks & kLengths)
    for (std::int64_t b = 0; b < B; ++b) m.key_lengths.push_back(rng.integer(0, S));
  if (c.masks & (kBool2d | kBool3d)) {
    m.bool_mask_batched = (c.masks & kBool3d) != 0;
    const std::int64_t n = (m.bool_mask_batched ? B * h : 1) * L * S;
    for (std::int64_t i = 0; i < n; ++i) m.bool_mask.push_back(rng.bernoulli(0.25));
  }
  if (c.masks & (kFloat2d | kFloat3d)) {
    m.float_mask_batched = (c.masks & kFloat3d) != 0;
    const std::int64_t n = (m.float_mask_batched ? B * h : 1) * L * S;
    for (std::int64_t i = 0; i < n; ++i) m.float_mask.push_back(rng.bernoulli(0.15) ? -kInf : rng.uniform(-3, 3));
    m.float_mask = rounded_to(c.dtype, m.float_mask);
  }

  std::vector<Tensor> storage;
  mha::AttentionOptions opts = options_for(m, c.dtype, storage);
  opts.kernel = kernel();
  const double scale = (c.masks & kScale) ? 0.37 : 1.0 / std::sqrt(static_cast<double>(d_k));
  if (c.masks & kScale) opts.scale = scale;
  opts.need_weights = true;
  opts.need_lse = true;

  const NaiveResult want = naive_attention(to_doubles(q), to_doubles(k), to_doubles(v), d_k, d_v, scale, m);
  const mha::AttentionResult got = mha::scaled_dot_product_attention(q, k, v, opts);

  ASSERT_TRUE(got.out.defined());
  EXPECT_EQ(got.out.dtype(), c.dtype);
  ASSERT_EQ(got.out.shape(), (Shape{B, h, L, d_v}));
  ASSERT_TRUE(got.weights.defined());
  EXPECT_EQ(got.weights.dtype(), c.dtype);
  ASSERT_EQ(got.weights.shape(), (Shape{B, h, L, S}));
  ASSERT_TRUE(got.lse.defined());
  ASSERT_EQ(got.lse.shape(), (Shape{B, h, L}));

  const Tolerance tol = tolerance_for(c.dtype);
  EXPECT_TRUE(all_close(to_doubles(got.out), want.out, tol.atol, tol.rtol, got.out.shape())) << "out";
  EXPECT_TRUE(all_close(to_doubles(got.weights), want.weights, tol.atol, tol.rtol, got.weights.shape())) << "weights";
  EXPECT_TRUE(all_close(to_doubles(got.lse), want.lse, tol.atol, tol.rtol, got.lse.shape())) << "lse";

  // Without weights and lse requested: same output, and those results are left undefined.
  opts.need_weights = false;
  opts.need_lse = false;
  const mha::AttentionResult plain = mha::scaled_dot_product_attention(q, k, v, opts);
  EXPECT_FALSE(plain.weights.defined());
  EXPECT_FALSE(plain.lse.defined());
  ASSERT_EQ(plain.out.shape(), (Shape{B, h, L, d_v}));
  EXPECT_TRUE(all_close(to_doubles(plain.out), want.out, tol.atol, tol.rtol, plain.out.shape()))
      << "out without weights";
}

INSTANTIATE_TEST_SUITE_P(Kernels, AttentionSweep,
                         ::testing::Combine(::testing::ValuesIn(sweep_cases()), ::testing::ValuesIn(kAllKernels)),
                         [](const ::testing::TestParamInfo<AttentionSweep::ParamType>& info) {
                           return std::string(kernel_name(std::get<1>(info.param))) + "_" +
                                  case_name(std::get<0>(info.param));
                         });

}  // namespace
}  // namespace mha_test
