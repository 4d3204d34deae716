// The online softmax's row rule and the merge of partial softmax results, each written once: the fused
// forward (flash_forward.cpp), the decode kernels (decode_rows-inl.h, decode_float64.cpp), split-KV
// decode's merge (decode/split_kv.hpp) and the ring's (distributed/blocks.hpp) call these; the SIMD
// loops over a row's entries stay with each kernel (online_softmax-inl.h, per target).
//
// A row's state over the keys seen so far is (m, l, acc): m the largest logit, l = sum_j exp(s_j - m),
// acc = sum_j exp(s_j - m) v_j (unnormalised); out = acc / l and lse = m + log l at the end (Milakov &
// Gimelshein 2018; FlashAttention-2's rescaling).
//
// The NaN rule: a NaN logit makes m NaN from then on (std::max would drop it), and so the row's l,
// acc, out and lse; -inf logits have weight exactly 0; a row whose logits so far are all -inf keeps
// m = -inf, l = 0, acc = 0 (its entries are given weight 0, not exp(-inf - -inf) = NaN).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace mha::detail {

// max(a, b), NaN when either is NaN.
template <class A>
A max_keeping_nan(A a, A b) {
  return std::isnan(a) || std::isnan(b) ? std::numeric_limits<A>::quiet_NaN() : std::max(a, b);
}

// One online-softmax step of a row: its running max m meets the largest logit of the next block.
template <class A>
struct OnlineSoftmaxStep {
  A m_new;         // max(m, block_max), NaN kept
  A rescale;       // exp(m - m_new) for the old l and acc: exactly 1 when the max did not change, 0 from -inf
  bool no_weight;  // m_new is -inf: every logit so far is -inf; the block's entries get weight 0, the state stays
};

template <class A>
OnlineSoftmaxStep<A> online_softmax_step(A m, A block_max) {
  const A m_new = max_keeping_nan(m, block_max);
  if (m_new == -std::numeric_limits<A>::infinity()) return {m_new, A(1), true};
  return {m_new, m_new == m ? A(1) : A(std::exp(m - m_new)), false};
}

// An attention sink (mha/score.hpp): one more logit of the row, `sink`, that brings no value. Folds it
// into the row's state (m, l) and returns the factor acc is multiplied by, exp(m - m'): 0 when the row
// had no weight, so acc stays 0 and the row's output 0. A NaN sink makes m and l NaN; a sink of -inf
// is none (the state stays, factor 1); +inf gives l NaN, as a +inf logit does.
template <class A>
A fold_sink(A& m, A& l, A sink) {
  const OnlineSoftmaxStep<A> step = online_softmax_step(m, sink);
  if (step.no_weight) return A(1);
  l = l * step.rescale + A(std::exp(sink - step.m_new));
  m = step.m_new;
  return step.rescale;
}

// The merge of one row's partial results over disjoint key sets (chunks of a sequence, ring steps):
// partial c is (m_c, l_c, acc_c) as above, or a normalised (lse_c, 1, out_c). The merged state is
// M = max_c m_c (NaN if any is), L = sum_c w_c l_c and acc = sum_c w_c acc_c with w_c = exp(m_c - M),
// skipping partials with m_c = -inf (no weight). Add the partials one by one, in a fixed order (the
// result depends on it only by rounding, and a fixed order keeps it bitwise reproducible), then finish.
template <class A>
class LseMerge {
 public:
  // m: one partial's max (NaN kept) before any add(): the merge needs M before it weighs the partials.
  void see_max(A m) { M_ = max_keeping_nan(M_, m); }
  A max() const { return M_; }
  // Adds w * (l, acc[0, d_v)) into (L, out) for a partial with max m, w = exp(m - M).
  void add(A m, A l, const A* acc, std::int64_t d_v, A* out) {
    if (m == kMinusInf) return;  // no weight in this partial
    const A w = m == M_ ? A(1) : A(std::exp(m - M_));
    L_ += w * l;
    for (std::int64_t e = 0; e < d_v; ++e) out[e] += w * acc[e];
  }
  // An attention sink (mha/score.hpp) as a partial with max `sink`, l = 1 and no value: adds its weight
  // to L only. See its max first (see_max(sink)), as any partial's.
  void add_sink(A sink) {
    if (sink == kMinusInf) return;
    L_ += sink == M_ ? A(1) : A(std::exp(sink - M_));
  }
  // out /= L; returns lse = M + log L. Call it only when some partial had weight (!no_weight()): what a
  // row without any is, the caller says (decode: 0 / 0, NaN, as its rows always see a key; the ring: a
  // row that saw no key keeps output 0 and lse -inf).
  A finish(std::int64_t d_v, A* out) const {
    const A inv = A(1) / L_;
    for (std::int64_t e = 0; e < d_v; ++e) out[e] *= inv;
    return M_ + std::log(L_);
  }
  bool no_weight() const { return M_ == kMinusInf; }

 private:
  static constexpr A kMinusInf = -std::numeric_limits<A>::infinity();
  A M_ = kMinusInf, L_ = 0;
};

}  // namespace mha::detail
