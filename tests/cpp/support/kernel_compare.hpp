// Comparing the fused kernel (Kernel::Flash, float32) with the reference kernel, FlashAttention's way:
// the error of the fused kernel in float32 against the reference run in float64 on the same numbers
// must be at most `factor` times the error of the reference kernel itself run in float32, plus 1e-6
// (factor 2 for forward results, 3 for gradients). Masked positions and rows with no allowed key must
// match exactly (weights 0, output 0, lse -inf, gradients 0).
//
// Legend: B batch, h heads, L queries, S keys, d_k query/key width, d_v value width.
// Everything host-side is a std::vector<double> in C order.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "attention/flash_config.hpp"
#include "support/naive_attention.hpp"
#include "support/test_util.hpp"

namespace mha_test {

// The fused kernel's block sizes, for sizes on and next to its block boundaries.
using mha::detail::flash::kBlockK;
using mha::detail::flash::kBlockQShort;
using mha::detail::flash::kBlockQTall;
using mha::detail::flash::kRowAlign;

// The suite runs again in an ASan + UBSan Debug build; there it runs a small subset.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_UNDEFINED__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif

// The rule's absolute slack, for results whose float32 reference error is (close to) zero.
inline constexpr double kRuleSlack = 1e-6;

// ---- configurations ------------------------------------------------------------------------------

enum CompareMask : unsigned {
  kCmpKeyPadding = 1u << 0,  // bool key_padding_mask [B, S]
  kCmpLengths = 1u << 1,     // key_lengths [B]
  kCmpBool2d = 1u << 2,      // bool attn_mask [L, S]
  kCmpBool3d = 1u << 3,      // bool attn_mask [B*h, L, S]
  kCmpFloat2d = 1u << 4,     // additive attn_mask [L, S], some -inf
  kCmpFloat3d = 1u << 5,     // additive attn_mask [B*h, L, S], some -inf
};

// Every mask kind alone, and combinations (at most one attn_mask per call); causal is drawn apart.
inline constexpr unsigned kMaskCombos[] = {
    0u,
    kCmpKeyPadding,
    kCmpLengths,
    kCmpBool2d,
    kCmpBool3d,
    kCmpFloat2d,
    kCmpFloat3d,
    kCmpKeyPadding | kCmpFloat2d,
    kCmpLengths | kCmpBool3d,
    kCmpKeyPadding | kCmpLengths | kCmpBool2d,
    kCmpLengths | kCmpFloat3d,
    kCmpKeyPadding | kCmpBool3d,
    kCmpKeyPadding | kCmpLengths | kCmpFloat2d,
};

// How q, k, v (and dout) are laid out in memory.
enum class Layout {
  Contiguous,   // [B, h, T, d]
  Interleaved,  // [B, T, h, d] viewed as [B, h, T, d], as MultiHeadAttention's projections are
  PaddedRows,   // [B, h, T, d + pad]: every row starts at an odd offset
};

struct KernelCase {
  int index = 0;
  std::uint64_t seed = 0;
  std::int64_t B = 1, h = 1, L = 1, S = 1, d_k = 1, d_v = 1;
  std::int64_t h_kv = 0;                             // key/value heads (grouped-query attention: a divisor of h); 0: h
  std::int64_t window_left = -1, window_right = -1;  // a sliding window; -1: unbounded
  bool alibi = false;                                // ALiBi slopes drawn per head
  double softcap = 0.0;                              // logit soft-capping; 0: none
  unsigned masks = 0;
  bool causal = false;
  bool need_weights = false;
  double dropout_p = 0.0;
  double scale = 0.0;      // 0: the default 1 / sqrt(d_k)
  double amplitude = 1.0;  // q, k, v uniform in [-amplitude, amplitude]
  Layout layout = Layout::Contiguous;

  // The cost of one run in multiply-adds, roughly: every score costs its two dot products plus a
  // constant (mask, exp, dropout hash); every row its load and store.
  static std::int64_t work_per_head(std::int64_t L, std::int64_t S, std::int64_t d_k, std::int64_t d_v) {
    return L * S * (d_k + d_v + 16) + (L + S) * (d_k + d_v);
  }
  std::int64_t work() const { return B * h * work_per_head(L, S, d_k, d_v); }
  std::int64_t kv_heads() const { return h_kv > 0 ? h_kv : h; }
  std::int64_t group() const { return h / kv_heads(); }  // query heads per key/value head
};

inline std::string case_name(const KernelCase& c) {
  std::ostringstream s;
  s << "c" << c.index << "_B" << c.B << "_h" << c.h;
  if (c.kv_heads() != c.h) s << "_hkv" << c.kv_heads();
  if (c.window_left >= 0 || c.window_right >= 0)
    s << "_win" << (c.window_left < 0 ? std::string("inf") : std::to_string(c.window_left)) << "x"
      << (c.window_right < 0 ? std::string("inf") : std::to_string(c.window_right));
  if (c.alibi) s << "_alibi";
  if (c.softcap > 0) s << "_softcap" << static_cast<int>(c.softcap * 10);
  s << "_L" << c.L << "_S" << c.S << "_dk" << c.d_k << "_dv" << c.d_v;
  if (c.masks == 0) s << "_nomask";
  if (c.masks & kCmpKeyPadding) s << "_kpm";
  if (c.masks & kCmpLengths) s << "_lengths";
  if (c.masks & kCmpBool2d) s << "_bool2d";
  if (c.masks & kCmpBool3d) s << "_bool3d";
  if (c.masks & kCmpFloat2d) s << "_float2d";
  if (c.masks & kCmpFloat3d) s << "_float3d";
  if (c.causal) s << "_causal";
  if (c.need_weights) s << "_weights";
  if (c.dropout_p > 0) s << "_drop" << static_cast<int>(c.dropout_p * 100);
  if (c.scale > 0) s << "_scale";
  if (c.layout == Layout::Interleaved) s << "_interleaved";
  if (c.layout == Layout::PaddedRows) s << "_paddedrows";
  s << "_amp" << static_cast<int>(c.amplitude * 10);
  return s.str();
}

inline void PrintTo(const KernelCase& c, std::ostream* os) { *os << case_name(c); }

// Sizes that sit on and next to the fused kernel's block boundaries (src/attention/flash_config.hpp:
// 128 query rows where the L2 is small and 256 = kBlockK where it is large (query_block.hpp), kBlockK keys, rows
// aligned to kRowAlign floats), in and past a half-full short query
// block, and the ends of the sweeps' range (1..300). random_kernel_cases() draws those up to its max_dim.
inline constexpr std::int64_t kBoundarySizes[] = {1,
                                                  2,
                                                  kRowAlign - 1,
                                                  kRowAlign,
                                                  kRowAlign + 1,
                                                  kBlockQShort / 2 - 1,
                                                  kBlockQShort / 2,
                                                  kBlockQShort / 2 + 1,
                                                  kBlockQShort - 1,
                                                  kBlockQShort,
                                                  kBlockQShort + 1,
                                                  kBlockQShort + kBlockQShort / 2 - 1,
                                                  kBlockQShort + kBlockQShort / 2,
                                                  kBlockK - 1,
                                                  kBlockK,
                                                  kBlockK + 1,
                                                  299,
                                                  300};
inline constexpr std::int64_t kHeadDims[] = {1, 5, 16, 32, 59, 64, 80, 96, 111, 128, 256};

// Key/value heads for a case with h query heads (grouped-query attention), from a generator of its
// own so that the other draws stay as they were: h for half the cases, otherwise 1 (multi-query), 2 or
// another divisor of h, so that groups of 1..h query heads share a key/value head.
inline std::int64_t grouped_kv_heads(std::int64_t h, std::uint64_t seed) {
  Rng rng(seed ^ 0x67716b76ULL);
  if (h == 1 || rng.bernoulli(0.5)) return h;
  std::vector<std::int64_t> divisors;
  for (std::int64_t n = 1; n < h; ++n)
    if (h % n == 0) divisors.push_back(n);
  const std::int64_t pick = rng.integer(0, 2);
  if (pick == 0 || divisors.size() == 1) return 1;
  if (pick == 1 && h % 2 == 0) return 2;
  return divisors[static_cast<std::size_t>(rng.integer(0, static_cast<std::int64_t>(divisors.size()) - 1))];
}

// A sliding window for a fifth of the cases (each side unbounded, 0, narrower than a tile, or wider than
// the sequence), ALiBi for a fifth and logit soft-capping for a fifth, from a generator of their own so that the other
// draws stay as they were.
inline void draw_variants(KernelCase& c) {
  Rng rng(c.seed ^ 0x77696e64ULL);
  if (rng.bernoulli(0.2)) {
    const std::int64_t extents[] = {-1, 0, 1, 5, 37, c.S / 2, c.L + c.S};
    do {
      c.window_left = extents[rng.integer(0, 6)];
      c.window_right = extents[rng.integer(0, 6)];
    } while (c.window_left < 0 && c.window_right < 0);
  }
  c.alibi = rng.bernoulli(0.2);
  const double caps[] = {0.5, 5.0, 30.0};  // below, near and above the logits' size
  if (rng.bernoulli(0.2)) c.softcap = caps[rng.integer(0, 2)];
}

// `count` seeded configurations: B, h, L, S in [1, max_dim], head dims from kHeadDims, every mask
// combination in turn, key/value heads from grouped_kv_heads, and work() <= max_work.
inline std::vector<KernelCase> random_kernel_cases(int count, std::uint64_t base_seed, std::int64_t max_dim,
                                                   std::int64_t max_work) {
  std::vector<KernelCase> cases;
  Rng rng(base_seed);
  auto pick_size = [&] {
    if (rng.bernoulli(0.5)) {
      std::vector<std::int64_t> fit;
      for (std::int64_t n : kBoundarySizes)
        if (n <= max_dim) fit.push_back(n);
      return fit[static_cast<std::size_t>(rng.integer(0, static_cast<std::int64_t>(fit.size()) - 1))];
    }
    return rng.integer(1, max_dim);
  };
  auto pick_dim = [&] {
    return kHeadDims[static_cast<std::size_t>(rng.integer(0, static_cast<std::int64_t>(std::size(kHeadDims)) - 1))];
  };
  // Log-uniform in [1, hi], so small counts dominate but large ones occur.
  auto pick_count = [&](std::int64_t hi) {
    const double x = std::exp(rng.uniform(0.0, std::log(static_cast<double>(hi) + 1.0)));
    return std::clamp<std::int64_t>(static_cast<std::int64_t>(x), 1, hi);
  };
  for (int i = 0; i < count; ++i) {
    KernelCase c;
    c.index = i;
    c.seed = base_seed * 1000003u + static_cast<std::uint64_t>(i);
    for (;;) {
      c.L = pick_size();
      c.S = rng.bernoulli(0.15) ? c.L : pick_size();  // mostly cross-attention shapes, L != S
      c.d_k = pick_dim();
      c.d_v = rng.bernoulli(0.25) ? c.d_k : pick_dim();
      if (KernelCase::work_per_head(c.L, c.S, c.d_k, c.d_v) <= max_work) break;
    }
    const std::int64_t per_head = KernelCase::work_per_head(c.L, c.S, c.d_k, c.d_v);
    c.B = pick_count(std::min<std::int64_t>(max_dim, max_work / per_head));
    c.h = pick_count(std::min<std::int64_t>(max_dim, max_work / (per_head * c.B)));
    c.masks = kMaskCombos[static_cast<std::size_t>(i) % std::size(kMaskCombos)];
    c.causal = rng.bernoulli(0.4);
    c.need_weights = rng.bernoulli(0.5) && c.B * c.h * c.L * c.S <= 2'000'000;
    c.dropout_p = rng.bernoulli(0.2) ? (rng.bernoulli(0.5) ? 0.1 : 0.5) : 0.0;
    c.scale = rng.bernoulli(0.1) ? 0.375 : 0.0;
    const double amplitudes[] = {0.5, 1.0, 2.0, 3.0};
    c.amplitude = amplitudes[rng.integer(0, 3)];
    const std::int64_t layout = rng.integer(0, 5);
    c.layout = layout == 4 ? Layout::Interleaved : layout == 5 ? Layout::PaddedRows : Layout::Contiguous;
    c.h_kv = grouped_kv_heads(c.h, c.seed);
    draw_variants(c);
    cases.push_back(c);
  }
  return cases;
}

// ---- inputs ----------------------------------------------------------------------------------------

// A [B, h, T, d] operand in one of the layouts; `view` reads `storage` through strides.
struct Operand {
  Tensor storage;
  TensorView view;
};

inline Operand make_operand(const std::vector<double>& values, DType dtype, std::int64_t B, std::int64_t h,
                            std::int64_t T, std::int64_t d, Layout layout) {
  Shape strides;
  std::int64_t total = 0;
  switch (layout) {
    case Layout::Contiguous:
      strides = {h * T * d, T * d, d, 1};
      total = B * h * T * d;
      break;
    case Layout::Interleaved:
      strides = {T * h * d, d, h * d, 1};
      total = B * h * T * d;
      break;
    case Layout::PaddedRows: {
      const std::int64_t ld = d + 3;
      strides = {h * T * ld, T * ld, ld, 1};
      total = B * h * T * ld;
      break;
    }
  }
  Operand o;
  o.storage = Tensor(dtype, {std::max<std::int64_t>(total, 1)});
  for (std::int64_t i = 0; i < total; ++i) store(o.storage.data(), dtype, i, kNaN);  // gaps hold NaN
  std::int64_t flat = 0;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t hh = 0; hh < h; ++hh)
      for (std::int64_t t = 0; t < T; ++t)
        for (std::int64_t c = 0; c < d; ++c, ++flat)
          store(o.storage.data(), dtype, b * strides[0] + hh * strides[1] + t * strides[2] + c,
                values[static_cast<std::size_t>(flat)]);
  o.view = TensorView(o.storage.data(), dtype, {B, h, T, d}, strides);
  return o;
}

// The numbers of one case (all float32-representable, so float32 and float64 runs see the same values)
// and its masks.
struct CaseData {
  std::vector<double> q, k, v, dout;  // [B, h, L, d_k], [B, h_kv, S, d_k], [B, h_kv, S, d_v], [B, h, L, d_v]
  NaiveMaskSpec masks;
};

inline CaseData make_case_data(const KernelCase& c) {
  Rng rng(c.seed);
  CaseData d;
  const double a = c.amplitude;
  d.q = rounded_to(DType::Float32, random_values(c.B * c.h * c.L * c.d_k, rng, -a, a));
  d.k = rounded_to(DType::Float32, random_values(c.B * c.kv_heads() * c.S * c.d_k, rng, -a, a));
  d.v = rounded_to(DType::Float32, random_values(c.B * c.kv_heads() * c.S * c.d_v, rng, -a, a));
  d.dout = rounded_to(DType::Float32, random_values(c.B * c.h * c.L * c.d_v, rng));
  NaiveMaskSpec& m = d.masks;
  m.B = c.B, m.h = c.h, m.L = c.L, m.S = c.S;
  m.causal = c.causal;
  m.window_left = c.window_left, m.window_right = c.window_right;
  m.softcap = c.softcap;
  if (c.alibi) {  // slopes from a generator of their own (the other draws stay as they were)
    Rng slopes(c.seed ^ 0x616c6962ULL);
    m.alibi_slopes = rounded_to(DType::Float32, random_values(c.h, slopes, 0.01, 1.0));
  }
  if (c.masks & kCmpKeyPadding) {
    for (std::int64_t b = 0; b < c.B; ++b) {
      const bool all = rng.bernoulli(0.15);  // a batch whose keys are all padding
      const double density = rng.uniform(0.0, 0.6);
      for (std::int64_t j = 0; j < c.S; ++j) m.key_padding.push_back(all || rng.bernoulli(density));
    }
  }
  if (c.masks & kCmpLengths) {
    for (std::int64_t b = 0; b < c.B; ++b) {
      const double u = rng.uniform(0.0, 1.0);
      m.key_lengths.push_back(u < 0.15 ? 0 : u < 0.3 ? c.S : rng.integer(0, c.S));
    }
  }
  if (c.masks & (kCmpBool2d | kCmpBool3d)) {
    m.bool_mask_batched = (c.masks & kCmpBool3d) != 0;
    const std::int64_t rows = (m.bool_mask_batched ? c.B * c.h : 1) * c.L;
    const double density = rng.uniform(0.0, 0.7);
    for (std::int64_t r = 0; r < rows; ++r) {
      const bool all = rng.bernoulli(0.1);  // a row that may attend to nothing
      for (std::int64_t j = 0; j < c.S; ++j) m.bool_mask.push_back(all || rng.bernoulli(density));
    }
  }
  if (c.masks & (kCmpFloat2d | kCmpFloat3d)) {
    m.float_mask_batched = (c.masks & kCmpFloat3d) != 0;
    const std::int64_t rows = (m.float_mask_batched ? c.B * c.h : 1) * c.L;
    for (std::int64_t r = 0; r < rows; ++r) {
      const bool all = rng.bernoulli(0.05);
      for (std::int64_t j = 0; j < c.S; ++j)
        m.float_mask.push_back(all || rng.bernoulli(0.2) ? -kInf : rng.uniform(-3.0, 3.0));
    }
    m.float_mask = rounded_to(DType::Float32, m.float_mask);
  }
  return d;
}

// One dtype's tensors of a case, with options pointing into `mask_storage`.
struct CaseTensors {
  Operand q, k, v, dout;
  std::vector<Tensor> mask_storage;
  mha::AttentionOptions options;
};

inline CaseTensors make_case_tensors(const KernelCase& c, const CaseData& d, DType dtype) {
  CaseTensors t;
  t.q = make_operand(d.q, dtype, c.B, c.h, c.L, c.d_k, c.layout);
  t.k = make_operand(d.k, dtype, c.B, c.kv_heads(), c.S, c.d_k, c.layout);
  t.v = make_operand(d.v, dtype, c.B, c.kv_heads(), c.S, c.d_v, c.layout);
  t.dout = make_operand(d.dout, dtype, c.B, c.h, c.L, c.d_v, c.layout);
  t.options = options_for(d.masks, dtype, t.mask_storage);
  if (c.scale > 0) t.options.scale = c.scale;
  t.options.dropout_p = c.dropout_p;
  t.options.dropout_seed = c.seed ^ 0x5eedULL;
  return t;
}

// ---- running the kernels ---------------------------------------------------------------------------

struct KernelRun {
  std::vector<double> out, weights, lse;  // [B, h, L, d_v], [B, h, L, S] (when asked), [B, h, L]
  std::vector<double> dq, dk, dv;         // when the backward ran
};

// The forward (need_lse always, weights as the case says) and, when `backward`, the backward from the
// forward's own out and lse, in `dtype` with `kernel`.
inline KernelRun run_kernel(const KernelCase& c, const CaseData& d, DType dtype, mha::Kernel kernel, bool backward) {
  CaseTensors t = make_case_tensors(c, d, dtype);
  t.options.kernel = kernel;
  t.options.need_lse = true;
  t.options.need_weights = c.need_weights;
  const mha::AttentionResult r = mha::scaled_dot_product_attention(t.q.view, t.k.view, t.v.view, t.options);
  KernelRun run;
  EXPECT_EQ(r.out.shape(), (Shape{c.B, c.h, c.L, c.d_v}));
  EXPECT_EQ(r.lse.shape(), (Shape{c.B, c.h, c.L}));
  run.out = to_doubles(r.out);
  run.lse = to_doubles(r.lse);
  if (c.need_weights) {
    EXPECT_EQ(r.weights.shape(), (Shape{c.B, c.h, c.L, c.S}));
    run.weights = to_doubles(r.weights);
  }
  if (backward) {
    const mha::AttentionGradients g =
        mha::scaled_dot_product_attention_backward(t.dout.view, t.q.view, t.k.view, t.v.view, r.out, r.lse, t.options);
    EXPECT_EQ(g.dq.shape(), (Shape{c.B, c.h, c.L, c.d_k}));
    EXPECT_EQ(g.dk.shape(), (Shape{c.B, c.kv_heads(), c.S, c.d_k}));
    EXPECT_EQ(g.dv.shape(), (Shape{c.B, c.kv_heads(), c.S, c.d_v}));
    run.dq = to_doubles(g.dq);
    run.dk = to_doubles(g.dk);
    run.dv = to_doubles(g.dv);
  }
  return run;
}

// ---- the rule --------------------------------------------------------------------------------------

// The largest |got - want| over elements where `want` is finite, and where it happens; an infinity
// in `want` must be matched exactly and a non-finite `got` where `want` is finite counts as infinite.
struct MaxError {
  double value = 0.0;
  std::int64_t at = -1;
};

inline MaxError max_abs_error(const std::vector<double>& got, const std::vector<double>& want) {
  MaxError e;
  if (got.size() != want.size()) return {kInf, -1};
  for (std::size_t i = 0; i < got.size(); ++i) {
    double err;
    if (std::isinf(want[i])) err = got[i] == want[i] ? 0.0 : kInf;
    else if (std::isnan(want[i])) err = std::isnan(got[i]) ? 0.0 : kInf;
    else err = std::isfinite(got[i]) ? std::fabs(got[i] - want[i]) : kInf;
    if (err > e.value) e = {err, static_cast<std::int64_t>(i)};
  }
  return e;
}

// The largest |x| over the finite entries (0 when none): the scale of a result, for absolute terms.
inline double max_abs_finite(const std::vector<double>& x) {
  double m = 0;
  for (double e : x)
    if (std::isfinite(e)) m = std::max(m, std::fabs(e));
  return m;
}

// error(fused, fp64 reference) <= factor * error(fp32 reference, fp64 reference) + slack
// (kRuleSlack unless the caller states a larger, derived one).
inline ::testing::AssertionResult within_rule(const char* what, const std::vector<double>& fused,
                                              const std::vector<double>& ref32, const std::vector<double>& ref64,
                                              double factor, const Shape& shape, double slack = kRuleSlack) {
  const MaxError e_fused = max_abs_error(fused, ref64);
  const MaxError e_ref = max_abs_error(ref32, ref64);
  auto where = [&](const MaxError& e) {
    if (e.at < 0) return std::string("-");
    const auto i = static_cast<std::size_t>(e.at);
    std::ostringstream s;
    s << (shape.empty() ? "element " + std::to_string(e.at) : index_str(shape, e.at)) << " (fused " << fused[i]
      << ", ref32 " << ref32[i] << ", ref64 " << ref64[i] << ")";
    return s.str();
  };
  if (!std::isfinite(e_ref.value))
    return ::testing::AssertionFailure() << what << ": the float32 reference itself disagrees with the float64 "
                                         << "reference on a non-finite value at " << where(e_ref);
  const double bound = factor * e_ref.value + slack;
  if (e_fused.value <= bound) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": fused error " << e_fused.value << " at " << where(e_fused) << " > "
                                       << factor << " x reference float32 error " << e_ref.value << " + " << slack
                                       << " = " << bound << " (reference's worst at " << where(e_ref) << ")";
}

// The gradient rule's slack for the cancellation in dS = P (dP - D). The backward's D = rowsum(dO * O)
// (FlashAttention-2's formulation, as specified) and dP = dO V^T are two d_v-term sums of the same
// magnitude computed in different orders (a scalar loop against a GEMM), so dP - D carries rounding of
// order sqrt(d_v) * eps32 * max|dO| * max|V| (a random walk of d_v roundings; the worst case is d_v)
// even where it is exactly 0 in exact arithmetic (with one key,
// dq and dk are exactly 0 and the reference, whose two sums share their order, gets 0 exactly).
// That error reaches dq through scale * sum_j P_ij |k_j| (sum_j P_ij <= 1) and dk through
// scale * sum_i P_ij |q_i| (sum_i P_ij <= L), both scaled by the dropout factor.
inline double cancellation_slack(const KernelCase& c, const CaseData& d, bool for_dk) {
  auto max_abs = [](const std::vector<double>& x) {
    double m = 0;
    for (double e : x) m = std::max(m, std::fabs(e));
    return m;
  };
  const double scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(static_cast<double>(c.d_k));
  const double eps32 = 0x1.0p-23;
  const double dp_error =
      std::sqrt(static_cast<double>(c.d_v)) * eps32 * max_abs(d.dout) * max_abs(d.v) / (1.0 - c.dropout_p);
  const double fan = for_dk ? static_cast<double>(c.L) * max_abs(d.q) : max_abs(d.k);
  return kRuleSlack + 4.0 * dp_error * scale * fan;  // 4: headroom over the typical random walk
}

// Whether query row (b, hh, i) may attend to any key, by the masks alone.
inline bool row_has_keys(const NaiveMaskSpec& m, std::int64_t b, std::int64_t hh, std::int64_t i) {
  for (std::int64_t j = 0; j < m.S; ++j)
    if (m.allowed(b, hh, i, j) && m.additive(b, hh, i, j) != -kInf) return true;
  return false;
}

inline bool position_allowed(const NaiveMaskSpec& m, std::int64_t b, std::int64_t hh, std::int64_t i, std::int64_t j) {
  return m.allowed(b, hh, i, j) && m.additive(b, hh, i, j) != -kInf;
}

// The exact parts of the contract: rows with no allowed key have out 0, lse -inf and weights 0 (and
// dq 0 when gradients ran); forbidden positions have weight 0; keys no query of their group may see
// have dk = dv = 0.
inline ::testing::AssertionResult masked_parts_exact(const KernelCase& c, const NaiveMaskSpec& m, const KernelRun& r) {
  std::ostringstream bad;
  int failures = 0;
  auto fail = [&](const std::string& msg) {
    if (failures++ < 5) bad << "\n  " << msg;
  };
  std::vector<std::uint8_t> key_seen(static_cast<std::size_t>(c.B * c.kv_heads() * c.S), 0);  // [B, h_kv, S]
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t hh = 0; hh < c.h; ++hh)
      for (std::int64_t i = 0; i < c.L; ++i) {
        const std::int64_t row = (b * c.h + hh) * c.L + i;
        const bool has_keys = row_has_keys(m, b, hh, i);
        if (!has_keys) {
          if (r.lse[static_cast<std::size_t>(row)] != -kInf)
            fail("lse" + index_str({c.B, c.h, c.L}, row) + " = " +
                 std::to_string(r.lse[static_cast<std::size_t>(row)]) +
                 " for a row with no allowed key, expected -inf");
          for (std::int64_t e = 0; e < c.d_v; ++e)
            if (r.out[static_cast<std::size_t>(row * c.d_v + e)] != 0.0)
              fail("out" + index_str({c.B, c.h, c.L, c.d_v}, row * c.d_v + e) +
                   " nonzero in a row with no allowed key");
          for (std::int64_t e = 0; e < c.d_k && !r.dq.empty(); ++e)
            if (r.dq[static_cast<std::size_t>(row * c.d_k + e)] != 0.0)
              fail("dq" + index_str({c.B, c.h, c.L, c.d_k}, row * c.d_k + e) + " nonzero in a row with no allowed key");
        } else if (!std::isfinite(r.lse[static_cast<std::size_t>(row)])) {
          fail("lse" + index_str({c.B, c.h, c.L}, row) + " not finite in a row with allowed keys");
        }
        for (std::int64_t j = 0; j < c.S; ++j) {
          const bool ok = position_allowed(m, b, hh, i, j);
          if (ok) key_seen[static_cast<std::size_t>((b * c.kv_heads() + hh / c.group()) * c.S + j)] = 1;
          if (!ok && !r.weights.empty() && r.weights[static_cast<std::size_t>(row * c.S + j)] != 0.0)
            fail("weights" + index_str({c.B, c.h, c.L, c.S}, row * c.S + j) + " = " +
                 std::to_string(r.weights[static_cast<std::size_t>(row * c.S + j)]) + " at a forbidden position");
        }
      }
  if (!r.dk.empty()) {
    for (std::int64_t key = 0; key < c.B * c.kv_heads() * c.S; ++key) {
      if (key_seen[static_cast<std::size_t>(key)]) continue;
      for (std::int64_t e = 0; e < c.d_k; ++e)
        if (r.dk[static_cast<std::size_t>(key * c.d_k + e)] != 0.0)
          fail("dk" + index_str({c.B, c.kv_heads(), c.S, c.d_k}, key * c.d_k + e) +
               " nonzero for a key no query may see");
      for (std::int64_t e = 0; e < c.d_v; ++e)
        if (r.dv[static_cast<std::size_t>(key * c.d_v + e)] != 0.0)
          fail("dv" + index_str({c.B, c.kv_heads(), c.S, c.d_v}, key * c.d_v + e) +
               " nonzero for a key no query may see");
    }
  }
  if (failures == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << failures << " exactness failures:" << bad.str();
}

// The fused kernel (float32) on one case (its numbers d, by default make_case_data's) against the reference
// in float32 and float64, by the sweeps' rules: out, lse and weights within 2x the float32 reference's error; with
// `backward`, the gradients within 3x (dq with the cancellation slack; dk and dv sum a group's g query heads, so dk's
// slack is g times one head's); the exact parts exact in the fused kernel and in the float64 reference.
inline void expect_fused_within_the_rule(const KernelCase& c, const CaseData& d, bool backward = true) {
  const KernelRun fused = run_kernel(c, d, DType::Float32, mha::Kernel::Flash, backward);
  const KernelRun ref32 = run_kernel(c, d, DType::Float32, mha::Kernel::Reference, backward);
  const KernelRun ref64 = run_kernel(c, d, DType::Float64, mha::Kernel::Reference, backward);
  EXPECT_TRUE(within_rule("out", fused.out, ref32.out, ref64.out, 2.0, {c.B, c.h, c.L, c.d_v}));
  EXPECT_TRUE(within_rule("lse", fused.lse, ref32.lse, ref64.lse, 2.0, {c.B, c.h, c.L}));
  if (c.need_weights) {
    EXPECT_TRUE(within_rule("weights", fused.weights, ref32.weights, ref64.weights, 2.0, {c.B, c.h, c.L, c.S}));
  }
  if (backward) {
    EXPECT_TRUE(
        within_rule("dq", fused.dq, ref32.dq, ref64.dq, 3.0, {c.B, c.h, c.L, c.d_k}, cancellation_slack(c, d, false)));
    EXPECT_TRUE(within_rule("dk", fused.dk, ref32.dk, ref64.dk, 3.0, {c.B, c.kv_heads(), c.S, c.d_k},
                            static_cast<double>(c.group()) * cancellation_slack(c, d, true)));
    EXPECT_TRUE(within_rule("dv", fused.dv, ref32.dv, ref64.dv, 3.0, {c.B, c.kv_heads(), c.S, c.d_v}));
  }
  EXPECT_TRUE(masked_parts_exact(c, d.masks, fused)) << "fused";
  EXPECT_TRUE(masked_parts_exact(c, d.masks, ref64)) << "reference, float64";
}
inline void expect_fused_within_the_rule(const KernelCase& c, bool backward = true) {
  expect_fused_within_the_rule(c, make_case_data(c), backward);
}

}  // namespace mha_test
