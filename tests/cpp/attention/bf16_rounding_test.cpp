// The two ways the kernels round P and dS to bfloat16, against a rounding written here (the nearest
// bfloat16 by distance in float64, ties to the even pattern) on random floats, exact ties and values that
// round to infinity:
// - AVX512-BF16's conversion (src/attention/bf16_rounding.hpp): subnormals flushed to a zero of their sign,
//   infinities kept, NaN kept (quiet); skipped where the CPU has no AVX512-BF16;
// - by hand (bf16_conversion.hpp's round_to_bfloat16), on every machine: subnormals rounded like the rest;
// and the spans of bf16_conversion.hpp (round_to_bfloat16, widen_bfloat16: also the conversions around the
// paths that compute bfloat16 in float32, and Tensor::copy_of) on every SIMD target, at every length around
// the vectors' widths, against the same rounding and against mha::bfloat16's own conversions.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "attention/bf16_rounding.hpp"
#include "bf16_conversion.hpp"
#include "support/every_target.hpp"

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
  if (by_hand) mha::detail::round_to_bfloat16(tile.data(), n, out.data());
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

class Bf16Spans : public EveryTarget {};
MHA_INSTANTIATE_EVERY_TARGET(Bf16Spans);

// round_to_bfloat16 on spans of every length 0-70 at every offset 0-3 (the vectors' tails and unaligned
// starts), each element the nearest bfloat16 (subnormals rounded, not flushed) or, for NaN, a quiet NaN;
// the elements around the span untouched.
TEST_P(Bf16Spans, RoundToNearestEvenAtEveryLengthAndOffset) {
  std::vector<float> x = floats_to_round(true);
  const float inf = std::numeric_limits<float>::infinity();
  for (float f : {inf, -inf, std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::signaling_NaN()})
    x.push_back(f);
  std::mt19937 rng(6);
  std::shuffle(x.begin(), x.end(), rng);
  constexpr std::uint16_t kGuard = 0x1234;
  std::size_t start = 0;
  for (std::int64_t n = 0; n <= 70; ++n)
    for (std::int64_t offset = 0; offset < 4; ++offset, start = (start + 71) % (x.size() - 71)) {
      std::vector<mha::bfloat16> out(static_cast<std::size_t>(n + offset + 1), mha::bfloat16::from_bits(kGuard));
      mha::detail::round_to_bfloat16(x.data() + start, n, out.data() + offset);
      for (std::int64_t i = 0; i < n; ++i) {
        const float f = x[start + static_cast<std::size_t>(i)];
        const std::uint16_t got = out[static_cast<std::size_t>(offset + i)].bits;
        if (std::isnan(f)) {
          ASSERT_EQ(got & 0x7f80, 0x7f80) << "NaN stays NaN";
          ASSERT_NE(got & 0x0040, 0) << "and quiet";
          ASSERT_EQ(got, mha::bfloat16(f).bits) << "as mha::bfloat16 converts it";
        } else {
          ASSERT_EQ(got, nearest_bfloat16(f)) << f << " at " << i << " of " << n;
        }
      }
      for (std::int64_t i = 0; i < offset; ++i) ASSERT_EQ(out[static_cast<std::size_t>(i)].bits, kGuard);
      ASSERT_EQ(out.back().bits, kGuard) << "n " << n << ": past the span";
    }
}

// widen_bfloat16 of every bfloat16 pattern (NaN included: its bits kept) is the float with those bits
// above 16 zero bits, at every length 0-70 and offset 0-3, nothing written past the span.
TEST_P(Bf16Spans, WidenEveryPatternExactlyAtEveryLengthAndOffset) {
  std::vector<mha::bfloat16> all(1 << 16);
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = mha::bfloat16::from_bits(static_cast<std::uint16_t>(i));
  std::vector<float> wide(all.size());
  mha::detail::widen_bfloat16(all.data(), static_cast<std::int64_t>(all.size()), wide.data());
  for (std::size_t i = 0; i < all.size(); ++i)
    ASSERT_EQ(std::bit_cast<std::uint32_t>(wide[i]), static_cast<std::uint32_t>(i) << 16) << "pattern " << i;
  const float guard = -7.0f;
  for (std::int64_t n = 0; n <= 70; ++n)
    for (std::int64_t offset = 0; offset < 4; ++offset) {
      const std::size_t start = static_cast<std::size_t>(n * 977 + offset * 131) % (all.size() - 71);
      std::vector<float> out(static_cast<std::size_t>(n + offset + 1), guard);
      mha::detail::widen_bfloat16(all.data() + start, n, out.data() + offset);
      for (std::int64_t i = 0; i < n; ++i)
        ASSERT_EQ(std::bit_cast<std::uint32_t>(out[static_cast<std::size_t>(offset + i)]),
                  static_cast<std::uint32_t>(start + static_cast<std::size_t>(i)) << 16);
      for (std::int64_t i = 0; i < offset; ++i) ASSERT_EQ(out[static_cast<std::size_t>(i)], guard);
      ASSERT_EQ(out.back(), guard) << "n " << n << ": past the span";
    }
}

}  // namespace
}  // namespace mha_test
