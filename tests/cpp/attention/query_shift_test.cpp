// The kernels' query shift (detail::run_attention / run_attention_backward's query_shift: query i sits
// at i + query_shift, key j at j), which the ring passes for every pair of sequence chunks:
//   (a) queries [a, a + n) against keys [c, c + m) of one sequence of N positions, run with
//       query_shift = a - c, equal rows [a, a + n) of one call over the whole sequence (L = S = N,
//       no shift needed) whose key_padding_mask hides every key outside [c, c + m): out, weights, lse,
//       and, with dout zero outside those rows, dq (rows [a, a + n)), dk and dv (rows [c, c + m)). Causal,
//       windows, ALiBi, softcap and dropout (at the chunks' offsets) combined, the query chunk before,
//       across or after the key chunk (negative shifts, shifts past S), chunk edges on and off the fused
//       kernel's blocks. float64 (reference kernel) to 1e-12; float32 and bfloat16 (fused kernel) and
//       float32 (reference kernel) against the float64 call, within kernel_compare.hpp's rule against
//       the whole call run by the float32 reference kernel;
//   (b) the default (no shift given) is query_shift = S - L, bitwise.
//
// Legend: B batch, h heads, N positions of the sequence, n queries and m keys of a chunk pair,
// d_k query/key width, d_v value width.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "attention/attention_core.hpp"
#include "support/kernel_compare.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::Kernel;

// One chunk pair of one sequence and the score's variants.
struct ShiftCase {
  std::string name;
  std::int64_t N, a, n, c, m;  // queries [a, a + n), keys [c, c + m) of N positions
  bool causal = false;
  std::int64_t window_left = -1, window_right = -1;
  bool alibi = false;
  double softcap = 0.0;
  double dropout_p = 0.0;
  std::int64_t B = 1, h = 2, d_k = 16, d_v = 12;
};

std::vector<ShiftCase> shift_cases() {
  std::vector<ShiftCase> cases = {
      // The query chunk before the key chunk (shift < 0): causal hides every key.
      {"causal_queries_before_keys", 420, 0, 100, 150, 270, true},
      // Chunks overlapping across the diagonal; blocks of both kernels' sizes on either side.
      {"causal_across_diagonal", 520, 100, 300, 150, 370, true},
      {"causal_window_across_diagonal", 520, 100, 300, 150, 370, true, 70, -1},
      // Queries after the keys (shift > 0): causal sees all, the window's left edge cuts.
      {"causal_window_queries_after_keys", 430, 300, 130, 0, 257, true, 200, -1},
      // A two-sided window, the queries before the keys.
      {"window_queries_before_keys", 400, 0, 140, 130, 270, false, 10, 20},
      // Queries past every key and beyond the window: the skipped blocks lie past S.
      {"window_queries_past_keys", 700, 600, 100, 0, 300, false, 30, 5},
      {"window_right_only_queries_past_keys", 700, 500, 200, 0, 129, false, -1, 3},
      // ALiBi distances on both sides, with a cap.
      {"alibi_queries_before_keys", 300, 0, 129, 129, 171, false, -1, -1, true},
      {"alibi_softcap_queries_after_keys", 300, 171, 129, 0, 171, false, -1, -1, true, 2.5},
      {"causal_window_alibi_softcap", 600, 256, 257, 128, 384, true, 130, -1, true, 4.0},
      {"dropout_window_alibi", 330, 40, 200, 100, 230, false, 60, 90, true, 0.0, 0.25},
      // The same position on both sides (shift 0, as the ring's diagonal chunk).
      {"causal_diagonal_chunk", 300, 100, 137, 100, 137, true, 50, -1, true},
  };
  Rng rng(0x5eed);
  for (int r = 0; r < (kSanitized ? 4 : 24); ++r) {
    ShiftCase s;
    s.N = rng.integer(2, kSanitized ? 60 : 600);
    s.a = rng.integer(0, s.N - 1), s.n = rng.integer(1, s.N - s.a);
    s.c = rng.integer(0, s.N - 1), s.m = rng.integer(1, s.N - s.c);
    s.causal = rng.bernoulli(0.5);
    if (rng.bernoulli(0.6)) s.window_left = rng.integer(-1, s.N / 2), s.window_right = rng.integer(-1, s.N / 2);
    s.alibi = rng.bernoulli(0.4);
    s.softcap = rng.bernoulli(0.3) ? rng.uniform(1.0, 8.0) : 0.0;
    s.dropout_p = rng.bernoulli(0.2) ? 0.2 : 0.0;
    s.B = rng.integer(1, 2), s.h = rng.integer(1, 3);
    s.d_k = rng.integer(1, 40), s.d_v = rng.integer(1, 40);
    s.name = "random_" + std::to_string(r) + "_N" + std::to_string(s.N) + "_q" + std::to_string(s.a) + "x" +
             std::to_string(s.n) + "_k" + std::to_string(s.c) + "x" + std::to_string(s.m) +
             (s.causal ? "_causal" : "") + (s.window_left >= 0 || s.window_right >= 0 ? "_window" : "") +
             (s.alibi ? "_alibi" : "") + (s.softcap > 0 ? "_softcap" : "") + (s.dropout_p > 0 ? "_dropout" : "");
    cases.push_back(s);
  }
  return cases;
}

// The numbers of one case, in float64, rounded to what `dtype` holds (so every dtype's call sees them).
struct ShiftData {
  std::vector<double> q, k, v, dout, slopes;  // [B, h, N, d_k], [B, h, N, d_k], [B, h, N, d_v], [B, h, N, d_v]
  std::vector<double> hidden;                 // [B, N]: 1 outside keys [c, c + m)
};

ShiftData make_data(const ShiftCase& s, DType dtype) {
  Rng rng(static_cast<std::uint64_t>(s.N * 7919 + s.a * 31 + s.c));
  ShiftData d;
  d.q = rounded_to(dtype, random_values(s.B * s.h * s.N * s.d_k, rng, -2, 2));
  d.k = rounded_to(dtype, random_values(s.B * s.h * s.N * s.d_k, rng, -2, 2));
  d.v = rounded_to(dtype, random_values(s.B * s.h * s.N * s.d_v, rng));
  d.dout = random_values(s.B * s.h * s.N * s.d_v, rng);
  for (std::int64_t row = 0; row < s.B * s.h * s.N; ++row)  // dout 0 outside the query chunk
    for (std::int64_t e = 0; e < s.d_v; ++e)
      if (row % s.N < s.a || row % s.N >= s.a + s.n) d.dout[static_cast<std::size_t>(row * s.d_v + e)] = 0.0;
  d.dout = rounded_to(dtype, d.dout);
  for (std::int64_t head = 0; head < s.h; ++head) d.slopes.push_back(0.05 + 0.4 * rng.uniform(0, 1));
  d.slopes = rounded_to(DType::Float32, d.slopes);
  for (std::int64_t b = 0; b < s.B; ++b)
    for (std::int64_t j = 0; j < s.N; ++j) d.hidden.push_back(j < s.c || j >= s.c + s.m ? 1.0 : 0.0);
  return d;
}

// Rows [start, start + count) of a [B, h, N, d] tensor, in place.
TensorView rows(const Tensor& t, std::int64_t start, std::int64_t count) {
  const auto* base = static_cast<const unsigned char*>(t.data());
  return TensorView(base + start * t.strides()[2] * static_cast<std::int64_t>(mha::dtype_size(t.dtype())), t.dtype(),
                    {t.size(0), t.size(1), count, t.size(3)}, t.strides());
}

// What a call returns, each as float64 in C order.
struct ShiftRun {
  std::vector<double> out, weights, lse, dq, dk, dv;
};

// The score's options of the case (ALiBi's slopes in `slopes`, float32 [h]).
mha::AttentionOptions score_options(const ShiftCase& s, const Tensor& slopes, Kernel kernel) {
  mha::AttentionOptions o;
  o.causal = s.causal;
  o.window_left = s.window_left, o.window_right = s.window_right;
  if (s.alibi) o.alibi_slopes = slopes.view();
  o.softcap = s.softcap;
  o.dropout_p = s.dropout_p, o.dropout_seed = 77;
  o.need_weights = o.need_lse = true;
  o.kernel = kernel;
  return o;
}

// Keys [c, c + m) seen from rows [a, a + n) of one unshifted call over all N positions.
ShiftRun whole_sequence(const ShiftCase& s, const ShiftData& d, DType dtype, Kernel kernel) {
  const Shape qk{s.B, s.h, s.N, s.d_k}, vo{s.B, s.h, s.N, s.d_v};
  const Tensor q = make_tensor(dtype, qk, d.q), k = make_tensor(dtype, qk, d.k), v = make_tensor(dtype, vo, d.v);
  const Tensor dout = make_tensor(dtype, vo, d.dout), slopes = make_tensor(DType::Float32, {s.h}, d.slopes);
  const Tensor hidden = make_tensor(DType::Bool, {s.B, s.N}, d.hidden);
  mha::AttentionOptions o = score_options(s, slopes, kernel);
  o.key_padding_mask = hidden.view();
  const mha::AttentionResult r = mha::scaled_dot_product_attention(q, k, v, o);
  const mha::AttentionGradients g = mha::scaled_dot_product_attention_backward(dout, q, k, v, r.out, r.lse, o);
  ShiftRun run{
      to_doubles(rows(r.out, s.a, s.n)), {}, {}, to_doubles(rows(g.dq, s.a, s.n)), to_doubles(rows(g.dk, s.c, s.m)),
      to_doubles(rows(g.dv, s.c, s.m))};
  const std::vector<double> all_weights = to_doubles(r.weights), all_lse = to_doubles(r.lse);
  for (std::int64_t bh = 0; bh < s.B * s.h; ++bh)
    for (std::int64_t i = s.a; i < s.a + s.n; ++i) {
      run.lse.push_back(all_lse[static_cast<std::size_t>(bh * s.N + i)]);
      const auto row = all_weights.begin() + (bh * s.N + i) * s.N;
      run.weights.insert(run.weights.end(), row + s.c, row + s.c + s.m);
    }
  return run;
}

// The chunk pair alone: queries [a, a + n) and keys [c, c + m) with query_shift = a - c, told its keys
// are a part (as the ring runs it), dropout at the chunks' offsets.
ShiftRun chunk_pair(const ShiftCase& s, const ShiftData& d, DType dtype, Kernel kernel) {
  const Shape qk{s.B, s.h, s.N, s.d_k}, vo{s.B, s.h, s.N, s.d_v};
  const Tensor q_all = make_tensor(dtype, qk, d.q), k_all = make_tensor(dtype, qk, d.k);
  const Tensor v_all = make_tensor(dtype, vo, d.v), dout_all = make_tensor(dtype, vo, d.dout);
  const Tensor slopes = make_tensor(DType::Float32, {s.h}, d.slopes);
  const TensorView q = rows(q_all, s.a, s.n), k = rows(k_all, s.c, s.m), v = rows(v_all, s.c, s.m);
  const TensorView dout = rows(dout_all, s.a, s.n);
  mha::AttentionOptions o = score_options(s, slopes, kernel);
  o.dropout_query_offset = s.a, o.dropout_key_offset = s.c;
  mha::detail::validate_attention(q, k, v, o);
  Tensor out(dtype, {s.B, s.h, s.n, s.d_v}), weights, lse;
  mha::detail::run_attention(q, k, v, o, {out.data(), out.strides()}, weights, lse, /*partial_over_keys=*/true,
                             s.a - s.c);
  Tensor dq(dtype, q.shape()), dk(dtype, k.shape()), dv(dtype, v.shape());  // zero, as the backward needs
  mha::detail::run_attention_backward(dout, q, k, v, out, lse, o, {dq.data(), dq.strides()}, {dk.data(), dk.strides()},
                                      {dv.data(), dv.strides()}, s.a - s.c);
  return {to_doubles(out), to_doubles(weights), to_doubles(lse), to_doubles(dq), to_doubles(dk), to_doubles(dv)};
}

class QueryShift : public ::testing::TestWithParam<ShiftCase> {};

TEST_P(QueryShift, ChunkPairEqualsTheWholeSequenceRestrictedToItsKeys) {
  const ShiftCase s = GetParam();
  const ShiftData d64 = make_data(s, DType::Float64);
  const ShiftRun want = whole_sequence(s, d64, DType::Float64, Kernel::Reference);
  const ShiftRun got = chunk_pair(s, d64, DType::Float64, Kernel::Reference);
  const char* names[] = {"out", "weights", "lse", "dq", "dk", "dv"};
  const std::vector<double> ShiftRun::*fields[] = {&ShiftRun::out, &ShiftRun::weights, &ShiftRun::lse,
                                                   &ShiftRun::dq,  &ShiftRun::dk,      &ShiftRun::dv};
  for (int f = 0; f < 6; ++f) {
    const std::vector<double>& w = want.*fields[f];
    EXPECT_TRUE(all_close(got.*fields[f], w, 1e-12 * std::max(1.0, max_abs_finite(w)), 1e-12)) << names[f];
  }
  // float32 and bfloat16: the pair within the rule against the whole call in float64, the float32
  // reference's own error the yardstick (factor 2 forward, 3 gradients; the slack scaled by magnitude).
  for (const auto& [dtype, kernel] :
       {std::pair{DType::Float32, Kernel::Flash}, std::pair{DType::Float32, Kernel::Reference},
        std::pair{DType::BFloat16, Kernel::Flash}}) {
    const ShiftData dn = make_data(s, dtype);
    const ShiftRun truth = whole_sequence(s, dn, DType::Float64, Kernel::Reference);
    const ShiftRun yardstick =
        whole_sequence(s, dn, dtype, dtype == DType::BFloat16 ? Kernel::Flash : Kernel::Reference);
    const ShiftRun pair = chunk_pair(s, dn, dtype, kernel);
    for (int f = 0; f < 6; ++f) {
      const std::vector<double>& w = truth.*fields[f];
      const double slack = kRuleSlack * std::max(1.0, max_abs_finite(w)) * (f >= 3 ? 10 : 1);
      EXPECT_TRUE(within_rule(names[f], pair.*fields[f], yardstick.*fields[f], w, f >= 3 ? 3.0 : 2.0, {}, slack))
          << short_name(dtype) << " " << kernel_name(kernel);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Pairs, QueryShift, ::testing::ValuesIn(shift_cases()),
                         [](const ::testing::TestParamInfo<ShiftCase>& info) { return info.param.name; });

// ---- (b) the default ---------------------------------------------------------------------------------

TEST(QueryShiftDefault, IsSMinusLBitwise) {
  Rng rng(12);
  const std::int64_t B = 2, h = 2, L = 150, S = 300, d = 24;
  const Tensor q = random_tensor(DType::Float32, {B, h, L, d}, rng),
               k = random_tensor(DType::Float32, {B, h, S, d}, rng);
  const Tensor v = random_tensor(DType::Float32, {B, h, S, d}, rng),
               dout = random_tensor(DType::Float32, {B, h, L, d}, rng);
  const Tensor slopes = make_tensor(DType::Float32, {h}, {0.25, 0.125});
  for (Kernel kernel : kAllKernels) {
    mha::AttentionOptions o;
    o.causal = true, o.window_left = 40, o.alibi_slopes = slopes.view(), o.softcap = 3.0;
    o.need_lse = true, o.kernel = kernel;
    Tensor out[2] = {Tensor(DType::Float32, {B, h, L, d}), Tensor(DType::Float32, {B, h, L, d})}, weights[2], lse[2];
    Tensor grads[2][3];
    for (int given = 0; given < 2; ++given) {
      const std::optional<std::int64_t> shift = given ? std::optional<std::int64_t>(S - L) : std::nullopt;
      mha::detail::run_attention(q, k, v, o, {out[given].data(), out[given].strides()}, weights[given], lse[given],
                                 false, shift);
      for (int n = 0; n < 3; ++n) grads[given][n] = Tensor(DType::Float32, n == 0 ? q.shape() : k.shape());
      mha::detail::run_attention_backward(dout, q, k, v, out[given], lse[given], o,
                                          {grads[given][0].data(), grads[given][0].strides()},
                                          {grads[given][1].data(), grads[given][1].strides()},
                                          {grads[given][2].data(), grads[given][2].strides()}, shift);
    }
    EXPECT_TRUE(bitwise_equal(out[0], out[1])) << kernel_name(kernel);
    EXPECT_TRUE(bitwise_equal(lse[0], lse[1])) << kernel_name(kernel);
    for (int n = 0; n < 3; ++n) EXPECT_TRUE(bitwise_equal(grads[0][n], grads[1][n])) << kernel_name(kernel) << n;
  }
}

}  // namespace
}  // namespace mha_test
