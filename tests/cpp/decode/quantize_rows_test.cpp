// The vector quantizers of appended rows (decode/quantize_rows.hpp) against the specification,
// quantize_int8_row / quantize_e4m3_row (decode/quantize.hpp, tested against independent roundings in
// quantized_kv_cache_test.cpp): the same scale and payload bits, on every SIMD target this CPU runs, for
// float32 and bfloat16 rows of every width up to a few vectors past the widest (so every tail length),
// every binary magnitude (subnormal scales included), payloads placed exactly on rounding ties of both
// formats, negative zeros (a float8 pattern of its own), rows saturating the largest float, and rows
// with a NaN or an infinity in a vector or in the tail.
//
// Legend: d a row's width, s its scale.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "decode/quantize.hpp"
#include "decode/quantize_rows.hpp"
#include "mha/bfloat16.hpp"
#include "support/every_target.hpp"

namespace {

namespace detail = mha::detail;
using mha::bfloat16;

class QuantizeRowsEveryTarget : public mha_test::EveryTarget {};
MHA_INSTANTIATE_EVERY_TARGET(QuantizeRowsEveryTarget);

// The float32 bits of a scale, NaN as one pattern (a NaN scale's payload bits are all that matter).
std::uint32_t scale_bits(float s) { return std::isnan(s) ? 0x7FC00000u : std::bit_cast<std::uint32_t>(s); }

// x [d] (float or bfloat16) quantized both ways, compared bit for bit.
template <class T>
void expect_same_as_specification(const std::vector<T>& x, const std::string& what) {
  const auto d = static_cast<std::int64_t>(x.size());
  std::vector<std::int8_t> q_spec(x.size(), 5), q_vec(x.size(), 7);
  const float s_spec = detail::quantize_int8_row(x.data(), d, q_spec.data());
  const float s_vec = detail::quantize_int8_row_vectors(x.data(), d, q_vec.data());
  EXPECT_EQ(scale_bits(s_vec), scale_bits(s_spec)) << "int8 scale, " << what;
  EXPECT_EQ(q_vec, q_spec) << "int8 payloads, " << what;
  std::vector<std::uint8_t> e_spec(x.size(), 5), e_vec(x.size(), 7);
  const float t_spec = detail::quantize_e4m3_row(x.data(), d, e_spec.data());
  const float t_vec = detail::quantize_e4m3_row_vectors(x.data(), d, e_vec.data());
  EXPECT_EQ(scale_bits(t_vec), scale_bits(t_spec)) << "e4m3 scale, " << what;
  EXPECT_EQ(e_vec, e_spec) << "e4m3 payloads, " << what;
}

// The row as float32 and as bfloat16 (each element rounded to it).
void expect_both_dtypes(const std::vector<float>& x, const std::string& what) {
  expect_same_as_specification(x, "float32, " + what);
  expect_same_as_specification(std::vector<bfloat16>(x.begin(), x.end()), "bfloat16, " + what);
}

// Random rows of every width 1..70 and every third binary magnitude from float32's subnormals to its
// largest, with negative zeros and exact zeros among the elements.
TEST_P(QuantizeRowsEveryTarget, RandomRowsOfEveryWidthAndMagnitudeMatchTheSpecification) {
  std::mt19937 gen(11);
  std::uniform_real_distribution<double> u(-1, 1);
  for (int d = 1; d <= 70; ++d)
    for (int e = -149; e <= 128; e += 3) {
      std::vector<float> x(static_cast<std::size_t>(d));
      for (float& v : x) {
        const double r = u(gen);
        v = r > 0.9    ? -0.0f
            : r < -0.9 ? 0.0f
                       : static_cast<float>(std::min(std::ldexp(r, e), double{std::numeric_limits<float>::max()}));
      }
      expect_both_dtypes(x, "d " + std::to_string(d) + ", 2^" + std::to_string(e));
    }
}

// Elements placed on the ties of both formats: (k + 1/2) s for int8, midpoints between neighbouring
// float8 values times s, where they are float32 numbers (the row's largest element fixes s first).
TEST_P(QuantizeRowsEveryTarget, ElementsOnRoundingTiesMatchTheSpecification) {
  for (int e : {-140, -120, -20, 0, 7, 60, 120}) {
    const float largest = std::ldexp(1.0f, e) * 1.25f;
    const double s_int8 = detail::quantization_scale(largest, detail::kInt8PayloadMax);
    const double s_e4m3 = detail::quantization_scale(largest, detail::kE4M3PayloadMax);
    std::vector<float> x = {largest};
    for (int k = -127; k < 127; ++k) x.push_back(static_cast<float>((k + 0.5) * s_int8));
    for (unsigned bits = 0; bits < 0x7E; ++bits) {
      const double mid = (detail::e4m3_to_float(static_cast<std::uint8_t>(bits)) +
                          detail::e4m3_to_float(static_cast<std::uint8_t>(bits + 1))) /
                         2;
      x.push_back(static_cast<float>(mid * s_e4m3));
      x.push_back(static_cast<float>(-mid * s_e4m3));
    }
    expect_both_dtypes(x, "ties at 2^" + std::to_string(e));
  }
}

// Rows that are not finite (NaN or +-Inf in a whole vector or in the tail), all zero, all negative
// zero, or holding float32's largest value.
TEST_P(QuantizeRowsEveryTarget, EdgeRowsMatchTheSpecification) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (int d : {1, 5, 16, 17, 33, 64, 67}) {
    for (int at : {0, d / 2, d - 1})
      for (float bad : {nan, inf, -inf}) {
        std::vector<float> x(static_cast<std::size_t>(d), 0.5f);
        x[static_cast<std::size_t>(at)] = bad;
        expect_both_dtypes(x, "d " + std::to_string(d) + ", " + std::to_string(bad) + " at " + std::to_string(at));
      }
    expect_both_dtypes(std::vector<float>(static_cast<std::size_t>(d), 0.0f), "zeros");
    expect_both_dtypes(std::vector<float>(static_cast<std::size_t>(d), -0.0f), "negative zeros");
    std::vector<float> huge(static_cast<std::size_t>(d), -1.0f);
    huge[0] = std::numeric_limits<float>::max();
    expect_both_dtypes(huge, "the largest float");
    std::vector<float> tiny(static_cast<std::size_t>(d), std::numeric_limits<float>::denorm_min());
    tiny[static_cast<std::size_t>(d - 1)] = -0.0f;
    expect_both_dtypes(tiny, "the smallest subnormal");
  }
}

}  // namespace
