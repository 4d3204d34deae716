// The two ways the kernels round P and dS to bfloat16, against a rounding written here (the nearest
// bfloat16 by distance in float64, ties to the even pattern) on random floats, exact ties and values that
// round to infinity:
// - AVX512-BF16's conversion (src/attention/bf16_rounding.hpp): subnormals flushed to a zero of their sign,
//   infinities kept, NaN kept (quiet); skipped where the CPU has no AVX512-BF16;
// - by hand (BfloatBits, flash_exp.hpp's flash_round_by_hand), on every machine: subnormals rounded like
//   the rest.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "attention/bf16_rounding.hpp"
#include "attention/flash_exp.hpp"

namespace mha_test {
namespace {

// The bfloat16 pattern nearest to a finite float x, ties to even; 0x7f80 / 0xff80 (inf)
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

// x rounded by the conversion instruction, or by hand.
std::vector<std::uint16_t> converted(const std::vector<float>& x, bool by_hand = false) {
  std::vector<float> tile(x);
  tile.resize((x.size() + 15) / 16 * 16, 0.0f);  // whole vectors
  std::vector<mha::bfloat16> out(tile.size());
  const auto n = static_cast<std::int64_t>(tile.size());
  if (by_hand) mha::detail::flash_round_by_hand(tile.data(), n, out.data());
  else mha::detail::round_rows_with_bf16_conversion(tile.data(), 0, 1, n, out.data(), 0);
  std::vector<std::uint16_t> bits;
  for (std::size_t i = 0; i < x.size(); ++i) bits.push_back(out[i].bits);
  return bits;
}

// Random floats of every exponent (normal, or subnormal too), each also as an exact tie (its low half
// 0x8000), and the edges: the largest floats (rounding to infinity), the smallest normal, +-1, +-0.
std::vector<float> floats_to_round(bool subnormals) {
  std::mt19937 rng(20261205);
  std::vector<float> x;
  auto keep = [&](float f) {
    if (std::isnormal(f) || (subnormals && std::isfinite(f))) x.push_back(f);
  };
  for (int i = 0; i < (1 << 16); ++i) {
    const std::uint32_t bits = rng();
    keep(std::bit_cast<float>(bits));
    keep(std::bit_cast<float>((bits & 0xffff0000u) | 0x8000u));
    if (subnormals) keep(std::bit_cast<float>(bits & 0x807fffffu));  // the same mantissa, subnormal
  }
  for (float f : {std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(), 3.3961e38f, 3.3895e38f,
                  std::numeric_limits<float>::min(), 1.0f, -1.0f, 0.0f, -0.0f})
    x.push_back(f);
  return x;
}

// Counts the elements of x whose rounding is not the nearest bfloat16 (reporting the first few).
int wrong_roundings(const std::vector<float>& x, const std::vector<std::uint16_t>& got) {
  int wrong = 0;
  for (std::size_t i = 0; i < x.size(); ++i)
    if (got[i] != nearest_bfloat16(x[i]) && ++wrong <= 5)
      ADD_FAILURE() << x[i] << " (0x" << std::hex << std::bit_cast<std::uint32_t>(x[i]) << "): 0x" << got[i]
                    << ", nearest 0x" << nearest_bfloat16(x[i]);
  return wrong;
}

TEST(Bf16Conversion, RoundsToNearestEvenFlushesSubnormalsKeepsInfAndNaN) {
  if (!mha::detail::has_bf16_conversion()) GTEST_SKIP() << "no AVX512-BF16 on this CPU: the kernels round by hand";
  const std::vector<float> normal = floats_to_round(false);
  const int wrong = wrong_roundings(normal, converted(normal));
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

TEST(Bf16Conversion, ByHandRoundsToNearestEvenSubnormalsIncluded) {
  const std::vector<float> x = floats_to_round(true);
  EXPECT_EQ(wrong_roundings(x, converted(x, true)), 0) << "of " << x.size();
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<std::uint16_t> s = converted({inf, -inf, std::numeric_limits<float>::quiet_NaN()}, true);
  EXPECT_EQ(s[0], 0x7f80);
  EXPECT_EQ(s[1], 0xff80);
  EXPECT_EQ(s[2] & 0x7f80, 0x7f80);
  EXPECT_NE(s[2] & 0x007f, 0) << "NaN stays NaN";
}

}  // namespace
}  // namespace mha_test
