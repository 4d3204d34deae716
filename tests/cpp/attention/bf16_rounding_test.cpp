// AVX512-BF16's conversion as the kernels use it to round P and dS (src/attention/bf16_rounding.hpp),
// against a rounding written here: the nearest bfloat16 by distance in float64, ties to the even
// pattern, on random normal floats, exact ties, values that round to infinity; subnormals flushed to a
// zero of their sign, infinities kept, NaN kept (quiet). Skipped where the CPU has no AVX512-BF16 (the
// kernels then round by hand, which the bfloat16 attention tests cover).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "attention/bf16_rounding.hpp"

namespace mha_test {
namespace {

// The bfloat16 pattern nearest to a finite float x (normal or zero), ties to even; 0x7f80 / 0xff80 (inf)
// when x lies at or past the midpoint between the largest bfloat16 and 2^128.
std::uint16_t nearest_bfloat16(float x) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const std::uint16_t down = static_cast<std::uint16_t>(bits >> 16);  // toward zero
  const std::uint16_t up = static_cast<std::uint16_t>(down + 1);      // away from zero (past the max: inf)
  const double exact = x;
  const double low = std::bit_cast<float>(static_cast<std::uint32_t>(down) << 16);
  const double high = (up & 0x7fff) == 0x7f80 ? std::copysign(std::ldexp(1.0, 128), exact)
                                              : double(std::bit_cast<float>(static_cast<std::uint32_t>(up) << 16));
  const double to_low = std::fabs(exact - low), to_high = std::fabs(high - exact);
  if (to_low < to_high) return down;
  if (to_high < to_low) return up;
  return (down & 1) == 0 ? down : up;
}

std::vector<std::uint16_t> converted(const std::vector<float>& x) {
  std::vector<float> tile(x);
  tile.resize((x.size() + 15) / 16 * 16, 0.0f);  // whole vectors
  std::vector<mha::bfloat16> out(tile.size());
  mha::detail::round_rows_with_bf16_conversion(tile.data(), 0, 1, static_cast<std::int64_t>(tile.size()), out.data(),
                                               0);
  std::vector<std::uint16_t> bits;
  for (std::size_t i = 0; i < x.size(); ++i) bits.push_back(out[i].bits);
  return bits;
}

TEST(Bf16Conversion, RoundsToNearestEvenFlushesSubnormalsKeepsInfAndNaN) {
  if (!mha::detail::has_bf16_conversion()) GTEST_SKIP() << "no AVX512-BF16 on this CPU: the kernels round by hand";
  std::mt19937 rng(20261205);
  std::vector<float> normal;
  for (int i = 0; i < (1 << 16); ++i) {
    const std::uint32_t bits = rng();
    const float x = std::bit_cast<float>(bits);
    if (std::isnormal(x)) normal.push_back(x);
    // an exact tie: the low half is 0x8000
    const float tie = std::bit_cast<float>((bits & 0xffff0000u) | 0x8000u);
    if (std::isnormal(tie)) normal.push_back(tie);
  }
  for (float x : {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(), 3.3961e38f, 3.3895e38f,
                  std::numeric_limits<float>::min(), 1.0f, -1.0f, 0.0f, -0.0f})
    normal.push_back(x);
  const std::vector<std::uint16_t> got = converted(normal);
  int wrong = 0;
  for (std::size_t i = 0; i < normal.size(); ++i)
    if (got[i] != nearest_bfloat16(normal[i]) && ++wrong <= 5)
      ADD_FAILURE() << normal[i] << " (0x" << std::hex << std::bit_cast<std::uint32_t>(normal[i]) << "): 0x" << got[i]
                    << ", nearest 0x" << nearest_bfloat16(normal[i]);
  EXPECT_EQ(wrong, 0) << "of " << normal.size();

  const float inf = std::numeric_limits<float>::infinity();
  const float sub = std::numeric_limits<float>::denorm_min();
  const std::vector<float> special = {sub,
                                      -sub,
                                      1e-40f,
                                      -1e-40f,
                                      std::numeric_limits<float>::min() / 2,
                                      inf,
                                      -inf,
                                      std::numeric_limits<float>::quiet_NaN(),
                                      std::numeric_limits<float>::signaling_NaN()};
  const std::vector<std::uint16_t> s = converted(special);
  const std::vector<std::uint16_t> zeros_and_infinities = {0x0000, 0x8000, 0x0000, 0x8000, 0x0000, 0x7f80, 0xff80};
  for (std::size_t i = 0; i < zeros_and_infinities.size(); ++i)
    EXPECT_EQ(s[i], zeros_and_infinities[i]) << "special value " << i << ": " << special[i];
  for (int i : {7, 8}) {
    EXPECT_EQ(s[i] & 0x7f80, 0x7f80) << "NaN stays NaN";
    EXPECT_NE(s[i] & 0x0040, 0) << "and quiet";
  }
}

}  // namespace
}  // namespace mha_test
