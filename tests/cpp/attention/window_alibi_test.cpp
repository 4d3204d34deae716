// A sliding window (AttentionOptions::window_left / window_right), ALiBi (alibi_slopes) and logit
// soft-capping (softcap):
//   (a) the reference kernel in float64 against the tests' own oracle (support/naive_attention.hpp: the
//       window, the bias and the cap applied to an explicit logits matrix), on 80 seeded configurations
//       with at least one of them (12 under sanitizers); the gradients of the reference are checked against
//       finite differences in gradients_test.cpp, and every fast path against the reference by the random
//       sweeps, which draw windows, ALiBi and soft-capping for a fifth of their cases each;
//   (b) the fused kernel, forward and backward, on hand-picked windows whose edges fall on the kernel's
//       block boundaries (where it skips whole key blocks or query blocks), within the float32 rule;
//   (c) bad windows, slopes and caps are refused naming the argument.
//
// Legend: B batch, h heads, L queries, S keys; query i sits at position i + S - L.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "support/finite_differences.hpp"
#include "support/kernel_compare.hpp"
#include "support/naive_attention.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

// ---- (a) the reference against the oracle ----------------------------------------------------------

std::vector<KernelCase> variant_cases() {
  std::vector<KernelCase> cases;
  const int wanted = kSanitized ? 12 : 80;
  const std::int64_t max_dim = kSanitized ? 24 : 300, max_work = kSanitized ? 20'000 : 400'000;
  for (KernelCase c : random_kernel_cases(10 * wanted, 8080, max_dim, max_work)) {
    if (static_cast<int>(cases.size()) == wanted) break;
    if (c.window_left < 0 && c.window_right < 0 && !c.alibi && c.softcap == 0) continue;
    c.dropout_p = 0.0;  // the oracle has no dropout
    c.index = static_cast<int>(cases.size());
    cases.push_back(c);
  }
  return cases;
}

class WindowAlibiReference : public ::testing::TestWithParam<KernelCase> {};

TEST_P(WindowAlibiReference, MatchesTheOracle) {
  const KernelCase c = GetParam();
  const CaseData d = make_case_data(c);
  const KernelRun got = run_kernel(c, d, DType::Float64, mha::Kernel::Reference, false);
  // The oracle reads k and v per query head: repeat grouped key/value heads.
  std::vector<double> k, v;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t head = 0; head < c.h; ++head) {
      const std::int64_t kv = b * c.kv_heads() + head / c.group();
      k.insert(k.end(), d.k.begin() + kv * c.S * c.d_k, d.k.begin() + (kv + 1) * c.S * c.d_k);
      v.insert(v.end(), d.v.begin() + kv * c.S * c.d_v, d.v.begin() + (kv + 1) * c.S * c.d_v);
    }
  const double scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(static_cast<double>(c.d_k));
  const NaiveResult want = naive_attention(d.q, k, v, c.d_k, c.d_v, scale, d.masks);
  auto close = [](const std::vector<double>& a, const std::vector<double>& b) {
    return max_abs_error(a, b).value <= 1e-12 * std::max(1.0, max_abs_finite(b));
  };
  EXPECT_TRUE(close(got.out, want.out)) << "out";
  EXPECT_TRUE(close(got.lse, want.lse)) << "lse";
  if (c.need_weights) {
    EXPECT_TRUE(close(got.weights, want.weights)) << "weights";
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, WindowAlibiReference, ::testing::ValuesIn(variant_cases()),
                         [](const ::testing::TestParamInfo<KernelCase>& info) { return case_name(info.param); });

TEST(WindowAlibiSweep, CoversNarrowWideOneSidedAndCombinedWindows) {
  bool narrow = false, wide = false, left_only = false, right_only = false, with_causal = false, alibi = false;
  for (const KernelCase& c : variant_cases()) {
    narrow |= c.window_left >= 0 && c.window_left < 16;
    wide |= c.window_left > c.L + c.S / 2 || c.window_right > c.L + c.S / 2;
    left_only |= c.window_left >= 0 && c.window_right < 0;
    right_only |= c.window_right >= 0 && c.window_left < 0;
    with_causal |= c.causal && c.window_left >= 0;
    alibi |= c.alibi;
  }
  if (kSanitized) {  // the sanitizer build's 12 cases: some window and ALiBi, not every kind
    EXPECT_TRUE((narrow || left_only || right_only) && alibi);
    return;
  }
  EXPECT_TRUE(narrow && left_only && right_only && with_causal && alibi && wide);
}

// ---- (b) the fused kernel where window edges meet block edges ----------------------------------

struct WindowShape {
  const char* name;
  std::int64_t L, S, window_left, window_right, h, h_kv;
  bool causal, alibi;
};

// kBlockQShort = 128 (or kBlockQTall = 256, query_block.hpp) query rows and kBlockK = 256 keys per block
// (flash_config.hpp).
const WindowShape kWindowShapes[] = {
    // row 256 (a query block's first) sees key 255 only, the last of the block before its own
    {"left_1_at_block_edges", 2 * kBlockK, 2 * kBlockK, 1, -1, 2, 2, false, false},
    {"left_one_block_causal", 3 * kBlockQShort + 7, 3 * kBlockQShort + 7, kBlockK, 0, 2, 1, true, true},
    {"diagonal_only", 300, 300, 0, 0, 1, 1, false, false},
    {"narrow_both_sides_alibi", 2 * kBlockQShort + 1, 700, 5, 5, 4, 2, false, true},
    {"right_only_cross", 150, 2 * kBlockK + 3, -1, 3, 3, 3, false, false},
    {"wider_than_the_sequence", 200, 260, 1000, 1000, 2, 1, true, true},
    {"left_block_minus_one", 2 * kBlockK + 5, 2 * kBlockK + 5, kBlockK - 1, 2, 1, 1, false, false},
};

void PrintTo(const WindowShape& s, std::ostream* os) { *os << s.name; }

class WindowFlash : public ::testing::TestWithParam<WindowShape> {};

TEST_P(WindowFlash, ForwardAndBackwardWithinTheRule) {
  const WindowShape& s = GetParam();
  KernelCase c;
  c.seed = name_seed(s.name);
  c.B = 1, c.h = s.h, c.h_kv = s.h_kv, c.L = s.L, c.S = s.S, c.d_k = 16, c.d_v = 8;
  c.window_left = s.window_left, c.window_right = s.window_right, c.causal = s.causal, c.alibi = s.alibi;
  c.need_weights = true;
  c.amplitude = 2.0;
  if (kSanitized) c.L = std::min<std::int64_t>(c.L, 40), c.S = std::min<std::int64_t>(c.S, 50);
  expect_fused_within_the_rule(c);
}

INSTANTIATE_TEST_SUITE_P(Shapes, WindowFlash, ::testing::ValuesIn(kWindowShapes),
                         [](const ::testing::TestParamInfo<WindowShape>& info) {
                           return std::string(info.param.name);
                         });

// ---- (c) bad arguments -------------------------------------------------------------------------

void expect_refused(const mha::AttentionOptions& o, const std::string& fragment) {
  const Tensor q(DType::Float32, {1, 2, 3, 4}), k(DType::Float32, {1, 2, 5, 4}), v(DType::Float32, {1, 2, 5, 4});
  try {
    (void)mha::scaled_dot_product_attention(q, k, v, o);
    ADD_FAILURE() << "accepted; expected an error naming " << fragment;
  } catch (const mha::Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(WindowAlibiBadInput, RefusedNamingTheArgument) {
  mha::AttentionOptions o;
  o.window_left = -2;
  expect_refused(o, "window");
  o = {};
  o.window_right = -5;
  expect_refused(o, "window");
  o = {};
  const Tensor three(DType::Float32, {3}), ints(DType::Bool, {2}), bf(DType::BFloat16, {2});
  for (const Tensor* slopes : {&three, &ints, &bf}) {
    o.alibi_slopes = slopes->view();
    expect_refused(o, "alibi_slopes");
  }
  o = {};
  for (double cap : {-1.0, kNaN, kInf}) {
    o.softcap = cap;
    expect_refused(o, "softcap");
  }
}

}  // namespace
}  // namespace mha_test
