// The fused kernel (Kernel::Flash, float32) against the reference kernel, forward, on 520 seeded
// configurations plus a few hand-picked ones (40 small ones under sanitizers): B, h, L, S in 1..300
// with sizes on and off the block boundaries, L != S both ways, d_k != d_v, head dims from
// {1, 5, 16, 32, 59, 64, 80, 96, 111, 128, 256}, every mask kind alone and combined, causal, weights,
// dropout, an explicit scale, and strided layouts.
//
// The rule (FlashAttention's): max |flash32 - ref64| <= 2 * max |ref32 - ref64| + 1e-6 for out, lse and
// weights, where ref64 is the reference kernel on float64 copies of the same (float32) numbers.
// Rows with no allowed key must give exactly 0 output, 0 weights and -inf lse; forbidden positions
// exactly 0 weight.
//
// Legend: B batch, h heads, L queries, S keys, d_k query/key width, d_v value width.
#include <gtest/gtest.h>

#include <cstdint>
#include <iterator>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "support/kernel_compare.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

constexpr int kRandomCases = kSanitized ? 40 : 520;
constexpr std::int64_t kMaxDim = kSanitized ? 48 : 300;
// KernelCase::work() (about B*h*L*S*(d_k + d_v)) per configuration: keeps the file within ~15 s in
// Release on two cores (the float64 and float32 reference runs dominate) and a few seconds under
// sanitizers.
constexpr std::int64_t kMaxWork = kSanitized ? 40'000 : 5'000'000;
static_assert(kSanitized || kMaxDim >= kBlockK + 1, "the sweep must reach past the fused kernel's key blocks");

// Shapes chosen by hand: the extremes of the range and the awkward sides of the fused kernel's blocks
// (128 or 256 queries: query_block.hpp; kBlockK keys).
std::vector<KernelCase> hand_picked_cases() {
  if (kSanitized) return {};
  struct Shape6 {
    std::int64_t B, h, L, S, d_k, d_v;
    unsigned masks;
    bool causal;
  };
  const Shape6 shapes[] = {
      {1, 1, 300, 300, 64, 64, 0u, true},                         // self-attention, several blocks
      {1, 1, 300, 129, 59, 111, kCmpKeyPadding, true},            // causal with L > S: leading rows empty
      {1, 1, kBlockQShort + 1, 300, 111, 59, kCmpLengths, true},  // causal with L < S
      {300, 1, 3, 5, 5, 1, kCmpBool3d, false},                    // many batches
      {1, 300, 2, 7, 16, 5, kCmpFloat3d, true},                   // many heads
      {2, 1, kBlockQShort / 2 + 1, kBlockK + 1, 256, 1, kCmpKeyPadding | kCmpFloat2d, false},
      {1, 1, 1, 300, 1, 256, kCmpLengths | kCmpBool2d, false},  // one query, many keys
      {1, 1, 300, 1, 256, 1, kCmpKeyPadding, true},             // one key: only the last row sees it
      {2, 1, kBlockQShort, kBlockK, 64, 64, kCmpKeyPadding | kCmpLengths | kCmpBool2d, true},  // exact blocks
      {1, 1, 2 * kBlockQShort + 1, kBlockK - 1, 80, 48, kCmpLengths | kCmpFloat3d, false},
      // several blocks both ways, the last ones partial
      {1, 1, 2 * kBlockQShort + 3, kBlockK + 37, 48, 40, kCmpKeyPadding | kCmpBool3d, true},
      // two tall blocks and 3 rows (four short ones and 3 rows), causal across all
      {1, 1, 2 * kBlockQTall + 3, kBlockK + 5, 16, 8, kCmpLengths | kCmpFloat3d, true},
  };
  std::vector<KernelCase> cases;
  int index = 10000;
  // Each shape without weights in both head layouts (the layer's interleaved one reads rows h*d apart,
  // which the kernel packs per block), and with weights, dropout and large logits interleaved.
  const std::pair<bool, Layout> variants[] = {
      {false, Layout::Contiguous}, {false, Layout::Interleaved}, {true, Layout::Interleaved}};
  for (const Shape6& s : shapes) {
    for (auto [weights, layout] : variants) {
      KernelCase c;
      c.index = index++;
      c.seed = 77 + static_cast<std::uint64_t>(c.index);
      c.B = s.B, c.h = s.h, c.L = s.L, c.S = s.S, c.d_k = s.d_k, c.d_v = s.d_v;
      c.masks = s.masks;
      c.causal = s.causal;
      c.need_weights = weights;
      c.dropout_p = weights ? 0.25 : 0.0;
      c.amplitude = weights ? 3.0 : 1.0;
      c.layout = layout;
      cases.push_back(c);
    }
  }
  return cases;
}

std::vector<KernelCase> all_cases() {
  std::vector<KernelCase> cases = random_kernel_cases(kRandomCases, 2024, kMaxDim, kMaxWork);
  for (const KernelCase& c : hand_picked_cases()) cases.push_back(c);
  return cases;
}

class FlashVsReference : public ::testing::TestWithParam<KernelCase> {};

TEST_P(FlashVsReference, ForwardWithinTwiceTheFloat32ReferenceError) {
  const KernelCase& c = GetParam();
  SCOPED_TRACE(case_name(c));
  expect_fused_within_the_rule(c, /*backward=*/false);
}

INSTANTIATE_TEST_SUITE_P(Sweep, FlashVsReference, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<KernelCase>& info) { return case_name(info.param); });

// The random sweep really covers what it is meant to (so a change to the generator cannot quietly
// thin it out).
TEST(FlashVsReferenceSweep, CoversTheRequiredConfigurations) {
  const std::vector<KernelCase> cases = all_cases();
  ASSERT_GE(cases.size(), kSanitized ? 40u : 500u);
  std::set<unsigned> combos;
  std::set<std::int64_t> dims;
  int l_gt_s = 0, l_lt_s = 0, causal_l_gt_s = 0, causal_l_lt_s = 0, dk_ne_dv = 0, odd_sizes = 0, weights = 0,
      dropout = 0, interleaved = 0, padded_rows = 0, large = 0;
  for (const KernelCase& c : cases) {
    combos.insert(c.masks);
    dims.insert(c.d_k);
    dims.insert(c.d_v);
    l_gt_s += c.L > c.S;
    l_lt_s += c.L < c.S;
    causal_l_gt_s += c.causal && c.L > c.S;
    causal_l_lt_s += c.causal && c.L < c.S;
    dk_ne_dv += c.d_k != c.d_v;
    odd_sizes += c.L % kBlockQShort != 0 && c.S % kBlockK != 0 && c.L > kBlockQShort && c.S > kBlockK;
    weights += c.need_weights;
    dropout += c.dropout_p > 0;
    interleaved += c.layout == Layout::Interleaved;
    padded_rows += c.layout == Layout::PaddedRows;
    large += c.B * c.h >= 100 || c.L >= 250 || c.S >= 250;
    EXPECT_LE(c.work(), kSanitized ? kMaxWork : 14'000'000) << case_name(c);
  }
  for (unsigned m : kMaskCombos) EXPECT_TRUE(combos.count(m)) << "mask combination " << m << " never drawn";
  if (!kSanitized) {
    for (std::int64_t d : kHeadDims) EXPECT_TRUE(dims.count(d)) << "head dim " << d << " never drawn";
    EXPECT_GE(odd_sizes, 10);
    EXPECT_GE(large, 20);
  }
  for (int n : {l_gt_s, l_lt_s, causal_l_gt_s, causal_l_lt_s, dk_ne_dv, weights, dropout, interleaved, padded_rows})
    EXPECT_GE(n, kSanitized ? 1 : 10);
}

}  // namespace
}  // namespace mha_test
