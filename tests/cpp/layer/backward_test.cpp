// MultiHeadAttention::backward, in one place:
//   (a) in float64 against finite differences, for every input and parameter: packed and separate
//       projections, d_k != d_v, add_bias_kv, add_zero_attn, batch first, sequence first and unbatched
//       inputs, masks, causal, dropout;
//   (b) in float32 with the fused kernel against a float64 layer with the reference kernel (same
//       parameters through load_state_dict), the float32 reference layer as the yardstick: factor 2 for
//       out and weights, 3 for every gradient;
//   (c) the two promises of its header comment: with one tensor as query, key and value the three input
//       gradients sum to the gradient of that tensor; and gradients come back in new tensors, nothing
//       accumulates across calls;
//   (d) keys hidden by key_padding_mask or key_lengths are never read: filling the key and value inputs
//       there with NaN or 1e10 changes no bit of out, weights, the input gradients at unpadded positions
//       and the parameter gradients;
//   (e) determinism: forward and backward are bitwise identical over 20 repeats and across
//       mha::set_num_threads(1) and (2), in float32 with the fused kernel and in float64.
// The kernels' own gradients are in attention/gradients_test.cpp; bad dout and backward without a
// training forward in bad_input_test.cpp.
//
// Legend: B batch, h heads, L queries, S keys, d_k query/key width, d_v value width, E = d_model.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "support/bitwise.hpp"
#include "support/finite_differences.hpp"
#include "support/kernel_compare.hpp"
#include "support/layer_harness.hpp"
#include "support/naive_mha.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::MultiHeadAttentionInputs;

// ---- (a) in float64 against finite differences --------------------------------------------------

LayerCase layer_case(std::string name) {
  LayerCase c;
  c.name = std::move(name);
  c.need_weights = false;
  return c;
}

std::vector<LayerCase> layer_fd_cases() {
  std::vector<LayerCase> cases;
  {
    LayerCase c = layer_case("packed_batch_first");
    cases.push_back(c);
  }
  {
    LayerCase c = layer_case("packed_sequence_first_key_padding");
    c.layout = InputLayout::SequenceFirst;
    c.masks = kCmpKeyPadding;
    cases.push_back(c);
  }
  {
    LayerCase c = layer_case("separate_kdim_vdim_lengths_causal_L_gt_S");
    c.kdim = 5, c.vdim = 7, c.L = 4, c.S = 3;
    c.masks = kCmpLengths;
    c.causal = true;
    cases.push_back(c);
  }
  {
    LayerCase c = layer_case("separate_dk_ne_dv_bool_2d");
    c.d_k = 4, c.d_v = 2;
    c.masks = kCmpBool2d;
    cases.push_back(c);
  }
  {
    LayerCase c = layer_case("bias_kv_float_3d");
    c.add_bias_kv = true;
    c.masks = kCmpFloat3d;
    cases.push_back(c);
  }
  {
    LayerCase c = layer_case("zero_attn_sequence_first_bool_3d_causal");
    c.add_zero_attn = true;
    c.layout = InputLayout::SequenceFirst;
    c.masks = kCmpBool3d;
    c.causal = true;
    cases.push_back(c);
  }
  {
    LayerCase c = layer_case("bias_kv_zero_attn_unbatched_key_padding_causal");
    c.add_bias_kv = true, c.add_zero_attn = true;
    c.layout = InputLayout::Unbatched;
    c.B = 1, c.L = 4, c.S = 5;
    c.masks = kCmpKeyPadding;
    c.causal = true;
    cases.push_back(c);
  }
  {
    LayerCase c = layer_case("unbatched_float_2d");
    c.layout = InputLayout::Unbatched;
    c.B = 1;
    c.masks = kCmpFloat2d;
    cases.push_back(c);
  }
  {
    LayerCase c = layer_case("no_bias_causal_L_lt_S_separate");
    c.bias = false;
    c.d_k = 2, c.d_v = 4, c.kdim = 3;
    c.L = 3, c.S = 5;
    c.causal = true;
    cases.push_back(c);
  }
  {
    LayerCase c = layer_case("dropout_key_padding");
    c.dropout = 0.3;
    c.masks = kCmpKeyPadding;
    cases.push_back(c);
  }
  {
    LayerCase c = layer_case("dropout_bias_kv_lengths_sequence_first");
    c.dropout = 0.5;
    c.add_bias_kv = true;
    c.layout = InputLayout::SequenceFirst;
    c.masks = kCmpLengths | kCmpFloat2d;
    cases.push_back(c);
  }
  return cases;
}

class LayerBackwardVsFiniteDifferences : public ::testing::TestWithParam<LayerCase> {};

TEST_P(LayerBackwardVsFiniteDifferences, Float64) {
  ThreadCountGuard threads;
  mha::set_num_threads(1);
  const LayerCase& c = GetParam();
  const LayerData base = make_layer_data(c, name_seed(c.name));
  const LayerRun analytic = run_layer(c, base, DType::Float64, mha::Kernel::Reference, true);
  ASSERT_EQ(analytic.grads.size(), 3 + base.params.size());
  LayerData d = base;
  auto loss = [&] { return dot(run_layer(c, d, DType::Float64, mha::Kernel::Reference, false).out, d.dout); };
  for (const auto& [name, grad] : analytic.grads)
    EXPECT_TRUE(matches_finite_differences(grad, layer_values(d, name), loss)) << name;
}

INSTANTIATE_TEST_SUITE_P(Cases, LayerBackwardVsFiniteDifferences, ::testing::ValuesIn(layer_fd_cases()),
                         [](const ::testing::TestParamInfo<LayerCase>& info) { return info.param.name; });

// ---- (b) the float32 layer with the fused kernel against a float64 reference layer --------------

std::vector<LayerCase> layer_flash_cases() {
  const std::int64_t scale_down = kSanitized ? 4 : 1;  // smaller sequences under sanitizers
  std::vector<LayerCase> cases;
  auto base = [&](std::string name) {
    LayerCase c;
    c.name = std::move(name);
    c.E = 64, c.h = 4, c.B = 2, c.L = 70 / scale_down, c.S = 150 / scale_down;
    return c;
  };
  {
    LayerCase c = base("packed_batch_first");
    cases.push_back(c);
  }
  {
    LayerCase c = base("packed_sequence_first_key_padding_causal_L_gt_S");
    c.layout = InputLayout::SequenceFirst;
    c.L = 150 / scale_down, c.S = 70 / scale_down;
    c.masks = kCmpKeyPadding;
    c.causal = true;
    cases.push_back(c);
  }
  {
    LayerCase c = base("separate_dk24_dv40_kdim48_vdim80_lengths");
    c.d_k = 24, c.d_v = 40, c.kdim = 48, c.vdim = 80;
    c.masks = kCmpLengths;
    cases.push_back(c);
  }
  {
    LayerCase c = base("bias_kv_zero_attn_bool_3d_causal");
    c.add_bias_kv = true, c.add_zero_attn = true;
    c.masks = kCmpBool3d;
    c.causal = true;
    cases.push_back(c);
  }
  {
    LayerCase c = base("unbatched_float_2d");
    c.layout = InputLayout::Unbatched;
    c.B = 1, c.L = 130 / scale_down, c.S = 129 / scale_down;
    c.masks = kCmpFloat2d;
    cases.push_back(c);
  }
  {
    LayerCase c = base("dropout_sequence_first_key_padding_float_2d");
    c.dropout = 0.2;
    c.layout = InputLayout::SequenceFirst;
    c.masks = kCmpKeyPadding | kCmpFloat2d;
    cases.push_back(c);
  }
  {
    LayerCase c = base("no_bias_bool_2d_per_head_weights");
    c.bias = false;
    c.masks = kCmpBool2d;
    c.average_attn_weights = false;
    cases.push_back(c);
  }
  {
    LayerCase c = base("h1_dk59_dv111_padding_lengths_float_3d");
    c.E = 96, c.h = 1, c.d_k = 59, c.d_v = 111;
    c.L = 65 / scale_down, c.S = (kBlockK + 1) / scale_down;
    c.masks = kCmpKeyPadding | kCmpLengths | kCmpFloat3d;
    cases.push_back(c);
  }
  return cases;
}

class LayerFlashVsReference : public ::testing::TestWithParam<LayerCase> {};

TEST_P(LayerFlashVsReference, WithinTheRule) {
  const LayerCase& c = GetParam();
  const LayerData d = make_layer_data(c, name_seed(c.name));
  const LayerRun fused = run_layer(c, d, DType::Float32, mha::Kernel::Flash, true);
  const LayerRun ref32 = run_layer(c, d, DType::Float32, mha::Kernel::Reference, true);
  const LayerRun ref64 = run_layer(c, d, DType::Float64, mha::Kernel::Reference, true);
  EXPECT_TRUE(within_rule("out", fused.out, ref32.out, ref64.out, 2.0, {}));
  EXPECT_TRUE(within_rule("weights", fused.weights, ref32.weights, ref64.weights, 2.0, {}));
  ASSERT_EQ(fused.grads.size(), ref64.grads.size());
  for (const auto& [name, grad] : ref64.grads)
    EXPECT_TRUE(within_rule(name.c_str(), fused.grads.at(name), ref32.grads.at(name), grad, 3.0, {}));
}

INSTANTIATE_TEST_SUITE_P(Cases, LayerFlashVsReference, ::testing::ValuesIn(layer_flash_cases()),
                         [](const ::testing::TestParamInfo<LayerCase>& info) { return info.param.name; });

// ---- (c) one tensor as query, key and value; no accumulation -------------------------------------

// One tensor as query, key and value: the three returned gradients sum to the total gradient.
TEST(MhaBackwardSelf, SumOfInputGradientsMatchesCentralDifferences) {
  MultiHeadAttentionConfig cfg;
  cfg.d_model = 4, cfg.num_heads = 2, cfg.dtype = DType::Float64;
  MultiHeadAttention m(cfg, 9);
  Rng rng(61);
  RandomState rs = random_state(4, 2, 2, 2, 4, 4, true, false, false, DType::Float64, rng);
  m.load_state_dict(rs.views());
  Tensor x = random_tensor(DType::Float64, {2, 3, 4}, rng);
  MultiHeadAttentionInputs in;
  in.causal = true;
  const auto out = m.forward(x, x, x, in).out;
  Tensor dout = random_tensor(DType::Float64, out.shape(), rng);
  const auto g = m.backward(dout);
  std::vector<double> total = to_doubles(g.query);
  const auto gk = to_doubles(g.key), gv = to_doubles(g.value);
  for (std::size_t i = 0; i < total.size(); ++i) total[i] += gk[i] + gv[i];
  const auto douts = to_doubles(dout);
  std::vector<double> numeric(total.size());
  const double eps = 1e-6;
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const double x0 = x.data_as<double>()[i];
    x.data_as<double>()[i] = x0 + eps;
    const double up = dot(douts, to_doubles(m.forward(x, x, x, in).out));
    x.data_as<double>()[i] = x0 - eps;
    const double down = dot(douts, to_doubles(m.forward(x, x, x, in).out));
    x.data_as<double>()[i] = x0;
    numeric[static_cast<std::size_t>(i)] = (up - down) / (2 * eps);
  }
  EXPECT_TRUE(all_close(total, numeric, 1e-7, 1e-6, x.shape()));
}

// Gradients are returned in new tensors: the same forward and backward again give the same values
// (nothing accumulates across calls).
TEST(MhaBackwardSelf, BackwardDoesNotAccumulate) {
  MultiHeadAttentionConfig cfg;
  cfg.d_model = 4, cfg.num_heads = 2, cfg.dtype = DType::Float64;
  MultiHeadAttention m(cfg, 10);
  Rng rng(62);
  Tensor x = random_tensor(DType::Float64, {2, 3, 4}, rng);
  Tensor dout = random_tensor(DType::Float64, {2, 3, 4}, rng);
  (void)m.forward(x, x, x);
  const auto a = m.backward(dout);
  (void)m.forward(x, x, x);
  const auto b = m.backward(dout);
  EXPECT_TRUE(bitwise_equal(a.query, b.query));
  for (const auto& [name, t] : a.parameters) EXPECT_TRUE(bitwise_equal(t, b.parameters.at(name))) << name;
}

// The saved forward belongs to the parameters it ran with: after set_parameter / load_state_dict, a
// backward without a new forward is refused (it returned gradients matching neither the old nor the
// new weights), and a new forward makes it work again.
TEST(MhaBackwardSelf, RefusedAfterTheParametersChange) {
  MultiHeadAttentionConfig cfg;
  cfg.d_model = 4, cfg.num_heads = 2, cfg.dtype = DType::Float64;
  MultiHeadAttention m(cfg, 10), other(cfg, 11);
  Rng rng(63);
  Tensor x = random_tensor(DType::Float64, {2, 3, 4}, rng);
  Tensor dout = random_tensor(DType::Float64, {2, 3, 4}, rng);
  (void)m.forward(x, x, x);
  m.load_state_dict(other.state_dict());
  EXPECT_TRUE(throws_error_containing([&] { m.backward(dout); }, "parameters changed"));
  (void)m.forward(x, x, x);
  m.set_parameter("out_proj.weight", other.parameter("out_proj.weight"));
  EXPECT_TRUE(throws_error_containing([&] { m.backward(dout); }, "call forward() again"));
  (void)m.forward(x, x, x);
  const auto after = m.backward(dout);
  (void)other.forward(x, x, x);
  const auto want = other.backward(dout);  // m now holds other's parameters
  EXPECT_TRUE(bitwise_equal(after.query, want.query));
}

// ---- (d) padded keys are never read -------------------------------------------------------------

struct LayerPoisonCase {
  const char* name;
  double poison;
  unsigned masks;
  bool add_bias_kv, add_zero_attn;
  InputLayout layout;
  bool packed;
};

const LayerPoisonCase kLayerPoisonCases[] = {
    {"nan_key_padding_packed", kNaN, kCmpKeyPadding, false, false, InputLayout::BatchFirst, true},
    {"nan_lengths_separate_sequence_first", kNaN, kCmpLengths, false, false, InputLayout::SequenceFirst, false},
    {"nan_padding_lengths_bias_kv_zero_attn", kNaN, kCmpKeyPadding | kCmpLengths, true, true, InputLayout::BatchFirst,
     true},
    {"big_key_padding_separate", 1e10, kCmpKeyPadding, false, false, InputLayout::BatchFirst, false},
    {"big_lengths_packed_sequence_first", 1e10, kCmpLengths, false, false, InputLayout::SequenceFirst, true},
    {"big_lengths_zero_attn", 1e10, kCmpLengths, false, true, InputLayout::BatchFirst, false},
};

TEST(PaddedKeysNeverReadLayer, PoisonedInputsChangeNothing) {
  for (const LayerPoisonCase& p : kLayerPoisonCases) {
    SCOPED_TRACE(p.name);
    LayerCase c;
    c.name = p.name;
    c.E = 32, c.h = 4, c.B = 3, c.L = kSanitized ? 6 : 40, c.S = kSanitized ? 10 : 150;
    if (!p.packed) c.kdim = 24, c.vdim = 40, c.d_v = 12;
    c.add_bias_kv = p.add_bias_kv, c.add_zero_attn = p.add_zero_attn;
    c.layout = p.layout;
    c.masks = p.masks;
    c.need_weights = true;
    c.average_attn_weights = false;
    const KernelCase shape{.B = c.B, .h = c.h, .L = c.L, .S = c.S, .masks = c.masks};
    LayerData clean = make_layer_data(c, 555);
    set_padding(shape, clean.masks);
    LayerData poisoned = clean;
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t j = 0; j < c.S; ++j) {
        if (!key_padded(clean.masks, b, j)) continue;
        const std::int64_t row = input_row(c, c.S, b, j);
        for (std::int64_t e = 0; e < c.kd(); ++e) poisoned.key[static_cast<std::size_t>(row * c.kd() + e)] = p.poison;
        for (std::int64_t e = 0; e < c.vd(); ++e) poisoned.value[static_cast<std::size_t>(row * c.vd() + e)] = p.poison;
      }
    const LayerRun a = run_layer(c, clean, DType::Float32, mha::Kernel::Flash, true);
    const LayerRun r = run_layer(c, poisoned, DType::Float32, mha::Kernel::Flash, true);
    EXPECT_TRUE(same_bits(r.out, a.out)) << "out";
    EXPECT_TRUE(same_bits(r.weights, a.weights)) << "weights";
    EXPECT_TRUE(same_bits(r.grads.at("query"), a.grads.at("query"))) << "d query";
    auto unpadded = [&](std::int64_t row) {  // a row of the key / value input
      for (std::int64_t b = 0; b < c.B; ++b)
        for (std::int64_t j = 0; j < c.S; ++j)
          if (input_row(c, c.S, b, j) == row) return !key_padded(clean.masks, b, j);
      return false;
    };
    for (const char* name : {"key", "value"}) {
      const std::int64_t width = std::string(name) == "key" ? c.kd() : c.vd();
      EXPECT_TRUE(
          same_bits(rows_where(r.grads.at(name), width, unpadded), rows_where(a.grads.at(name), width, unpadded)))
          << "d " << name << " at unpadded positions";
    }
    const std::int64_t qk = c.h * c.dk();
    for (const auto& [name, grad] : a.grads) {
      if (name == "query" || name == "key" || name == "value") continue;
      if (std::isnan(p.poison) && (name == "k_proj_weight" || name == "v_proj_weight")) {
        // d W_k = dK_proj^T key: the padded rows enter as 0 * NaN, which is NaN in IEEE arithmetic
        // (as in PyTorch); only 1e10 can be checked here.
        continue;
      }
      if (std::isnan(p.poison) && name == "in_proj_weight") {  // rows [q | k | v]: only the q rows
        const std::vector<double> q_rows_a(grad.begin(), grad.begin() + qk * c.E);
        const std::vector<double> q_rows_r(r.grads.at(name).begin(), r.grads.at(name).begin() + qk * c.E);
        EXPECT_TRUE(same_bits(q_rows_r, q_rows_a)) << name << " (q rows)";
        continue;
      }
      EXPECT_TRUE(same_bits(r.grads.at(name), grad)) << name;
    }
  }
}

// ---- (e) determinism -----------------------------------------------------------------------------

LayerCase determinism_layer_case() {
  LayerCase c;
  c.name = "determinism";
  c.E = 64, c.h = 4, c.B = 3, c.L = kSanitized ? 12 : 100, c.S = kSanitized ? 16 : 140;
  c.add_bias_kv = true;
  c.dropout = 0.1;
  c.masks = kCmpKeyPadding;
  c.causal = true;
  c.need_weights = true;
  return c;
}

::testing::AssertionResult same_layer_run(const LayerRun& got, const LayerRun& want, std::string* differing) {
  std::ostringstream msg;
  bool ok = true;
  auto check = [&](const std::string& name, const std::vector<double>& a, const std::vector<double>& b) {
    const ::testing::AssertionResult r = same_bits(a, b);
    if (!r) {
      ok = false;
      msg << "\n  " << name << ": " << r.message();
      if (differing) *differing += (differing->empty() ? "" : ", ") + name;
    }
  };
  check("out", got.out, want.out);
  check("weights", got.weights, want.weights);
  for (const auto& [name, g] : want.grads) check("d " + name, got.grads.at(name), g);
  if (ok) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << msg.str();
}

TEST(LayerDeterminism, Repeats) {
  ThreadCountGuard restore;
  mha::set_num_threads(2);
  const LayerCase c = determinism_layer_case();
  const LayerData d = make_layer_data(c, 99);
  const LayerRun first = run_layer(c, d, DType::Float32, mha::Kernel::Flash, true);
  for (int r = 1; r < kRepeats; ++r)
    EXPECT_TRUE(same_layer_run(run_layer(c, d, DType::Float32, mha::Kernel::Flash, true), first, nullptr))
        << "repeat " << r;
}

TEST(LayerDeterminism, OneThreadVsTwo) {
  ThreadCountGuard restore;
  const LayerCase c = determinism_layer_case();
  const LayerData d = make_layer_data(c, 99);
  mha::set_num_threads(2);
  const LayerRun two = run_layer(c, d, DType::Float32, mha::Kernel::Flash, true);
  mha::set_num_threads(1);
  const LayerRun one = run_layer(c, d, DType::Float32, mha::Kernel::Flash, true);
  // The projections run each block of output rows whole on one thread (src/gemm.cpp), so the
  // float32 layer, like the attention core, must not depend on the thread count.
  std::string differing;
  EXPECT_TRUE(same_layer_run(one, two, &differing)) << "1 thread vs 2; differing: " << differing;
}

// The float64 layer has no oneDNN in it (plain-loop projections, the reference kernel): its result
// must not depend on the thread count at all.
TEST(LayerDeterminism, Float64OneThreadVsTwo) {
  ThreadCountGuard restore;
  const LayerCase c = determinism_layer_case();
  const LayerData d = make_layer_data(c, 99);
  mha::set_num_threads(2);
  const LayerRun two = run_layer(c, d, DType::Float64, mha::Kernel::Reference, true);
  mha::set_num_threads(1);
  const LayerRun one = run_layer(c, d, DType::Float64, mha::Kernel::Reference, true);
  EXPECT_TRUE(same_layer_run(one, two, nullptr)) << "1 thread vs 2";
}

}  // namespace
}  // namespace mha_test
