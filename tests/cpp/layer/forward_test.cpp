// MultiHeadAttention::forward against the tests' fp64 oracle (naive_mha.hpp), with random parameters
// (nonzero biases) loaded through load_state_dict: batch-first, sequence-first and unbatched layouts,
// packed and separate projections, add_bias_kv, add_zero_attn, every mask kind, averaged and per-head
// weights; then fully masked rows, dropout in training mode, strided inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "support/naive_mha.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::MultiHeadAttentionInputs;
using mha::MultiHeadAttentionOutput;

enum class Layout { BatchFirst, SeqFirst, Unbatched };

enum FwdMask : unsigned {
  kKpm = 1u << 0,      // bool key_padding_mask
  kLens = 1u << 1,     // key_lengths
  kBool2d = 1u << 2,   // bool attn_mask [L, S]
  kFloat2d = 1u << 3,  // float attn_mask [L, S] (module dtype), some -inf
  kBool3d = 1u << 4,   // bool attn_mask [B*h, L, S]
  kFloat3d = 1u << 5,  // float attn_mask [B*h, L, S], some -inf
  kCausal = 1u << 6,
};

struct FwdCase {
  const char* name;
  DType dtype;
  std::int64_t E, h, d_k, d_v, kdim, vdim;  // config (0 = default)
  bool bias, add_bias_kv, add_zero_attn;
  Layout layout;
  std::int64_t B, L, S;
  unsigned masks;
  bool need_weights, average;
  bool self_attention;  // query, key and value are the same view (then S == L, kdim == vdim == E)
};

// [B, L, C] (batch first) -> the layout's order: [L, B, C] or [L, C] (B == 1).
std::vector<double> to_layout(const std::vector<double>& x, std::int64_t B, std::int64_t L, std::int64_t C,
                              Layout layout) {
  if (layout != Layout::SeqFirst) return x;
  std::vector<double> y(x.size());
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t l = 0; l < L; ++l)
      for (std::int64_t c = 0; c < C; ++c)
        y[static_cast<std::size_t>((l * B + b) * C + c)] = x[static_cast<std::size_t>((b * L + l) * C + c)];
  return y;
}
Shape layout_shape(std::int64_t B, std::int64_t L, std::int64_t C, Layout layout) {
  switch (layout) {
    case Layout::BatchFirst: return {B, L, C};
    case Layout::SeqFirst: return {L, B, C};
    case Layout::Unbatched: return {L, C};
  }
  return {};
}

void PrintTo(const FwdCase& c, std::ostream* os) { *os << c.name; }

class MhaForward : public KernelParamTest<FwdCase> {};

TEST_P(MhaForward, MatchesFp64Oracle) {
  const FwdCase& c = param();
  const DType dt = c.dtype;
  const std::int64_t E = c.E, h = c.h, B = c.B, L = c.L, S = c.self_attention ? c.L : c.S;
  const std::int64_t d_k = c.d_k ? c.d_k : E / h, d_v = c.d_v ? c.d_v : E / h;
  const std::int64_t kdim = c.kdim ? c.kdim : E, vdim = c.vdim ? c.vdim : E;
  ASSERT_TRUE(c.layout != Layout::Unbatched || B == 1);

  MultiHeadAttentionConfig cfg;
  cfg.d_model = E, cfg.num_heads = h, cfg.d_k = c.d_k, cfg.d_v = c.d_v, cfg.kdim = c.kdim, cfg.vdim = c.vdim;
  cfg.bias = c.bias, cfg.add_bias_kv = c.add_bias_kv, cfg.add_zero_attn = c.add_zero_attn;
  cfg.batch_first = c.layout != Layout::SeqFirst;
  cfg.dtype = dt;
  MultiHeadAttention m(cfg, 5);
  m.set_kernel(kernel());
  Rng rng(std::hash<std::string>{}(c.name));
  RandomState rs = random_state(E, h, d_k, d_v, kdim, vdim, c.bias, c.add_bias_kv, c.add_zero_attn, dt, rng);
  m.load_state_dict(rs.views());
  m.eval();

  // Inputs, batch first for the oracle; the library gets them in the case's layout.
  const auto xq = rounded_to(dt, random_values(B * L * E, rng));
  const auto xk = c.self_attention ? xq : rounded_to(dt, random_values(B * S * kdim, rng));
  const auto xv = c.self_attention ? xq : rounded_to(dt, random_values(B * S * vdim, rng));
  Tensor tq = make_tensor(dt, layout_shape(B, L, E, c.layout), to_layout(xq, B, L, E, c.layout));
  Tensor tk = make_tensor(dt, layout_shape(B, S, kdim, c.layout), to_layout(xk, B, S, kdim, c.layout));
  Tensor tv = make_tensor(dt, layout_shape(B, S, vdim, c.layout), to_layout(xv, B, S, vdim, c.layout));

  NaiveMaskSpec ms;
  ms.B = B, ms.h = h, ms.L = L, ms.S = S;
  MultiHeadAttentionInputs in;
  in.need_weights = c.need_weights;
  in.average_attn_weights = c.average;
  std::vector<Tensor> keep;
  if (c.masks & kKpm) {
    for (std::int64_t i = 0; i < B * S; ++i) ms.key_padding.push_back(rng.bernoulli(0.3));
    std::vector<double> kp(ms.key_padding.begin(), ms.key_padding.end());
    keep.push_back(make_tensor(DType::Bool, c.layout == Layout::Unbatched ? Shape{S} : Shape{B, S}, kp));
    in.key_padding_mask = keep.back().view();
  }
  if (c.masks & kLens) {
    for (std::int64_t b = 0; b < B; ++b) ms.key_lengths.push_back(rng.integer(0, S));
    in.key_lengths = ms.key_lengths;
  }
  if (c.masks & (kBool2d | kBool3d)) {
    ms.bool_mask_batched = (c.masks & kBool3d) != 0;
    const std::int64_t n = (ms.bool_mask_batched ? B * h : 1) * L * S;
    for (std::int64_t i = 0; i < n; ++i) ms.bool_mask.push_back(rng.bernoulli(0.25));
    std::vector<double> bm(ms.bool_mask.begin(), ms.bool_mask.end());
    keep.push_back(make_tensor(DType::Bool, ms.bool_mask_batched ? Shape{B * h, L, S} : Shape{L, S}, bm));
    in.attn_mask = keep.back().view();
  }
  if (c.masks & (kFloat2d | kFloat3d)) {
    ms.float_mask_batched = (c.masks & kFloat3d) != 0;
    const std::int64_t n = (ms.float_mask_batched ? B * h : 1) * L * S;
    for (std::int64_t i = 0; i < n; ++i) ms.float_mask.push_back(rng.bernoulli(0.15) ? -kInf : rng.uniform(-2, 2));
    ms.float_mask = rounded_to(dt, ms.float_mask);
    keep.push_back(make_tensor(dt, ms.float_mask_batched ? Shape{B * h, L, S} : Shape{L, S}, ms.float_mask));
    in.attn_mask = keep.back().view();
  }
  ms.causal = in.causal = (c.masks & kCausal) != 0;

  const MultiHeadAttentionOutput got = c.self_attention ? m.forward(tq, tq, tq, in) : m.forward(tq, tk, tv, in);
  const NaiveMhaResult want = naive_mha(rs.weights, xq, xk, xv, B, L, S, ms);
  const std::int64_t Sx = want.S_ext;
  EXPECT_EQ(Sx, S + (c.add_bias_kv ? 1 : 0) + (c.add_zero_attn ? 1 : 0));

  const double tol = dt == DType::Float64 ? 1e-11 : 3e-5;
  ASSERT_TRUE(got.out.defined());
  EXPECT_EQ(got.out.dtype(), dt);
  ASSERT_EQ(got.out.shape(), layout_shape(B, L, E, c.layout));
  EXPECT_TRUE(all_close(to_doubles(got.out), to_layout(want.out, B, L, E, c.layout), tol, tol, got.out.shape()))
      << "out";

  if (!c.need_weights) {
    EXPECT_FALSE(got.weights.defined());
    return;
  }
  ASSERT_TRUE(got.weights.defined());
  EXPECT_EQ(got.weights.dtype(), dt);
  const bool unbatched = c.layout == Layout::Unbatched;
  if (c.average) {
    ASSERT_EQ(got.weights.shape(), (unbatched ? Shape{L, Sx} : Shape{B, L, Sx}));
    EXPECT_TRUE(all_close(to_doubles(got.weights), want.weights_avg, tol, tol, got.weights.shape())) << "weights";
  } else {
    ASSERT_EQ(got.weights.shape(), (unbatched ? Shape{h, L, Sx} : Shape{B, h, L, Sx}));
    EXPECT_TRUE(all_close(to_doubles(got.weights), want.weights_per_head, tol, tol, got.weights.shape()))
        << "weights per head";
  }
}

constexpr auto F32 = DType::Float32;
constexpr auto F64 = DType::Float64;
constexpr auto BF = Layout::BatchFirst;
constexpr auto SF = Layout::SeqFirst;
constexpr auto UB = Layout::Unbatched;

// name, dtype, E, h, d_k, d_v, kdim, vdim, bias, bias_kv, zero_attn, layout, B, L, S, masks, need_weights,
// average, self_attention
const FwdCase kFwdCases[] = {
    {"f64_batch_first_packed", F64, 12, 3, 0, 0, 0, 0, true, false, false, BF, 2, 5, 7, 0, true, true, false},
    {"f64_seq_first_packed", F64, 12, 3, 0, 0, 0, 0, true, false, false, SF, 2, 5, 7, 0, true, true, false},
    {"f64_unbatched_packed_kpm_per_head", F64, 12, 3, 0, 0, 0, 0, true, false, false, UB, 1, 4, 6, kKpm, true, false,
     false},
    {"f64_unbatched_lengths_causal", F64, 8, 2, 0, 0, 0, 0, true, false, false, UB, 1, 5, 5, kLens | kCausal, true,
     true, false},
    {"f64_self_attention_causal_per_head", F64, 12, 4, 0, 0, 0, 0, true, false, false, BF, 3, 6, 6, kCausal, true,
     false, true},
    {"f64_cross_kdim5_vdim7_dk4_dv6_kpm_bool2d", F64, 8, 2, 4, 6, 5, 7, true, false, false, BF, 2, 3, 9, kKpm | kBool2d,
     true, true, false},
    {"f64_packed_hdk_ne_E_lengths", F64, 12, 2, 5, 5, 0, 0, true, false, false, BF, 2, 4, 6, kLens, true, false, false},
    {"f64_E10_h3_dk4_dv2_float3d", F64, 10, 3, 4, 2, 0, 0, true, false, false, SF, 2, 5, 3, kFloat3d, true, false,
     false},
    {"f64_float2d_B3", F64, 8, 2, 0, 0, 0, 0, true, false, false, BF, 3, 4, 6, kFloat2d, true, true, false},
    {"f64_bool3d_causal_L_lt_S", F64, 8, 2, 0, 0, 0, 0, true, false, false, BF, 2, 3, 8, kBool3d | kCausal, true, false,
     false},
    {"f64_causal_L_gt_S", F64, 8, 2, 0, 0, 0, 0, true, false, false, BF, 2, 7, 4, kCausal, true, false, false},
    {"f64_bias_kv", F64, 12, 3, 0, 0, 0, 0, true, true, false, BF, 2, 4, 5, 0, true, false, false},
    {"f64_bias_kv_kpm_float3d", F64, 12, 3, 0, 0, 0, 0, true, true, false, BF, 2, 4, 5, kKpm | kFloat3d, true, false,
     false},
    {"f64_bias_kv_causal", F64, 8, 2, 0, 0, 0, 0, true, true, false, BF, 2, 4, 6, kCausal, true, false, false},
    {"f64_zero_attn_lengths", F64, 8, 2, 0, 0, 0, 0, true, false, true, BF, 3, 4, 5, kLens, true, true, false},
    {"f64_bias_kv_zero_attn_seq_first_bool2d", F64, 8, 4, 3, 5, 6, 9, true, true, true, SF, 2, 5, 4, kBool2d, true,
     false, false},
    {"f64_unbatched_bias_kv_zero_attn_kpm", F64, 8, 2, 0, 0, 0, 0, true, true, true, UB, 1, 3, 6, kKpm, true, true,
     false},
    {"f64_nobias_separate_dk3_dv5", F64, 8, 2, 3, 5, 0, 0, false, false, false, BF, 2, 4, 6, kKpm, true, true, false},
    {"f64_no_weights", F64, 12, 3, 0, 0, 0, 0, true, false, false, BF, 2, 5, 7, kLens, false, true, false},
    {"f64_L1_S1", F64, 4, 1, 0, 0, 0, 0, true, false, false, BF, 1, 1, 1, 0, true, true, false},
    {"f32_batch_first_packed_kpm", F32, 16, 4, 0, 0, 0, 0, true, false, false, BF, 2, 6, 9, kKpm, true, true, false},
    {"f32_seq_first_cross_float3d", F32, 8, 2, 4, 6, 5, 7, true, false, false, SF, 3, 4, 6, kFloat3d, true, false,
     false},
    {"f32_unbatched_bias_kv_zero_attn_causal", F32, 12, 3, 0, 0, 0, 0, true, true, true, UB, 1, 5, 7, kCausal, true,
     false, false},
    {"f32_self_attention_lengths_bool2d", F32, 12, 2, 0, 0, 0, 0, true, false, false, BF, 2, 7, 7, kLens | kBool2d,
     true, true, true},
    {"f32_long_L130_S150_kpm_causal", F32, 16, 2, 0, 0, 0, 0, true, false, false, BF, 1, 130, 150, kKpm | kCausal, true,
     false, false},
    {"f32_nobias_no_weights", F32, 8, 2, 0, 0, 0, 0, false, false, false, SF, 2, 3, 4, 0, false, true, false},
};
INSTANTIATE_TEST_SUITE_P(Configs, MhaForward,
                         ::testing::Combine(::testing::ValuesIn(kFwdCases), ::testing::ValuesIn(kAllKernels)),
                         [](const ::testing::TestParamInfo<MhaForward::ParamType>& info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  kernel_name(std::get<1>(info.param));
                         });

class MhaForwardDtype : public KernelParamTest<DType> {};
INSTANTIATE_TEST_SUITE_P(Dtypes, MhaForwardDtype, kFloatDtypesTimesKernels, dtype_kernel_name);

// A query row with every key forbidden attends to nothing, so its output is out_proj.bias exactly
// (0 @ W^T + b) and its weights are 0.
TEST_P(MhaForwardDtype, FullyMaskedQueryRowGivesOutProjBiasExactly) {
  const DType dt = param();
  const std::int64_t E = 8, h = 2, B = 2, L = 4, S = 5;
  MultiHeadAttentionConfig cfg;
  cfg.d_model = E, cfg.num_heads = h, cfg.dtype = dt;
  MultiHeadAttention m(cfg, 6);
  m.set_kernel(kernel());
  Rng rng(41);
  RandomState rs = random_state(E, h, E / h, E / h, E, E, true, false, false, dt, rng);
  m.load_state_dict(rs.views());
  m.eval();
  Tensor q = random_tensor(dt, {B, L, E}, rng);
  Tensor k = random_tensor(dt, {B, S, E}, rng);
  Tensor v = random_tensor(dt, {B, S, E}, rng);
  // Batch 1: every key is padding. Batch 0: query 2 forbids every key through attn_mask.
  Tensor kpm(DType::Bool, {B, S});
  for (std::int64_t j = 0; j < S; ++j) kpm.data_as<bool>()[1 * S + j] = true;
  Tensor am(DType::Bool, {L, S});
  for (std::int64_t j = 0; j < S; ++j) am.data_as<bool>()[2 * S + j] = true;
  MultiHeadAttentionInputs in;
  in.key_padding_mask = kpm.view();
  in.attn_mask = am.view();
  in.average_attn_weights = false;
  const MultiHeadAttentionOutput r = m.forward(q, k, v, in);
  const auto out = to_doubles(r.out), w = to_doubles(r.weights);
  const auto bias = to_doubles(rs.tensors.at("out_proj.bias"));
  auto expect_bias_row = [&](std::int64_t b, std::int64_t i) {
    for (std::int64_t e = 0; e < E; ++e)
      EXPECT_EQ(out[static_cast<std::size_t>((b * L + i) * E + e)], bias[static_cast<std::size_t>(e)])
          << "b=" << b << " i=" << i << " e=" << e;
    for (std::int64_t hh = 0; hh < h; ++hh)
      for (std::int64_t j = 0; j < S; ++j)
        EXPECT_EQ(w[static_cast<std::size_t>(((b * h + hh) * L + i) * S + j)], 0.0) << "b=" << b << " i=" << i;
  };
  for (std::int64_t i = 0; i < L; ++i) expect_bias_row(1, i);
  expect_bias_row(0, 2);
  EXPECT_TRUE(all_finite(out));
  EXPECT_TRUE(all_finite(w));
  // The other rows of batch 0 are ordinary.
  EXPECT_NE(out[static_cast<std::size_t>(0 * E)], bias[0]);
}

// Dropout applies in training mode only: eval() matches the oracle and is deterministic; training
// draws a new mask on every call, and each per-head weight is 0 or 1 / (1 - p) times its eval value.
TEST_P(MhaForwardDtype, DropoutOnlyInTrainingMode) {
  const DType dt = param();
  const std::int64_t E = 8, h = 2, B = 2, L = 12, S = 16;
  MultiHeadAttentionConfig cfg;
  cfg.d_model = E, cfg.num_heads = h, cfg.dtype = dt, cfg.dropout = 0.5;
  MultiHeadAttention m(cfg, 7);
  m.set_kernel(kernel());
  Rng rng(42);
  RandomState rs = random_state(E, h, E / h, E / h, E, E, true, false, false, dt, rng);
  m.load_state_dict(rs.views());
  EXPECT_TRUE(m.training());
  const auto xq = rounded_to(dt, random_values(B * L * E, rng));
  const auto xk = rounded_to(dt, random_values(B * S * E, rng));
  const auto xv = rounded_to(dt, random_values(B * S * E, rng));
  Tensor q = make_tensor(dt, {B, L, E}, xq), k = make_tensor(dt, {B, S, E}, xk), v = make_tensor(dt, {B, S, E}, xv);
  MultiHeadAttentionInputs in;
  in.average_attn_weights = false;

  const MultiHeadAttentionOutput t1 = m.forward(q, k, v, in);
  const MultiHeadAttentionOutput t2 = m.forward(q, k, v, in);
  EXPECT_FALSE(bitwise_equal(t1.weights, t2.weights)) << "each training call must draw a new mask";

  m.eval();
  const MultiHeadAttentionOutput e1 = m.forward(q, k, v, in);
  const MultiHeadAttentionOutput e2 = m.forward(q, k, v, in);
  EXPECT_TRUE(bitwise_equal(e1.out, e2.out));
  NaiveMaskSpec ms;
  ms.B = B, ms.h = h, ms.L = L, ms.S = S;
  const NaiveMhaResult want = naive_mha(rs.weights, xq, xk, xv, B, L, S, ms);
  const double tol = dt == DType::Float64 ? 1e-11 : 3e-5;
  EXPECT_TRUE(all_close(to_doubles(e1.out), want.out, tol, tol)) << "eval out";
  EXPECT_TRUE(all_close(to_doubles(e1.weights), want.weights_per_head, tol, tol)) << "eval weights";

  const auto w0 = want.weights_per_head, w1 = to_doubles(t1.weights);
  std::size_t zeroed = 0, wrong = 0;
  for (std::size_t i = 0; i < w0.size(); ++i) {
    if (w1[i] == 0.0) ++zeroed;
    else if (std::fabs(w1[i] - 2.0 * w0[i]) > 10 * tol * (1 + 2.0 * w0[i])) ++wrong;
  }
  EXPECT_EQ(wrong, 0u) << "kept weights must be 2x the eval weights";
  const double frac = static_cast<double>(zeroed) / static_cast<double>(w0.size());
  EXPECT_NEAR(frac, 0.5, 0.1) << zeroed << " of " << w0.size();
}

// A batch-first module reading the query from sequence-first storage through a strided view gives the
// same output as from a contiguous copy.
TEST_P(MhaForwardDtype, StridedInputsMatchContiguous) {
  const DType dt = param();
  const std::int64_t E = 8, h = 2, B = 3, L = 4, S = 5;
  MultiHeadAttentionConfig cfg;
  cfg.d_model = E, cfg.num_heads = h, cfg.dtype = dt;
  MultiHeadAttention m(cfg, 8);
  m.set_kernel(kernel());
  m.eval();
  Rng rng(43);
  Tensor qs = random_tensor(dt, {L, B, E}, rng);  // storage [L, B, E]
  Tensor kvs = random_tensor(dt, {S, B, E}, rng);
  const TensorView qv(qs.data(), dt, {B, L, E}, {E, B * E, 1});
  const TensorView kvv(kvs.data(), dt, {B, S, E}, {E, B * E, 1});
  Tensor qc = make_tensor(dt, {B, L, E}, to_doubles(qv));
  Tensor kvc = make_tensor(dt, {B, S, E}, to_doubles(kvv));
  const MultiHeadAttentionOutput a = m.forward(qv, kvv, kvv);
  const MultiHeadAttentionOutput b = m.forward(qc, kvc, kvc);
  const double tol = dt == DType::Float64 ? 1e-13 : 1e-6;
  EXPECT_TRUE(all_close(to_doubles(a.out), to_doubles(b.out), tol, tol));
  EXPECT_TRUE(all_close(to_doubles(a.weights), to_doubles(b.weights), tol, tol));
}

// Same parameters, same inputs: batch-first, sequence-first and unbatched (per batch element) agree.
TEST_P(MhaForwardDtype, LayoutsAgree) {
  const DType dt = param();
  const std::int64_t E = 8, h = 4, B = 2, L = 3, S = 5;
  Rng rng(44);
  RandomState rs = random_state(E, h, E / h, E / h, E, E, true, true, false, dt, rng);
  MultiHeadAttentionConfig cfg;
  cfg.d_model = E, cfg.num_heads = h, cfg.dtype = dt, cfg.add_bias_kv = true;
  MultiHeadAttention bf(cfg);
  bf.set_kernel(kernel());
  cfg.batch_first = false;
  MultiHeadAttention sf(cfg);
  sf.set_kernel(kernel());
  bf.load_state_dict(rs.views());
  sf.load_state_dict(rs.views());
  const auto xq = random_values(B * L * E, rng), xk = random_values(B * S * E, rng), xv = random_values(B * S * E, rng);
  Tensor q = make_tensor(dt, {B, L, E}, xq), k = make_tensor(dt, {B, S, E}, xk), v = make_tensor(dt, {B, S, E}, xv);
  Tensor qs = make_tensor(dt, {L, B, E}, to_layout(xq, B, L, E, SF));
  Tensor ks = make_tensor(dt, {S, B, E}, to_layout(xk, B, S, E, SF));
  Tensor vs = make_tensor(dt, {S, B, E}, to_layout(xv, B, S, E, SF));
  const auto a = bf.forward(q, k, v);
  const auto s = sf.forward(qs, ks, vs);
  const double tol = dt == DType::Float64 ? 1e-13 : 1e-6;
  EXPECT_TRUE(all_close(to_doubles(s.out), to_layout(to_doubles(a.out), B, L, E, SF), tol, tol));
  EXPECT_TRUE(all_close(to_doubles(s.weights), to_doubles(a.weights), tol, tol));
  for (std::int64_t b = 0; b < B; ++b) {
    SCOPED_TRACE(b);
    auto slice = [&](const std::vector<double>& x, std::int64_t n) {
      return std::vector<double>(x.begin() + b * n, x.begin() + (b + 1) * n);
    };
    Tensor qu = make_tensor(dt, {L, E}, slice(xq, L * E));
    Tensor ku = make_tensor(dt, {S, E}, slice(xk, S * E));
    Tensor vu = make_tensor(dt, {S, E}, slice(xv, S * E));
    const auto u = bf.forward(qu, ku, vu);
    ASSERT_EQ(u.out.shape(), (Shape{L, E}));
    ASSERT_EQ(u.weights.shape(), (Shape{L, S + 1}));
    EXPECT_TRUE(all_close(to_doubles(u.out), slice(to_doubles(a.out), L * E), tol, tol));
    EXPECT_TRUE(all_close(to_doubles(u.weights), slice(to_doubles(a.weights), L * (S + 1)), tol, tol));
  }
}

}  // namespace
}  // namespace mha_test
