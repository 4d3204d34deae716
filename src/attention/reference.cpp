// The reference attention kernel: plain loops over one query row at a time, the row's logits
// materialised, any element type (float, double). Never optimised: it is the specification.
//
// For each (b, head, i), with k and v of key/value head head / (h / h_kv) (grouped-query attention):
//   s_j = cap(scale * q_i . k_j) + added_ij        for keys j not forbidden (AttentionInputs::forbidden);
//                                                  cap(x) = softcap tanh(x / softcap), or x without softcap
//   with an attention sink (sinks[head], no value), one more logit s_sink in m and l only:
//   m   = max(max_j s_j, s_sink);  l = sum_j exp(s_j - m) + exp(s_sink - m);  p_j = exp(s_j - m) / l
//   lse = m + log(l)
//   p_j = dropout(p_j)                             (kept: p_j / (1 - dropout_p), dropped: 0)
//   out_i = sum_j p_j v_j
// A row with no allowed key has out_i = 0, p = 0, lse = -inf (with a sink: s_sink). Keys with p_j == 0 are
// not read.
#include "attention/reference.hpp"

#include <omp.h>

#include <cmath>
#include <limits>
#include <vector>

#include "attention/dropout.hpp"
#include "attention/masks.hpp"
#include "parallel.hpp"

namespace mha::detail {

namespace {

// The soft-capped logit (x itself without softcap).
template <class T>
T capped(const AttentionInputs<T>& p, T x) {
  return p.softcap > 0 ? p.softcap * std::tanh(x / p.softcap) : x;
}

}  // namespace

template <class T>
void reference_attention_forward(const AttentionParams<T>& p) {
  constexpr T kMinusInf = -std::numeric_limits<T>::infinity();
  const std::int64_t rows = p.B * p.h * p.L;
  const SerialIfSmall serial_if_small(2.0 * rows * p.S * (p.d_k + p.d_v));
  // One logits row per thread, allocated once per call.
  std::vector<T> scratch(static_cast<std::size_t>(omp_get_max_threads() * p.S));

#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t b = r / (p.h * p.L), head = (r / p.L) % p.h, i = r % p.L, kv = p.kv_head(head);
    T* s = scratch.data() + omp_get_thread_num() * p.S;  // s: [S], logits then probabilities

    // A key is forbidden by the boolean masks or by an additive -inf; its weight is exactly 0.
    auto forbidden = [&](std::int64_t j) { return p.forbidden(b, head, i, j); };

    // Logits; forbidden keys get -inf without reading k (it may hold anything).
    T m = kMinusInf;
    for (std::int64_t j = 0; j < p.S; ++j) {
      if (forbidden(j)) {
        s[j] = kMinusInf;
        continue;
      }
      const T added = p.added(b, head, i, j);
      T dot = 0;
      for (std::int64_t c = 0; c < p.d_k; ++c) dot += p.q(b, head, i, c) * p.k(b, kv, j, c);
      s[j] = capped(p, dot * p.scale) + added;
      if (!(s[j] <= m)) m = s[j];  // a NaN logit becomes the max, so the row turns NaN
    }

    for (std::int64_t c = 0; c < p.d_v; ++c) p.out(b, head, i, c) = 0;
    T* weights = p.weights ? p.weights + r * p.S : nullptr;
    const T sink = p.sinks ? p.sinks[head] : kMinusInf;           // -inf: no sink
    if (p.sinks && !(sink <= m)) m = sink;                        // NaN kept, as for a logit
    if (m == kMinusInf && has_allowed_key(p, b, head, i, p.S)) {  // allowed keys, all at -inf: 0 / 0
      if (p.partial_over_keys) {  // no weight in this part: lse -inf, the output NaN as a mark
        for (std::int64_t c = 0; c < p.d_v; ++c) p.out(b, head, i, c) = std::numeric_limits<T>::quiet_NaN();
        for (std::int64_t j = 0; j < p.S && weights; ++j) weights[j] = 0;
        if (p.lse) p.lse[r] = kMinusInf;
        continue;
      }
      m = std::numeric_limits<T>::quiet_NaN();
    }
    if (m == kMinusInf) {  // no allowed key: attend to nothing
      for (std::int64_t j = 0; j < p.S && weights; ++j) weights[j] = 0;
      if (p.lse) p.lse[r] = kMinusInf;
      continue;
    }

    // Softmax, stable: subtract the row max before exponentiating.
    T sum = sink == kMinusInf ? T(0) : std::exp(sink - m);
    for (std::int64_t j = 0; j < p.S; ++j) {
      s[j] = forbidden(j) ? T(0) : std::exp(s[j] - m);  // NaN everywhere allowed when m is NaN
      sum += s[j];
    }
    if (p.lse) p.lse[r] = m + std::log(sum);
    const T keep_scale = T(1) / (T(1) - p.dropout_p);
    for (std::int64_t j = 0; j < p.S; ++j) {
      s[j] = forbidden(j) ? T(0) : s[j] / sum;
      if (p.dropout_p > 0) s[j] = dropped(p, b, head, i, j) ? T(0) : s[j] * keep_scale;
      if (weights) weights[j] = s[j];
    }

    // out_i = sum_j p_j v_j
    for (std::int64_t j = 0; j < p.S; ++j) {
      if (s[j] == 0) continue;
      for (std::int64_t c = 0; c < p.d_v; ++c) p.out(b, head, i, c) += s[j] * p.v(b, kv, j, c);
    }
  }
}

// The backward, one (b, key/value head) pair per iteration, its group's query heads in order, so every
// gradient element has one writer and dK, dV sum the group's heads in a fixed order:
//   D_i = dO_i . O_i                      (= sum_j P_ij dP_ij, dropout included)
//   p_ij = exp(s_ij - lse_i)              (in the forward: p_ij = exp(s_ij - m_i) / l_i)
//   f_ij = dropout factor (0 or 1/(1-dropout_p), 1 without dropout)
//   dV_j += p_ij f_ij dO_i                (forward: out_i = sum_j p_ij f_ij v_j)
//   dP_ij = f_ij dO_i . v_j;  dS_ij = p_ij (dP_ij - D_i)
//   dQ_i += scale dS_ij c_ij k_j;  dK_j += scale dS_ij c_ij q_i
//   with c_ij = d cap / dx = 1 - tanh^2(x / softcap) under softcap (1 without)
namespace {

// dq, dk, dv = 0: the gradients are accumulated into them (the caller's buffers are not zeroed).
template <class T>
void zero_gradients(const AttentionBackwardParams<T>& p) {
  for (std::int64_t b = 0; b < p.B; ++b) {
    for (std::int64_t head = 0; head < p.h; ++head)
      for (std::int64_t i = 0; i < p.L; ++i)
        for (std::int64_t c = 0; c < p.d_k; ++c) p.dq(b, head, i, c) = 0;
    for (std::int64_t kv = 0; kv < p.h_kv; ++kv)
      for (std::int64_t j = 0; j < p.S; ++j) {
        for (std::int64_t c = 0; c < p.d_k; ++c) p.dk(b, kv, j, c) = 0;
        for (std::int64_t c = 0; c < p.d_v; ++c) p.dv(b, kv, j, c) = 0;
      }
  }
}

}  // namespace

template <class T>
void reference_attention_backward(const AttentionBackwardParams<T>& p) {
  constexpr T kMinusInf = -std::numeric_limits<T>::infinity();
  const SerialIfSmall serial_if_small(4.0 * p.B * p.h * p.L * p.S * (p.d_k + p.d_v));
  zero_gradients(p);
#pragma omp parallel for schedule(static)
  for (std::int64_t b_kv = 0; b_kv < p.B * p.h_kv; ++b_kv) {
    const std::int64_t b = b_kv / p.h_kv, kv = b_kv % p.h_kv;
    for (std::int64_t head = kv * p.group(); head < (kv + 1) * p.group(); ++head) {
      for (std::int64_t i = 0; i < p.L; ++i) {
        const T lse = p.lse_in(b, head, i, 0);
        if (lse == kMinusInf) continue;  // the row attended to nothing: no gradient flows through it
        T D = 0;
        for (std::int64_t c = 0; c < p.d_v; ++c) D += p.dout(b, head, i, c) * p.o(b, head, i, c);
        for (std::int64_t j = 0; j < p.S; ++j) {
          const T added = p.added(b, head, i, j);
          if (!p.allowed(b, head, i, j) || added == kMinusInf) continue;
          T dot = 0;
          for (std::int64_t c = 0; c < p.d_k; ++c) dot += p.q(b, head, i, c) * p.k(b, kv, j, c);
          const T logit = capped(p, dot * p.scale);
          const T prob = std::exp(logit + added - lse);
          const T cap_slope = p.softcap > 0 ? T(1) - (logit / p.softcap) * (logit / p.softcap) : T(1);
          T factor = 1;
          if (p.dropout_p > 0) factor = dropped(p, b, head, i, j) ? T(0) : T(1) / (T(1) - p.dropout_p);
          T dprob = 0;  // dP_ij
          for (std::int64_t c = 0; c < p.d_v; ++c) {
            p.dv(b, kv, j, c) += prob * factor * p.dout(b, head, i, c);
            dprob += p.dout(b, head, i, c) * p.v(b, kv, j, c);
          }
          const T dscore = prob * (factor * dprob - D) * cap_slope * p.scale;  // dS_ij c_ij scale
          for (std::int64_t c = 0; c < p.d_k; ++c) {
            p.dq(b, head, i, c) += dscore * p.k(b, kv, j, c);
            p.dk(b, kv, j, c) += dscore * p.q(b, head, i, c);
          }
        }
      }
    }
  }
}

template void reference_attention_forward<float>(const AttentionParams<float>&);
template void reference_attention_forward<double>(const AttentionParams<double>&);
template void reference_attention_backward<float>(const AttentionBackwardParams<float>&);
template void reference_attention_backward<double>(const AttentionBackwardParams<double>&);

}  // namespace mha::detail
