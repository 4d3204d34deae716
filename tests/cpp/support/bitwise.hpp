// Bitwise comparisons for the property tests of the fused kernel (attention/flash_properties_test.cpp)
// and of the layer (layer/backward_test.cpp): padded keys are never read, a NaN stays in its row,
// results do not depend on repeats or thread counts. And the key padding those tests poison.
//
// Legend: B batch, h heads, L queries, S keys.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "support/kernel_compare.hpp"
#include "support/naive_attention.hpp"
#include "support/test_util.hpp"

namespace mha_test {

// Identical bit patterns everywhere (NaNs included); on failure: how many elements differ, the
// largest absolute and relative differences, and the first difference.
inline ::testing::AssertionResult same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << "size " << a.size() << " vs " << b.size();
  std::size_t differ = 0, first = 0;
  double max_abs = 0.0, max_rel = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(double)) == 0) continue;
    if (differ++ == 0) first = i;
    const double d = std::fabs(a[i] - b[i]);
    max_abs = std::max(max_abs, d);
    if (b[i] != 0.0) max_rel = std::max(max_rel, d / std::fabs(b[i]));
  }
  if (differ == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << differ << " of " << a.size() << " elements differ; max abs difference "
                                       << max_abs << ", max relative " << max_rel << "; first at " << first << ": "
                                       << a[first] << " vs " << b[first];
}

// The elements of `x` (rows of `width`) whose row satisfies `keep`.
template <class Keep>
std::vector<double> rows_where(const std::vector<double>& x, std::int64_t width, Keep&& keep) {
  std::vector<double> out;
  for (std::size_t r = 0; r * static_cast<std::size_t>(width) < x.size(); ++r)
    if (keep(static_cast<std::int64_t>(r)))
      out.insert(out.end(), x.begin() + static_cast<std::ptrdiff_t>(r * width),
                 x.begin() + static_cast<std::ptrdiff_t>((r + 1) * width));
  return out;
}

// How often the determinism tests repeat a run.
inline constexpr int kRepeats = kSanitized ? 3 : 20;

// The padding of the poisoning tests (B = 3): it covers single keys, runs of keys, a whole key block
// and a whole batch. c.masks says which of kCmpKeyPadding and kCmpLengths to set.
inline void set_padding(const KernelCase& c, NaiveMaskSpec& m) {
  if (c.masks & kCmpKeyPadding) {
    m.key_padding.assign(static_cast<std::size_t>(c.B * c.S), 0);
    for (std::int64_t j = 0; j < c.S; ++j) {
      m.key_padding[static_cast<std::size_t>(j)] = j % 3 == 1 || j >= c.S - c.S / 3;  // scattered + a tail run
      m.key_padding[static_cast<std::size_t>(c.S + j)] = (j / 4) % 2 == 1;            // runs of 4
      m.key_padding[static_cast<std::size_t>(2 * c.S + j)] = c.masks & kCmpLengths ? j % 2 : 1;  // all, or every other
    }
  }
  if (c.masks & kCmpLengths) m.key_lengths = {c.S, c.S - c.S / 3 - 1, c.S / 2};
}

inline bool key_padded(const NaiveMaskSpec& m, std::int64_t b, std::int64_t j) {
  if (!m.key_padding.empty() && m.key_padding[static_cast<std::size_t>(b * m.S + j)]) return true;
  return !m.key_lengths.empty() && j >= m.key_lengths[static_cast<std::size_t>(b)];
}

}  // namespace mha_test
