/// \file
/// mha::bfloat16: the 16-bit floating-point type of DType::BFloat16 (the upper half of an IEEE float32:
/// 1 sign bit, 8 exponent bits, 7 mantissa bits; float32's range at about 3 significant digits).
#pragma once

#include <bit>
#include <cstdint>

namespace mha {

/// A bfloat16 value. Converts implicitly from float (rounding to the nearest bfloat16, ties to even,
/// as PyTorch and the AVX512-BF16 instructions round; NaN stays NaN, overflow becomes infinity) and to
/// float (exactly). Arithmetic happens in float:
///
///     mha::bfloat16 x = 0.1f;           // 0.10009765625
///     float y = x * 2.0f;               // 0.2001953125
///     mha::bfloat16 z = y;              // rounded again
struct bfloat16 {
  std::uint16_t bits = 0;

  constexpr bfloat16() = default;
  constexpr bfloat16(float x) : bits(round_to_bits(x)) {}  // NOLINT: implicit, like float's other widths
  constexpr operator float() const { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }

  /// The value whose bit pattern is `bits`.
  static constexpr bfloat16 from_bits(std::uint16_t bits) {
    bfloat16 b;
    b.bits = bits;
    return b;
  }

  /// double x rounded to bfloat16 once (to nearest, ties to even), not through float's rounding first:
  /// float's rounding can land exactly halfway between two bfloat16 values and so pick the wrong one.
  static constexpr bfloat16 from_double(double x) {
    float f = static_cast<float>(x);
    std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    // A float that ended exactly halfway (low half 0x8000) only because of rounding is nudged toward x,
    // so that the tie is broken the way the exact value breaks it.
    if ((u & 0xffffu) == 0x8000u && static_cast<double>(f) != x && x == x) {
      const bool above = (static_cast<double>(f) > x) != (f < 0);  // |f| > |x|
      u = above ? u - 1 : u + 1;
      f = std::bit_cast<float>(u);
    }
    return from_bits(round_to_bits(f));
  }

  /// The bits of float x rounded to bfloat16: to nearest, ties to even; a NaN stays NaN (made quiet).
  static constexpr std::uint16_t round_to_bits(float x) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // NaN
    const std::uint32_t lsb = (u >> 16) & 1u;  // ties go to the even neighbour
    return static_cast<std::uint16_t>((u + 0x7fffu + lsb) >> 16);
  }
};

static_assert(sizeof(bfloat16) == 2, "bfloat16 is two bytes, as in memory and in files");

}  // namespace mha
