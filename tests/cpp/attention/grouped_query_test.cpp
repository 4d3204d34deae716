// Grouped-query attention (GQA; multi-query attention when h_kv = 1): k and v with h_kv key/value
// heads, h_kv dividing h, query head i reading key/value head i / (h / h_kv).
//   (a) the reference kernel with grouped heads equals the reference kernel on k and v with each
//       key/value head repeated for its group (the plain multi-head path, checked against finite
//       differences in gradients_test.cpp), dk and dv being the sums of the repeated heads' gradients
//       over each group; on 120 seeded configurations (15 under sanitizers);
//   (b) the fused kernel on hand-picked grouped shapes where its group items are awkward (one query
//       row, 160 heads on one key/value head, causal with L > S), forward and backward,
//       within the float32 rule against the float64 reference (the random sweeps of
//       flash_vs_reference_test.cpp, gradients_test.cpp and bfloat16_test.cpp draw grouped heads too);
//   (c) bfloat16 determinism with grouped heads (float32's is in flash_properties_test.cpp);
//   (d) bad head counts are refused naming h_kv.
//
// Legend: B batch, h query heads, h_kv key/value heads, L queries, S keys, d_k, d_v head widths.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "support/bitwise.hpp"
#include "support/finite_differences.hpp"
#include "support/kernel_compare.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

// [B, h_kv, T, d] -> [B, h, T, d]: each key/value head repeated for the g query heads of its group.
std::vector<double> repeat_heads(const std::vector<double>& x, const KernelCase& c, std::int64_t T, std::int64_t d) {
  std::vector<double> out(static_cast<std::size_t>(c.B * c.h * T * d));
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t head = 0; head < c.h; ++head)
      std::copy_n(x.begin() + ((b * c.kv_heads() + head / c.group()) * T * d), T * d,
                  out.begin() + ((b * c.h + head) * T * d));
  return out;
}

// [B, h, T, d] -> [B, h_kv, T, d]: the gradients of the repeated heads summed over each group, in order.
std::vector<double> sum_groups(const std::vector<double>& x, const KernelCase& c, std::int64_t T, std::int64_t d) {
  std::vector<double> out(static_cast<std::size_t>(c.B * c.kv_heads() * T * d), 0.0);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t head = 0; head < c.h; ++head)
      for (std::int64_t n = 0; n < T * d; ++n)
        out[static_cast<std::size_t>((b * c.kv_heads() + head / c.group()) * T * d + n)] +=
            x[static_cast<std::size_t>((b * c.h + head) * T * d + n)];
  return out;
}

// ---- (a) the reference with grouped heads = the reference on repeated heads -----------------------

std::vector<KernelCase> grouped_cases() {
  std::vector<KernelCase> cases;
  const int wanted = kSanitized ? 15 : 120;
  const std::int64_t max_dim = kSanitized ? 24 : 160, max_work = kSanitized ? 20'000 : 600'000;
  for (KernelCase c : random_kernel_cases(40 * wanted, 5151, max_dim, max_work)) {
    if (static_cast<int>(cases.size()) == wanted) break;
    if (c.h < 2) continue;
    if (c.kv_heads() == c.h) c.h_kv = cases.size() % 2 == 0 || c.h % 2 != 0 || c.h == 2 ? 1 : 2;
    c.index = static_cast<int>(cases.size());
    cases.push_back(c);
  }
  return cases;
}

class GroupedReference : public ::testing::TestWithParam<KernelCase> {};

TEST_P(GroupedReference, EqualsTheReferenceOnRepeatedHeads) {
  const KernelCase c = GetParam();
  ASSERT_LT(c.kv_heads(), c.h);
  const CaseData d = make_case_data(c);
  KernelCase repeated = c;
  repeated.h_kv = 0;
  CaseData rd = d;
  rd.k = repeat_heads(d.k, c, c.S, c.d_k);
  rd.v = repeat_heads(d.v, c, c.S, c.d_v);
  const KernelRun grouped = run_kernel(c, d, DType::Float64, mha::Kernel::Reference, true);
  const KernelRun want = run_kernel(repeated, rd, DType::Float64, mha::Kernel::Reference, true);
  // The forward and dq read the same numbers in the same order: the same bits.
  EXPECT_TRUE(same_bits(grouped.out, want.out)) << "out";
  EXPECT_TRUE(same_bits(grouped.lse, want.lse)) << "lse";
  EXPECT_TRUE(same_bits(grouped.weights, want.weights)) << "weights";
  EXPECT_TRUE(same_bits(grouped.dq, want.dq)) << "dq";
  // dk, dv: one sum over the group's rows against per-head sums added up: float64 rounding apart.
  const std::vector<double> dk = sum_groups(want.dk, c, c.S, c.d_k), dv = sum_groups(want.dv, c, c.S, c.d_v);
  EXPECT_LE(max_abs_error(grouped.dk, dk).value, 1e-12 * std::max(1.0, max_abs_finite(dk))) << "dk";
  EXPECT_LE(max_abs_error(grouped.dv, dv).value, 1e-12 * std::max(1.0, max_abs_finite(dv))) << "dv";
  EXPECT_TRUE(masked_parts_exact(c, d.masks, grouped));
}

INSTANTIATE_TEST_SUITE_P(Sweep, GroupedReference, ::testing::ValuesIn(grouped_cases()),
                         [](const ::testing::TestParamInfo<KernelCase>& info) { return case_name(info.param); });

TEST(GroupedReferenceSweep, CoversMultiQueryTwoGroupsAndWiderGroups) {
  bool multi_query = false, two = false, other = false, causal = false;
  for (const KernelCase& c : grouped_cases()) {
    multi_query |= c.kv_heads() == 1;
    two |= c.kv_heads() == 2;
    other |= c.kv_heads() > 2;
    causal |= c.causal && c.L != c.S;
  }
  EXPECT_TRUE(multi_query && two && causal);
  if (!kSanitized) {
    EXPECT_TRUE(other);
  }
}

// ---- (b) the fused kernel on awkward grouped shapes ------------------------------------------------

struct GroupedShape {
  const char* name;
  std::int64_t B, h, h_kv, L, S, d_k, d_v;
  unsigned masks;
  bool causal;
  Layout layout;
};

const GroupedShape kShapes[] = {
    {"decode_one_row_8_per_group", 2, 8, 1, 1, 300, 64, 64, kCmpLengths, true, Layout::Interleaved},
    {"one_kv_head_for_160_heads", 1, 160, 1, 3, 40, 16, 8, kCmpKeyPadding, false, Layout::Contiguous},
    {"three_per_group_blocks", 2, 12, 4, kBlockQShort + 1, kBlockK + 1, 32, 24, kCmpBool3d, true, Layout::Interleaved},
    {"causal_L_gt_S", 1, 6, 3, 300, 5, 8, 8, kCmpFloat3d, true, Layout::PaddedRows},
    {"odd_rows_per_head", 1, 5, 1, 77, 260, 59, 111, kCmpKeyPadding | kCmpFloat2d, false, Layout::Contiguous},
};

void PrintTo(const GroupedShape& s, std::ostream* os) { *os << s.name; }

class GroupedFlash : public ::testing::TestWithParam<GroupedShape> {};

TEST_P(GroupedFlash, ForwardAndBackwardWithinTheRule) {
  const GroupedShape& s = GetParam();
  KernelCase c;
  c.seed = name_seed(s.name);
  c.B = s.B, c.h = s.h, c.h_kv = s.h_kv, c.L = s.L, c.S = s.S, c.d_k = s.d_k, c.d_v = s.d_v;
  c.masks = s.masks, c.causal = s.causal, c.layout = s.layout;
  c.need_weights = true;
  if (kSanitized) c.L = std::min<std::int64_t>(c.L, 20), c.S = std::min<std::int64_t>(c.S, 30);
  expect_fused_within_the_rule(c);
}

INSTANTIATE_TEST_SUITE_P(Shapes, GroupedFlash, ::testing::ValuesIn(kShapes),
                         [](const ::testing::TestParamInfo<GroupedShape>& info) {
                           return std::string(info.param.name);
                         });

// ---- (c) bfloat16 determinism ----------------------------------------------------------------------

TEST(GroupedBfloat16, BitwiseAcrossThreadCounts) {
  ThreadCountGuard restore;
  KernelCase c;
  c.B = 2, c.h = 6, c.h_kv = 2, c.L = kSanitized ? 30 : 200, c.S = kSanitized ? 40 : 290, c.d_k = 32, c.d_v = 32;
  c.seed = 6, c.causal = true, c.masks = kCmpKeyPadding, c.layout = Layout::Interleaved;
  const CaseData d = make_case_data(c);
  mha::set_num_threads(1);
  const KernelRun one = run_kernel(c, d, DType::BFloat16, mha::Kernel::Flash, true);
  mha::set_num_threads(2);
  const KernelRun two = run_kernel(c, d, DType::BFloat16, mha::Kernel::Flash, true);
  EXPECT_TRUE(same_bits(one.out, two.out) && same_bits(one.lse, two.lse)) << "forward";
  EXPECT_TRUE(same_bits(one.dq, two.dq) && same_bits(one.dk, two.dk) && same_bits(one.dv, two.dv)) << "backward";
}

// ---- (d) bad head counts ---------------------------------------------------------------------------

void expect_refused(std::int64_t h, std::int64_t h_k, std::int64_t h_v, const std::string& fragment) {
  const Tensor q(DType::Float32, {1, h, 2, 4}), k(DType::Float32, {1, h_k, 3, 4}), v(DType::Float32, {1, h_v, 3, 4});
  try {
    (void)mha::scaled_dot_product_attention(q, k, v);
    ADD_FAILURE() << "h " << h << ", k heads " << h_k << ", v heads " << h_v << " accepted";
  } catch (const mha::Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(GroupedBadInput, HeadCountsThatDoNotDivideAreRefusedNamingHkv) {
  expect_refused(4, 3, 3, "h_kv");         // 3 does not divide 4
  expect_refused(2, 4, 4, "h_kv");         // more key/value heads than query heads
  expect_refused(4, 0, 0, "h_kv");         // no key/value heads for 4 query heads
  expect_refused(4, 2, 1, "v: expected");  // k and v disagree
  const Tensor q(DType::Float32, {1, 4, 2, 4}), k(DType::Float32, {1, 2, 3, 4}), v(DType::Float32, {1, 2, 3, 4});
  EXPECT_NO_THROW((void)mha::scaled_dot_product_attention(q, k, v));
}

}  // namespace
}  // namespace mha_test
