// transpose_bf16 and transpose_rounding_to_bf16 (src/attention/bf16_transpose.hpp), which the bfloat16
// backward's products read P and dS through: every element lands at its transposed place, for sizes on and
// off the 32 x 32 blocks, with row strides wider than the tile; nothing outside the transposed tile is
// written; a float32 source is rounded as AVX512-BF16's conversion rounds (checked against a rounding
// written here), the same bits as rounding the rows first and transposing after.
#include "attention/bf16_transpose.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "attention/bf16_rounding.hpp"

namespace mha::detail {
namespace {

// A bfloat16 whose bits say where it came from: row r, column c of the source (r, c < 256).
bfloat16 tagged(std::int64_t r, std::int64_t c) {
  return bfloat16::from_bits(static_cast<std::uint16_t>((r << 8) | c));
}

void check_transpose(std::int64_t rows, std::int64_t cols, std::int64_t lds, std::int64_t ldd) {
  std::vector<bfloat16> src(static_cast<std::size_t>(std::max<std::int64_t>(1, rows * lds)));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < lds; ++c) src[static_cast<std::size_t>(r * lds + c)] = tagged(r, c);
  const bfloat16 untouched = bfloat16::from_bits(0xffff);  // a NaN no source element has (rows < 255)
  std::vector<bfloat16> dst(static_cast<std::size_t>(std::max<std::int64_t>(1, cols * ldd + 7)), untouched);
  transpose_bf16(src.data(), lds, rows, cols, dst.data(), ldd);
  for (std::int64_t c = 0; c < cols; ++c)
    for (std::int64_t r = 0; r < ldd; ++r) {
      const std::uint16_t got = dst[static_cast<std::size_t>(c * ldd + r)].bits;
      const std::uint16_t want = r < rows ? tagged(r, c).bits : untouched.bits;
      ASSERT_EQ(got, want) << "rows " << rows << " cols " << cols << " lds " << lds << " ldd " << ldd << " at (" << c
                           << ", " << r << ")";
    }
  for (std::size_t i = static_cast<std::size_t>(cols * ldd); i < dst.size(); ++i)
    ASSERT_EQ(dst[i].bits, untouched.bits) << "written past the tile";
}

TEST(Bfloat16Transpose, PutsEveryElementAtItsTransposedPlace) {
  for (const std::int64_t rows : {0, 1, 2, 31, 32, 33, 63, 64, 65, 96, 200, 254})
    for (const std::int64_t cols : {0, 1, 17, 31, 32, 33, 64, 100, 128, 255, 256})
      check_transpose(rows, cols, cols + (cols % 3), rows + 5);
}

TEST(Bfloat16Transpose, RandomSizesAndStrides) {
  std::mt19937_64 rng(32);
  std::uniform_int_distribution<std::int64_t> size(0, 254), extra(0, 40);
  for (int i = 0; i < 60; ++i) {
    const std::int64_t rows = size(rng), cols = std::min<std::int64_t>(256, size(rng) + 1);
    check_transpose(rows, cols, std::min<std::int64_t>(256, cols + extra(rng)), rows + extra(rng));
  }
}

// The bfloat16 nearest to x, ties to the even one, by comparing the two candidates around it in double;
// a subnormal x to a zero of its sign and a NaN to any quiet NaN of its sign (what vcvtneps2bf16 does).
std::uint16_t nearest_bf16_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  if (std::isnan(x)) return static_cast<std::uint16_t>(sign | 0x7fc0u);
  if (std::fpclassify(x) == FP_SUBNORMAL || x == 0.0f) return sign;
  const auto widen = [](std::uint32_t top) {
    const std::uint32_t bits = top << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return static_cast<double>(f);
  };
  const std::uint32_t below = u >> 16, above = below + 1;  // toward zero and away from it (same sign)
  const double x_mag = std::fabs(static_cast<double>(x));
  const double to_below = x_mag - std::fabs(widen(below));
  if (std::isinf(x)) return static_cast<std::uint16_t>(below);
  const double to_above = (below & 0x7fffu) == 0x7f7fu ? to_below + 1.0  // the largest finite: above is Inf
                                                       : std::fabs(widen(above)) - x_mag;
  if ((below & 0x7fffu) == 0x7f7fu && x_mag >= 3.3961775292304266e38)  // past half a step above the largest: Inf
    return static_cast<std::uint16_t>(sign | 0x7f80u);
  if (to_below < to_above || (to_below == to_above && (below & 1u) == 0)) return static_cast<std::uint16_t>(below);
  return static_cast<std::uint16_t>(above);
}

float from_bits(std::uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Floats that test the rounding: ordinary values, exact ties (odd and even), subnormals, zeros of both
// signs, infinities, NaNs of both signs, the largest finite float and values just under and over the
// bfloat16 overflow point.
std::vector<float> rounding_cases(std::mt19937_64& rng, std::size_t count) {
  std::vector<float> x(count);
  std::uniform_int_distribution<std::uint32_t> bits;
  std::uniform_int_distribution<int> kind(0, 9);
  for (float& v : x) {
    const std::uint32_t b = bits(rng);
    switch (kind(rng)) {
      case 0: v = from_bits((b & 0xffff0000u) | 0x8000u); break;  // a tie
      case 1: v = from_bits(b & 0x807fffffu); break;              // subnormal or zero
      case 2: v = from_bits((b & 0x80000000u) | 0x7f800000u | (b & 0x7fffffu ? b & 0x7fffffu : 1u)); break;  // NaN
      case 3: v = (b & 1) ? std::numeric_limits<float>::infinity() : -std::numeric_limits<float>::max(); break;
      case 4: v = from_bits((b & 0x80000000u) | 0x7f7f8000u | (b & 0x7fffu)); break;  // near the overflow point
      default: v = std::ldexp(static_cast<float>(b) / 4294967296.0f - 0.5f, static_cast<int>(b % 40) - 20);
    }
  }
  return x;
}

void check_rounding_transpose(std::mt19937_64& rng, std::int64_t rows, std::int64_t cols, std::int64_t lds,
                              std::int64_t ldd) {
  const std::vector<float> src = rounding_cases(rng, static_cast<std::size_t>(std::max<std::int64_t>(1, rows * lds)));
  const bfloat16 untouched = bfloat16::from_bits(0x7fa5);  // a NaN the rounding never writes (no quiet bit)
  std::vector<bfloat16> dst(static_cast<std::size_t>(std::max<std::int64_t>(1, cols * ldd + 7)), untouched);
  transpose_rounding_to_bf16(src.data(), lds, rows, cols, dst.data(), ldd);
  for (std::int64_t c = 0; c < cols; ++c)
    for (std::int64_t r = 0; r < ldd; ++r) {
      const std::uint16_t got = dst[static_cast<std::size_t>(c * ldd + r)].bits;
      if (r >= rows) {
        ASSERT_EQ(got, untouched.bits) << "written outside the tile at (" << c << ", " << r << ")";
        continue;
      }
      const float x = src[static_cast<std::size_t>(r * lds + c)];
      const std::uint16_t want = nearest_bf16_bits(x);
      if (std::isnan(x)) {
        ASSERT_EQ(got & 0xffc0u, want) << "a quiet NaN of the same sign, at (" << r << ", " << c << ")";
      } else {
        ASSERT_EQ(got, want) << "x = " << x << " at (" << r << ", " << c << "), rows " << rows << " cols " << cols;
      }
    }
  for (std::size_t i = static_cast<std::size_t>(cols * ldd); i < dst.size(); ++i)
    ASSERT_EQ(dst[i].bits, untouched.bits) << "written past the tile";
  if (!has_bf16_conversion() || cols % 16 != 0) return;
  // The backward's bits before this function: the rows rounded by the instruction, then transposed.
  std::vector<bfloat16> rounded(static_cast<std::size_t>(std::max<std::int64_t>(1, rows * lds)));
  round_rows_with_bf16_conversion(src.data(), lds, rows, cols, rounded.data(), lds);
  std::vector<bfloat16> before(dst.size(), untouched);
  transpose_bf16(rounded.data(), lds, rows, cols, before.data(), ldd);
  for (std::size_t i = 0; i < dst.size(); ++i) ASSERT_EQ(dst[i].bits, before[i].bits) << "element " << i;
}

TEST(Bfloat16Transpose, RoundsFloatsAsTheConversionInstructionOnTheWay) {
  std::mt19937_64 rng(3232);
  for (const std::int64_t rows : {0, 1, 31, 32, 33, 64, 100, 256})
    for (const std::int64_t cols : {0, 1, 16, 17, 32, 48, 64, 200, 256})
      check_rounding_transpose(rng, rows, cols, cols + (cols % 5), rows + 3);
  std::uniform_int_distribution<std::int64_t> size(0, 256), extra(0, 40);
  for (int i = 0; i < 40; ++i) {
    const std::int64_t rows = size(rng), cols = size(rng);
    check_rounding_transpose(rng, rows, cols, cols + extra(rng), rows + extra(rng));
  }
}

}  // namespace
}  // namespace mha::detail
