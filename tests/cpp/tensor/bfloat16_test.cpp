// mha::bfloat16 and DType::BFloat16: rounding from float against an independent formula (nearest
// representable value by exact arithmetic in double, ties to the even mantissa), conversions through
// Tensor::copy_of, typed views, and the file formats (safetensors keeps BF16 bits; .npy has no bf16 and
// gets float32).
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "support/io_bytes.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::bfloat16;

// The bfloat16 value of bit pattern b, computed from its fields (not by a shift of float's bits).
double bf16_value(std::uint16_t b) {
  const int sign = b >> 15, exponent = (b >> 7) & 0xff, mantissa = b & 0x7f;
  double magnitude;
  if (exponent == 0xff) magnitude = mantissa ? std::numeric_limits<double>::quiet_NaN() : kInf;
  else if (exponent == 0) magnitude = std::ldexp(mantissa / 128.0, -126);
  else magnitude = std::ldexp(1.0 + mantissa / 128.0, exponent - 127);
  return sign ? -magnitude : magnitude;
}

// The bits of x rounded to nearest bfloat16, ties to even, found by comparing x with its two
// neighbours among all bfloat16 values of its sign (a search, sharing nothing with the library's bit
// trick). Beyond the largest finite value by half an ulp or more: infinity.
std::uint16_t expected_bits(float x) {
  const double v = x;
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(v);
  const double max_finite = bf16_value(0x7f7f), half_ulp_at_max = std::ldexp(1.0, 127 - 7 - 1);
  if (a >= max_finite + half_ulp_at_max) return sign | 0x7f80;
  std::uint16_t lo = 0, hi = 0x7f7f;  // largest pattern whose value <= a
  while (lo < hi) {
    const std::uint16_t mid = static_cast<std::uint16_t>((lo + hi + 1) / 2);
    if (bf16_value(mid) <= a) lo = mid;
    else hi = static_cast<std::uint16_t>(mid - 1);
  }
  if (bf16_value(lo) == a) return sign | lo;
  const std::uint16_t up = static_cast<std::uint16_t>(lo + 1);
  const double below = a - bf16_value(lo), above = bf16_value(up) - a;
  if (below < above) return sign | lo;
  if (above < below) return sign | up;
  return sign | ((lo & 1) ? up : lo);
}

TEST(Bfloat16, RoundsToNearestEvenLikeAnIndependentSearch) {
  std::vector<float> values = {0.0f,
                               -0.0f,
                               1.0f,
                               -1.0f,
                               0.1f,
                               1.00390625f /* tie, to even: 1 */,
                               1.01171875f /* tie, to even: 1.015625 */,
                               3.3895314e38f,
                               3.3961776e38f,
                               std::numeric_limits<float>::max(),
                               std::numeric_limits<float>::denorm_min(),
                               std::numeric_limits<float>::min(),
                               1e-40f,
                               -1e-45f};
  std::mt19937 gen(7);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 20000; ++i) {
    const float x = std::bit_cast<float>(bits(gen));
    if (!std::isnan(x)) values.push_back(x);
  }
  for (std::uint32_t low = 0; low < 0x10000; low += 0x1111) values.push_back(std::bit_cast<float>(0x3f800000u | low));
  for (float x : values) {
    const bfloat16 b = x;
    ASSERT_EQ(b.bits, expected_bits(x)) << "x = " << x << " (bits " << std::bit_cast<std::uint32_t>(x) << ")";
  }
}

// double -> bfloat16 rounds once: x just above a tie between two bfloat16 values, whose rounding to
// float lands exactly on the tie (and would then go to the even one, the wrong way), and the mirror.
TEST(Bfloat16, FromDoubleRoundsOnceNotThroughFloat) {
  const double tie = 1.0 + 0x1.0p-8;  // halfway between 1 and 1 + 2^-7
  for (double sign : {1.0, -1.0}) {
    const double above = sign * (tie + 0x1.0p-40), below = sign * (tie - 0x1.0p-40);
    ASSERT_EQ(static_cast<float>(above), static_cast<float>(sign * tie)) << "the test needs float's rounding to tie";
    EXPECT_EQ(float(bfloat16::from_double(above)), sign * (1.0 + 0x1.0p-7));
    EXPECT_EQ(float(bfloat16::from_double(below)), sign * 1.0);
    EXPECT_EQ(float(bfloat16::from_double(sign * tie)), sign * 1.0);  // an exact tie: to even
  }
  std::mt19937_64 gen(3);
  std::uniform_real_distribution<double> uniform(-4.0, 4.0);
  for (int i = 0; i < 20000; ++i) {  // no bfloat16 neighbour of the result is nearer to x
    const double x = uniform(gen);
    const std::uint16_t bits = bfloat16::from_double(x).bits;
    const double err = std::fabs(bf16_value(bits) - x);
    for (int step : {-1, 1}) ASSERT_LE(err, std::fabs(bf16_value(static_cast<std::uint16_t>(bits + step)) - x)) << x;
  }
  // and the library's copy from float64 rounds the same way
  const Tensor f64 = make_tensor(DType::Float64, {2}, {1.0 + 0x1.0p-8 + 0x1.0p-40, -(1.0 + 0x1.0p-8 + 0x1.0p-40)});
  const Tensor b = Tensor::copy_of(f64, DType::BFloat16);
  EXPECT_EQ(float(b.data_as<bfloat16>()[0]), 1.0 + 0x1.0p-7);
  EXPECT_EQ(float(b.data_as<bfloat16>()[1]), -(1.0 + 0x1.0p-7));
}

TEST(Bfloat16, NanStaysNanInfinitiesStay) {
  for (std::uint32_t nan_bits : {0x7fc00000u, 0x7f800001u, 0xffc00000u, 0x7f80ffffu, 0x7fff0000u}) {
    const bfloat16 b = std::bit_cast<float>(nan_bits);
    EXPECT_TRUE(std::isnan(float(b))) << std::hex << nan_bits;
  }
  EXPECT_EQ(float(bfloat16(std::numeric_limits<float>::infinity())), std::numeric_limits<float>::infinity());
  EXPECT_EQ(float(bfloat16(-std::numeric_limits<float>::infinity())), -std::numeric_limits<float>::infinity());
}

TEST(Bfloat16, EveryPatternWidensExactly) {
  for (std::uint32_t p = 0; p < 0x10000; ++p) {
    const auto bits = static_cast<std::uint16_t>(p);
    const float f = bfloat16::from_bits(bits);
    const double want = bf16_value(bits);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(f));
    } else {
      ASSERT_EQ(static_cast<double>(f), want) << p;
      ASSERT_EQ(bfloat16(f).bits, bits) << "round trip of " << p;
    }
  }
}

TEST(Bfloat16, TensorsConvertAndViewsCheckTheirSpan) {
  const std::vector<double> values = {0.1, -2.5, 1e30, 3.0e38, -0.0, 65536.5};
  const Tensor f64 = make_tensor(DType::Float64, {2, 3}, values);
  const Tensor b = Tensor::copy_of(f64, DType::BFloat16);
  ASSERT_EQ(b.dtype(), DType::BFloat16);
  EXPECT_EQ(b.nbytes(), 12u);
  for (std::size_t i = 0; i < values.size(); ++i)
    EXPECT_EQ(b.data_as<bfloat16>()[i].bits, expected_bits(static_cast<float>(values[i]))) << values[i];
  const Tensor back = Tensor::copy_of(Tensor::copy_of(b, DType::Float32), DType::BFloat16);
  EXPECT_TRUE(bitwise_equal(back, b));
  EXPECT_THROW(b.data_as<float>(), mha::Error);

  const std::vector<bfloat16> data(6, bfloat16(1.5f));
  const mha::TensorView view(std::span<const bfloat16>(data), {3, 2});
  EXPECT_EQ(view.dtype(), DType::BFloat16);
  EXPECT_EQ(to_doubles(view), std::vector<double>(6, 1.5));
  EXPECT_THROW(mha::TensorView(std::span<const bfloat16>(data), {7}), mha::Error);
  EXPECT_STREQ(mha::dtype_name(DType::BFloat16), "bfloat16");
  EXPECT_EQ(mha::dtype_size(DType::BFloat16), 2u);
}

TEST(Bfloat16, SafetensorsKeepsTheBitsAndNpyWidensToFloat32) {
  std::vector<bfloat16> data;
  for (std::uint32_t p : {0x3f80u, 0xc049u, 0x7f80u, 0x0001u, 0x7fc1u, 0x8000u}) data.push_back(bfloat16::from_bits(p));
  const mha::TensorView view(std::span<const bfloat16>(data), {2, 3});
  const auto bytes = mha::serialize_safetensors({{"w", view}});
  const std::string text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  EXPECT_NE(text.find("\"BF16\""), std::string::npos) << "written as BF16";
  const auto file = mha::parse_safetensors(bytes, "x");
  const Tensor& read = file.tensors.at("w");
  ASSERT_EQ(read.dtype(), DType::BFloat16);
  for (std::size_t i = 0; i < data.size(); ++i) EXPECT_EQ(read.data_as<bfloat16>()[i].bits, data[i].bits);
  const auto as_f64 = mha::parse_safetensors(bytes, "x", DType::Float64);
  EXPECT_EQ(as_f64.tensors.at("w").data_as<double>()[1], bf16_value(0xc049));

  const Tensor npy = mha::parse_npy(mha::serialize_npy(view), "x.npy");
  ASSERT_EQ(npy.dtype(), DType::Float32);
  for (std::size_t i = 0; i < data.size(); ++i) {
    const double want = bf16_value(data[i].bits);
    if (std::isnan(want)) EXPECT_TRUE(std::isnan(npy.data_as<float>()[i]));
    else EXPECT_EQ(npy.data_as<float>()[i], want);
  }
}

}  // namespace
}  // namespace mha_test
