// Parameter initialisation with PyTorch's distributions from a seeded, portable generator.
// (std::uniform_real_distribution and std::normal_distribution differ between standard libraries;
// these conversions are spelled out so a seed gives the same parameters everywhere.)
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>
#include <random>

namespace mha::detail {

class InitRng {
 public:
  explicit InitRng(std::uint64_t seed) : engine_(seed) {}

  // Uniform in [0, 1): the top 53 bits of one 64-bit draw.
  double uniform01() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }
  double uniform(double low, double high) { return low + (high - low) * uniform01(); }
  // Standard normal by Box-Muller (one of the pair; simple beats fast here).
  double normal() {
    const double u1 = 1.0 - uniform01();  // (0, 1]: log is finite
    const double u2 = uniform01();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }

 private:
  std::mt19937_64 engine_;
};

}  // namespace mha::detail
