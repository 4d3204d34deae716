// scaled_dot_product_attention on the cases the header singles out: hand-computed values, causal
// alignment, L = 0 and S = 0, fully masked rows, NaN isolation, poisoned masked keys, strided and
// broadcast inputs, huge logits and the scale option.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "support/naive_attention.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::AttentionOptions;
using mha::AttentionResult;
using mha::scaled_dot_product_attention;

class AttentionEdge : public KernelParamTest<DType> {
 protected:
  DType dtype() const { return param(); }
};
INSTANTIATE_TEST_SUITE_P(Dtypes, AttentionEdge, kFloatDtypesTimesKernels, dtype_kernel_name);

// One query, two keys, width 1, scale 1: logits 0 and ln 2, so weights 1/3 and 2/3. The oracle is
// checked against the hand values too, so that a mistake in it cannot hide one in the library.
TEST_P(AttentionEdge, HandComputedTwoKeys) {
  const DType dt = dtype();
  const double ln2 = std::log(2.0);
  Tensor q = make_tensor(dt, {1, 1, 1, 1}, {1.0});
  Tensor k = make_tensor(dt, {1, 1, 2, 1}, {0.0, ln2});
  Tensor v = make_tensor(dt, {1, 1, 2, 2}, {1.0, -1.0, 4.0, 2.0});
  AttentionOptions o = options();
  o.scale = 1.0;
  o.need_weights = true;
  o.need_lse = true;
  const AttentionResult r = scaled_dot_product_attention(q, k, v, o);
  const double tol = dt == DType::Float64 ? 1e-14 : 1e-6;
  // out = 1/3 * [1, -1] + 2/3 * [4, 2] = [3, 1]; lse = log(1 + 2) (the k value is rounded in float32).
  const double kq = to_doubles(k)[1];
  const double w1 = std::exp(kq) / (1.0 + std::exp(kq));
  EXPECT_TRUE(all_close(to_doubles(r.weights), {1.0 - w1, w1}, tol, tol));
  EXPECT_TRUE(all_close(to_doubles(r.out), {(1.0 - w1) * 1.0 + w1 * 4.0, -(1.0 - w1) + w1 * 2.0}, tol, tol));
  EXPECT_TRUE(all_close(to_doubles(r.lse), {std::log(1.0 + std::exp(kq))}, tol, tol));
  if (dt == DType::Float64) {
    EXPECT_TRUE(all_close(to_doubles(r.out), {3.0, 1.0}, 1e-14, 1e-14));
    NaiveMaskSpec m;
    m.B = 1, m.h = 1, m.L = 1, m.S = 2;
    const NaiveResult n = naive_attention(to_doubles(q), to_doubles(k), to_doubles(v), 1, 2, 1.0, m);
    EXPECT_TRUE(all_close(n.out, {3.0, 1.0}, 1e-14, 1e-14)) << "oracle";
    EXPECT_TRUE(all_close(n.weights, {1.0 / 3.0, 2.0 / 3.0}, 1e-14, 1e-14)) << "oracle";
    EXPECT_TRUE(all_close(n.lse, {std::log(3.0)}, 1e-14, 1e-14)) << "oracle";
  }
}

// Which weights are nonzero under causal masking, for L < S and L > S, read off the header's rule
// "query i may attend to key j only when j <= i + S - L" without the oracle.
TEST_P(AttentionEdge, CausalIsBottomRightAligned) {
  const DType dt = dtype();
  Rng rng(7);
  for (const auto& [L, S] :
       std::vector<std::pair<std::int64_t, std::int64_t>>{{2, 5}, {5, 2}, {4, 4}, {1, 6}, {6, 1}}) {
    SCOPED_TRACE("L=" + std::to_string(L) + " S=" + std::to_string(S));
    Tensor q = random_tensor(dt, {1, 1, L, 3}, rng);
    Tensor k = random_tensor(dt, {1, 1, S, 3}, rng);
    Tensor v = random_tensor(dt, {1, 1, S, 2}, rng, 1.0, 2.0);  // positive, so a seen key makes out > 0
    AttentionOptions o = options();
    o.causal = true;
    o.need_weights = true;
    o.need_lse = true;
    const AttentionResult r = scaled_dot_product_attention(q, k, v, o);
    const auto w = to_doubles(r.weights);
    const auto out = to_doubles(r.out);
    const auto lse = to_doubles(r.lse);
    ASSERT_EQ(w.size(), static_cast<std::size_t>(L * S));
    for (std::int64_t i = 0; i < L; ++i) {
      bool any = false;
      for (std::int64_t j = 0; j < S; ++j) {
        const bool visible = j <= i + S - L;
        any |= visible;
        if (visible) EXPECT_GT(w[static_cast<std::size_t>(i * S + j)], 0.0) << "i=" << i << " j=" << j;
        else EXPECT_EQ(w[static_cast<std::size_t>(i * S + j)], 0.0) << "i=" << i << " j=" << j;
      }
      if (any) {
        EXPECT_GT(out[static_cast<std::size_t>(i * 2)], 0.0) << "i=" << i;
        EXPECT_TRUE(std::isfinite(lse[static_cast<std::size_t>(i)]));
      } else {
        EXPECT_EQ(out[static_cast<std::size_t>(i * 2)], 0.0) << "i=" << i;
        EXPECT_EQ(out[static_cast<std::size_t>(i * 2 + 1)], 0.0) << "i=" << i;
        EXPECT_EQ(lse[static_cast<std::size_t>(i)], -kInf) << "i=" << i;
      }
    }
  }
}

TEST_P(AttentionEdge, NoQueriesGiveEmptyResultsOfTheRightShape) {
  const DType dt = dtype();
  Rng rng(3);
  Tensor q(dt, {2, 3, 0, 5});
  Tensor k = random_tensor(dt, {2, 3, 7, 5}, rng);
  Tensor v = random_tensor(dt, {2, 3, 7, 4}, rng);
  AttentionOptions o = options();
  o.need_weights = true;
  o.need_lse = true;
  o.causal = true;
  o.key_lengths = {3, 7};
  const AttentionResult r = scaled_dot_product_attention(q, k, v, o);
  EXPECT_TRUE(r.out.defined());
  EXPECT_EQ(r.out.shape(), (Shape{2, 3, 0, 4}));
  EXPECT_EQ(r.out.dtype(), dt);
  EXPECT_EQ(r.weights.shape(), (Shape{2, 3, 0, 7}));
  EXPECT_EQ(r.lse.shape(), (Shape{2, 3, 0}));
}

TEST_P(AttentionEdge, NoKeysGiveZeroRowsAndMinusInfLse) {
  const DType dt = dtype();
  Rng rng(4);
  Tensor q = random_tensor(dt, {2, 3, 6, 5}, rng);
  Tensor k(dt, {2, 3, 0, 5});
  Tensor v(dt, {2, 3, 0, 4});
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE(variant);
    AttentionOptions o = options();
    o.need_weights = true;
    o.need_lse = true;
    Tensor kpm(DType::Bool, {2, 0});
    if (variant == 1) {
      o.causal = true;
      o.key_lengths = {0, 0};
    }
    if (variant == 2) o.key_padding_mask = kpm.view();
    const AttentionResult r = scaled_dot_product_attention(q, k, v, o);
    ASSERT_EQ(r.out.shape(), (Shape{2, 3, 6, 4}));
    EXPECT_EQ(to_doubles(r.out), std::vector<double>(2 * 3 * 6 * 4, 0.0));
    EXPECT_EQ(r.weights.shape(), (Shape{2, 3, 6, 0}));
    ASSERT_EQ(r.lse.shape(), (Shape{2, 3, 6}));
    EXPECT_EQ(to_doubles(r.lse), std::vector<double>(2 * 3 * 6, -kInf));
  }
}

// Every way of forbidding all keys of a row: the row's output and weights are exactly 0, its lse is
// -inf, nothing anywhere is NaN, and the other rows still match the oracle.
TEST_P(AttentionEdge, FullyMaskedRowsAreZeroNotNaN) {
  const DType dt = dtype();
  const std::int64_t B = 2, h = 2, L = 5, S = 4, d_k = 3, d_v = 2;
  Rng rng(5);
  Tensor q = random_tensor(dt, {B, h, L, d_k}, rng);
  Tensor k = random_tensor(dt, {B, h, S, d_k}, rng);
  Tensor v = random_tensor(dt, {B, h, S, d_v}, rng);
  const char* kinds[] = {"key_padding_all",   "key_lengths_zero", "bool_row",
                         "float_row_neg_inf", "causal_L_gt_S",    "bool3d_row_and_padding"};
  for (const char* kind : kinds) {
    SCOPED_TRACE(kind);
    const std::string s = kind;
    NaiveMaskSpec m;
    m.B = B, m.h = h, m.L = L, m.S = S;
    if (s == "key_padding_all") m.key_padding = {0, 1, 0, 1, 1, 1, 1, 1};  // batch 1 all padding
    if (s == "key_lengths_zero") m.key_lengths = {0, 3};
    if (s == "bool_row") {
      m.bool_mask.assign(static_cast<std::size_t>(L * S), 0);
      for (std::int64_t j = 0; j < S; ++j) m.bool_mask[static_cast<std::size_t>(2 * S + j)] = 1;  // query 2
    }
    if (s == "float_row_neg_inf") {
      m.float_mask = rounded_to(dt, random_values(L * S, rng));
      for (std::int64_t j = 0; j < S; ++j) m.float_mask[static_cast<std::size_t>(4 * S + j)] = -kInf;
    }
    if (s == "causal_L_gt_S") m.causal = true;  // the first L - S = 1 queries see nothing
    if (s == "bool3d_row_and_padding") {
      // Query 1 of (b=0, head 1) forbids keys 0 and 1; padding forbids keys 2 and 3 of batch 0.
      m.bool_mask_batched = true;
      m.bool_mask.assign(static_cast<std::size_t>(B * h * L * S), 0);
      m.bool_mask[static_cast<std::size_t>(((0 * h + 1) * L + 1) * S + 0)] = 1;
      m.bool_mask[static_cast<std::size_t>(((0 * h + 1) * L + 1) * S + 1)] = 1;
      m.key_padding = {0, 0, 1, 1, 0, 0, 0, 0};
    }
    std::vector<Tensor> storage;
    AttentionOptions o = options_for(m, dt, storage);
    o.kernel = kernel();
    o.kernel = kernel();
    o.need_weights = true;
    o.need_lse = true;
    const AttentionResult r = scaled_dot_product_attention(q, k, v, o);
    const NaiveResult want =
        naive_attention(to_doubles(q), to_doubles(k), to_doubles(v), d_k, d_v, 1.0 / std::sqrt(3.0), m);
    const auto out = to_doubles(r.out), w = to_doubles(r.weights), lse = to_doubles(r.lse);
    EXPECT_TRUE(all_finite(out));
    EXPECT_TRUE(all_finite(w));
    std::size_t masked_rows = 0;
    for (std::size_t row = 0; row < want.lse.size(); ++row) {
      if (want.lse[row] != -kInf) continue;
      ++masked_rows;
      EXPECT_EQ(lse[row], -kInf) << "row " << row;
      for (std::int64_t c = 0; c < d_v; ++c)
        EXPECT_EQ(out[row * d_v + static_cast<std::size_t>(c)], 0.0) << "row " << row;
      for (std::int64_t j = 0; j < S; ++j) EXPECT_EQ(w[row * S + static_cast<std::size_t>(j)], 0.0) << "row " << row;
    }
    EXPECT_GT(masked_rows, 0u) << "the case must mask at least one row";
    const Tolerance tol = tolerance_for(dt);
    EXPECT_TRUE(all_close(out, want.out, tol.atol, tol.rtol, r.out.shape()));
    EXPECT_TRUE(all_close(w, want.weights, tol.atol, tol.rtol, r.weights.shape()));
    EXPECT_TRUE(all_close(lse, want.lse, tol.atol, tol.rtol, r.lse.shape()));
  }
}

// A NaN in one query row reaches only that row's output: every other row is bitwise the same as with
// clean data.
TEST_P(AttentionEdge, NaNInOneQueryRowStaysInThatRow) {
  const DType dt = dtype();
  const std::int64_t B = 2, h = 2, L = 6, S = 7, d_k = 5, d_v = 3;
  Rng rng(6);
  Tensor q = random_tensor(dt, {B, h, L, d_k}, rng);
  Tensor k = random_tensor(dt, {B, h, S, d_k}, rng);
  Tensor v = random_tensor(dt, {B, h, S, d_v}, rng);
  AttentionOptions o = options();
  o.need_weights = true;
  o.need_lse = true;
  const AttentionResult clean = scaled_dot_product_attention(q, k, v, o);
  const std::int64_t bad_row = (1 * h + 0) * L + 3;  // b = 1, head 0, query 3
  store(q.data(), dt, bad_row * d_k + 2, kNaN);
  const AttentionResult dirty = scaled_dot_product_attention(q, k, v, o);
  const auto co = to_doubles(clean.out), dirty_out = to_doubles(dirty.out);
  const auto cw = to_doubles(clean.weights), dw = to_doubles(dirty.weights);
  for (std::int64_t row = 0; row < B * h * L; ++row) {
    if (row == bad_row) continue;
    for (std::int64_t c = 0; c < d_v; ++c) {
      const auto i = static_cast<std::size_t>(row * d_v + c);
      EXPECT_EQ(dirty_out[i], co[i]) << "row " << row;
    }
    for (std::int64_t j = 0; j < S; ++j) {
      const auto i = static_cast<std::size_t>(row * S + j);
      EXPECT_EQ(dw[i], cw[i]) << "row " << row;
    }
  }
}

// Masked keys are never read: NaN, Inf or 1e10 stored in k and v where the masks forbid a key for
// every query of its (batch, head) leave out, weights and lse bitwise unchanged.
struct PoisonCase {
  const char* name;
  DType dtype;
  double poison;
  int how;  // 0 key_padding_mask, 1 key_lengths, 2 key_lengths + causal, 3 bool [B*h, L, S] columns,
            // 4 bool [L, S] columns
};

void PrintTo(const PoisonCase& c, std::ostream* os) { *os << c.name; }

class AttentionPoison : public KernelParamTest<PoisonCase> {};

TEST_P(AttentionPoison, MaskedKeysAreNeverRead) {
  const PoisonCase& c = param();
  const DType dt = c.dtype;
  const std::int64_t B = 2, h = 2, L = 4, S = 6, d_k = 3, d_v = 5;
  Rng rng(8);
  Tensor q = random_tensor(dt, {B, h, L, d_k}, rng);
  Tensor k = random_tensor(dt, {B, h, S, d_k}, rng);
  Tensor v = random_tensor(dt, {B, h, S, d_v}, rng);
  Tensor kd = k.clone(), vd = v.clone();

  NaiveMaskSpec m;
  m.B = B, m.h = h, m.L = L, m.S = S;
  // forbidden(b, hh, j): key j of (b, hh) is forbidden for every query.
  std::vector<std::uint8_t> forbidden(static_cast<std::size_t>(B * h * S), 0);
  auto forbid = [&](std::int64_t b, std::int64_t hh, std::int64_t j) {
    forbidden[static_cast<std::size_t>((b * h + hh) * S + j)] = 1;
  };
  if (c.how == 0) {
    m.key_padding = {0, 1, 0, 0, 1, 1, /* b=1 */ 1, 0, 0, 0, 0, 1};
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t j = 0; j < S; ++j)
        if (m.key_padding[static_cast<std::size_t>(b * S + j)])
          for (std::int64_t hh = 0; hh < h; ++hh) forbid(b, hh, j);
  } else if (c.how == 1 || c.how == 2) {
    m.key_lengths = {2, 5};
    m.causal = c.how == 2;
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t j = m.key_lengths[static_cast<std::size_t>(b)]; j < S; ++j)
        for (std::int64_t hh = 0; hh < h; ++hh) forbid(b, hh, j);
  } else if (c.how == 4) {
    m.bool_mask.assign(static_cast<std::size_t>(L * S), 0);
    for (std::int64_t j : {1, 4}) {
      for (std::int64_t i = 0; i < L; ++i) m.bool_mask[static_cast<std::size_t>(i * S + j)] = 1;
      for (std::int64_t bh = 0; bh < B * h; ++bh) forbid(bh / h, bh % h, j);
    }
  } else {
    m.bool_mask_batched = true;
    m.bool_mask.assign(static_cast<std::size_t>(B * h * L * S), 0);
    const std::int64_t cols[][3] = {{0, 0, 1}, {0, 1, 5}, {1, 0, 0}, {1, 1, 3}, {1, 1, 4}};  // (b, hh, j)
    for (const auto& col : cols) {
      forbid(col[0], col[1], col[2]);
      for (std::int64_t i = 0; i < L; ++i)
        m.bool_mask[static_cast<std::size_t>(((col[0] * h + col[1]) * L + i) * S + col[2])] = 1;
    }
  }
  std::size_t poisoned = 0;
  for (std::int64_t bh = 0; bh < B * h; ++bh)
    for (std::int64_t j = 0; j < S; ++j) {
      if (!forbidden[static_cast<std::size_t>(bh * S + j)]) continue;
      ++poisoned;
      for (std::int64_t c2 = 0; c2 < d_k; ++c2) store(kd.data(), dt, (bh * S + j) * d_k + c2, c.poison);
      for (std::int64_t c2 = 0; c2 < d_v; ++c2) store(vd.data(), dt, (bh * S + j) * d_v + c2, c.poison);
    }
  ASSERT_GT(poisoned, 0u);

  std::vector<Tensor> storage;
  AttentionOptions o = options_for(m, dt, storage);
  o.kernel = kernel();
  o.need_weights = true;
  o.need_lse = true;
  const AttentionResult clean = scaled_dot_product_attention(q, k, v, o);
  const AttentionResult dirty = scaled_dot_product_attention(q, kd, vd, o);
  EXPECT_TRUE(bitwise_equal(dirty.out, clean.out)) << "out";
  EXPECT_TRUE(bitwise_equal(dirty.weights, clean.weights)) << "weights";
  EXPECT_TRUE(bitwise_equal(dirty.lse, clean.lse)) << "lse";
  EXPECT_TRUE(all_finite(to_doubles(dirty.out)));
  // And the clean run is right.
  const NaiveResult want =
      naive_attention(to_doubles(q), to_doubles(k), to_doubles(v), d_k, d_v, 1.0 / std::sqrt(3.0), m);
  const Tolerance tol = tolerance_for(dt);
  EXPECT_TRUE(all_close(to_doubles(clean.out), want.out, tol.atol, tol.rtol, clean.out.shape()));
}

const PoisonCase kPoisonCases[] = {
    {"f64_nan_key_padding", DType::Float64, kNaN, 0},     {"f64_inf_key_padding", DType::Float64, kInf, 0},
    {"f64_1e10_key_padding", DType::Float64, 1e10, 0},    {"f64_nan_key_lengths", DType::Float64, kNaN, 1},
    {"f64_nan_lengths_causal", DType::Float64, kNaN, 2},  {"f64_1e10_lengths_causal", DType::Float64, 1e10, 2},
    {"f64_nan_bool3d_columns", DType::Float64, kNaN, 3},  {"f32_nan_key_padding", DType::Float32, kNaN, 0},
    {"f32_1e10_key_lengths", DType::Float32, 1e10, 1},    {"f32_nan_lengths_causal", DType::Float32, kNaN, 2},
    {"f32_inf_bool3d_columns", DType::Float32, -kInf, 3}, {"f32_1e10_bool3d_columns", DType::Float32, 1e10, 3},
    {"f32_nan_bool3d_columns", DType::Float32, kNaN, 3},  {"f32_nan_bool2d_columns", DType::Float32, kNaN, 4},
    {"f64_inf_bool2d_columns", DType::Float64, kInf, 4},  {"f32_inf_key_padding", DType::Float32, kInf, 0},
    {"f32_inf_lengths_causal", DType::Float32, kInf, 2},
};
INSTANTIATE_TEST_SUITE_P(Poison, AttentionPoison,
                         ::testing::Combine(::testing::ValuesIn(kPoisonCases), ::testing::ValuesIn(kAllKernels)),
                         [](const ::testing::TestParamInfo<AttentionPoison::ParamType>& info) {
                           return std::string(std::get<0>(info.param).name) + "_" +
                                  kernel_name(std::get<1>(info.param));
                         });

// Strided inputs give the same bits as contiguous copies made here (not by the library):
// the transposed-head layout [B, L, h, d] viewed as [B, h, L, d], padded rows, and k / v broadcast
// over heads with stride 0; masks as strided and broadcast views too.
TEST_P(AttentionEdge, StridedInputsMatchContiguousCopies) {
  const DType dt = dtype();
  const std::int64_t B = 2, h = 3, L = 5, S = 7, d_k = 4, d_v = 6;
  Rng rng(9);
  // Storage in [B, L, h, d] order.
  Tensor qs = random_tensor(dt, {B, L, h, d_k}, rng);
  Tensor ks = random_tensor(dt, {B, S, h, d_k}, rng);
  Tensor vs = random_tensor(dt, {B, S, h, d_v}, rng);
  const TensorView qv(qs.data(), dt, {B, h, L, d_k}, {L * h * d_k, d_k, h * d_k, 1});
  const TensorView kv(ks.data(), dt, {B, h, S, d_k}, {S * h * d_k, d_k, h * d_k, 1});
  const TensorView vv(vs.data(), dt, {B, h, S, d_v}, {S * h * d_v, d_v, h * d_v, 1});
  EXPECT_FALSE(qv.is_contiguous());
  // Contiguous copies, element by element through to_doubles.
  Tensor qc = make_tensor(dt, {B, h, L, d_k}, to_doubles(qv));
  Tensor kc = make_tensor(dt, {B, h, S, d_k}, to_doubles(kv));
  Tensor vc = make_tensor(dt, {B, h, S, d_v}, to_doubles(vv));

  // Masks: key padding stored transposed as [S, B]; a bool [L, S] mask broadcast to [B*h, L, S].
  std::vector<double> kp_t(static_cast<std::size_t>(S * B), 0.0);  // [S, B]
  kp_t[static_cast<std::size_t>(6 * B + 0)] = 1;
  kp_t[static_cast<std::size_t>(2 * B + 1)] = 1;
  kp_t[static_cast<std::size_t>(3 * B + 1)] = 1;
  Tensor kp_store = make_tensor(DType::Bool, {S, B}, kp_t);
  const TensorView kp_view(kp_store.data(), DType::Bool, {B, S}, {1, B});
  Tensor kp_contig = make_tensor(DType::Bool, {B, S}, to_doubles(kp_view));
  std::vector<double> am(static_cast<std::size_t>(L * S), 0.0);
  for (std::size_t i = 0; i < am.size(); ++i) am[i] = rng.bernoulli(0.2);
  Tensor am2d = make_tensor(DType::Bool, {L, S}, am);
  const TensorView am_bcast(am2d.data(), DType::Bool, {B * h, L, S}, {0, S, 1});
  Tensor am3d = make_tensor(DType::Bool, {B * h, L, S}, to_doubles(am_bcast));

  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "not causal");
    AttentionOptions strided_opts = options(), contig_opts = options();
    strided_opts.need_weights = contig_opts.need_weights = true;
    strided_opts.need_lse = contig_opts.need_lse = true;
    strided_opts.causal = contig_opts.causal = causal;
    strided_opts.key_padding_mask = kp_view;
    contig_opts.key_padding_mask = kp_contig.view();
    strided_opts.attn_mask = am_bcast;
    contig_opts.attn_mask = am3d.view();
    const AttentionResult a = scaled_dot_product_attention(qv, kv, vv, strided_opts);
    const AttentionResult b = scaled_dot_product_attention(qc, kc, vc, contig_opts);
    EXPECT_TRUE(bitwise_equal(a.out, b.out)) << "out";
    EXPECT_TRUE(bitwise_equal(a.weights, b.weights)) << "weights";
    EXPECT_TRUE(bitwise_equal(a.lse, b.lse)) << "lse";
    // The broadcast 3-D mask and the plain 2-D mask mean the same.
    contig_opts.attn_mask = am2d.view();
    const AttentionResult c = scaled_dot_product_attention(qc, kc, vc, contig_opts);
    EXPECT_TRUE(bitwise_equal(c.out, b.out)) << "2-D mask vs its broadcast";
  }

  // Padded rows (row stride d + 3) and k / v shared by all heads through stride 0.
  Tensor kpad = random_tensor(dt, {B, 1, S, d_k + 3}, rng);
  Tensor vpad = random_tensor(dt, {B, 1, S, d_v + 3}, rng);
  const TensorView kb(kpad.data(), dt, {B, h, S, d_k}, {S * (d_k + 3), 0, d_k + 3, 1});
  const TensorView vb(vpad.data(), dt, {B, h, S, d_v}, {S * (d_v + 3), 0, d_v + 3, 1});
  Tensor kbc = make_tensor(dt, {B, h, S, d_k}, to_doubles(kb));
  Tensor vbc = make_tensor(dt, {B, h, S, d_v}, to_doubles(vb));
  AttentionOptions o = options();
  o.need_weights = true;
  const AttentionResult a = scaled_dot_product_attention(qv, kb, vb, o);
  const AttentionResult b = scaled_dot_product_attention(qc, kbc, vbc, o);
  EXPECT_TRUE(bitwise_equal(a.out, b.out)) << "broadcast k/v out";
  EXPECT_TRUE(bitwise_equal(a.weights, b.weights)) << "broadcast k/v weights";
}

// Logits around 1e4 (entries of q and k around 100): finite, rows of weights sum to 1, and equal to the
// fp64 oracle (tight in float64; in float32 the logits themselves carry ~1e-3 of rounding).
TEST_P(AttentionEdge, HugeLogitsStayFiniteAndCorrect) {
  const DType dt = dtype();
  const std::int64_t B = 1, h = 2, L = 9, S = 11, d_k = 8, d_v = 3;
  Rng rng(10);
  Tensor q = random_tensor(dt, {B, h, L, d_k}, rng, -100, 100);
  Tensor k = random_tensor(dt, {B, h, S, d_k}, rng, -100, 100);
  Tensor v = random_tensor(dt, {B, h, S, d_v}, rng);
  NaiveMaskSpec m;
  m.B = B, m.h = h, m.L = L, m.S = S;
  m.key_lengths = {10};
  std::vector<Tensor> storage;
  AttentionOptions o = options_for(m, dt, storage);
  o.kernel = kernel();
  o.need_weights = true;
  o.need_lse = true;
  const AttentionResult r = scaled_dot_product_attention(q, k, v, o);
  const NaiveResult want =
      naive_attention(to_doubles(q), to_doubles(k), to_doubles(v), d_k, d_v, 1.0 / std::sqrt(8.0), m);
  ASSERT_TRUE(all_finite(want.out)) << "oracle";
  const auto out = to_doubles(r.out), w = to_doubles(r.weights), lse = to_doubles(r.lse);
  EXPECT_TRUE(all_finite(out));
  EXPECT_TRUE(all_finite(w));
  EXPECT_TRUE(all_finite(lse));
  double max_lse = 0;
  for (double x : want.lse) max_lse = std::max(max_lse, std::fabs(x));
  EXPECT_GT(max_lse, 1000.0) << "the test must produce large logits";
  for (std::int64_t row = 0; row < B * h * L; ++row) {
    double sum = 0;
    for (std::int64_t j = 0; j < S; ++j) sum += w[static_cast<std::size_t>(row * S + j)];
    EXPECT_NEAR(sum, 1.0, 1e-5) << "row " << row;
  }
  if (dt == DType::Float64) {
    EXPECT_TRUE(all_close(out, want.out, 1e-9, 1e-9, r.out.shape()));
    EXPECT_TRUE(all_close(w, want.weights, 1e-9, 1e-9, r.weights.shape()));
    EXPECT_TRUE(all_close(lse, want.lse, 1e-9, 1e-12, r.lse.shape()));
  } else {
    EXPECT_TRUE(all_close(out, want.out, 0.05, 0.0, r.out.shape()));
    EXPECT_TRUE(all_close(lse, want.lse, 0.5, 1e-4, r.lse.shape()));
  }
}

TEST_P(AttentionEdge, ScaleOption) {
  const DType dt = dtype();
  const std::int64_t B = 2, h = 1, L = 4, S = 6, d_k = 5, d_v = 2;
  Rng rng(11);
  Tensor q = random_tensor(dt, {B, h, L, d_k}, rng);
  Tensor k = random_tensor(dt, {B, h, S, d_k}, rng);
  Tensor v = random_tensor(dt, {B, h, S, d_v}, rng);
  NaiveMaskSpec m;
  m.B = B, m.h = h, m.L = L, m.S = S;
  const Tolerance tol = tolerance_for(dt);
  for (double scale : {0.25, 1.0, 3.0, 1.0 / std::sqrt(5.0)}) {
    SCOPED_TRACE(scale);
    AttentionOptions o = options();
    o.scale = scale;
    o.need_lse = true;
    const AttentionResult r = scaled_dot_product_attention(q, k, v, o);
    const NaiveResult want = naive_attention(to_doubles(q), to_doubles(k), to_doubles(v), d_k, d_v, scale, m);
    EXPECT_TRUE(all_close(to_doubles(r.out), want.out, tol.atol, tol.rtol));
    EXPECT_TRUE(all_close(to_doubles(r.lse), want.lse, tol.atol, tol.rtol));
  }
  // The default is 1 / sqrt(d_k); a different scale must change the result.
  AttentionOptions o = options();
  const AttentionResult def = scaled_dot_product_attention(q, k, v, o);
  const NaiveResult want =
      naive_attention(to_doubles(q), to_doubles(k), to_doubles(v), d_k, d_v, 1.0 / std::sqrt(5.0), m);
  EXPECT_TRUE(all_close(to_doubles(def.out), want.out, tol.atol, tol.rtol));
  o.scale = 2.0;
  EXPECT_FALSE(bitwise_equal(scaled_dot_product_attention(q, k, v, o).out, def.out));
}

// The same call twice gives the same bits.
TEST_P(AttentionEdge, Deterministic) {
  const DType dt = dtype();
  Rng rng(12);
  Tensor q = random_tensor(dt, {2, 3, 17, 13}, rng);
  Tensor k = random_tensor(dt, {2, 3, 19, 13}, rng);
  Tensor v = random_tensor(dt, {2, 3, 19, 5}, rng);
  AttentionOptions o = options();
  o.causal = true;
  o.need_weights = true;
  const AttentionResult a = scaled_dot_product_attention(q, k, v, o);
  const AttentionResult b = scaled_dot_product_attention(q, k, v, o);
  EXPECT_TRUE(bitwise_equal(a.out, b.out));
  EXPECT_TRUE(bitwise_equal(a.weights, b.weights));
}

}  // namespace
}  // namespace mha_test
