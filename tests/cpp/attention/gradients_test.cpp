// Gradients of attention, four ways:
//   (a) the reference backward in float64 against central finite differences of
//       loss = sum(dout * out), every mask kind, causal (L < S and L > S), dropout with a fixed seed;
//   (b) the fused backward (Kernel::Flash, float32) against the reference backward in float64 on 150
//       seeded configurations and 6 hand-picked ones (20 small ones under sanitizers), FlashAttention's
//       rule with factor 3:
//       max |flash32 - ref64| <= 3 * max |ref32 - ref64| + 1e-6 for dq, dk and dv, and exact zeros for
//       rows with no allowed key (dq) and keys no query may see (dk, dv);
//   (c) MultiHeadAttention::backward in float64 against finite differences, for every input and
//       parameter: packed and separate projections, d_k != d_v, add_bias_kv, add_zero_attn, batch first,
//       sequence first and unbatched inputs, masks, causal, dropout;
//   (d) MultiHeadAttention in float32 with the fused kernel against a float64 layer with the reference
//       kernel (same parameters through load_state_dict), the float32 reference layer as the yardstick:
//       factor 2 for out and weights, 3 for every gradient.
//
// Legend: B batch, h heads, L queries, S keys, d_k query/key width, d_v value width, E = d_model.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "support/kernel_compare.hpp"
#include "support/layer_harness.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

// FNV-1a, so a case's seed depends on its name only.
std::uint64_t name_seed(const std::string& name) {
  std::uint64_t x = 0xcbf29ce484222325ULL;
  for (unsigned char ch : name) x = (x ^ ch) * 0x100000001b3ULL;
  return x;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double s = 0.0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) s += a[i] * b[i];
  return s;
}

// Under sanitizers every kFdStride-th element is differenced (the analytic backward still runs whole).
constexpr std::size_t kFdStride = kSanitized ? 5 : 1;

// d loss / d values[i] by the fourth-order central difference
//   (-f(x + 2e) + 8 f(x + e) - 8 f(x - e) + f(x - 2e)) / 12e,
// whose error (about e^4 |f^(5)| + eps |f| / e, ~1e-12 here) is far below the tolerance, for every
// kFdStride-th i, against analytic[i]: |analytic - numeric| <= 1e-9 + 1e-7 |numeric|.
template <class Loss>
::testing::AssertionResult matches_finite_differences(const std::vector<double>& analytic, std::vector<double>& values,
                                                      Loss&& loss, const Shape& shape = {}) {
  constexpr double e = 1e-3, atol = 1e-9, rtol = 1e-7;
  if (analytic.size() != values.size())
    return ::testing::AssertionFailure() << "gradient has " << analytic.size() << " elements, input " << values.size();
  std::vector<double> got, want;
  for (std::size_t i = 0; i < values.size(); i += kFdStride) {
    const double x = values[i];
    double f[4];
    const double offsets[4] = {2 * e, e, -e, -2 * e};
    for (int s = 0; s < 4; ++s) {
      values[i] = x + offsets[s];
      f[s] = loss();
    }
    values[i] = x;
    want.push_back((-f[0] + 8 * f[1] - 8 * f[2] + f[3]) / (12 * e));
    got.push_back(analytic[i]);
  }
  return all_close(got, want, atol, rtol, kFdStride == 1 ? shape : Shape{});  // sampled: flat indices
}

// ---- (a) the reference backward in float64 against finite differences --------------------------

struct FdCase {
  const char* name;
  std::int64_t B, h, L, S, d_k, d_v;
  unsigned masks;
  bool causal;
  double dropout_p;
  double scale;  // 0: default
};

void PrintTo(const FdCase& c, std::ostream* os) { *os << c.name; }

KernelCase kernel_case(const FdCase& f) {
  KernelCase c;
  c.seed = name_seed(f.name);
  c.B = f.B, c.h = f.h, c.L = f.L, c.S = f.S, c.d_k = f.d_k, c.d_v = f.d_v;
  c.masks = f.masks;
  c.causal = f.causal;
  c.dropout_p = f.dropout_p;
  c.scale = f.scale;
  c.amplitude = 1.5;  // logits of a few units: softmax neither flat nor saturated
  return c;
}

const FdCase kFdCases[] = {
    {"plain", 2, 2, 4, 5, 3, 2, 0u, false, 0.0, 0.0},
    {"key_padding", 2, 2, 4, 5, 3, 2, kCmpKeyPadding, false, 0.0, 0.0},
    {"key_lengths", 3, 2, 4, 5, 3, 2, kCmpLengths, false, 0.0, 0.0},
    {"bool_2d", 2, 2, 4, 5, 3, 2, kCmpBool2d, false, 0.0, 0.0},
    {"bool_3d", 2, 2, 4, 5, 3, 2, kCmpBool3d, false, 0.0, 0.0},
    {"float_2d", 2, 2, 4, 5, 3, 2, kCmpFloat2d, false, 0.0, 0.0},
    {"float_3d", 2, 2, 4, 5, 3, 2, kCmpFloat3d, false, 0.0, 0.0},
    {"causal_L_lt_S", 2, 2, 3, 6, 3, 2, 0u, true, 0.0, 0.0},
    {"causal_L_gt_S", 2, 2, 6, 3, 3, 2, 0u, true, 0.0, 0.0},
    {"causal_key_padding_float_2d", 2, 2, 4, 5, 3, 2, kCmpKeyPadding | kCmpFloat2d, true, 0.0, 0.0},
    {"causal_lengths_bool_3d", 2, 2, 5, 4, 2, 3, kCmpLengths | kCmpBool3d, true, 0.0, 0.0},
    {"padding_lengths_float_3d", 2, 2, 4, 5, 3, 2, kCmpKeyPadding | kCmpLengths | kCmpFloat3d, false, 0.0, 0.0},
    {"dropout", 2, 2, 4, 5, 3, 2, 0u, false, 0.3, 0.0},
    {"dropout_causal_key_padding", 2, 2, 5, 5, 3, 2, kCmpKeyPadding, true, 0.5, 0.0},
    {"dropout_float_3d", 1, 3, 4, 6, 2, 2, kCmpFloat3d, false, 0.2, 0.0},
    {"explicit_scale", 2, 2, 4, 5, 3, 2, kCmpBool2d, false, 0.0, 0.7},
    {"one_key", 2, 2, 4, 1, 3, 2, 0u, false, 0.0, 0.0},
    {"one_query", 2, 2, 1, 5, 3, 2, kCmpKeyPadding, false, 0.0, 0.0},
    {"dk1_dv5", 2, 1, 3, 4, 1, 5, 0u, true, 0.0, 0.0},
};

class ReferenceBackwardVsFiniteDifferences : public ::testing::TestWithParam<FdCase> {};

TEST_P(ReferenceBackwardVsFiniteDifferences, Float64) {
  ThreadCountGuard threads;  // the result does not depend on threads; one avoids waking a team per call
  mha::set_num_threads(1);
  const KernelCase c = kernel_case(GetParam());
  const CaseData base = make_case_data(c);
  const KernelRun analytic = run_kernel(c, base, DType::Float64, mha::Kernel::Reference, true);
  CaseData d = base;
  auto loss = [&] { return dot(run_kernel(c, d, DType::Float64, mha::Kernel::Reference, false).out, d.dout); };
  EXPECT_TRUE(matches_finite_differences(analytic.dq, d.q, loss, {c.B, c.h, c.L, c.d_k})) << "dq";
  EXPECT_TRUE(matches_finite_differences(analytic.dk, d.k, loss, {c.B, c.h, c.S, c.d_k})) << "dk";
  EXPECT_TRUE(matches_finite_differences(analytic.dv, d.v, loss, {c.B, c.h, c.S, c.d_v})) << "dv";
  EXPECT_TRUE(masked_parts_exact(c, base.masks, analytic));
}

INSTANTIATE_TEST_SUITE_P(Cases, ReferenceBackwardVsFiniteDifferences, ::testing::ValuesIn(kFdCases),
                         [](const ::testing::TestParamInfo<FdCase>& info) { return std::string(info.param.name); });

// ---- (b) the fused backward against the reference backward --------------------------------------

constexpr int kBackwardCases = kSanitized ? 20 : 150;
constexpr std::int64_t kBackwardMaxDim = kSanitized ? 40 : 300;
constexpr std::int64_t kBackwardMaxWork = kSanitized ? 20'000 : 2'500'000;

std::vector<KernelCase> backward_cases() {
  std::vector<KernelCase> cases = random_kernel_cases(kBackwardCases, 4048, kBackwardMaxDim, kBackwardMaxWork);
  if (kSanitized) return cases;
  // Several query and key blocks with causal L != S, padding across block edges, a whole padded block.
  struct Shape7 {
    std::int64_t B, h, L, S, d_k, d_v;
    unsigned masks;
    bool causal;
    double dropout_p;
  };
  const Shape7 shapes[] = {
      {1, 1, 300, 130, 32, 48, 0u, true, 0.0},
      {1, 1, 130, 300, 48, 32, kCmpKeyPadding, true, 0.0},
      {2, 1, 257, 257, 16, 16, kCmpLengths, true, 0.1},
      {1, 2, 129, 260, 59, 5, kCmpKeyPadding | kCmpFloat2d, false, 0.0},
      {1, 1, 200, 129, 111, 80, kCmpLengths | kCmpBool3d, true, 0.5},
      {2, 2, 200, 1, 32, 96, 0u, false, 0.0},  // one key: dq and dk are exactly 0 in exact arithmetic
  };
  int index = 20000;
  for (const Shape7& s : shapes) {
    KernelCase c;
    c.index = index++;
    c.seed = 99 + static_cast<std::uint64_t>(c.index);
    c.B = s.B, c.h = s.h, c.L = s.L, c.S = s.S, c.d_k = s.d_k, c.d_v = s.d_v;
    c.masks = s.masks;
    c.causal = s.causal;
    c.dropout_p = s.dropout_p;
    c.amplitude = 2.0;
    cases.push_back(c);
  }
  return cases;
}

class FlashBackwardVsReference : public ::testing::TestWithParam<KernelCase> {};

TEST_P(FlashBackwardVsReference, WithinThriceTheFloat32ReferenceError) {
  const KernelCase& c = GetParam();
  SCOPED_TRACE(case_name(c));
  const CaseData d = make_case_data(c);
  const KernelRun fused = run_kernel(c, d, DType::Float32, mha::Kernel::Flash, true);
  const KernelRun ref32 = run_kernel(c, d, DType::Float32, mha::Kernel::Reference, true);
  const KernelRun ref64 = run_kernel(c, d, DType::Float64, mha::Kernel::Reference, true);
  EXPECT_TRUE(within_rule("out", fused.out, ref32.out, ref64.out, 2.0, {c.B, c.h, c.L, c.d_v}));
  EXPECT_TRUE(within_rule("dq", fused.dq, ref32.dq, ref64.dq, 3.0, {c.B, c.h, c.L, c.d_k},
                          cancellation_slack(c, d, false)));
  EXPECT_TRUE(within_rule("dk", fused.dk, ref32.dk, ref64.dk, 3.0, {c.B, c.h, c.S, c.d_k},
                          cancellation_slack(c, d, true)));
  EXPECT_TRUE(within_rule("dv", fused.dv, ref32.dv, ref64.dv, 3.0, {c.B, c.h, c.S, c.d_v}));
  EXPECT_TRUE(masked_parts_exact(c, d.masks, fused)) << "fused";
  EXPECT_TRUE(masked_parts_exact(c, d.masks, ref64)) << "reference, float64";
}

INSTANTIATE_TEST_SUITE_P(Sweep, FlashBackwardVsReference, ::testing::ValuesIn(backward_cases()),
                         [](const ::testing::TestParamInfo<KernelCase>& info) { return case_name(info.param); });

// ---- (c) MultiHeadAttention::backward in float64 against finite differences ---------------------

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

// ---- (d) the float32 layer with the fused kernel against a float64 reference layer --------------

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
    c.L = 65 / scale_down, c.S = 257 / scale_down;
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

}  // namespace
}  // namespace mha_test
