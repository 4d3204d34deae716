// The reference attention kernel: plain loops over one query row at a time, the row's logits
// materialised, any element type (float, double). Never optimised: it is the specification.
//
// For each (b, head, i):
//   s_j = scale * q_i . k_j + additive_mask_ij     for allowed keys j (see AttentionParams::allowed)
//   m   = max_j s_j;  l = sum_j exp(s_j - m);  p_j = exp(s_j - m) / l;  lse = m + log(l)
//   p_j = dropout(p_j)                             (kept: p_j / (1 - dropout_p), dropped: 0)
//   out_i = sum_j p_j v_j
// A row with no allowed key has out_i = 0, p = 0, lse = -inf. Keys with p_j == 0 are not read.
#include "attention/reference.hpp"

#include <omp.h>

#include <cmath>
#include <limits>
#include <vector>

#include "attention/dropout.hpp"

namespace mha::detail {

template <class T>
void reference_attention_forward(const AttentionParams<T>& p) {
  constexpr T kMinusInf = -std::numeric_limits<T>::infinity();
  const std::int64_t rows = p.B * p.h * p.L;
  // One logits row per thread, allocated once per call.
  std::vector<T> scratch(static_cast<std::size_t>(omp_get_max_threads() * p.S));

#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t b = r / (p.h * p.L), head = (r / p.L) % p.h, i = r % p.L;
    T* s = scratch.data() + omp_get_thread_num() * p.S;  // s: [S], logits then probabilities

    // Logits; forbidden keys get -inf without reading k (it may hold anything).
    T m = kMinusInf;
    for (std::int64_t j = 0; j < p.S; ++j) {
      const T added = p.additive_mask ? p.additive_mask(b, head, i, j) : T(0);
      if (!p.allowed(b, head, i, j) || added == kMinusInf) {
        s[j] = kMinusInf;
        continue;
      }
      T dot = 0;
      for (std::int64_t c = 0; c < p.d_k; ++c) dot += p.q(b, head, i, c) * p.k(b, head, j, c);
      s[j] = dot * p.scale + added;
      if (!(s[j] <= m)) m = s[j];  // a NaN logit becomes the max, so the row turns NaN
    }

    for (std::int64_t c = 0; c < p.d_v; ++c) p.out(b, head, i, c) = 0;
    T* weights = p.weights ? p.weights + r * p.S : nullptr;
    if (m == kMinusInf) {  // no allowed key: attend to nothing
      for (std::int64_t j = 0; j < p.S && weights; ++j) weights[j] = 0;
      if (p.lse) p.lse[r] = kMinusInf;
      continue;
    }

    // Softmax, stable: subtract the row max before exponentiating.
    T sum = 0;
    for (std::int64_t j = 0; j < p.S; ++j) {
      s[j] = s[j] == kMinusInf ? T(0) : std::exp(s[j] - m);
      sum += s[j];
    }
    if (p.lse) p.lse[r] = m + std::log(sum);
    const T keep_scale = T(1) / (T(1) - p.dropout_p);
    for (std::int64_t j = 0; j < p.S; ++j) {
      s[j] /= sum;
      if (p.dropout_p > 0)
        s[j] = dropout_uniform(p.dropout_seed, b, head, i, j) < p.dropout_p ? T(0) : s[j] * keep_scale;
      if (weights) weights[j] = s[j];
    }

    // out_i = sum_j p_j v_j
    for (std::int64_t j = 0; j < p.S; ++j) {
      if (s[j] == 0) continue;
      for (std::int64_t c = 0; c < p.d_v; ++c) p.out(b, head, i, c) += s[j] * p.v(b, head, j, c);
    }
  }
}

template void reference_attention_forward<float>(const AttentionParams<float>&);
template void reference_attention_forward<double>(const AttentionParams<double>&);

}  // namespace mha::detail
