// Counter-based dropout: whether attention weight (b, head, i, j) is dropped is a pure function of
// (seed, b, head, i, j), so a backward pass can regenerate the mask without storing it and the result
// does not depend on how rows are split among threads.
#pragma once

#include <cstdint>

namespace mha::detail {

// SplitMix64's finaliser (Steele, Lea, Flood 2014): a bijective mix with good avalanche.
constexpr std::uint64_t mix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// A uniform number in [0, 1) keyed by the position of one attention weight.
inline double dropout_uniform(std::uint64_t seed, std::int64_t b, std::int64_t head, std::int64_t i,
                              std::int64_t j) {
  std::uint64_t x = mix64(seed);
  for (std::int64_t coordinate : {b, head, i, j}) x = mix64(x ^ static_cast<std::uint64_t>(coordinate));
  return static_cast<double>(x >> 11) * 0x1.0p-53;  // the top 53 bits
}

}  // namespace mha::detail
