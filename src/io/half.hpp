// IEEE 754 binary16 ("half", safetensors F16, NumPy '<f2') and bfloat16 (safetensors BF16) to float.
//
// Written by hand because neither C++20 nor a Debian library we use offers it (std::float16_t is
// C++23). Both conversions are exact: every half and every bfloat16 value is a float.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace mha::io {

// binary16: 1 sign bit, 5 exponent bits (bias 15), 10 mantissa bits.
inline float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h >> 15) << 31;
  const std::uint32_t exponent = (h >> 10) & 0x1f;
  const std::uint32_t mantissa = h & 0x3ff;
  std::uint32_t bits;
  if (exponent == 0x1f) {
    // Infinity (mantissa 0) or NaN; the NaN payload moves to the top of float's mantissa, so a
    // quiet NaN stays quiet.
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    // Normal: rebias the exponent from 15 to 127.
    bits = sign | ((exponent + (127 - 15)) << 23) | (mantissa << 13);
  } else {
    // Zero or subnormal: mantissa * 2^-24, exact in float (float's normal range reaches 2^-126).
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(bits);
}

// bfloat16 is the top half of a float: 1 sign, 8 exponent, 7 mantissa bits.
inline float bfloat16_to_float(std::uint16_t b) { return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16); }

}  // namespace mha::io
