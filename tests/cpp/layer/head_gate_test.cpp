// The per-head gate, MultiHeadAttentionInputs::head_gate (out = Concat(g_1 head_1, ..., g_h head_h) W^O
// + b_O) and its gradient MultiHeadAttentionGradients::head_gate:
//   (a) forward against the tests' fp64 oracle with the heads gated (naive_mha.hpp), in float64 with
//       both kernels and float32 with the fused one: random gates with 0 and negative entries, [h] and
//       [B, h], masks, causal, add_bias_kv, add_zero_attn, batch first, sequence first and unbatched;
//       the returned weights are not gated;
//   (b) backward in float64 against finite differences, for every input, parameter and the gate;
//   (c) float32 fused against the float64 reference layer (within the rule of backward_test.cpp), and
//       the bfloat16 layer within the bfloat16 rule of bfloat16_test.cpp;
//   (d) a gate of ones gives bitwise the results of no gate (out, weights, every gradient); results do
//       not depend on the thread count;
//   (e) forward_cached with a gate equals forward with it;
//   (f) a NaN in the gate reaches exactly the batch it gates; a float32 / float64 / strided gate gives a
//       gradient of its own dtype and shape; bad gates throw mha::Error naming the problem.
//
// Legend: B batch, L queries, S keys, E = d_model, h heads, d_v the per-head value width.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "support/bad_input.hpp"
#include "support/bitwise.hpp"
#include "support/finite_differences.hpp"
#include "support/kernel_compare.hpp"
#include "support/layer_harness.hpp"
#include "support/naive_mha.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::KeyValueCache;
using mha::MultiHeadAttention;
using mha::MultiHeadAttentionInputs;

struct GateCase {
  LayerCase layer;
  bool per_batch = false;  // a [B, h] gate, else [h]
};

void PrintTo(const GateCase& g, std::ostream* os) { *os << g.layer.name; }

std::string gate_case_name(const ::testing::TestParamInfo<GateCase>& info) { return info.param.layer.name; }

std::vector<GateCase> gate_cases() {
  std::vector<GateCase> out;
  auto add = [&](std::string name, bool per_batch, auto edit) {
    GateCase g;
    g.layer.name = std::move(name);
    g.layer.E = 6, g.layer.h = 3;
    g.per_batch = per_batch;
    edit(g.layer);
    out.push_back(g);
  };
  add("per_head_batch_first", false, [](LayerCase&) {});
  add("per_batch_batch_first_key_padding", true, [](LayerCase& c) { c.masks = kCmpKeyPadding; });
  add("per_batch_sequence_first_causal_lengths", true, [](LayerCase& c) {
    c.layout = InputLayout::SequenceFirst, c.causal = true, c.masks = kCmpLengths, c.B = 3, c.L = 4, c.S = 4;
  });
  add("per_head_sequence_first_float_3d", false,
      [](LayerCase& c) { c.layout = InputLayout::SequenceFirst, c.masks = kCmpFloat3d; });
  add("per_batch_bias_kv_zero_attn_bool_2d", true,
      [](LayerCase& c) { c.add_bias_kv = c.add_zero_attn = true, c.masks = kCmpBool2d; });
  add("per_head_unbatched_bias_kv_causal", false, [](LayerCase& c) {
    c.layout = InputLayout::Unbatched, c.B = 1, c.add_bias_kv = true, c.causal = true, c.L = 4, c.S = 5;
  });
  add("per_batch_separate_dk_dv_kdim_no_bias", true,
      [](LayerCase& c) { c.d_k = 2, c.d_v = 3, c.kdim = 5, c.vdim = 4, c.bias = false, c.B = 3; });
  return out;
}

// A random gate of the case's shape, float32-representable (so a float32 and a float64 gate hold the
// same numbers), with a 0 first and a negative entry last.
void set_random_gate(const GateCase& g, LayerData& d, std::uint64_t seed) {
  const LayerCase& c = g.layer;
  d.head_gate_shape = g.per_batch ? Shape{c.B, c.h} : Shape{c.h};
  Rng rng(seed ^ 0x9a7eULL);
  d.head_gate = rounded_to(DType::Float32, random_values(mha::shape_numel(d.head_gate_shape), rng, -2.0, 2.0));
  d.head_gate.front() = 0.0;
  d.head_gate.back() = -0.75;
}

// The gate expanded to [B, h], as the oracle takes it.
std::vector<double> gate_per_batch(const LayerCase& c, const LayerData& d) {
  if (d.head_gate_shape.size() == 2) return d.head_gate;
  std::vector<double> g;
  for (std::int64_t b = 0; b < c.B; ++b) g.insert(g.end(), d.head_gate.begin(), d.head_gate.end());
  return g;
}

// x (an input with T positions of `width`, in the case's layout) as [B, T, width].
std::vector<double> batch_first(const LayerCase& c, const std::vector<double>& x, std::int64_t T, std::int64_t width) {
  std::vector<double> y(x.size());
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t w = 0; w < width; ++w)
        y[static_cast<std::size_t>((b * T + t) * width + w)] =
            x[static_cast<std::size_t>(input_row(c, T, b, t) * width + w)];
  return y;
}

// The case's data with parameters from random_state (whose oracle weights come with them) and a gate.
struct GatedData {
  LayerData data;
  NaiveMhaWeights weights;
};

GatedData gated_data(const GateCase& g) {
  const LayerCase& c = g.layer;
  const std::uint64_t seed = name_seed(c.name);
  GatedData gd{make_layer_data(c, seed), {}};
  Rng rng(seed ^ 0x51ULL);
  const RandomState state = random_state(c.E, c.h, c.dk(), c.dv(), c.kd(), c.vd(), c.bias, c.add_bias_kv,
                                         c.add_zero_attn, DType::Float32, rng);
  for (const auto& [name, t] : state.tensors) gd.data.params[name] = to_doubles(t);
  gd.weights = state.weights;
  set_random_gate(g, gd.data, seed);
  return gd;
}

// ---- (a) forward against the gated oracle -------------------------------------------------------

class HeadGateForward : public ::testing::TestWithParam<GateCase> {};

TEST_P(HeadGateForward, MatchesTheGatedOracle) {
  const LayerCase& c = GetParam().layer;
  const GatedData gd = gated_data(GetParam());
  const LayerData& d = gd.data;
  const NaiveMhaResult want =
      naive_mha(gd.weights, batch_first(c, d.query, c.L, c.E), batch_first(c, d.key, c.S, c.kd()),
                batch_first(c, d.value, c.S, c.vd()), c.B, c.L, c.S, d.masks, gate_per_batch(c, d));
  for (auto [dtype, kernel, tol] :
       {std::tuple{DType::Float64, mha::Kernel::Reference, 1e-11},
        std::tuple{DType::Float64, mha::Kernel::Flash, 1e-11}, std::tuple{DType::Float32, mha::Kernel::Flash, 5e-5}}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + kernel_name(kernel));
    const LayerRun got = run_layer(c, d, dtype, kernel, false);
    EXPECT_TRUE(all_close(batch_first(c, got.out, c.L, c.E), want.out, tol, tol)) << "out";
    EXPECT_TRUE(all_close(got.weights, want.weights_avg, tol, tol)) << "weights (not gated)";
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, HeadGateForward, ::testing::ValuesIn(gate_cases()), gate_case_name);

// A gate of 0 removes exactly that head: out equals the oracle's with that head's block of W^O zeroed.
TEST(HeadGate, ZeroGateRemovesTheHeadExactlyAsAZeroedOutProjBlock) {
  GateCase g = gate_cases().front();
  const LayerCase& c = g.layer;
  GatedData gd = gated_data(g);
  gd.data.head_gate = {1.0, 0.0, 1.0};
  const LayerRun got = run_layer(c, gd.data, DType::Float64, mha::Kernel::Flash, false);
  NaiveMhaWeights zeroed = gd.weights;
  const std::int64_t d_v = c.dv(), vw = c.h * d_v;
  for (std::int64_t e = 0; e < c.E; ++e)
    for (std::int64_t k = d_v; k < 2 * d_v; ++k) zeroed.wo[static_cast<std::size_t>(e * vw + k)] = 0.0;
  const LayerData& d = gd.data;
  const NaiveMhaResult want = naive_mha(zeroed, d.query, d.key, d.value, c.B, c.L, c.S, d.masks);
  EXPECT_TRUE(all_close(got.out, want.out, 1e-12, 1e-12));
}

// ---- (b) backward in float64 against finite differences -----------------------------------------

class HeadGateBackward : public ::testing::TestWithParam<GateCase> {};

TEST_P(HeadGateBackward, Float64MatchesFiniteDifferencesGateIncluded) {
  ThreadCountGuard threads;
  mha::set_num_threads(1);
  const LayerCase& c = GetParam().layer;
  const LayerData base = gated_data(GetParam()).data;
  const LayerRun analytic = run_layer(c, base, DType::Float64, mha::Kernel::Reference, true);
  ASSERT_EQ(analytic.grads.size(), 4 + base.params.size());
  ASSERT_EQ(analytic.grads.count("head_gate"), 1u);
  LayerData d = base;
  auto loss = [&] { return dot(run_layer(c, d, DType::Float64, mha::Kernel::Reference, false).out, d.dout); };
  for (const auto& [name, grad] : analytic.grads)
    EXPECT_TRUE(matches_finite_differences(grad, layer_values(d, name), loss)) << name;
}

INSTANTIATE_TEST_SUITE_P(Cases, HeadGateBackward, ::testing::ValuesIn(gate_cases()), gate_case_name);

// ---- (c) float32 fused against the float64 reference; bfloat16 ----------------------------------

GateCase large_case(std::string name, bool per_batch) {
  GateCase g;
  g.layer.name = std::move(name);
  g.layer.E = 64, g.layer.h = 4, g.layer.B = 2;
  g.layer.L = kSanitized ? 20 : 70;
  g.layer.S = kSanitized ? 40 : 150;
  g.per_batch = per_batch;
  return g;
}

TEST(HeadGate, Float32FusedWithinTheRuleOfTheFloat64Reference) {
  for (const GateCase& g : {large_case("large_per_head_causal", false), large_case("large_per_batch_padding", true)}) {
    SCOPED_TRACE(g.layer.name);
    LayerCase c = g.layer;
    c.causal = !g.per_batch;
    c.masks = g.per_batch ? unsigned{kCmpKeyPadding} : 0u;
    LayerData d = make_layer_data(c, name_seed(c.name));
    set_random_gate(g, d, name_seed(c.name));
    const LayerRun fused = run_layer(c, d, DType::Float32, mha::Kernel::Flash, true);
    const LayerRun ref32 = run_layer(c, d, DType::Float32, mha::Kernel::Reference, true);
    const LayerRun ref64 = run_layer(c, d, DType::Float64, mha::Kernel::Reference, true);
    EXPECT_TRUE(within_rule("out", fused.out, ref32.out, ref64.out, 2.0, {}));
    ASSERT_EQ(fused.grads.size(), ref64.grads.size());
    for (const auto& [name, grad] : ref64.grads)
      EXPECT_TRUE(within_rule(name.c_str(), fused.grads.at(name), ref32.grads.at(name), grad, 3.0, {}));
  }
}

// The bfloat16 layer (gate applied in float32) within bfloat16_test.cpp's bounds of the float64 layer:
// 2^-5 of the largest magnitude for out, 2^-4 for gradients.
TEST(HeadGate, Bfloat16WithinTheBfloat16Rule) {
  GateCase g = large_case("bf16_per_batch_float_mask", true);
  g.layer.masks = kCmpFloat2d;
  const LayerCase& c = g.layer;
  LayerData d = make_layer_data(c, name_seed(c.name));
  for (auto* x : {&d.query, &d.key, &d.value, &d.dout, &d.masks.float_mask})
    *x = rounded_to(DType::BFloat16, std::move(*x));
  for (auto& [name, values] : d.params) values = rounded_to(DType::BFloat16, std::move(values));
  set_random_gate(g, d, 5);
  d.head_gate_dtype = DType::Float32;
  const LayerRun got = run_layer(c, d, DType::BFloat16, mha::Kernel::Flash, true);
  d.head_gate_dtype = DType::Float64;
  const LayerRun want = run_layer(c, d, DType::Float64, mha::Kernel::Reference, true);
  auto within = [](const std::vector<double>& a, const std::vector<double>& b, double relative) {
    return max_abs_error(a, b).value <= relative * max_abs_finite(b) + 1e-6;
  };
  EXPECT_TRUE(within(got.out, want.out, 0x1.0p-5));
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (const auto& [name, grad] : want.grads) EXPECT_TRUE(within(got.grads.at(name), grad, 0x1.0p-4)) << name;
}

// ---- (d) a gate of ones is no gate; thread counts --------------------------------------------------

void expect_same_runs(const LayerRun& a, const LayerRun& b, bool gate_in_b) {
  EXPECT_TRUE(same_bits(a.out, b.out)) << "out";
  EXPECT_TRUE(same_bits(a.weights, b.weights)) << "weights";
  EXPECT_EQ(a.grads.size() + (gate_in_b ? 1 : 0), b.grads.size());
  for (const auto& [name, grad] : a.grads) EXPECT_TRUE(same_bits(grad, b.grads.at(name))) << name;
}

TEST(HeadGate, GateOfOnesIsBitwiseNoGate) {
  for (const GateCase& g : {large_case("ones_per_head", false), large_case("ones_per_batch", true)}) {
    LayerCase c = g.layer;
    c.masks = kCmpKeyPadding;
    c.add_bias_kv = true;
    const LayerData plain = make_layer_data(c, name_seed(c.name));
    LayerData ones = plain;
    ones.head_gate_shape = g.per_batch ? Shape{c.B, c.h} : Shape{c.h};
    ones.head_gate.assign(static_cast<std::size_t>(mha::shape_numel(ones.head_gate_shape)), 1.0);
    for (DType dtype : {DType::Float32, DType::Float64, DType::BFloat16})
      for (mha::Kernel kernel : {mha::Kernel::Flash, mha::Kernel::Reference}) {
        if (dtype == DType::BFloat16 && kernel == mha::Kernel::Reference) continue;
        SCOPED_TRACE(c.name + " " + dtype_name(dtype) + " " + kernel_name(kernel));
        expect_same_runs(run_layer(c, plain, dtype, kernel, true), run_layer(c, ones, dtype, kernel, true), true);
      }
  }
}

TEST(HeadGate, OneAndTwoThreadsBitwiseEqual) {
  ThreadCountGuard threads;
  GateCase g = large_case("threads_per_head_causal", false);
  g.layer.causal = true;
  for (bool per_batch : {false, true}) {
    g.per_batch = per_batch;
    LayerData d = make_layer_data(g.layer, name_seed(g.layer.name));
    set_random_gate(g, d, 11);
    for (DType dtype : {DType::Float32, DType::Float64}) {
      mha::set_num_threads(1);
      const LayerRun one = run_layer(g.layer, d, dtype, mha::Kernel::Flash, true);
      mha::set_num_threads(2);
      const LayerRun two = run_layer(g.layer, d, dtype, mha::Kernel::Flash, true);
      expect_same_runs(one, two, false);
    }
  }
}

// ---- (e) the KV-cache path --------------------------------------------------------------------------

TEST(HeadGate, ForwardCachedWithAGateEqualsForwardWithIt) {
  for (DType dtype : {DType::Float32, DType::Float64}) {
    mha::MultiHeadAttentionConfig cfg;
    cfg.d_model = 8, cfg.num_heads = 4, cfg.add_bias_kv = true, cfg.dtype = dtype;
    MultiHeadAttention layer(cfg, 3);
    layer.eval();
    Rng rng(17);
    const std::int64_t B = 2, S = 6;
    const Tensor x = random_tensor(dtype, {B, S, 8}, rng);
    const Tensor gate = make_tensor(DType::Float64, {B, 4}, {0.0, -1.5, 2.0, 0.5, 1.0, 0.0, -0.25, 3.0});
    MultiHeadAttentionInputs in;
    in.causal = true;
    in.head_gate = gate.view();
    const auto full = layer.forward(x, x, x, in);
    KeyValueCache cache;
    layer.append_to_cache(cache, x, x);
    const auto cached = layer.forward_cached(x, cache, in);
    const double tol = dtype == DType::Float64 ? 1e-12 : 1e-5;
    EXPECT_TRUE(all_close(to_doubles(cached.out), to_doubles(full.out), tol, tol)) << dtype_name(dtype);
    EXPECT_TRUE(all_close(to_doubles(cached.weights), to_doubles(full.weights), tol, tol)) << dtype_name(dtype);
    in.head_gate.reset();
    EXPECT_FALSE(all_close(to_doubles(layer.forward_cached(x, cache, in).out), to_doubles(full.out), tol, tol))
        << "the gate changes the result";
  }
}

// ---- (f) NaN, dtypes and strides of the gate; bad gates --------------------------------------------

TEST(HeadGate, NanInTheGateReachesExactlyTheBatchItGates) {
  GateCase g = gate_cases()[1];  // [B, h]
  LayerCase& c = g.layer;
  c.masks = 0;
  LayerData d = gated_data(g).data;
  d.head_gate[static_cast<std::size_t>(c.h + 1)] = kNaN;  // batch 1, head 1
  const LayerRun run = run_layer(c, d, DType::Float32, mha::Kernel::Flash, true);
  for (std::int64_t l = 0; l < c.L; ++l)
    for (std::int64_t e = 0; e < c.E; ++e) {
      const double batch0 = run.out[static_cast<std::size_t>((0 * c.L + l) * c.E + e)];
      const double batch1 = run.out[static_cast<std::size_t>((1 * c.L + l) * c.E + e)];
      EXPECT_TRUE(std::isfinite(batch0));
      EXPECT_TRUE(std::isnan(batch1));
    }
  EXPECT_TRUE(all_finite(run.weights)) << "weights are not gated";
  const std::vector<double>& dgate = run.grads.at("head_gate");
  for (std::int64_t n = 0; n < c.B * c.h; ++n)  // d out / d g does not involve g itself
    EXPECT_TRUE(std::isfinite(dgate[static_cast<std::size_t>(n)])) << n;
  EXPECT_TRUE(all_finite(rows_where(run.grads.at("query"), c.E, [&](std::int64_t r) { return r < c.L; })));
}

TEST(HeadGate, GradientHasTheGatesDtypeAndShapeForAnyStrides) {
  for (DType layer_dtype : {DType::Float32, DType::Float64}) {
    mha::MultiHeadAttentionConfig cfg;
    cfg.d_model = 6, cfg.num_heads = 3, cfg.dtype = layer_dtype;
    MultiHeadAttention layer(cfg, 5);
    Rng rng(23);
    const Tensor x = random_tensor(layer_dtype, {2, 4, 6}, rng);
    const Tensor dout = random_tensor(layer_dtype, {2, 4, 6}, rng);
    // A [B, h] = [2, 3] gate viewed with strides (1, 2) in a [3, 2] buffer (transposed), and the same
    // numbers contiguous in the other dtype: the same out and the same gradient.
    const Tensor storage = make_tensor(DType::Float32, {3, 2}, {0.5, -1.0, 0.0, 2.0, 1.5, 0.25});
    const TensorView strided(storage.data(), DType::Float32, {2, 3}, {1, 2});
    const Tensor contiguous = make_tensor(DType::Float64, {2, 3}, {0.5, 0.0, 1.5, -1.0, 2.0, 0.25});
    MultiHeadAttentionInputs in;
    in.head_gate = strided;
    const auto out_strided = to_doubles(layer.forward(x, x, x, in).out);
    const auto g_strided = layer.backward(dout);
    in.head_gate = contiguous.view();
    const auto out_contiguous = to_doubles(layer.forward(x, x, x, in).out);
    const auto g_contiguous = layer.backward(dout);
    EXPECT_TRUE(same_bits(out_strided, out_contiguous));
    EXPECT_EQ(g_strided.head_gate.dtype(), DType::Float32);
    EXPECT_EQ(g_contiguous.head_gate.dtype(), DType::Float64);
    EXPECT_EQ(g_strided.head_gate.shape(), (Shape{2, 3}));
    const auto a = to_doubles(g_strided.head_gate), b = to_doubles(g_contiguous.head_gate);
    for (std::size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], static_cast<double>(static_cast<float>(b[i]))) << i;
    in.head_gate.reset();
    layer.forward(x, x, x, in);
    EXPECT_FALSE(layer.backward(dout).head_gate.defined()) << "no gate, no gradient";
  }
}

std::vector<BadCase> bad_gates() {
  static const Tensor x = make_tensor(DType::Float32, {2, 3, 4}, std::vector<double>(24, 0.5));
  static const Tensor x_unbatched = make_tensor(DType::Float32, {3, 4}, std::vector<double>(12, 0.5));
  auto call = [](Shape shape, DType dtype, bool unbatched = false, bool cached = false) {
    return [=] {
      mha::MultiHeadAttentionConfig cfg;
      cfg.d_model = 4, cfg.num_heads = 2;
      MultiHeadAttention layer(cfg, 1);
      const Tensor gate(dtype, shape);
      MultiHeadAttentionInputs in;
      in.head_gate = gate.view();
      const Tensor& q = unbatched ? x_unbatched : x;
      if (!cached) return (void)layer.forward(q, q, q, in);
      KeyValueCache cache;
      layer.append_to_cache(cache, q, q);
      layer.forward_cached(q, cache, in);
    };
  };
  return {
      {"rank_3", call({2, 2, 1}, DType::Float32), "head_gate: expected shape .h. = .2. or .B, h. = .2, 2.*rank 3"},
      {"rank_0", call({}, DType::Float32), "head_gate: expected shape"},
      {"wrong_heads", call({3}, DType::Float32), "head_gate: expected one value per head .num_heads = 2."},
      {"wrong_heads_batched", call({2, 5}, DType::Float64), "head_gate.*num_heads = 2"},
      {"wrong_batch", call({3, 2}, DType::Float32), "head_gate: expected batch size 2"},
      {"batched_gate_unbatched_input", call({1, 2}, DType::Float32, true), "head_gate.*\\[h\\] = \\[2\\] .unbatched"},
      {"bool", call({2}, DType::Bool), "head_gate: expected float32 or float64, got bool"},
      {"bfloat16", call({2}, DType::BFloat16), "head_gate: expected float32 or float64, got bfloat16"},
      {"cached_wrong_heads", call({4}, DType::Float32, false, true), "head_gate.*num_heads = 2"},
      {"cached_wrong_batch", call({1, 2}, DType::Float32, false, true), "head_gate: expected batch size 2"},
  };
}

class HeadGateBadInput : public ::testing::TestWithParam<BadCase> {};
TEST_P(HeadGateBadInput, ThrowsNamingTheProblem) { expect_error_naming_the_argument(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Cases, HeadGateBadInput, ::testing::ValuesIn(bad_gates()), bad_case_name);

// A rejected gate changes nothing: the last training-mode forward can still be differentiated.
TEST(HeadGate, BadGateLeavesTheLayerAsItWas) {
  mha::MultiHeadAttentionConfig cfg;
  cfg.d_model = 4, cfg.num_heads = 2, cfg.dropout = 0.25;
  MultiHeadAttention layer(cfg, 1);
  Rng rng(3);
  const Tensor x = random_tensor(DType::Float32, {2, 3, 4}, rng);
  const Tensor dout = random_tensor(DType::Float32, {2, 3, 4}, rng);
  const Tensor gate = make_tensor(DType::Float32, {2}, {1.0, -1.0});
  MultiHeadAttentionInputs in;
  in.head_gate = gate.view();
  layer.forward(x, x, x, in);
  const auto before = layer.backward(dout);
  const Tensor bad(DType::Float32, {3});
  MultiHeadAttentionInputs bad_in;
  bad_in.head_gate = bad.view();
  EXPECT_THROW(layer.forward(x, x, x, bad_in), mha::Error);
  const auto after = layer.backward(dout);
  EXPECT_TRUE(bitwise_equal(before.query, after.query));
  EXPECT_TRUE(bitwise_equal(before.head_gate, after.head_gate));
}

}  // namespace
}  // namespace mha_test
