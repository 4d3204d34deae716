// bfloat16 attention (both kernels, forward and backward) against float64, under issue 12's rule: the
// error of every bfloat16 output and gradient against the float64 reference (on the same,
// bf16-representable numbers) is at most 2x (3x for gradients) the error of an emulation of what
// bfloat16 attention must lose anyway, plus a small absolute term. The emulation (written here, in
// float64): forward, P = exp(s - m) rounded to bfloat16 before P V and the output rounded to bfloat16
// (FlashAttention's rounding points); gradients, the float64 backward given the bfloat16-rounded output
// (as the caller has only that) with P and dS rounded to bfloat16 for their products, its results
// rounded to bfloat16. The log-sum-exp stays float32: the
// float32 rule (2x the float32 reference's error). 320 seeded configurations (40 under sanitizers) with
// every mask kind, causal, L != S, head dims {1, 5, 16, 32, 59, 64, 80, 96, 111, 128, 256}, sizes on and
// across the tile boundaries, and each head layout. Dropout has its own test: the emulation cannot
// regenerate the library's dropout mask, so there the float64 reference with the same seed is compared
// with a relative bound.
//
// Legend: B batch, h heads, L queries, S keys, d_k query/key width, d_v value width.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "gemm.hpp"
#include "support/bitwise.hpp"
#include "support/kernel_compare.hpp"
#include "support/rising_logits.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

constexpr int kRandomCases = kSanitized ? 40 : 320;
constexpr std::int64_t kMaxDim = kSanitized ? 40 : 300;
constexpr std::int64_t kMaxWork = kSanitized ? 30'000 : 3'000'000;

double bf16(double x) { return bf16_rounded(x); }
std::vector<double> bf16(std::vector<double> values) { return rounded_to(DType::BFloat16, std::move(values)); }

std::vector<KernelCase> bf16_cases() {
  std::vector<KernelCase> cases = random_kernel_cases(kRandomCases, 4242, kMaxDim, kMaxWork);
  for (KernelCase& c : cases) c.dropout_p = 0.0;  // dropout: BfloatDropout below
  return cases;
}

// The case's numbers rounded to bfloat16, so that every dtype's run sees the same values.
CaseData bf16_case_data(const KernelCase& c) {
  CaseData d = make_case_data(c);
  for (auto* x : {&d.q, &d.k, &d.v, &d.dout, &d.masks.float_mask}) *x = bf16(*x);
  return d;
}

// Forward with bfloat16 rounding at FlashAttention's points, in float64 otherwise: out [B, h, L, d_v].
std::vector<double> emulated_bf16_out(const KernelCase& c, const CaseData& d) {
  const double scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(static_cast<double>(c.d_k));
  std::vector<double> out(static_cast<std::size_t>(c.B * c.h * c.L * c.d_v), 0.0), s(static_cast<std::size_t>(c.S));
  for (std::int64_t bh = 0; bh < c.B * c.h; ++bh) {
    const std::int64_t b = bh / c.h, hh = bh % c.h, b_kv = b * c.kv_heads() + hh / c.group();  // K/V's (b, head)
    for (std::int64_t i = 0; i < c.L; ++i) {
      double m = -kInf;
      for (std::int64_t j = 0; j < c.S; ++j) {
        double& x = s[static_cast<std::size_t>(j)];
        x = -kInf;
        if (!d.masks.allowed(b, hh, i, j)) continue;
        double dot = 0;
        for (std::int64_t e = 0; e < c.d_k; ++e)
          dot += d.q[static_cast<std::size_t>((bh * c.L + i) * c.d_k + e)] *
                 d.k[static_cast<std::size_t>((b_kv * c.S + j) * c.d_k + e)];
        x = dot * scale + d.masks.additive(b, hh, i, j);
        m = std::max(m, x);
      }
      if (m == -kInf) continue;
      double l = 0;
      for (double x : s) l += x == -kInf ? 0.0 : std::exp(x - m);
      double* row = &out[static_cast<std::size_t>((bh * c.L + i) * c.d_v)];
      for (std::int64_t j = 0; j < c.S; ++j) {
        const double x = s[static_cast<std::size_t>(j)];
        if (x == -kInf) continue;
        const double p = bf16(std::exp(x - m));  // P rounded for the P V product
        for (std::int64_t e = 0; e < c.d_v; ++e)
          row[e] += p * d.v[static_cast<std::size_t>((b_kv * c.S + j) * c.d_v + e)];
      }
      for (std::int64_t e = 0; e < c.d_v; ++e) row[e] = bf16(row[e] / l);
    }
  }
  return out;
}

struct Gradients {
  std::vector<double> dq, dk, dv;
};

// The float64 backward with FlashAttention's bfloat16 rounding points: D = rowsum(dO * O) from the
// bfloat16-rounded output (all the caller has), P = exp(s - lse), dS = P (dP - D); P rounded to
// bfloat16 in dV = P^T dO, dS rounded in dK = scale dS^T Q and dQ = scale dS K; the gradients rounded.
Gradients emulated_bf16_gradients(const KernelCase& c, const CaseData& d) {
  CaseTensors t = make_case_tensors(c, d, DType::Float64);
  t.options.kernel = mha::Kernel::Reference;
  t.options.need_lse = true;
  const mha::AttentionResult r = mha::scaled_dot_product_attention(t.q.view, t.k.view, t.v.view, t.options);
  const std::vector<double> out = bf16(to_doubles(r.out)), lse = to_doubles(r.lse);
  const double scale = c.scale > 0 ? c.scale : 1.0 / std::sqrt(static_cast<double>(c.d_k));
  Gradients g{std::vector<double>(d.q.size()), std::vector<double>(d.k.size()), std::vector<double>(d.v.size())};
  auto at = [](const std::vector<double>& x, std::int64_t row, std::int64_t width, std::int64_t e) {
    return x[static_cast<std::size_t>(row * width + e)];
  };
  for (std::int64_t bh = 0; bh < c.B * c.h; ++bh) {
    const std::int64_t b = bh / c.h, hh = bh % c.h, b_kv = b * c.kv_heads() + hh / c.group();  // K/V's (b, head)
    for (std::int64_t i = 0; i < c.L; ++i) {
      const std::int64_t qi = bh * c.L + i;
      const double row_lse = lse[static_cast<std::size_t>(qi)];
      if (row_lse == -kInf) continue;
      double D = 0;
      for (std::int64_t e = 0; e < c.d_v; ++e) D += at(d.dout, qi, c.d_v, e) * at(out, qi, c.d_v, e);
      for (std::int64_t j = 0; j < c.S; ++j) {
        const std::int64_t kj = b_kv * c.S + j;
        if (!d.masks.allowed(b, hh, i, j) || d.masks.additive(b, hh, i, j) == -kInf) continue;
        double dot = 0, dp = 0;
        for (std::int64_t e = 0; e < c.d_k; ++e) dot += at(d.q, qi, c.d_k, e) * at(d.k, kj, c.d_k, e);
        for (std::int64_t e = 0; e < c.d_v; ++e) dp += at(d.dout, qi, c.d_v, e) * at(d.v, kj, c.d_v, e);
        const double P = std::exp(dot * scale + d.masks.additive(b, hh, i, j) - row_lse);
        const double p16 = bf16(P), ds16 = bf16(P * (dp - D));
        for (std::int64_t e = 0; e < c.d_v; ++e)
          g.dv[static_cast<std::size_t>(kj * c.d_v + e)] += p16 * at(d.dout, qi, c.d_v, e);
        for (std::int64_t e = 0; e < c.d_k; ++e) {
          g.dk[static_cast<std::size_t>(kj * c.d_k + e)] += scale * ds16 * at(d.q, qi, c.d_k, e);
          g.dq[static_cast<std::size_t>(qi * c.d_k + e)] += scale * ds16 * at(d.k, kj, c.d_k, e);
        }
      }
    }
  }
  for (auto* x : {&g.dq, &g.dk, &g.dv}) *x = bf16(*x);
  return g;
}

class Bfloat16Attention : public ::testing::TestWithParam<std::tuple<KernelCase, mha::Kernel>> {};

// Kernel `kernel` in bfloat16 on case c with numbers d (bfloat16-representable) against float64 by the rule.
void expect_within_the_rule(const KernelCase& c, const CaseData& d, mha::Kernel kernel) {
  const KernelRun got = run_kernel(c, d, DType::BFloat16, kernel, true);
  const KernelRun ref64 = run_kernel(c, d, DType::Float64, mha::Kernel::Reference, true);
  const KernelRun ref32 = run_kernel(c, d, DType::Float32, mha::Kernel::Reference, false);

  // Absolute terms: 1/64 of a bfloat16 ulp (2^-8 relative) of each result's scale, for results that
  // the emulation happens to get exactly (single-key rows, say) where ours differs in the last bit.
  const double out_slack = 0x1.0p-14 * max_abs_finite(ref64.out) + kRuleSlack;
  EXPECT_TRUE(within_rule("out", got.out, emulated_bf16_out(c, d), ref64.out, 2.0, {c.B, c.h, c.L, c.d_v}, out_slack));
  EXPECT_TRUE(within_rule("lse", got.lse, ref32.lse, ref64.lse, 2.0, {c.B, c.h, c.L}));
  if (c.need_weights) {
    EXPECT_TRUE(within_rule("weights", got.weights, bf16(ref64.weights), ref64.weights, 2.0, {c.B, c.h, c.L, c.S},
                            0x1.0p-14 + kRuleSlack));
  }
  const Gradients e = emulated_bf16_gradients(c, d);
  // dq and dk add the float32 cancellation slack of the float rule (kernel_compare.hpp): the backward
  // forms dS = P (dP - D) in float32, where it is exactly 0 in exact arithmetic for a single key.
  for (auto [name, mine, emulated, exact, cancellation] :
       {std::tuple{"dq", &got.dq, &e.dq, &ref64.dq, cancellation_slack(c, d, false)},
        std::tuple{"dk", &got.dk, &e.dk, &ref64.dk, cancellation_slack(c, d, true)},
        std::tuple{"dv", &got.dv, &e.dv, &ref64.dv, kRuleSlack}})
    EXPECT_TRUE(
        within_rule(name, *mine, *emulated, *exact, 3.0, {}, 0x1.0p-14 * max_abs_finite(*exact) + cancellation));
  EXPECT_TRUE(masked_parts_exact(c, d.masks, got));
}

TEST_P(Bfloat16Attention, WithinTheRuleAgainstFloat64) {
  const auto& [c, kernel] = GetParam();
  SCOPED_TRACE(case_name(c));
  expect_within_the_rule(c, bf16_case_data(c), kernel);
}

INSTANTIATE_TEST_SUITE_P(Sweep, Bfloat16Attention,
                         ::testing::Combine(::testing::ValuesIn(bf16_cases()),
                                            ::testing::Values(mha::Kernel::Flash, mha::Kernel::Reference)),
                         [](const auto& info) {
                           return case_name(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) == mha::Kernel::Flash ? "_flash" : "_reference");
                         });

TEST(Bfloat16AttentionSweep, CoversTheIssuesHeadDimsAndMasks) {
  const std::vector<KernelCase> cases = bf16_cases();
  ASSERT_GE(cases.size(), kSanitized ? 40u : 300u);
  std::set<std::int64_t> dims;
  std::set<unsigned> masks;
  int crossing = 0;
  for (const KernelCase& c : cases) {
    dims.insert(c.d_k), dims.insert(c.d_v), masks.insert(c.masks);
    crossing += c.L > kBlockQShort || c.S > kBlockK;
  }
  for (unsigned m : kMaskCombos) EXPECT_TRUE(masks.count(m)) << "mask combination " << m;
  if (!kSanitized) {
    for (std::int64_t d : {1, 59, 64, 80, 111, 128, 256}) EXPECT_TRUE(dims.count(d)) << "head dim " << d;
    EXPECT_GE(crossing, 20);
  }
}

// Logits that rise past the fused forward's softmax headroom in later key blocks (support/rising_logits.hpp;
// the float32 kernel's cases are in softmax_reference_test.cpp), causal and not.
TEST(Bfloat16RisingLogits, WithinTheRuleAgainstFloat64) {
  for (const bool causal : {false, true}) {
    const KernelCase c = rising_logits_case(causal);
    CaseData d = bf16_case_data(c);
    put_rising_logits(c, d);
    d.q = bf16(d.q), d.k = bf16(d.k);
    SCOPED_TRACE(causal ? "causal" : "not causal");
    expect_within_the_rule(c, d, mha::Kernel::Flash);
  }
}

// Dropout in bfloat16: the same positions are dropped as in float64 (exact zeros in the weights), and
// the results are within a few bfloat16 ulps of the float64 reference with the same seed.
TEST(Bfloat16Dropout, DropsThePositionsFloat64DropsWithinBf16Precision) {
  KernelCase c;
  c.B = 2, c.h = 3, c.L = 150, c.S = 270, c.d_k = 64, c.d_v = 40, c.seed = 99;
  c.need_weights = true, c.dropout_p = 0.3, c.causal = true;
  const CaseData d = bf16_case_data(c);
  const KernelRun got = run_kernel(c, d, DType::BFloat16, mha::Kernel::Flash, true);
  const KernelRun ref64 = run_kernel(c, d, DType::Float64, mha::Kernel::Reference, true);
  for (std::size_t i = 0; i < got.weights.size(); ++i)
    ASSERT_EQ(got.weights[i] == 0.0, ref64.weights[i] == 0.0) << "weight " << i;
  for (auto [name, mine, exact] : {std::tuple{"out", &got.out, &ref64.out}, std::tuple{"dq", &got.dq, &ref64.dq},
                                   std::tuple{"dk", &got.dk, &ref64.dk}, std::tuple{"dv", &got.dv, &ref64.dv}}) {
    const MaxError e = max_abs_error(*mine, *exact);
    EXPECT_LE(e.value, 0x1.0p-6 * max_abs_finite(*exact)) << name << " at " << e.at;
  }
}

// bfloat16 results are bitwise the same for 1 and 2 threads and from run to run.
TEST(Bfloat16Determinism, BitwiseAcrossThreadCountsAndRuns) {
  KernelCase c;
  c.B = 2, c.h = 4, c.L = 300, c.S = 290, c.d_k = 64, c.d_v = 64, c.seed = 5, c.causal = true;
  c.masks = kCmpKeyPadding;
  const CaseData d = bf16_case_data(c);
  auto run = [&](int threads) {
    mha::set_num_threads(threads);
    CaseTensors t = make_case_tensors(c, d, DType::BFloat16);
    t.options.need_lse = true;
    mha::AttentionResult r = mha::scaled_dot_product_attention(t.q.view, t.k.view, t.v.view, t.options);
    mha::AttentionGradients g =
        mha::scaled_dot_product_attention_backward(t.dout.view, t.q.view, t.k.view, t.v.view, r.out, r.lse, t.options);
    std::vector<Tensor> results;
    for (Tensor* t : {&r.out, &r.lse, &g.dq, &g.dk, &g.dv}) results.push_back(std::move(*t));
    return results;
  };
  ThreadCountGuard restore;  // the count this thread had (not the bound, which later tests would inherit)
  const auto one = run(1), two = run(2), again = run(2);
  for (std::size_t i = 0; i < one.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(one[i], two[i])) << "result " << i << ": 1 vs 2 threads";
    EXPECT_TRUE(bitwise_equal(two[i], again[i])) << "result " << i << ": run to run";
  }
}

// Where this process's bfloat16 products run on sgemm (forced by ctest's bfloat16_gemm_sgemm; chosen where
// sgemm is faster, as on Intel without AMX; always without bf16 instructions), the fused kernel's bfloat16
// attention is the float32 kernel's on the inputs widened once, its results rounded to bfloat16 once
// (attention_core.cpp, runs_in_float32): bitwise, forward (out, lse, weights) and backward. The bfloat16
// kernel, which rounds P and dS, differed in 10-42% of each result's elements (checked with it put back).
TEST(Bfloat16SgemmPath, IsTheFloat32KernelOnWidenedInputsRoundedOnce) {
  if (mha::detail::bf16_gemm_path() != mha::detail::Bf16Path::WidenedSgemm)
    GTEST_SKIP() << "this process's bfloat16 products run on oneDNN (ctest bfloat16_gemm_sgemm forces sgemm)";
  KernelCase grouped, masked;
  grouped.B = 2, grouped.h = 4, grouped.h_kv = 2, grouped.L = 300, grouped.S = 290, grouped.d_k = 64, grouped.d_v = 64,
  grouped.seed = 7, grouped.causal = true, grouped.masks = kCmpKeyPadding, grouped.layout = Layout::Interleaved;
  masked.B = 1, masked.h = 3, masked.L = 129, masked.S = 257, masked.d_k = 80, masked.d_v = 48, masked.seed = 8,
  masked.masks = kCmpFloat3d | kCmpLengths, masked.need_weights = true, masked.layout = Layout::PaddedRows;
  for (const KernelCase& c : {grouped, masked}) {
    SCOPED_TRACE(case_name(c));
    const CaseData d = bf16_case_data(c);
    CaseTensors t16 = make_case_tensors(c, d, DType::BFloat16), t32 = make_case_tensors(c, d, DType::Float32);
    for (CaseTensors* t : {&t16, &t32}) t->options.need_lse = true, t->options.need_weights = c.need_weights;
    const auto r16 = mha::scaled_dot_product_attention(t16.q.view, t16.k.view, t16.v.view, t16.options);
    const auto r32 = mha::scaled_dot_product_attention(t32.q.view, t32.k.view, t32.v.view, t32.options);
    EXPECT_TRUE(same_bits(to_doubles(r16.out), bf16(to_doubles(r32.out)))) << "out";
    EXPECT_TRUE(same_bits(to_doubles(r16.lse), to_doubles(r32.lse))) << "lse";
    if (c.need_weights) {
      EXPECT_TRUE(same_bits(to_doubles(r16.weights), bf16(to_doubles(r32.weights)))) << "weights";
    }
    // The backward from the bfloat16 forward's out (what a caller has), widened, and its lse.
    const Tensor out_widened = Tensor::copy_of(r16.out, DType::Float32);
    const auto g16 = mha::scaled_dot_product_attention_backward(t16.dout.view, t16.q.view, t16.k.view, t16.v.view,
                                                                r16.out, r16.lse, t16.options);
    const auto g32 = mha::scaled_dot_product_attention_backward(t32.dout.view, t32.q.view, t32.k.view, t32.v.view,
                                                                out_widened, r16.lse, t32.options);
    EXPECT_TRUE(same_bits(to_doubles(g16.dq), bf16(to_doubles(g32.dq)))) << "dq";
    EXPECT_TRUE(same_bits(to_doubles(g16.dk), bf16(to_doubles(g32.dk)))) << "dk";
    EXPECT_TRUE(same_bits(to_doubles(g16.dv), bf16(to_doubles(g32.dv)))) << "dv";
  }
}

TEST(Bfloat16BadInput, MixedDtypesAreRefusedNamingBoth) {
  const Tensor q(DType::BFloat16, {1, 1, 2, 4}), k(DType::Float32, {1, 1, 3, 4}), v(DType::BFloat16, {1, 1, 3, 4});
  try {
    (void)mha::scaled_dot_product_attention(q, k, v);
    FAIL() << "bfloat16 q with float32 k was accepted";
  } catch (const mha::Error& e) {
    EXPECT_NE(std::string(e.what()).find("bfloat16"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("float32"), std::string::npos) << e.what();
  }
  mha::AttentionOptions o;
  const Tensor lse64(DType::Float64, {1, 1, 2});
  o.need_lse = true;
  const auto r = mha::scaled_dot_product_attention(q, v, v, o);
  EXPECT_EQ(r.lse.dtype(), DType::Float32) << "the log-sum-exp of bfloat16 attention is float32";
  EXPECT_THROW((void)mha::scaled_dot_product_attention_backward(r.out, q, v, v, r.out, lse64, o), mha::Error);
}

}  // namespace
}  // namespace mha_test
