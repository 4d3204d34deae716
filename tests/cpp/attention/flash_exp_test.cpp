// The vectorised exps of the fused kernels (mha::detail::flash_exp, flash_exp_bfloat16), each lane as the
// kernels compute it, on every SIMD target compiled in that this CPU runs, against std::exp in double:
// - the float32 kernels' within 2 ULP over the range they evaluate it on (x <= 0), exp(-inf) exactly 0
//   and exp(0) exactly 1;
// - the bfloat16 kernel's within 4e-7 relative (its probabilities are then rounded to bfloat16, 2^-9
//   relative): the same points, the same special values, NaN kept.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>

#include "attention/flash_exp.hpp"
#include "support/every_target.hpp"
#include "support/kernel_compare.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

// Distance in units in the last place between two non-negative floats (bit patterns are monotonic).
std::int64_t ulp_distance(float a, float b) {
  if (a == 0.0f) a = 0.0f;  // -0 -> +0
  if (b == 0.0f) b = 0.0f;
  std::int32_t ia = 0, ib = 0;
  std::memcpy(&ia, &a, sizeof ia);
  std::memcpy(&ib, &b, sizeof ib);
  return std::abs(static_cast<std::int64_t>(ia) - static_cast<std::int64_t>(ib));
}

struct ExpSweep {
  std::int64_t points = 0, worst_ulp = 0;
  float worst_x = 0.0f;
  void check(float x) {
    ++points;
    const float got = mha::detail::flash_exp(x);
    const float want = static_cast<float>(std::exp(static_cast<double>(x)));
    const std::int64_t ulp = std::isfinite(got) && got >= 0.0f ? ulp_distance(got, want) : std::int64_t{1} << 40;
    if (ulp > worst_ulp) worst_ulp = ulp, worst_x = x;
  }
};

// The points both sweeps visit, x in [-104, 0]: an even grid, uniform and log-uniform draws, every
// float near 0 and near x = (n + 1/2) ln2 (where the exps' range reduction may take either n), and the
// range where results become subnormal.
template <class Check>
void for_each_exp_point(Check&& check) {
  const std::int64_t n = kSanitized ? 1 << 12 : 1 << 20;
  for (std::int64_t i = 0; i < n; ++i)
    check(static_cast<float>(-104.0 * static_cast<double>(i) / static_cast<double>(n - 1)));
  Rng rng(2718);
  for (std::int64_t i = 0; i < n; ++i) check(static_cast<float>(rng.uniform(-104.0, 0.0)));
  for (std::int64_t i = 0; i < n / 16; ++i)  // magnitudes log-uniform in [1e-30, 104]
    check(-static_cast<float>(std::exp(rng.uniform(std::log(1e-30), std::log(104.0)))));
  for (int e = -40; e <= 0; ++e) {  // 256 floats in a row from -2^e down
    float x = -std::ldexp(1.0f, e);
    for (int i = 0; i < 256; ++i, x = std::nextafter(x, -1e30f)) check(x);
  }
  for (std::int64_t i = 0; i <= (kSanitized ? 1 << 10 : 1 << 16); ++i)
    check(-static_cast<float>(i) / static_cast<float>(kSanitized ? 1 << 10 : 1 << 16));
  for (int k = -126; k <= 0; ++k) {
    float x = static_cast<float>((k + 0.5) * 0.69314718055994530942), below = x;
    for (int i = 0; i < 64; ++i, x = std::nextafter(x, 1e30f), below = std::nextafter(below, -1e30f))
      if (x <= 0.0f) check(x), check(below);
  }
  for (float x = -87.0f; x >= -104.0f; x -= 1.0f / 64) check(x);
}

// Each test runs once per SIMD target this CPU supports (support/every_target.hpp).
class FlashExpEveryTarget : public mha_test::EveryTarget {};
MHA_INSTANTIATE_EVERY_TARGET(FlashExpEveryTarget);

TEST_P(FlashExpEveryTarget, WithinTwoUlpOfStdExpOverTheKernelsRange) {
  ExpSweep sweep;
  for_each_exp_point([&](float x) { sweep.check(x); });
  RecordProperty("points", std::to_string(sweep.points));
  RecordProperty("worst_ulp", std::to_string(sweep.worst_ulp));
  EXPECT_LE(sweep.worst_ulp, 2) << "worst at x = " << sweep.worst_x << " (flash_exp "
                                << mha::detail::flash_exp(sweep.worst_x) << ", std::exp "
                                << static_cast<float>(std::exp(static_cast<double>(sweep.worst_x))) << ") over "
                                << sweep.points << " points";
}

TEST_P(FlashExpEveryTarget, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(mha::detail::flash_exp(-inf), 0.0f);  // a forbidden logit contributes exactly nothing
  EXPECT_EQ(mha::detail::flash_exp(0.0f), 1.0f);  // the row maximum has weight exactly exp(0)
  EXPECT_EQ(mha::detail::flash_exp(-0.0f), 1.0f);
  EXPECT_TRUE(std::isnan(mha::detail::flash_exp(std::numeric_limits<float>::quiet_NaN())));
  // Below the range every result rounds to 0 (or the smallest subnormal); never garbage.
  for (float x : {-104.5f, -120.0f, -1000.0f, -1e30f, -std::numeric_limits<float>::max()}) {
    const float got = mha::detail::flash_exp(x);
    EXPECT_TRUE(got >= 0.0f && got <= std::numeric_limits<float>::denorm_min()) << "x = " << x << ": " << got;
  }
}

// exp for the bfloat16 kernel: relative error against std::exp in double where the result is a normal
// float; below, where results are subnormal, the same relative error plus 2 ULP of the subnormal step
// (2^-149): on AVX-512 the bfloat16 kernel's own polynomial scaled down and rounded once (vscalefps), on
// other targets Highway's exp within 2 ULP.
TEST_P(FlashExpEveryTarget, BfloatKernelsExpWithin4e7RelativeOverTheKernelsRange) {
  double worst = 0.0;
  float worst_x = 0.0f;
  std::int64_t points = 0;
  double worst_subnormal_excess = -1.0;  // the largest error past the allowance, in steps of 2^-149
  for_each_exp_point([&](float x) {
    ++points;
    const float got = mha::detail::flash_exp_bfloat16(x);
    const double want = std::exp(static_cast<double>(x));
    if (!(got >= 0.0f) || !std::isfinite(got)) {
      worst = std::numeric_limits<double>::infinity(), worst_x = x;
      return;
    }
    if (want < std::numeric_limits<float>::min()) {
      const double step = std::numeric_limits<float>::denorm_min();  // 2^-149
      const double allowed_steps = 4e-7 * want / step + 2.0;
      const double steps = std::abs(static_cast<double>(got) - want) / step;
      worst_subnormal_excess = std::max(worst_subnormal_excess, steps - allowed_steps);
      return;
    }
    const double error = std::abs(static_cast<double>(got) / want - 1.0);
    if (error > worst) worst = error, worst_x = x;
  });
  RecordProperty("points", std::to_string(points));
  RecordProperty("worst_relative", std::to_string(worst));
  EXPECT_LE(worst, 4e-7) << "worst at x = " << worst_x << " (flash_exp_bfloat16 "
                         << mha::detail::flash_exp_bfloat16(worst_x) << ", std::exp " << std::exp(double{worst_x})
                         << ") over " << points << " points";
  EXPECT_LE(worst_subnormal_excess, 0.0) << "subnormal results: steps of 2^-149 past 4e-7 relative + 2";
}

TEST_P(FlashExpEveryTarget, BfloatKernelsExpSpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(mha::detail::flash_exp_bfloat16(-inf), 0.0f);
  EXPECT_EQ(mha::detail::flash_exp_bfloat16(0.0f), 1.0f);
  EXPECT_EQ(mha::detail::flash_exp_bfloat16(-0.0f), 1.0f);
  EXPECT_TRUE(std::isnan(mha::detail::flash_exp_bfloat16(std::numeric_limits<float>::quiet_NaN())));
  for (float x : {-104.5f, -120.0f, -1000.0f, -1e30f, -std::numeric_limits<float>::max()}) {
    const float got = mha::detail::flash_exp_bfloat16(x);
    EXPECT_TRUE(got >= 0.0f && got <= std::numeric_limits<float>::denorm_min()) << "x = " << x << ": " << got;
  }
}

}  // namespace
}  // namespace mha_test
