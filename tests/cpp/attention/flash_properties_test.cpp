// Properties of the fused kernel (Kernel::Flash) beyond accuracy:
//   (a) keys hidden by key_padding_mask or key_lengths are never read: filling them in k and v with NaN
//       or 1e10 changes no result bit (out, weights, lse, dq, and dk / dv at unpadded positions);
//   (b) determinism: forward and backward are bitwise identical over 20 repeats and across
//       mha::set_num_threads(1), (2) and (3), grouped-query attention included;
//   (c) the vectorised exps the kernels use: attention/flash_exp_test.cpp;
//   (d) edge cases: causal with L > S (leading rows attend to nothing), S = 0, L = 0, and a NaN in one
//       query row reaching no other row.
// The same properties of MultiHeadAttention (padded key and value inputs never read, determinism of
// forward and backward) are in layer/backward_test.cpp.
//
// Legend: B batch, h heads, L queries, S keys, d_k query/key width, d_v value width.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "attention/query_block.hpp"
#include "support/bitwise.hpp"
#include "support/kernel_compare.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

// ---- (a) padded keys are never read --------------------------------------------------------------

struct PoisonCase {
  const char* name;
  double poison;
  unsigned masks;  // kCmpKeyPadding and / or kCmpLengths
  bool causal;
  double dropout_p;
  bool need_weights;
  bool small;
};

void PrintTo(const PoisonCase& c, std::ostream* os) { *os << c.name; }

const PoisonCase kPoisonCases[] = {
    {"nan_key_padding", kNaN, kCmpKeyPadding, false, 0.0, true, false},
    {"nan_lengths", kNaN, kCmpLengths, false, 0.0, true, false},
    {"nan_padding_lengths_causal_dropout", kNaN, kCmpKeyPadding | kCmpLengths, true, 0.2, true, false},
    {"big_key_padding_causal", 1e10, kCmpKeyPadding, true, 0.0, false, false},
    {"big_lengths_dropout", 1e10, kCmpLengths, false, 0.3, true, false},
    {"inf_key_padding", kInf, kCmpKeyPadding, false, 0.0, true, false},
    {"nan_key_padding_small", kNaN, kCmpKeyPadding, true, 0.0, true, true},
    {"big_lengths_small", 1e10, kCmpLengths, false, 0.0, true, true},
};

// A case whose padding covers single keys, runs of keys, a whole key block and a whole batch.
KernelCase poison_kernel_case(const PoisonCase& p) {
  KernelCase c;
  c.seed = 4242;
  const bool small = p.small || kSanitized;
  c.B = 3, c.h = 2, c.L = small ? 7 : 150, c.S = small ? 11 : 270, c.d_k = small ? 5 : 40, c.d_v = small ? 3 : 24;
  c.masks = p.masks;
  c.causal = p.causal;
  c.dropout_p = p.dropout_p;
  c.need_weights = p.need_weights;
  c.amplitude = 2.0;
  return c;
}

class PaddedKeysNeverRead : public ::testing::TestWithParam<std::tuple<PoisonCase, mha::Kernel>> {};

TEST_P(PaddedKeysNeverRead, Kernel) {
  const PoisonCase& p = std::get<0>(GetParam());
  const mha::Kernel kernel = std::get<1>(GetParam());
  const KernelCase c = poison_kernel_case(p);
  CaseData clean = make_case_data(c);
  set_padding(c, clean.masks);
  CaseData poisoned = clean;
  std::int64_t poisoned_keys = 0;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t j = 0; j < c.S; ++j) {
      if (!key_padded(clean.masks, b, j)) continue;
      ++poisoned_keys;
      for (std::int64_t hh = 0; hh < c.h; ++hh) {
        const std::int64_t key = (b * c.h + hh) * c.S + j;
        for (std::int64_t e = 0; e < c.d_k; ++e) poisoned.k[static_cast<std::size_t>(key * c.d_k + e)] = p.poison;
        for (std::int64_t e = 0; e < c.d_v; ++e) poisoned.v[static_cast<std::size_t>(key * c.d_v + e)] = p.poison;
      }
    }
  ASSERT_GT(poisoned_keys, 0);

  const KernelRun a = run_kernel(c, clean, DType::Float32, kernel, true);
  const KernelRun b = run_kernel(c, poisoned, DType::Float32, kernel, true);
  EXPECT_TRUE(same_bits(b.out, a.out)) << "out";
  EXPECT_TRUE(same_bits(b.lse, a.lse)) << "lse";
  EXPECT_TRUE(same_bits(b.weights, a.weights)) << "weights";
  EXPECT_TRUE(same_bits(b.dq, a.dq)) << "dq";
  auto unpadded = [&](std::int64_t key_row) {  // key_row = (b * h + head) * S + j
    return !key_padded(clean.masks, key_row / (c.h * c.S), key_row % c.S);
  };
  EXPECT_TRUE(same_bits(rows_where(b.dk, c.d_k, unpadded), rows_where(a.dk, c.d_k, unpadded))) << "dk";
  EXPECT_TRUE(same_bits(rows_where(b.dv, c.d_v, unpadded), rows_where(a.dv, c.d_v, unpadded))) << "dv";
  // And the exact zeros: rows with nothing to attend to, gradients of keys nobody sees.
  EXPECT_TRUE(masked_parts_exact(c, clean.masks, b)) << "poisoned run";
}

INSTANTIATE_TEST_SUITE_P(Cases, PaddedKeysNeverRead,
                         ::testing::Combine(::testing::ValuesIn(kPoisonCases), ::testing::ValuesIn(kAllKernels)),
                         [](const ::testing::TestParamInfo<PaddedKeysNeverRead::ParamType>& info) {
                           return std::string(kernel_name(std::get<1>(info.param))) + "_" +
                                  std::get<0>(info.param).name;
                         });

// ---- (b) determinism -----------------------------------------------------------------------------

KernelCase determinism_case() {
  KernelCase c;
  c.seed = 31337;
  c.B = 2, c.h = 3, c.L = kSanitized ? 40 : 300, c.S = kSanitized ? 50 : 260;
  c.d_k = kSanitized ? 8 : 64, c.d_v = kSanitized ? 5 : 48;
  c.masks = kCmpKeyPadding | kCmpFloat2d;
  c.causal = true;
  c.dropout_p = 0.1;
  c.need_weights = true;
  c.amplitude = 2.0;
  return c;
}

void expect_same_run(const KernelRun& got, const KernelRun& want, const std::string& what) {
  EXPECT_TRUE(same_bits(got.out, want.out)) << what << ": out";
  EXPECT_TRUE(same_bits(got.weights, want.weights)) << what << ": weights";
  EXPECT_TRUE(same_bits(got.lse, want.lse)) << what << ": lse";
  EXPECT_TRUE(same_bits(got.dq, want.dq)) << what << ": dq";
  EXPECT_TRUE(same_bits(got.dk, want.dk)) << what << ": dk";
  EXPECT_TRUE(same_bits(got.dv, want.dv)) << what << ": dv";
}

// One (b, head) with many key blocks: the backward deals them into several groups, each with a dQ of its
// own, summed in a fixed order (flash_backward.cpp); interleaved heads, as the layer has them.
KernelCase one_head_determinism_case() {
  KernelCase c;
  c.seed = 4242;
  c.B = 1, c.h = 1, c.L = kSanitized ? 40 : 2 * mha::detail::query_block_rows() + 5,
  c.S = kSanitized ? 60 : 5 * kBlockK + 7;
  c.d_k = kSanitized ? 8 : 64, c.d_v = kSanitized ? 8 : 64;
  c.causal = true;
  c.amplitude = 2.0;
  c.layout = Layout::Interleaved;
  return c;
}

// Grouped-query attention: 6 query heads on 2 key/value heads (each item of the forward stacks a
// group's rows; the backward sums a group's dK and dV), interleaved heads, masks and dropout.
KernelCase grouped_determinism_case() {
  KernelCase c = determinism_case();
  c.seed = 777;
  c.h = 6, c.h_kv = 2;
  c.layout = Layout::Interleaved;
  return c;
}

class FlashDeterminism : public ::testing::TestWithParam<int> {};

TEST_P(FlashDeterminism, KernelRepeatsAndThreadCounts) {
  ThreadCountGuard restore;
  const KernelCase c = GetParam() == 0   ? determinism_case()
                       : GetParam() == 1 ? one_head_determinism_case()
                                         : grouped_determinism_case();
  const CaseData d = make_case_data(c);
  mha::set_num_threads(2);
  const KernelRun first = run_kernel(c, d, DType::Float32, mha::Kernel::Flash, true);
  for (int r = 1; r < kRepeats; ++r)
    expect_same_run(run_kernel(c, d, DType::Float32, mha::Kernel::Flash, true), first, "repeat " + std::to_string(r));
  for (int threads : {1, 3}) {
    mha::set_num_threads(threads);
    expect_same_run(run_kernel(c, d, DType::Float32, mha::Kernel::Flash, true), first,
                    std::to_string(threads) + " threads vs 2");
  }
}

std::string determinism_case_name(const ::testing::TestParamInfo<int>& info) {
  const char* names[] = {"MasksDropoutWeights", "OneHeadManyKeyBlocks", "GroupedQuery"};
  return names[info.param];
}

INSTANTIATE_TEST_SUITE_P(Cases, FlashDeterminism, ::testing::Values(0, 1, 2), determinism_case_name);

// ---- (d) edge cases ------------------------------------------------------------------------------

TEST(FlashEdgeCases, CausalWithMoreQueriesThanKeys) {
  for (const auto& [L, S] :
       {std::pair<std::int64_t, std::int64_t>{5, 2}, {kSanitized ? 40 : 200, kSanitized ? 13 : 70}}) {
    KernelCase c;
    c.seed = 8;
    c.B = 2, c.h = 2, c.L = L, c.S = S, c.d_k = 32, c.d_v = 16;
    c.causal = true;
    c.need_weights = true;
    SCOPED_TRACE(case_name(c));
    const CaseData d = make_case_data(c);
    const KernelRun fused = run_kernel(c, d, DType::Float32, mha::Kernel::Flash, true);
    const KernelRun ref32 = run_kernel(c, d, DType::Float32, mha::Kernel::Reference, true);
    const KernelRun ref64 = run_kernel(c, d, DType::Float64, mha::Kernel::Reference, true);
    // The first L - S rows attend to nothing: out 0, weights 0, lse -inf, dq 0.
    for (std::int64_t bh = 0; bh < c.B * c.h; ++bh)
      for (std::int64_t i = 0; i < L - S; ++i) {
        const std::int64_t row = bh * L + i;
        EXPECT_EQ(fused.lse[static_cast<std::size_t>(row)], -kInf) << "row " << row;
        for (std::int64_t e = 0; e < c.d_v; ++e) EXPECT_EQ(fused.out[static_cast<std::size_t>(row * c.d_v + e)], 0.0);
        for (std::int64_t e = 0; e < c.d_k; ++e) EXPECT_EQ(fused.dq[static_cast<std::size_t>(row * c.d_k + e)], 0.0);
        for (std::int64_t j = 0; j < S; ++j) EXPECT_EQ(fused.weights[static_cast<std::size_t>(row * S + j)], 0.0);
      }
    EXPECT_TRUE(masked_parts_exact(c, d.masks, fused));
    EXPECT_TRUE(within_rule("out", fused.out, ref32.out, ref64.out, 2.0, {c.B, c.h, c.L, c.d_v}));
    EXPECT_TRUE(within_rule("lse", fused.lse, ref32.lse, ref64.lse, 2.0, {c.B, c.h, c.L}));
    EXPECT_TRUE(within_rule("weights", fused.weights, ref32.weights, ref64.weights, 2.0, {c.B, c.h, c.L, c.S}));
    EXPECT_TRUE(within_rule("dq", fused.dq, ref32.dq, ref64.dq, 3.0, {c.B, c.h, c.L, c.d_k}));
    EXPECT_TRUE(within_rule("dk", fused.dk, ref32.dk, ref64.dk, 3.0, {c.B, c.kv_heads(), c.S, c.d_k}));
    EXPECT_TRUE(within_rule("dv", fused.dv, ref32.dv, ref64.dv, 3.0, {c.B, c.kv_heads(), c.S, c.d_v}));
  }
}

class FlashEmpty : public ::testing::TestWithParam<mha::Kernel> {};

TEST_P(FlashEmpty, NoKeys) {
  const std::int64_t B = 2, h = 3, L = 5, S = 0, d_k = 8, d_v = 4;
  Rng rng(1);
  const Tensor q = random_tensor(DType::Float32, {B, h, L, d_k}, rng);
  const Tensor k(DType::Float32, {B, h, S, d_k});
  const Tensor v(DType::Float32, {B, h, S, d_v});
  mha::AttentionOptions o;
  o.kernel = GetParam();
  o.need_weights = true;
  o.need_lse = true;
  o.causal = true;
  const mha::AttentionResult r = mha::scaled_dot_product_attention(q, k, v, o);
  ASSERT_EQ(r.out.shape(), (Shape{B, h, L, d_v}));
  EXPECT_EQ(r.weights.shape(), (Shape{B, h, L, S}));
  ASSERT_EQ(r.lse.shape(), (Shape{B, h, L}));
  for (double x : to_doubles(r.out)) EXPECT_EQ(x, 0.0);
  for (double x : to_doubles(r.lse)) EXPECT_EQ(x, -kInf);
  const Tensor dout = random_tensor(DType::Float32, {B, h, L, d_v}, rng);
  const mha::AttentionGradients g = mha::scaled_dot_product_attention_backward(dout, q, k, v, r.out, r.lse, o);
  ASSERT_EQ(g.dq.shape(), q.shape());
  EXPECT_EQ(g.dk.shape(), k.shape());
  EXPECT_EQ(g.dv.shape(), v.shape());
  for (double x : to_doubles(g.dq)) EXPECT_EQ(x, 0.0);
}

TEST_P(FlashEmpty, NoQueries) {
  const std::int64_t B = 2, h = 3, L = 0, S = 6, d_k = 8, d_v = 4;
  Rng rng(2);
  const Tensor q(DType::Float32, {B, h, L, d_k});
  const Tensor k = random_tensor(DType::Float32, {B, h, S, d_k}, rng);
  const Tensor v = random_tensor(DType::Float32, {B, h, S, d_v}, rng);
  mha::AttentionOptions o;
  o.kernel = GetParam();
  o.need_weights = true;
  o.need_lse = true;
  const mha::AttentionResult r = mha::scaled_dot_product_attention(q, k, v, o);
  EXPECT_EQ(r.out.shape(), (Shape{B, h, L, d_v}));
  EXPECT_EQ(r.weights.shape(), (Shape{B, h, L, S}));
  EXPECT_EQ(r.lse.shape(), (Shape{B, h, L}));
  const Tensor dout(DType::Float32, {B, h, L, d_v});
  const mha::AttentionGradients g = mha::scaled_dot_product_attention_backward(dout, q, k, v, r.out, r.lse, o);
  EXPECT_EQ(g.dq.shape(), q.shape());
  ASSERT_EQ(g.dk.shape(), k.shape());
  ASSERT_EQ(g.dv.shape(), v.shape());
  for (double x : to_doubles(g.dk)) EXPECT_EQ(x, 0.0);
  for (double x : to_doubles(g.dv)) EXPECT_EQ(x, 0.0);
}

INSTANTIATE_TEST_SUITE_P(Kernels, FlashEmpty, ::testing::ValuesIn(kAllKernels),
                         [](const ::testing::TestParamInfo<mha::Kernel>& info) { return kernel_name(info.param); });

TEST(FlashEdgeCases, NanInOneQueryRowReachesOnlyThatRow) {
  KernelCase c;
  c.seed = 12;
  c.B = 2, c.h = 2, c.L = kSanitized ? 20 : 200, c.S = kSanitized ? 30 : 150, c.d_k = 16, c.d_v = 8;
  c.need_weights = true;
  c.masks = kCmpKeyPadding;
  const CaseData clean = make_case_data(c);
  CaseData poisoned = clean;
  const std::int64_t bad_row = (1 * c.h + 0) * c.L + c.L / 2 + 3;  // (b 1, head 0, i L/2 + 3): mid-block
  poisoned.q[static_cast<std::size_t>(bad_row * c.d_k + 5)] = kNaN;
  const KernelRun a = run_kernel(c, clean, DType::Float32, mha::Kernel::Flash, true);
  const KernelRun b = run_kernel(c, poisoned, DType::Float32, mha::Kernel::Flash, true);
  auto other = [&](std::int64_t row) { return row != bad_row; };
  EXPECT_TRUE(same_bits(rows_where(b.out, c.d_v, other), rows_where(a.out, c.d_v, other))) << "out";
  EXPECT_TRUE(same_bits(rows_where(b.lse, 1, other), rows_where(a.lse, 1, other))) << "lse";
  EXPECT_TRUE(same_bits(rows_where(b.weights, c.S, other), rows_where(a.weights, c.S, other))) << "weights";
  // dq of other rows depends on their own probabilities and on k, v only; dk and dv legitimately see
  // the NaN row (dK = dS^T Q sums over every query).
  EXPECT_TRUE(same_bits(rows_where(b.dq, c.d_k, other), rows_where(a.dq, c.d_k, other))) << "dq";
}

TEST(FlashEdgeCases, OutputDoesNotDependOnWhatElseIsRequested) {
  KernelCase c;
  c.seed = 5;
  c.B = 2, c.h = 2, c.L = 130, c.S = 140, c.d_k = 24, c.d_v = 40;
  c.masks = kCmpLengths | kCmpFloat2d;
  c.causal = true;
  c.dropout_p = 0.2;
  const CaseData d = make_case_data(c);
  CaseTensors t = make_case_tensors(c, d, DType::Float32);
  t.options.kernel = mha::Kernel::Flash;
  const mha::AttentionResult plain = mha::scaled_dot_product_attention(t.q.view, t.k.view, t.v.view, t.options);
  t.options.need_weights = true;
  t.options.need_lse = true;
  const mha::AttentionResult full = mha::scaled_dot_product_attention(t.q.view, t.k.view, t.v.view, t.options);
  EXPECT_FALSE(plain.weights.defined());
  EXPECT_FALSE(plain.lse.defined());
  EXPECT_TRUE(bitwise_equal(plain.out, full.out));
}

}  // namespace
}  // namespace mha_test
