// Quantized rows of a PagedKVCache (mha/paged_kv_cache.hpp, KVStorage::Int8 and ::Float8E4M3): one row
// x [d] of keys or values (one token, one kv head) becomes d one-byte payloads q and one float32 scale s,
// symmetric, and is read back (by keys() / values() and by decode) as x'_c = float(q_c) * s in float32.
//
//   m = max_c |x_c|, computed in float64
//   int8:      s = scale_for(m, 127), q_c = round_half_even(x_c / s)          in [-127, 127]
//   e4m3 (fn): s = scale_for(m, 448), q_c = e4m3_from_double(x_c / s)         nearest, ties to even,
//              saturating at +-448 (no NaN from finite input)
//   the divisions x_c / s in float64, with s the stored float32 scale.
//
// scale_for(m, qmax) is m / qmax (in float64) made a float32 that keeps the guarantees below:
//   - m / qmax >= 2^-133: rounded down to 17 significant bits. Then m / s < qmax (1 + 2^-16), so no
//     payload needs clamping (127.002 still rounds to 127), and an int8 product q * s (7 bits times 17)
//     is exact in float32: x' = q s exactly, hence |x' - x| <= s / 2 for every element (int8; exactly so
//     for float32 and bfloat16 input, whose quotient x / s in float64 never crosses a tie; float64 input
//     may exceed it by the division's rounding).
//   - below (float32's subnormal scales): rounded up to a multiple of 2^-149, the smallest float32, so
//     s > 0 and m / s <= qmax; rounding to nearest would give m = 2^-140 the scale 4 * 2^-149 and the
//     payload 128. A row whose m / qmax underflows thus still stays within s / 2 of x (int8).
// Edge rows: all zero (m = 0): s = 0 and q = 0 (x' = 0). An element that is NaN, +-Inf or (float64
// input) beyond float32's largest finite value: s = NaN and q = 0, so every element of the row reads
// back as NaN: the row stays visibly not finite, never becomes a finite number.
//
// float8 e4m3 "fn" (as PyTorch's float8_e4m3fn, OCP FP8): sign, 4 exponent bits (bias 7), 3 mantissa
// bits; no infinities, S.1111.111 the only NaN; largest 448 = 1.75 * 2^8, subnormals m * 2^-9.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

namespace mha::detail {

inline constexpr double kInt8PayloadMax = 127.0;  // |q| of an int8 row
inline constexpr double kE4M3PayloadMax = 448.0;  // the largest finite float8 e4m3 (fn) value
inline constexpr std::uint8_t kE4M3MaxBits = 0x7E, kE4M3NaNBits = 0x7F;

// The float8 e4m3 (fn) value of `bits`, exactly: exponent field e > 0: (1 + m/8) 2^(e-7), i.e. the
// float32 with exponent e - 7 and the same 3 mantissa bits; e = 0: m 2^-9; S.1111.111: NaN (signed).
inline float e4m3_to_float(std::uint8_t bits) {
  const std::uint32_t magnitude = bits & 0x7Fu, sign = static_cast<std::uint32_t>(bits & 0x80u) << 24;
  float value;
  if (magnitude == kE4M3NaNBits) value = std::numeric_limits<float>::quiet_NaN();
  else if (magnitude < 8) value = static_cast<float>(magnitude) * (1.0f / 512.0f);  // subnormal (or 0)
  else value = std::bit_cast<float>((magnitude << 20) + (120u << 23));              // e - 7 + 127 = e + 120
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(value) | sign);
}

// v rounded to the nearest integer, ties to the even one, whatever the floating-point environment's
// rounding mode (|v| < 2^52).
inline double round_half_even(double v) {
  const double below = std::floor(v), rest = v - below;
  return rest > 0.5 || (rest == 0.5 && std::fmod(below, 2.0) != 0.0) ? below + 1.0 : below;
}

// y rounded to float8 e4m3 (fn): to nearest, ties to the even pattern; |y| >= 448 (Inf too) saturates to
// +-448; NaN gives NaN (0x7F). With E = max(floor(log2 |y|), -6), |y| / 2^(E-3) lies in [8, 16) (or
// [0, 8) below 2^-6: a subnormal) and rounds to r; the pattern is (E + 6) * 8 + r, r = 16 carrying into
// the exponent.
inline std::uint8_t e4m3_from_double(double y) {
  if (std::isnan(y)) return kE4M3NaNBits;
  const std::uint8_t sign = std::signbit(y) ? 0x80 : 0x00;
  const double a = std::fabs(y);
  if (a >= kE4M3PayloadMax) return sign | kE4M3MaxBits;
  if (a == 0.0) return sign;
  const int exponent = std::max(std::ilogb(a), -6);
  const double r = round_half_even(std::ldexp(a, 3 - exponent));
  const int magnitude = (exponent + 6) * 8 + static_cast<int>(r);
  return static_cast<std::uint8_t>(sign | std::min(magnitude, static_cast<int>(kE4M3MaxBits)));
}

// The scale of a row whose largest magnitude is max_abs (0 < max_abs <= FLT_MAX), for payloads up to
// payload_max: scale_for in the legend above.
inline float quantization_scale(double max_abs, double payload_max) {
  const double s = max_abs / payload_max;
  if (std::ilogb(s) >= -133) {  // 17 significant bits, rounded down: 2^(E-16) <= s / 2^16
    const double unit = std::ldexp(1.0, std::ilogb(s) - 16);
    return static_cast<float>(std::floor(s / unit) * unit);
  }
  constexpr double kSmallest = 0x1p-149;  // rounded up to a multiple of the smallest float32
  return static_cast<float>(std::ceil(s / kSmallest) * kSmallest);
}

// max |x_c| of a row x [d] (elements `stride` apart) in float64, or NaN when an element is NaN, +-Inf
// or beyond float32's largest finite value.
template <class T>
double row_max_abs(const T* x, std::int64_t d, std::int64_t stride) {
  double max_abs = 0.0;
  for (std::int64_t c = 0; c < d; ++c) {
    const double a = std::fabs(static_cast<double>(x[c * stride]));
    if (!(a <= static_cast<double>(std::numeric_limits<float>::max()))) return std::numeric_limits<double>::quiet_NaN();
    max_abs = std::max(max_abs, a);
  }
  return max_abs;
}

// The row x [d] as payloads q [d] of `Round(x_c / s)` (float64); returns s (0 for an all-zero row, NaN
// for a row that is not finite, both with q = 0).
template <class T, class Payload, class Round>
float quantize_row(const T* x, std::int64_t d, Payload* q, std::int64_t stride, double payload_max, Round round) {
  const double max_abs = row_max_abs(x, d, stride);
  if (!(max_abs > 0.0)) {
    std::fill_n(q, d, Payload{0});
    return max_abs == 0.0 ? 0.0f : std::numeric_limits<float>::quiet_NaN();
  }
  const float s = quantization_scale(max_abs, payload_max);
  for (std::int64_t c = 0; c < d; ++c) q[c] = round(static_cast<double>(x[c * stride]) / static_cast<double>(s));
  return s;
}

// y = x / s rounded to an int8 payload: to nearest, ties to even, clamped to +-127.
inline std::int8_t int8_from_double(double y) {
  return static_cast<std::int8_t>(std::clamp(round_half_even(y), -kInt8PayloadMax, kInt8PayloadMax));
}

// A row x [d] of float, double or mha::bfloat16 (elements `stride` apart) quantized to int8 payloads
// q [d]; returns the row's scale.
template <class T>
float quantize_int8_row(const T* x, std::int64_t d, std::int8_t* q, std::int64_t stride = 1) {
  return quantize_row(x, d, q, stride, kInt8PayloadMax, int8_from_double);
}

// A row x [d] quantized to float8 e4m3 (fn) bit patterns q [d]; returns the row's scale.
template <class T>
float quantize_e4m3_row(const T* x, std::int64_t d, std::uint8_t* q, std::int64_t stride = 1) {
  return quantize_row(x, d, q, stride, kE4M3PayloadMax, e4m3_from_double);
}

// One element read back: x' = float(q) * s in float32 (0 * NaN = NaN: a non-finite row's every element).
inline float dequantize_int8(std::int8_t q, float scale) { return static_cast<float>(q) * scale; }
inline float dequantize_e4m3(std::uint8_t bits, float scale) { return e4m3_to_float(bits) * scale; }

}  // namespace mha::detail
