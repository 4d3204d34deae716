// Gradients of the attention kernels, two ways:
//   (a) the reference backward in float64 against central finite differences of
//       loss = sum(dout * out), every mask kind, causal (L < S and L > S), dropout with a fixed seed;
//   (b) the fused backward (Kernel::Flash, float32) against the reference backward in float64 on 150
//       seeded configurations and 6 hand-picked ones (20 small ones under sanitizers), FlashAttention's
//       rule with factor 3:
//       max |flash32 - ref64| <= 3 * max |ref32 - ref64| + 1e-6 for dq, dk and dv, and exact zeros for
//       rows with no allowed key (dq) and keys no query may see (dk, dv).
// MultiHeadAttention's backward is tested in layer/backward_test.cpp.
//
// Legend: B batch, h heads, L queries, S keys, d_k query/key width, d_v value width.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "support/finite_differences.hpp"
#include "support/kernel_compare.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

// ---- (a) the reference backward in float64 against finite differences --------------------------

struct FdCase {
  const char* name;
  std::int64_t B, h, L, S, d_k, d_v;
  unsigned masks;
  bool causal;
  double dropout_p;
  double scale;           // 0: default
  std::int64_t h_kv = 0;  // key/value heads (grouped-query attention); 0: h
  std::int64_t window_left = -1, window_right = -1;
  bool alibi = false;
  double softcap = 0.0;
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
  c.h_kv = f.h_kv;
  c.window_left = f.window_left, c.window_right = f.window_right, c.alibi = f.alibi;
  c.softcap = f.softcap;
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
    // grouped-query attention: dk and dv sum the group's query heads
    {"grouped_2_of_4_causal_bool_3d", 2, 4, 4, 5, 3, 2, kCmpBool3d, true, 0.0, 0.0, 2},
    {"multi_query_dropout_key_padding", 1, 3, 4, 6, 2, 3, kCmpKeyPadding, false, 0.3, 0.0, 1},
    {"grouped_3_of_6_float_3d_lengths", 2, 6, 3, 4, 2, 2, kCmpFloat3d | kCmpLengths, false, 0.0, 0.0, 2},
    // a sliding window and ALiBi: masks and a bias, no gradient of their own
    {"window_1_2_alibi", 2, 2, 5, 6, 3, 2, 0u, false, 0.0, 0.0, 0, 1, 2, true},
    {"window_left_causal_dropout", 1, 2, 6, 6, 3, 2, kCmpKeyPadding, true, 0.3, 0.0, 0, 2, -1, false},
    {"alibi_grouped_float_2d", 2, 4, 4, 5, 3, 2, kCmpFloat2d, true, 0.0, 0.0, 1, -1, -1, true},
    // logit soft-capping: the gradient goes through d cap / d logit = 1 - tanh^2
    {"softcap_below_the_logits", 2, 2, 4, 5, 3, 2, kCmpKeyPadding, false, 0.0, 0.0, 0, -1, -1, false, 0.5},
    {"softcap_window_alibi_dropout", 1, 2, 5, 6, 3, 2, 0u, true, 0.2, 0.0, 0, 2, -1, true, 2.0},
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
  EXPECT_TRUE(matches_finite_differences(analytic.dk, d.k, loss, {c.B, c.kv_heads(), c.S, c.d_k})) << "dk";
  EXPECT_TRUE(matches_finite_differences(analytic.dv, d.v, loss, {c.B, c.kv_heads(), c.S, c.d_v})) << "dv";
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
  // Several query and key blocks (128 or 256 queries, kBlockK keys) with causal L != S, padding across block
  // edges, a whole padded block.
  struct Shape7 {
    std::int64_t B, h, L, S, d_k, d_v;
    unsigned masks;
    bool causal;
    double dropout_p;
  };
  const Shape7 shapes[] = {
      {1, 1, 300, 130, 32, 48, 0u, true, 0.0},
      {1, 1, 130, 300, 48, 32, kCmpKeyPadding, true, 0.0},
      {2, 1, 2 * kBlockQShort + 1, kBlockK + 1, 16, 16, kCmpLengths, true, 0.1},
      {1, 2, kBlockQShort + 1, 260, 59, 5, kCmpKeyPadding | kCmpFloat2d, false, 0.0},
      {1, 1, 200, 129, 111, 80, kCmpLengths | kCmpBool3d, true, 0.5},
      {2, 2, 200, 1, 32, 96, 0u, false, 0.0},  // one key: dq and dk are exactly 0 in exact arithmetic
  };
  int index = 20000;
  for (const Shape7& s : shapes)
    for (Layout layout : {Layout::Contiguous, Layout::Interleaved}) {  // interleaved: as the layer calls it
      KernelCase c;
      c.index = index++;
      c.seed = 99 + static_cast<std::uint64_t>(c.index);
      c.B = s.B, c.h = s.h, c.L = s.L, c.S = s.S, c.d_k = s.d_k, c.d_v = s.d_v;
      c.masks = s.masks;
      c.causal = s.causal;
      c.dropout_p = s.dropout_p;
      c.amplitude = 2.0;
      c.layout = layout;
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
  EXPECT_TRUE(
      within_rule("dq", fused.dq, ref32.dq, ref64.dq, 3.0, {c.B, c.h, c.L, c.d_k}, cancellation_slack(c, d, false)));
  EXPECT_TRUE(within_rule("dk", fused.dk, ref32.dk, ref64.dk, 3.0, {c.B, c.kv_heads(), c.S, c.d_k},
                          cancellation_slack(c, d, true)));
  EXPECT_TRUE(within_rule("dv", fused.dv, ref32.dv, ref64.dv, 3.0, {c.B, c.kv_heads(), c.S, c.d_v}));
  EXPECT_TRUE(masked_parts_exact(c, d.masks, fused)) << "fused";
  EXPECT_TRUE(masked_parts_exact(c, d.masks, ref64)) << "reference, float64";
}

INSTANTIATE_TEST_SUITE_P(Sweep, FlashBackwardVsReference, ::testing::ValuesIn(backward_cases()),
                         [](const ::testing::TestParamInfo<KernelCase>& info) { return case_name(info.param); });

}  // namespace
}  // namespace mha_test
