// Numbers whose logits rise (or fall) along the keys, for the cases that move the fused forward's softmax
// reference (flash_forward.cpp, OnlineSoftmaxTile: a row's tiles after its first are exponentiated against
// its running reference m in one pass, and m moves only when a logit exceeds it by more than 8).
#pragma once

#include <cstdint>

#include "support/kernel_compare.hpp"

namespace mha_test {

// The logit ramp of head hh at key j (q's first entry 1, k's first entry the ramp, the rest small): head 0
// rises 0.05 a key (12.8 over a key block of 256, past the headroom in every block); head 1 steps up by 100
// at key 300 (inside the second block's third vector; past float32's exp range, so a pass that did not stop
// there would overflow) and by 3 at key 530 (within the headroom); head 2 falls (its first block holds the
// max) until it steps up by 150 at key 645, inside the vector [640, 656) where the causal rows 140-155 of
// rising_logits_case see only a prefix; and so on in turn.
inline double logit_ramp(std::int64_t hh, std::int64_t j) {
  const double x = static_cast<double>(j);
  switch (hh % 3) {
    case 0: return 0.05 * x;
    case 1: return (j >= 300 ? 100.0 : 0.0) + (j >= 530 ? 3.0 : 0.0);
    default: return -0.05 * x + (j >= 645 ? 150.0 : 0.0);
  }
}

// Rewrites d.q and d.k of case c (scale 1 wanted: c.scale = 1) so that logit_ij = logit_ramp(head, j) plus
// a few hundredths: q rows (1, q / 10...), k rows (ramp, k / 10...); every value float32-representable.
inline void put_rising_logits(const KernelCase& c, CaseData& d) {
  for (double& x : d.q) x /= 10.0 * c.amplitude;
  for (double& x : d.k) x /= 10.0 * c.amplitude;
  for (std::int64_t bh = 0; bh < c.B * c.h; ++bh)
    for (std::int64_t i = 0; i < c.L; ++i) d.q[static_cast<std::size_t>((bh * c.L + i) * c.d_k)] = 1.0;
  for (std::int64_t bh = 0; bh < c.B * c.kv_heads(); ++bh)
    for (std::int64_t j = 0; j < c.S; ++j)
      d.k[static_cast<std::size_t>((bh * c.S + j) * c.d_k)] = logit_ramp(bh % c.kv_heads(), j);
  d.q = rounded_to(DType::Float32, d.q), d.k = rounded_to(DType::Float32, d.k);
}

// A case for them: 3 heads, 200 queries (two query blocks), 700 keys (three key blocks, the last partial).
inline KernelCase rising_logits_case(bool causal) {
  KernelCase c;
  c.seed = 2024;
  c.B = 1, c.h = 3, c.L = 200, c.S = 700, c.d_k = 4, c.d_v = 3;
  c.scale = 1.0;
  c.causal = causal;
  c.need_weights = true;
  return c;
}

}  // namespace mha_test
