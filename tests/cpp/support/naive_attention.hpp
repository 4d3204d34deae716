// The tests' own oracle for scaled dot-product attention: plain fp64 loops, written from the rules in
// include/mha/attention.hpp and sharing no code with the library.
//
//     out = softmax(q k^T * scale + additive mask, over allowed keys) v
//
// Legend: B batch, h heads, L queries, S keys, d_k query/key width, d_v value width.
// Every tensor here is a std::vector<double> in C order.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "support/test_util.hpp"

namespace mha_test {

// The masks of one attention call as plain host data, and the header's rules for them:
//   a boolean `1` forbids a position; a float mask is added to the logit (-inf forbids);
//   key padding / lengths forbid whole key columns of a batch;
//   causal is bottom-right aligned: query i may see key j only when j <= i + S - L;
//   a position is allowed only if every mask allows it.
struct NaiveMaskSpec {
  std::int64_t B = 0, h = 0, L = 0, S = 0;
  bool causal = false;
  std::vector<std::uint8_t> key_padding;  // [B, S], 1 = padding; empty: none
  std::vector<std::int64_t> key_lengths;  // [B]; empty: none
  std::vector<std::uint8_t> bool_mask;    // [L, S] or [B*h, L, S] (bool_mask_batched); 1 = forbidden
  bool bool_mask_batched = false;
  std::vector<double> float_mask;  // [L, S] or [B*h, L, S] (float_mask_batched); added
  bool float_mask_batched = false;
  // A sliding window around each query's position p = i + S - L: keys p - window_left .. p +
  // window_right (-1: unbounded on that side).
  std::int64_t window_left = -1, window_right = -1;
  std::vector<double> alibi_slopes;  // [h] or empty: -slope * |p - j| added to every logit
  double softcap = 0.0;              // > 0: each scaled logit x becomes softcap tanh(x / softcap), first

  bool allowed(std::int64_t b, std::int64_t hh, std::int64_t i, std::int64_t j) const {
    if (!key_padding.empty() && key_padding[static_cast<std::size_t>(b * S + j)] != 0) return false;
    if (!key_lengths.empty() && j >= key_lengths[static_cast<std::size_t>(b)]) return false;
    if (causal && j > i + S - L) return false;
    const std::int64_t position = i + S - L;
    if (window_left >= 0 && position - j > window_left) return false;
    if (window_right >= 0 && j - position > window_right) return false;
    if (!bool_mask.empty() && bool_mask[mask_index(bool_mask_batched, b, hh, i, j)] != 0) return false;
    return true;
  }
  double additive(std::int64_t b, std::int64_t hh, std::int64_t i, std::int64_t j) const {
    double sum = 0.0;
    if (!alibi_slopes.empty())
      sum -= alibi_slopes[static_cast<std::size_t>(hh)] * std::fabs(static_cast<double>(i + S - L - j));
    if (!float_mask.empty()) sum += float_mask[mask_index(float_mask_batched, b, hh, i, j)];
    return sum;
  }

 private:
  std::size_t mask_index(bool batched, std::int64_t b, std::int64_t hh, std::int64_t i, std::int64_t j) const {
    const std::int64_t plane = batched ? (b * h + hh) : 0;
    return static_cast<std::size_t>((plane * L + i) * S + j);
  }
};

struct NaiveResult {
  std::vector<double> out;      // [B, h, L, d_v]
  std::vector<double> weights;  // [B, h, L, S]
  std::vector<double> lse;      // [B, h, L]
};

using AllowedFn = std::function<bool(std::int64_t, std::int64_t, std::int64_t, std::int64_t)>;
using AdditiveFn = std::function<double(std::int64_t, std::int64_t, std::int64_t, std::int64_t)>;

// q: [B, h, L, d_k], k: [B, h, S, d_k], v: [B, h, S, d_v]. A row with no allowed key (or whose
// allowed logits are all -inf) gets out 0, weights 0, lse -inf. Softmax subtracts the row maximum,
// so logits of any finite size are fine.
inline NaiveResult naive_attention(const std::vector<double>& q, const std::vector<double>& k,
                                   const std::vector<double>& v, std::int64_t B, std::int64_t h, std::int64_t L,
                                   std::int64_t S, std::int64_t d_k, std::int64_t d_v, double scale,
                                   const AllowedFn& allowed, const AdditiveFn& additive, double softcap = 0.0) {
  NaiveResult r;
  r.out.assign(static_cast<std::size_t>(B * h * L * d_v), 0.0);
  r.weights.assign(static_cast<std::size_t>(B * h * L * S), 0.0);
  r.lse.assign(static_cast<std::size_t>(B * h * L), -kInf);
  std::vector<double> logit(static_cast<std::size_t>(S));
  std::vector<bool> use(static_cast<std::size_t>(S));
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t hh = 0; hh < h; ++hh) {
      const std::int64_t bh = b * h + hh;
      for (std::int64_t i = 0; i < L; ++i) {
        double m = -kInf;
        for (std::int64_t j = 0; j < S; ++j) {
          const auto js = static_cast<std::size_t>(j);
          use[js] = allowed(b, hh, i, j);
          if (!use[js]) continue;
          double dot = 0.0;
          for (std::int64_t c = 0; c < d_k; ++c)
            dot += q[static_cast<std::size_t>((bh * L + i) * d_k + c)] *
                   k[static_cast<std::size_t>((bh * S + j) * d_k + c)];
          const double x = dot * scale;
          logit[js] = (softcap > 0 ? softcap * std::tanh(x / softcap) : x) + additive(b, hh, i, j);
          if (logit[js] == -kInf) use[js] = false;
          else m = std::max(m, logit[js]);
        }
        if (m == -kInf) continue;  // fully masked row: zeros and lse = -inf, already set
        double sum = 0.0;
        for (std::int64_t j = 0; j < S; ++j)
          if (use[static_cast<std::size_t>(j)]) sum += std::exp(logit[static_cast<std::size_t>(j)] - m);
        r.lse[static_cast<std::size_t>(bh * L + i)] = m + std::log(sum);
        for (std::int64_t j = 0; j < S; ++j) {
          if (!use[static_cast<std::size_t>(j)]) continue;
          const double w = std::exp(logit[static_cast<std::size_t>(j)] - m) / sum;
          r.weights[static_cast<std::size_t>((bh * L + i) * S + j)] = w;
          for (std::int64_t c = 0; c < d_v; ++c)
            r.out[static_cast<std::size_t>((bh * L + i) * d_v + c)] +=
                w * v[static_cast<std::size_t>((bh * S + j) * d_v + c)];
        }
      }
    }
  }
  return r;
}

inline NaiveResult naive_attention(const std::vector<double>& q, const std::vector<double>& k,
                                   const std::vector<double>& v, std::int64_t d_k, std::int64_t d_v, double scale,
                                   const NaiveMaskSpec& masks) {
  return naive_attention(
      q, k, v, masks.B, masks.h, masks.L, masks.S, d_k, d_v, scale,
      [&](std::int64_t b, std::int64_t hh, std::int64_t i, std::int64_t j) { return masks.allowed(b, hh, i, j); },
      [&](std::int64_t b, std::int64_t hh, std::int64_t i, std::int64_t j) { return masks.additive(b, hh, i, j); },
      masks.softcap);
}

// The library-side form of a NaiveMaskSpec: AttentionOptions whose views point into tensors kept in
// `storage` (a Tensor's heap buffer does not move when the Tensor object does). At most one of
// bool_mask / float_mask may be set; the float mask is stored as `float_dtype`.
inline mha::AttentionOptions options_for(const NaiveMaskSpec& m, DType float_dtype, std::vector<Tensor>& storage) {
  mha::AttentionOptions o;
  o.causal = m.causal;
  o.key_lengths = m.key_lengths;
  if (!m.key_padding.empty()) {
    std::vector<double> kp(m.key_padding.begin(), m.key_padding.end());
    storage.push_back(make_tensor(DType::Bool, {m.B, m.S}, kp));
    o.key_padding_mask = storage.back().view();
  }
  EXPECT_FALSE(!m.bool_mask.empty() && !m.float_mask.empty()) << "one attn_mask per call";
  if (!m.bool_mask.empty()) {
    std::vector<double> bm(m.bool_mask.begin(), m.bool_mask.end());
    const Shape shape = m.bool_mask_batched ? Shape{m.B * m.h, m.L, m.S} : Shape{m.L, m.S};
    storage.push_back(make_tensor(DType::Bool, shape, bm));
    o.attn_mask = storage.back().view();
  }
  if (!m.float_mask.empty()) {
    const Shape shape = m.float_mask_batched ? Shape{m.B * m.h, m.L, m.S} : Shape{m.L, m.S};
    storage.push_back(make_tensor(float_dtype, shape, m.float_mask));
    o.attn_mask = storage.back().view();
  }
  o.window_left = m.window_left, o.window_right = m.window_right;
  o.softcap = m.softcap;
  if (!m.alibi_slopes.empty()) {  // float32 or float64 only
    storage.push_back(
        make_tensor(float_dtype == DType::Float64 ? DType::Float64 : DType::Float32, {m.h}, m.alibi_slopes));
    o.alibi_slopes = storage.back().view();
  }
  return o;
}

}  // namespace mha_test
