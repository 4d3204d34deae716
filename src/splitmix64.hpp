// SplitMix64 (Steele, Lea, Flood 2014, "Fast splittable pseudorandom number generators"): the mixing
// function behind the library's dropout streams and seeds, and a small generator for the example
// Transformer. Portable: the same numbers on every platform, unlike std:: distributions.
#pragma once

#include <cstdint>

namespace mha::detail {

inline constexpr std::uint64_t kSplitMix64Gamma = 0x9e3779b97f4a7c15ULL;  // 2^64 / golden ratio, odd

// SplitMix64's output function: a bijective 64-bit mix with good avalanche.
constexpr std::uint64_t splitmix64_finalize(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// One SplitMix64 step from state z: the output for state z + gamma. Used as a keyed hash.
constexpr std::uint64_t mix64(std::uint64_t z) { return splitmix64_finalize(z + kSplitMix64Gamma); }

// The SplitMix64 generator: next() returns mix64 of the states seed, seed + gamma, seed + 2 gamma, ...
class SplitMix64 {
 public:
  explicit constexpr SplitMix64(std::uint64_t seed) : state_(seed) {}
  constexpr std::uint64_t next() {
    state_ += kSplitMix64Gamma;
    return splitmix64_finalize(state_);
  }

 private:
  std::uint64_t state_;
};

}  // namespace mha::detail
