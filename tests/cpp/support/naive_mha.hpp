// The tests' own fp64 oracle for MultiHeadAttention.forward, written from
// include/mha/multi_head_attention.hpp (PyTorch's nn.MultiheadAttention semantics):
//
//   Q = x_q Wq^T + bq, K = x_k Wk^T + bk, V = x_v Wv^T + bv      (y = x W^T + b)
//   K, V get bias_k / bias_v appended as one more position (add_bias_kv), then a zero position
//   (add_zero_attn); masks given over the S input keys allow those extra positions.
//   head i uses columns [i*d_k, (i+1)*d_k) of Q and K and [i*d_v, (i+1)*d_v) of V;
//   out = Concat(heads) Wo^T + bo, or with a head gate g [B, h] Concat(g_1 head_1, ..., g_h head_h) Wo^T + bo;
//   weights (never gated) averaged over heads or kept per head.
//
// Legend: B batch, L queries, S keys (S' = S + extra positions), E = d_model, h heads.
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "support/naive_attention.hpp"
#include "support/test_util.hpp"

namespace mha_test {

struct NaiveMhaWeights {
  std::int64_t E = 0, h = 0, d_k = 0, d_v = 0, kdim = 0, vdim = 0;
  std::vector<double> wq, wk, wv;      // [h*d_k, E], [h*d_k, kdim], [h*d_v, vdim]
  std::vector<double> bq, bk, bv;      // [h*d_k], [h*d_k], [h*d_v]; empty: no bias
  std::vector<double> bias_k, bias_v;  // [h*d_k], [h*d_v]; empty: no add_bias_kv
  std::vector<double> wo, bo;          // [E, h*d_v], [E]; bo empty: no bias
  bool add_zero_attn = false;
};

struct NaiveMhaResult {
  std::vector<double> out;               // [B, L, E]
  std::vector<double> weights_per_head;  // [B, h, L, S']
  std::vector<double> weights_avg;       // [B, L, S']
  std::int64_t S_ext = 0;                // S'
};

// y[n, o] = b[o] + sum_i x[n, i] w[o, i]   (x: [n, in], w: [out, in])
inline std::vector<double> naive_linear(const std::vector<double>& x, std::int64_t n, std::int64_t in,
                                        const std::vector<double>& w, const std::vector<double>& b, std::int64_t out) {
  std::vector<double> y(static_cast<std::size_t>(n * out), 0.0);
  for (std::int64_t r = 0; r < n; ++r)
    for (std::int64_t o = 0; o < out; ++o) {
      double s = b.empty() ? 0.0 : b[static_cast<std::size_t>(o)];
      for (std::int64_t i = 0; i < in; ++i)
        s += x[static_cast<std::size_t>(r * in + i)] * w[static_cast<std::size_t>(o * in + i)];
      y[static_cast<std::size_t>(r * out + o)] = s;
    }
  return y;
}

// query [B, L, E], key [B, S, kdim], value [B, S, vdim] (batch first, C order). `masks` describes the
// masks over the S input keys (its B, h, L, S must be set). head_gate: [B, h], or empty for none.
inline NaiveMhaResult naive_mha(const NaiveMhaWeights& p, const std::vector<double>& query,
                                const std::vector<double>& key, const std::vector<double>& value, std::int64_t B,
                                std::int64_t L, std::int64_t S, const NaiveMaskSpec& masks,
                                const std::vector<double>& head_gate = {}) {
  const std::int64_t h = p.h, d_k = p.d_k, d_v = p.d_v;
  const std::vector<double> Q = naive_linear(query, B * L, p.E, p.wq, p.bq, h * d_k);     // [B, L, h*d_k]
  const std::vector<double> K = naive_linear(key, B * S, p.kdim, p.wk, p.bk, h * d_k);    // [B, S, h*d_k]
  const std::vector<double> V = naive_linear(value, B * S, p.vdim, p.wv, p.bv, h * d_v);  // [B, S, h*d_v]
  const std::int64_t extra = (p.bias_k.empty() ? 0 : 1) + (p.add_zero_attn ? 1 : 0);
  const std::int64_t Sx = S + extra;

  // Split into heads: [B, h, L, d_k], [B, h, S', d_k], [B, h, S', d_v].
  std::vector<double> qh(static_cast<std::size_t>(B * h * L * d_k));
  std::vector<double> kh(static_cast<std::size_t>(B * h * Sx * d_k), 0.0);
  std::vector<double> vh(static_cast<std::size_t>(B * h * Sx * d_v), 0.0);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t hh = 0; hh < h; ++hh) {
      for (std::int64_t i = 0; i < L; ++i)
        for (std::int64_t c = 0; c < d_k; ++c)
          qh[static_cast<std::size_t>(((b * h + hh) * L + i) * d_k + c)] =
              Q[static_cast<std::size_t>((b * L + i) * h * d_k + hh * d_k + c)];
      for (std::int64_t j = 0; j < Sx; ++j) {
        for (std::int64_t c = 0; c < d_k; ++c) {
          double x = 0.0;  // the zero-attention position stays 0
          if (j < S) x = K[static_cast<std::size_t>((b * S + j) * h * d_k + hh * d_k + c)];
          else if (j == S && !p.bias_k.empty()) x = p.bias_k[static_cast<std::size_t>(hh * d_k + c)];
          kh[static_cast<std::size_t>(((b * h + hh) * Sx + j) * d_k + c)] = x;
        }
        for (std::int64_t c = 0; c < d_v; ++c) {
          double x = 0.0;
          if (j < S) x = V[static_cast<std::size_t>((b * S + j) * h * d_v + hh * d_v + c)];
          else if (j == S && !p.bias_v.empty()) x = p.bias_v[static_cast<std::size_t>(hh * d_v + c)];
          vh[static_cast<std::size_t>(((b * h + hh) * Sx + j) * d_v + c)] = x;
        }
      }
    }

  const NaiveResult att = naive_attention(
      qh, kh, vh, B, h, L, Sx, d_k, d_v, 1.0 / std::sqrt(static_cast<double>(d_k)),
      [&](std::int64_t b, std::int64_t hh, std::int64_t i, std::int64_t j) {
        return j >= S || masks.allowed(b, hh, i, j);
      },
      [&](std::int64_t b, std::int64_t hh, std::int64_t i, std::int64_t j) {
        return j >= S ? 0.0 : masks.additive(b, hh, i, j);
      });

  // Concat heads (each times its gate): [B, L, h*d_v], then the output projection.
  std::vector<double> cat(static_cast<std::size_t>(B * L * h * d_v));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t hh = 0; hh < h; ++hh) {
      const double g = head_gate.empty() ? 1.0 : head_gate[static_cast<std::size_t>(b * h + hh)];
      for (std::int64_t i = 0; i < L; ++i)
        for (std::int64_t c = 0; c < d_v; ++c) {
          const double head = att.out[static_cast<std::size_t>(((b * h + hh) * L + i) * d_v + c)];
          cat[static_cast<std::size_t>((b * L + i) * h * d_v + hh * d_v + c)] = head_gate.empty() ? head : g * head;
        }
    }
  NaiveMhaResult r;
  r.S_ext = Sx;
  r.out = naive_linear(cat, B * L, h * d_v, p.wo, p.bo, p.E);
  r.weights_per_head = att.weights;
  r.weights_avg.assign(static_cast<std::size_t>(B * L * Sx), 0.0);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t hh = 0; hh < h; ++hh)
      for (std::int64_t i = 0; i < L; ++i)
        for (std::int64_t j = 0; j < Sx; ++j)
          r.weights_avg[static_cast<std::size_t>((b * L + i) * Sx + j)] +=
              att.weights[static_cast<std::size_t>(((b * h + hh) * L + i) * Sx + j)] / static_cast<double>(h);
  return r;
}

// The parameter names and shapes the header prescribes for a config, in PyTorch's state_dict order,
// computed here from the header's table (not asked of the library).
struct ExpectedParam {
  std::string name;
  Shape shape;
};
inline std::vector<ExpectedParam> expected_parameters(std::int64_t E, std::int64_t h, std::int64_t d_k,
                                                      std::int64_t d_v, std::int64_t kdim, std::int64_t vdim, bool bias,
                                                      bool add_bias_kv) {
  std::vector<ExpectedParam> ps;
  const bool packed = kdim == E && vdim == E && d_k == d_v;
  if (packed) {
    ps.push_back({"in_proj_weight", {2 * h * d_k + h * d_v, E}});
  } else {
    ps.push_back({"q_proj_weight", {h * d_k, E}});
    ps.push_back({"k_proj_weight", {h * d_k, kdim}});
    ps.push_back({"v_proj_weight", {h * d_v, vdim}});
  }
  if (bias) ps.push_back({"in_proj_bias", {2 * h * d_k + h * d_v}});
  if (add_bias_kv) {
    ps.push_back({"bias_k", {1, 1, h * d_k}});
    ps.push_back({"bias_v", {1, 1, h * d_v}});
  }
  ps.push_back({"out_proj.weight", {E, h * d_v}});
  if (bias) ps.push_back({"out_proj.bias", {E}});
  return ps;
}

// Random values for every parameter (biases included, so that they matter), as owned tensors of
// `dtype`, plus the oracle's weights cut from the same numbers by the header's layout.
struct RandomState {
  std::map<std::string, Tensor> tensors;
  NaiveMhaWeights weights;

  std::map<std::string, TensorView> views() const {
    std::map<std::string, TensorView> m;
    for (const auto& [name, t] : tensors) m.emplace(name, t.view());
    return m;
  }
};

inline RandomState random_state(std::int64_t E, std::int64_t h, std::int64_t d_k, std::int64_t d_v, std::int64_t kdim,
                                std::int64_t vdim, bool bias, bool add_bias_kv, bool add_zero_attn, DType dtype,
                                Rng& rng) {
  RandomState s;
  NaiveMhaWeights& w = s.weights;
  w.E = E, w.h = h, w.d_k = d_k, w.d_v = d_v, w.kdim = kdim, w.vdim = vdim;
  w.add_zero_attn = add_zero_attn;
  for (const ExpectedParam& p : expected_parameters(E, h, d_k, d_v, kdim, vdim, bias, add_bias_kv)) {
    const double bound = p.shape.size() == 1 ? 0.5 : 1.0 / std::sqrt(static_cast<double>(p.shape.back()));
    std::vector<double> vals = rounded_to(dtype, random_values(mha::shape_numel(p.shape), rng, -bound, bound));
    s.tensors.emplace(p.name, make_tensor(dtype, p.shape, vals));
    auto slice = [&](std::int64_t row0, std::int64_t rows, std::int64_t cols) {
      return std::vector<double>(vals.begin() + row0 * cols, vals.begin() + (row0 + rows) * cols);
    };
    if (p.name == "in_proj_weight") {
      w.wq = slice(0, h * d_k, E);
      w.wk = slice(h * d_k, h * d_k, E);
      w.wv = slice(2 * h * d_k, h * d_v, E);
    } else if (p.name == "in_proj_bias") {
      w.bq = slice(0, h * d_k, 1);
      w.bk = slice(h * d_k, h * d_k, 1);
      w.bv = slice(2 * h * d_k, h * d_v, 1);
    } else if (p.name == "q_proj_weight") {
      w.wq = vals;
    } else if (p.name == "k_proj_weight") {
      w.wk = vals;
    } else if (p.name == "v_proj_weight") {
      w.wv = vals;
    } else if (p.name == "bias_k") {
      w.bias_k = vals;
    } else if (p.name == "bias_v") {
      w.bias_v = vals;
    } else if (p.name == "out_proj.weight") {
      w.wo = vals;
    } else if (p.name == "out_proj.bias") {
      w.bo = vals;
    }
  }
  return s;
}

}  // namespace mha_test
