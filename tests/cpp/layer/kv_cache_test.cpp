// KeyValueCache and MultiHeadAttention::append_to_cache / forward_cached (incremental decoding)
// against forward() in evaluation mode on the same layer: appending step by step (or in chunks) and
// attending with bottom-right causal masking must reproduce a causal forward over the whole
// sequence; appending a source once and attending query by query must reproduce cross-attention
// with its masks; weights (per head and averaged) must match; clear() and growth keep the right rows;
// bad arguments throw mha::Error naming the argument.
//
// Legend: B batch, L queries, S keys (the cache's length), E = d_model, h heads, d_k, d_v per-head
// widths, kdim / vdim key and value input widths; S' = S + add_bias_kv + add_zero_attn.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/message_matches.hpp"
#include "support/naive_mha.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::KeyValueCache;
using mha::MultiHeadAttention;
using mha::MultiHeadAttentionConfig;
using mha::MultiHeadAttentionInputs;
using mha::MultiHeadAttentionOutput;

enum class Layout { BatchFirst, SeqFirst, Unbatched };

const char* layout_name(Layout layout) {
  switch (layout) {
    case Layout::BatchFirst: return "batch_first";
    case Layout::SeqFirst: return "seq_first";
    case Layout::Unbatched: return "unbatched";
  }
  return "?";
}

Shape layout_shape(std::int64_t B, std::int64_t T, std::int64_t C, Layout layout) {
  switch (layout) {
    case Layout::BatchFirst: return {B, T, C};
    case Layout::SeqFirst: return {T, B, C};
    case Layout::Unbatched: return {T, C};
  }
  return {};
}

// Positions [t0, t1) of x [B, T, C] (batch first, C order) as a tensor in `layout`.
Tensor positions_tensor(DType dt, const std::vector<double>& x, std::int64_t B, std::int64_t T, std::int64_t C,
                        std::int64_t t0, std::int64_t t1, Layout layout) {
  const std::int64_t n = t1 - t0;
  std::vector<double> y(static_cast<std::size_t>(B * n * C));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t c = 0; c < C; ++c) {
        const std::int64_t row = layout == Layout::SeqFirst ? t * B + b : b * n + t;
        y[static_cast<std::size_t>(row * C + c)] = x[static_cast<std::size_t>((b * T + t0 + t) * C + c)];
      }
  return make_tensor(dt, layout_shape(B, n, C, layout), y);
}

// out [B, n, E] in `layout` written into positions [t0, t0 + n) of full [B, T, E] (batch first).
void put_positions(const Tensor& out, std::int64_t B, std::int64_t T, std::int64_t E, std::int64_t t0, Layout layout,
                   std::vector<double>& full) {
  const std::vector<double> y = to_doubles(out);
  const std::int64_t n = static_cast<std::int64_t>(y.size()) / (B * E);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t e = 0; e < E; ++e) {
        const std::int64_t row = layout == Layout::SeqFirst ? t * B + b : b * n + t;
        full[static_cast<std::size_t>((b * T + t0 + t) * E + e)] = y[static_cast<std::size_t>(row * E + e)];
      }
}

// Weights [N, n, S_step + extra] of n queries (N = B or B*h, batch dimension dropped when unbatched,
// which leaves the same numbers) written into rows [t0, t0 + n) of full [N, T, S_full + extra]: the
// first S_step columns are cache positions, the last `extra` the appended bias_k / zero positions,
// which sit after all S_full keys in the full weights. The columns between stay 0.
void put_weight_rows(const Tensor& w, std::int64_t N, std::int64_t T, std::int64_t S_full, std::int64_t extra,
                     std::int64_t t0, std::int64_t S_step, std::vector<double>& full) {
  const std::vector<double> y = to_doubles(w);
  const std::int64_t cols = S_step + extra, n = static_cast<std::int64_t>(y.size()) / (N * cols);
  const std::int64_t full_cols = S_full + extra;
  for (std::int64_t m = 0; m < N; ++m)
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t j = 0; j < cols; ++j) {
        const std::int64_t to_col = j < S_step ? j : S_full + (j - S_step);
        full[static_cast<std::size_t>((m * T + t0 + i) * full_cols + to_col)] =
            y[static_cast<std::size_t>((m * n + i) * cols + j)];
      }
}

// Tolerances for cached vs full computation on the same layer. float64: both paths run the same
// float64 loops (projections row by row, the reference kernel), so they agree to rounding.
// float32: the projections go through oneDNN sgemm, whose kernel (and summation order) may depend on
// the number of rows, and the flash kernel tiles a 1-row query differently from a full one. Every
// output is a sum of at most max(E, kdim, vdim, h*d_v, S) <= 40 products of numbers of magnitude <= 1
// on both paths, so reordering moves it by at most ~40 * 2^-24 * (sum of |terms|, a few) ~ 1e-5.
// (Measured: float64 agrees exactly, float32 to 1.2e-7.) bfloat16 rounds the projections, P and every
// output to 8 significant bits (relative 2^-9 each), so the two paths may differ by a few such
// roundings of values of magnitude <= a few: 2^-5.
double tolerance(DType dt) { return dt == DType::Float64 ? 1e-12 : dt == DType::BFloat16 ? 0x1.0p-5 : 1e-5; }

// ---- incremental self-attention == causal forward over the whole sequence -----------------------

struct CacheCase {
  std::string name;
  DType dtype = DType::Float64;
  Layout layout = Layout::BatchFirst;
  std::int64_t E = 8, h = 2, d_k = 4, d_v = 4, kdim = 8, vdim = 8;
  bool bias = true, add_bias_kv = false, add_zero_attn = false;
  std::int64_t B = 2, S = 10;
  bool chunks = false;  // false: one position per step; true: random chunks of 1..6 positions
  bool average = true;  // average_attn_weights
  std::uint64_t seed = 0;
};

void PrintTo(const CacheCase& c, std::ostream* os) { *os << c.name; }

// A layer for the case with random parameters (biases included), in evaluation mode.
struct TestLayer {
  MultiHeadAttention layer;
  RandomState state;
};

TestLayer make_layer(const CacheCase& c, mha::Kernel kernel, Rng& rng) {
  MultiHeadAttentionConfig cfg;
  cfg.d_model = c.E, cfg.num_heads = c.h, cfg.d_k = c.d_k, cfg.d_v = c.d_v, cfg.kdim = c.kdim, cfg.vdim = c.vdim;
  cfg.bias = c.bias, cfg.add_bias_kv = c.add_bias_kv, cfg.add_zero_attn = c.add_zero_attn;
  cfg.batch_first = c.layout != Layout::SeqFirst;
  cfg.dtype = c.dtype;
  cfg.dropout = 0.25;  // must not apply: forward_cached never drops, and the reference is in eval mode
  TestLayer t{MultiHeadAttention(cfg, 3), random_state(c.E, c.h, c.d_k, c.d_v, c.kdim, c.vdim, c.bias, c.add_bias_kv,
                                                       c.add_zero_attn, c.dtype, rng)};
  t.layer.load_state_dict(t.state.views());
  t.layer.set_kernel(kernel);
  t.layer.eval();
  return t;
}

// 36 configurations: two of every (dtype, layout, step/chunk) combination, one with add_bias_kv and
// one with add_zero_attn among each four, the rest drawn at random.
std::vector<CacheCase> random_cases() {
  std::vector<CacheCase> cases;
  Rng rng(20240611);
  std::uint64_t seed = 1;
  int combination = 0;
  for (DType dt : {DType::Float64, DType::Float32, DType::BFloat16})
    for (Layout layout : {Layout::BatchFirst, Layout::SeqFirst, Layout::Unbatched}) {
      for (int draw = 0; draw < 4; ++draw) {
        CacheCase c;
        const bool chunks = draw % 2 == 1;
        c.dtype = dt, c.layout = layout, c.chunks = chunks, c.seed = seed++;
        c.h = rng.integer(1, 3);
        c.d_k = rng.integer(1, 6);
        c.d_v = rng.integer(1, 6);
        if (c.d_v == c.d_k) c.d_v = c.d_k + 1;  // d_k != d_v
        c.E = rng.integer(3, 10);
        c.kdim = rng.integer(2, 9);
        c.vdim = rng.integer(2, 9);
        if (c.kdim == c.E) ++c.kdim;  // kdim, vdim != E
        if (c.vdim == c.E) ++c.vdim;
        c.bias = rng.bernoulli(0.8);
        c.add_bias_kv = draw == combination % 4;
        c.add_zero_attn = draw == (combination + 2) % 4;
        c.B = layout == Layout::Unbatched || draw == 0 ? 1 : rng.integer(2, 3);
        c.S = draw == 0 ? rng.integer(1, 4) : rng.integer(10, 40);
        c.average = rng.bernoulli(0.5);
        std::ostringstream name;
        name << short_name(dt) << "_" << layout_name(layout) << (chunks ? "_chunks" : "_steps") << "_B" << c.B << "_S"
             << c.S << "_E" << c.E << "_h" << c.h << "_dk" << c.d_k << "_dv" << c.d_v << "_kdim" << c.kdim << "_vdim"
             << c.vdim << (c.bias ? "" : "_nobias") << (c.add_bias_kv ? "_bias_kv" : "")
             << (c.add_zero_attn ? "_zero_attn" : "") << (c.average ? "_avg" : "_per_head");
        c.name = name.str();
        cases.push_back(c);
      }
      ++combination;
    }
  return cases;
}

class KvCacheIncremental : public KernelParamTest<CacheCase> {};

TEST_P(KvCacheIncremental, EqualsCausalFullForward) {
  const CacheCase& c = param();
  Rng rng(c.seed * 7919);
  TestLayer t = make_layer(c, kernel(), rng);
  MultiHeadAttention& m = t.layer;
  const std::int64_t B = c.B, S = c.S, E = c.E, h = c.h;
  const std::int64_t extra = (c.add_bias_kv ? 1 : 0) + (c.add_zero_attn ? 1 : 0);
  const auto xq = rounded_to(c.dtype, random_values(B * S * E, rng));       // [B, S, E]
  const auto xk = rounded_to(c.dtype, random_values(B * S * c.kdim, rng));  // [B, S, kdim]
  const auto xv = rounded_to(c.dtype, random_values(B * S * c.vdim, rng));  // [B, S, vdim]

  // The whole sequence at once: queries, keys and values at positions 0..S-1, causal.
  MultiHeadAttentionInputs full_in;
  full_in.causal = true;
  full_in.average_attn_weights = c.average;
  const MultiHeadAttentionOutput full = m.forward(positions_tensor(c.dtype, xq, B, S, E, 0, S, c.layout),
                                                  positions_tensor(c.dtype, xk, B, S, c.kdim, 0, S, c.layout),
                                                  positions_tensor(c.dtype, xv, B, S, c.vdim, 0, S, c.layout), full_in);

  // Incrementally: append positions [t0, t1), attend for those queries.
  KeyValueCache cache;
  EXPECT_EQ(cache.batch(), 0);
  EXPECT_EQ(cache.length(), 0);
  const std::int64_t N = c.average ? B : B * h;  // rows of the weights before [L, S']
  std::vector<double> out(static_cast<std::size_t>(B * S * E), kNaN);
  std::vector<double> weights(static_cast<std::size_t>(N * S * (S + extra)), 0.0);
  for (std::int64_t t0 = 0, step = 0; t0 < S; ++step) {
    const std::int64_t t1 = std::min(S, t0 + (c.chunks ? rng.integer(1, 6) : 1));
    m.append_to_cache(cache, positions_tensor(c.dtype, xk, B, S, c.kdim, t0, t1, c.layout),
                      positions_tensor(c.dtype, xv, B, S, c.vdim, t0, t1, c.layout));
    ASSERT_EQ(cache.length(), t1);
    ASSERT_EQ(cache.batch(), B);
    MultiHeadAttentionInputs in;
    in.causal = c.chunks || step % 2 == 0;  // one query sees the whole cache either way
    in.average_attn_weights = c.average;
    const MultiHeadAttentionOutput r =
        m.forward_cached(positions_tensor(c.dtype, xq, B, S, E, t0, t1, c.layout), cache, in);
    ASSERT_EQ(r.out.shape(), layout_shape(B, t1 - t0, E, c.layout));
    const bool unbatched = c.layout == Layout::Unbatched;
    Shape weights_shape = c.average ? Shape{B, t1 - t0, t1 + extra} : Shape{B, h, t1 - t0, t1 + extra};
    if (unbatched) weights_shape.erase(weights_shape.begin());
    ASSERT_EQ(r.weights.shape(), weights_shape);
    put_positions(r.out, B, S, E, t0, c.layout, out);
    put_weight_rows(r.weights, N, S, S, extra, t0, t1, weights);
    t0 = t1;
  }
  std::vector<double> want(static_cast<std::size_t>(B * S * E));
  put_positions(full.out, B, S, E, 0, c.layout, want);
  const double tol = tolerance(c.dtype);
  EXPECT_TRUE(all_close(out, want, tol, tol, {B, S, E})) << "out, batch first";
  EXPECT_TRUE(all_close(weights, to_doubles(full.weights), tol, tol)) << "weights";
}

INSTANTIATE_TEST_SUITE_P(Configs, KvCacheIncremental,
                         ::testing::Combine(::testing::ValuesIn(random_cases()), ::testing::ValuesIn(kAllKernels)),
                         [](const ::testing::TestParamInfo<KvCacheIncremental::ParamType>& info) {
                           return std::get<0>(info.param).name + "_" + kernel_name(std::get<1>(info.param));
                         });

// ---- cross-attention: the source appended once, the queries attended one by one -----------------

class KvCacheDtype : public KernelParamTest<DType> {};

INSTANTIATE_TEST_SUITE_P(Dtypes, KvCacheDtype, kFloatDtypesTimesKernels, dtype_kernel_name);

CacheCase small_case(DType dt, Layout layout = Layout::BatchFirst) {
  CacheCase c;
  c.dtype = dt, c.layout = layout;
  c.E = 8, c.h = 2, c.d_k = 3, c.d_v = 5, c.kdim = 6, c.vdim = 6, c.B = 3;
  return c;
}

TEST_P(KvCacheDtype, CrossAttentionStepByStepEqualsForwardWithMasks) {
  const DType dt = param();
  for (Layout layout : {Layout::BatchFirst, Layout::SeqFirst, Layout::Unbatched}) {
    SCOPED_TRACE(layout_name(layout));
    CacheCase c = small_case(dt, layout);
    if (layout == Layout::Unbatched) c.B = 1;
    Rng rng(11);
    TestLayer t = make_layer(c, kernel(), rng);
    MultiHeadAttention& m = t.layer;
    const std::int64_t B = c.B, L = 6, S = 9, E = c.E, h = c.h;
    const auto xq = rounded_to(dt, random_values(B * L * E, rng));        // [B, L, E]
    const auto src = rounded_to(dt, random_values(B * S * c.kdim, rng));  // [B, S, kdim], kdim == vdim
    const Tensor source = positions_tensor(dt, src, B, S, c.kdim, 0, S, layout);
    KeyValueCache cache;
    m.append_to_cache(cache, source, source);
    ASSERT_EQ(cache.length(), S);

    // Masks over the S source positions: padding (as a mask and as lengths, both apply) and, in turn,
    // a bool [L, S] and a float [B*h, L, S] attn_mask; per step, the query's row of the attn_mask.
    std::vector<double> padding(static_cast<std::size_t>(B * S));
    for (auto& p : padding) p = rng.bernoulli(0.2);
    std::vector<std::int64_t> lengths;
    for (std::int64_t b = 0; b < B; ++b) lengths.push_back(rng.integer(S / 2, S));
    const Tensor kpm = make_tensor(DType::Bool, layout == Layout::Unbatched ? Shape{S} : Shape{B, S}, padding);
    for (int variant = 0; variant < 2; ++variant) {
      SCOPED_TRACE(variant == 0 ? "bool [L, S] attn_mask" : "float [B*h, L, S] attn_mask");
      const std::int64_t N = variant == 0 ? 1 : B * h;  // leading dimension of the attn_mask
      std::vector<double> am(static_cast<std::size_t>(N * L * S));
      for (auto& a : am) a = variant == 0 ? rng.bernoulli(0.2) : (rng.bernoulli(0.1) ? -kInf : rng.uniform(-2, 2));
      const DType am_dt = variant == 0 ? DType::Bool : dt;
      const Tensor attn_mask = make_tensor(am_dt, variant == 0 ? Shape{L, S} : Shape{N, L, S}, am);
      for (bool average : {true, false}) {
        SCOPED_TRACE(average ? "averaged weights" : "per-head weights");
        MultiHeadAttentionInputs in;
        in.key_padding_mask = kpm.view();
        in.key_lengths = lengths;
        in.attn_mask = attn_mask.view();
        in.average_attn_weights = average;
        const MultiHeadAttentionOutput full =
            m.forward(positions_tensor(dt, xq, B, L, E, 0, L, layout), source, source, in);

        const std::int64_t W = average ? B : B * h;
        std::vector<double> out(static_cast<std::size_t>(B * L * E), kNaN),
            weights(static_cast<std::size_t>(W * L * S));
        for (std::int64_t i = 0; i < L; ++i) {
          std::vector<double> row(static_cast<std::size_t>(N * S));  // attn_mask[:, i, :] -> [N, 1, S]
          for (std::int64_t n = 0; n < N; ++n) std::copy_n(am.begin() + (n * L + i) * S, S, row.begin() + n * S);
          const Tensor step_mask = make_tensor(am_dt, variant == 0 ? Shape{1, S} : Shape{N, 1, S}, row);
          in.attn_mask = step_mask.view();
          const MultiHeadAttentionOutput r =
              m.forward_cached(positions_tensor(dt, xq, B, L, E, i, i + 1, layout), cache, in);
          put_positions(r.out, B, L, E, i, layout, out);
          put_weight_rows(r.weights, W, L, S, 0, i, S, weights);
        }
        std::vector<double> want(static_cast<std::size_t>(B * L * E));
        put_positions(full.out, B, L, E, 0, layout, want);
        const double tol = tolerance(dt);
        EXPECT_TRUE(all_close(out, want, tol, tol, {B, L, E})) << "out";
        EXPECT_TRUE(all_close(weights, to_doubles(full.weights), tol, tol)) << "weights";
        EXPECT_EQ(cache.length(), S) << "attending must not change the cache";
      }
    }
  }
}

// All queries at once against the cache equal forward() too, including weights, and need_weights =
// false returns no weights.
TEST_P(KvCacheDtype, WeightsPerHeadAndAveragedMatchForward) {
  const DType dt = param();
  CacheCase c = small_case(dt);
  c.add_bias_kv = true, c.add_zero_attn = true;
  Rng rng(12);
  TestLayer t = make_layer(c, kernel(), rng);
  MultiHeadAttention& m = t.layer;
  const std::int64_t B = c.B, L = 4, S = 7, E = c.E, h = c.h;
  const Tensor q = random_tensor(dt, {B, L, E}, rng);
  const Tensor k = random_tensor(dt, {B, S, c.kdim}, rng), v = random_tensor(dt, {B, S, c.vdim}, rng);
  KeyValueCache cache;
  m.append_to_cache(cache, k, v);
  for (bool causal : {false, true})
    for (bool average : {true, false}) {
      SCOPED_TRACE(std::string(causal ? "causal " : "") + (average ? "averaged" : "per head"));
      MultiHeadAttentionInputs in;
      in.causal = causal;
      in.average_attn_weights = average;
      const MultiHeadAttentionOutput full = m.forward(q, k, v, in);
      const MultiHeadAttentionOutput cached = m.forward_cached(q, cache, in);
      ASSERT_EQ(cached.weights.shape(), (average ? Shape{B, L, S + 2} : Shape{B, h, L, S + 2}));
      ASSERT_EQ(cached.weights.shape(), full.weights.shape());
      const double tol = tolerance(dt);
      EXPECT_TRUE(all_close(to_doubles(cached.out), to_doubles(full.out), tol, tol)) << "out";
      EXPECT_TRUE(all_close(to_doubles(cached.weights), to_doubles(full.weights), tol, tol)) << "weights";
    }
  MultiHeadAttentionInputs no_weights;
  no_weights.need_weights = false;
  const MultiHeadAttentionOutput r = m.forward_cached(q, cache, no_weights);
  EXPECT_FALSE(r.weights.defined());
  EXPECT_TRUE(
      all_close(to_doubles(r.out), to_doubles(m.forward(q, k, v, no_weights).out), tolerance(dt), tolerance(dt)));
}

// Strided (non-contiguous) key, value and query views give the same cache and output as copies.
TEST_P(KvCacheDtype, StridedInputsMatchContiguous) {
  const DType dt = param();
  CacheCase c = small_case(dt);
  Rng rng(13);
  TestLayer t = make_layer(c, kernel(), rng);
  const std::int64_t B = c.B, S = 5, E = c.E;
  const Tensor ks = random_tensor(dt, {S, B, c.kdim}, rng);  // storage [S, B, kdim], viewed [B, S, kdim]
  const Tensor vs = random_tensor(dt, {S, B, c.vdim}, rng);
  const Tensor qs = random_tensor(dt, {S, B, E}, rng);
  const TensorView kv(ks.data(), dt, {B, S, c.kdim}, {c.kdim, B * c.kdim, 1});
  const TensorView vv(vs.data(), dt, {B, S, c.vdim}, {c.vdim, B * c.vdim, 1});
  const TensorView qv(qs.data(), dt, {B, S, E}, {E, B * E, 1});
  KeyValueCache strided, contiguous;
  t.layer.append_to_cache(strided, kv, vv);
  t.layer.append_to_cache(contiguous, Tensor::copy_of(kv), Tensor::copy_of(vv));
  MultiHeadAttentionInputs in;
  in.causal = true;
  const auto a = t.layer.forward_cached(qv, strided, in);
  const auto b = t.layer.forward_cached(Tensor::copy_of(qv), contiguous, in);
  EXPECT_TRUE(bitwise_equal(a.out, b.out));
  EXPECT_TRUE(bitwise_equal(a.weights, b.weights));
}

// ---- clear() and growth --------------------------------------------------------------------------

// clear() empties the cache but keeps its storage; a reused cache gives the same results as a fresh
// one, also with another batch size after the clear. (With add_zero_attn the zero position lands on
// a row that held a key before the clear.)
TEST_P(KvCacheDtype, ClearThenReuse) {
  const DType dt = param();
  CacheCase c = small_case(dt);
  c.add_bias_kv = true, c.add_zero_attn = true;
  Rng rng(14);
  TestLayer t = make_layer(c, kernel(), rng);
  MultiHeadAttention& m = t.layer;
  const std::int64_t B = c.B, E = c.E;
  KeyValueCache reused;
  m.append_to_cache(reused, random_tensor(dt, {B, 7, c.kdim}, rng), random_tensor(dt, {B, 7, c.vdim}, rng));
  const std::int64_t capacity = reused.capacity();
  reused.clear();
  EXPECT_EQ(reused.length(), 0);
  EXPECT_EQ(reused.capacity(), capacity) << "clear() keeps the storage";
  EXPECT_THROW((void)m.forward_cached(random_tensor(dt, {B, 1, E}, rng), reused), mha::Error);

  for (std::int64_t batch : {B, std::int64_t{1}}) {  // the same batch size, then another
    SCOPED_TRACE(batch);
    KeyValueCache fresh;
    const Tensor k = random_tensor(dt, {batch, 4, c.kdim}, rng), v = random_tensor(dt, {batch, 4, c.vdim}, rng);
    const Tensor q = random_tensor(dt, {batch, 2, E}, rng);
    m.append_to_cache(reused, k, v);
    m.append_to_cache(fresh, k, v);
    EXPECT_EQ(reused.batch(), batch);
    EXPECT_EQ(reused.length(), 4);
    MultiHeadAttentionInputs in;
    in.causal = true;
    in.average_attn_weights = false;
    const auto a = m.forward_cached(q, reused, in), b = m.forward_cached(q, fresh, in);
    EXPECT_TRUE(bitwise_equal(a.out, b.out));
    EXPECT_TRUE(bitwise_equal(a.weights, b.weights));
    reused.clear();
  }
}

// Appending one position at a time far past the first allocation grows the capacity geometrically
// and keeps every row: attending all queries at once afterwards equals the causal full forward.
TEST_P(KvCacheDtype, GrowthKeepsOldRows) {
  const DType dt = param();
  CacheCase c = small_case(dt, Layout::SeqFirst);
  c.add_zero_attn = true;
  Rng rng(15);
  TestLayer t = make_layer(c, kernel(), rng);
  MultiHeadAttention& m = t.layer;
  const std::int64_t B = c.B, S = kUnderSanitizers ? 70 : 150, E = c.E;
  const auto xk = rounded_to(dt, random_values(B * S * c.kdim, rng));
  const auto xv = rounded_to(dt, random_values(B * S * c.vdim, rng));
  KeyValueCache cache;
  std::vector<std::int64_t> capacities;
  for (std::int64_t s = 0; s < S; ++s) {
    m.append_to_cache(cache, positions_tensor(dt, xk, B, S, c.kdim, s, s + 1, c.layout),
                      positions_tensor(dt, xv, B, S, c.vdim, s, s + 1, c.layout));
    ASSERT_GE(cache.capacity(), cache.length() + 1) << "room for the zero-attention position";
    if (capacities.empty() || capacities.back() != cache.capacity()) capacities.push_back(cache.capacity());
  }
  ASSERT_GE(capacities.size(), 3u) << "the test must grow the cache several times";
  for (std::size_t i = 1; i < capacities.size(); ++i) EXPECT_GE(capacities[i], 2 * capacities[i - 1]);

  const Tensor q = random_tensor(dt, {S, B, E}, rng);
  MultiHeadAttentionInputs in;
  in.causal = true;
  const auto cached = m.forward_cached(q, cache, in);
  const auto full = m.forward(q, positions_tensor(dt, xk, B, S, c.kdim, 0, S, c.layout),
                              positions_tensor(dt, xv, B, S, c.vdim, 0, S, c.layout), in);
  const double tol = tolerance(dt);
  EXPECT_TRUE(all_close(to_doubles(cached.out), to_doubles(full.out), tol, tol, full.out.shape())) << "out";
  EXPECT_TRUE(all_close(to_doubles(cached.weights), to_doubles(full.weights), tol, tol)) << "weights";
}

// ---- bad arguments -------------------------------------------------------------------------------

struct BadCacheCall {
  const char* name;
  std::function<void()> call;
  const char* names_arg;  // ECMAScript regex the message must match
};

void PrintTo(const BadCacheCall& c, std::ostream* os) { *os << c.name; }

// A float32 layer: E = 8, h = 2, d_k = 3, d_v = 5, kdim = 6, vdim = 7, batch first, and a cache
// holding B = 2 and S = 4 positions of it.
MultiHeadAttentionConfig bad_config() {
  MultiHeadAttentionConfig cfg;
  cfg.d_model = 8, cfg.num_heads = 2, cfg.d_k = 3, cfg.d_v = 5, cfg.kdim = 6, cfg.vdim = 7;
  return cfg;
}
Tensor T(Shape s, DType d = DType::Float32) { return Tensor(d, std::move(s)); }

struct Filled {
  MultiHeadAttention layer{bad_config()};
  KeyValueCache cache;
  Filled() { layer.append_to_cache(cache, T({2, 4, 6}), T({2, 4, 7})); }
};

// forward_cached on the filled cache with query [2, 1, 8] and the masks `set` makes.
void attend_with(const std::function<void(MultiHeadAttentionInputs&, std::vector<Tensor>&)>& set) {
  Filled f;
  std::vector<Tensor> keep;
  MultiHeadAttentionInputs in;
  set(in, keep);
  (void)f.layer.forward_cached(T({2, 1, 8}), f.cache, in);
}

std::vector<BadCacheCall> bad_calls() {
  using In = MultiHeadAttentionInputs;
  using Keep = std::vector<Tensor>;
  std::vector<BadCacheCall> c;
  c.push_back({"attend_empty_cache",
               [] {
                 MultiHeadAttention m(bad_config());
                 KeyValueCache cache;
                 (void)m.forward_cached(T({2, 1, 8}), cache);
               },
               R"(\bcache\b.*empty)"});
  c.push_back({"attend_cleared_cache",
               [] {
                 Filled f;
                 f.cache.clear();
                 (void)f.layer.forward_cached(T({2, 1, 8}), f.cache);
               },
               R"(\bcache\b.*empty)"});
  c.push_back({"attend_batch_mismatch",
               [] {
                 Filled f;
                 (void)f.layer.forward_cached(T({3, 1, 8}), f.cache);
               },
               R"(\bquery\b.*batch)"});
  c.push_back({"attend_unbatched_query_with_batch_2",
               [] {
                 Filled f;
                 (void)f.layer.forward_cached(T({1, 8}), f.cache);
               },
               R"(\bquery\b)"});
  c.push_back({"attend_query_width",
               [] {
                 Filled f;
                 (void)f.layer.forward_cached(T({2, 1, 7}), f.cache);
               },
               R"(\bquery\b.*d_model)"});
  c.push_back({"attend_query_rank4",
               [] {
                 Filled f;
                 (void)f.layer.forward_cached(T({1, 2, 1, 8}), f.cache);
               },
               R"(\bquery\b.*rank)"});
  c.push_back({"attend_query_dtype",
               [] {
                 Filled f;
                 (void)f.layer.forward_cached(T({2, 1, 8}, DType::Float64), f.cache);
               },
               R"(\bquery\b.*float32)"});
  c.push_back({"append_batch_mismatch",
               [] {
                 Filled f;
                 f.layer.append_to_cache(f.cache, T({3, 1, 6}), T({3, 1, 7}));
               },
               R"(\bkey\b.*batch)"});
  c.push_back({"append_key_width",
               [] {
                 Filled f;
                 f.layer.append_to_cache(f.cache, T({2, 1, 8}), T({2, 1, 7}));
               },
               R"(\bkey\b.*kdim)"});
  c.push_back({"append_value_width",
               [] {
                 Filled f;
                 f.layer.append_to_cache(f.cache, T({2, 1, 6}), T({2, 1, 6}));
               },
               R"(\bvalue\b.*vdim)"});
  c.push_back({"append_key_dtype",
               [] {
                 Filled f;
                 f.layer.append_to_cache(f.cache, T({2, 1, 6}, DType::Float64), T({2, 1, 7}));
               },
               R"(\bkey\b.*float32)"});
  c.push_back({"append_value_bool",
               [] {
                 Filled f;
                 f.layer.append_to_cache(f.cache, T({2, 1, 6}), T({2, 1, 7}, DType::Bool));
               },
               R"(\bvalue\b.*float32)"});
  c.push_back({"append_value_positions",
               [] {
                 Filled f;
                 f.layer.append_to_cache(f.cache, T({2, 2, 6}), T({2, 3, 7}));
               },
               R"(\bvalue\b.*positions)"});
  c.push_back({"append_value_batch",
               [] {
                 Filled f;
                 f.layer.append_to_cache(f.cache, T({2, 2, 6}), T({1, 2, 7}));
               },
               R"(\bvalue\b.*batch)"});
  c.push_back({"append_value_rank",
               [] {
                 Filled f;
                 f.layer.append_to_cache(f.cache, T({2, 2, 6}), T({2, 7}));
               },
               R"(\bvalue\b.*rank)"});
  c.push_back({"append_key_rank1",
               [] {
                 Filled f;
                 f.layer.append_to_cache(f.cache, T({6}), T({7}));
               },
               R"(\bkey\b.*rank)"});
  c.push_back({"append_no_positions",
               [] {
                 Filled f;
                 f.layer.append_to_cache(f.cache, T({2, 0, 6}), T({2, 0, 7}));
               },
               R"(\bkey\b.*position)"});
  c.push_back({"append_with_other_layer",
               [] {
                 Filled f;
                 MultiHeadAttentionConfig cfg = bad_config();
                 cfg.d_k = 4;
                 MultiHeadAttention other(cfg);
                 other.append_to_cache(f.cache, T({2, 1, 6}), T({2, 1, 7}));
               },
               R"(\bcache\b.*d_k = 3)"});
  c.push_back({"attend_with_other_dtype_layer",
               [] {
                 Filled f;
                 MultiHeadAttentionConfig cfg = bad_config();
                 cfg.dtype = DType::Float64;
                 MultiHeadAttention other(cfg);
                 (void)other.forward_cached(T({2, 1, 8}, DType::Float64), f.cache);
               },
               R"(\bcache\b.*float64)"});
  c.push_back({"attend_with_layer_without_bias_kv",
               [] {
                 Filled f;
                 MultiHeadAttentionConfig cfg = bad_config();
                 cfg.add_bias_kv = true;
                 MultiHeadAttention other(cfg);
                 (void)other.forward_cached(T({2, 1, 8}), f.cache);
               },
               R"(\bcache\b.*add_bias_kv)"});
  c.push_back({"attend_with_other_bias_kv_values",
               [] {
                 MultiHeadAttentionConfig cfg = bad_config();
                 cfg.add_bias_kv = true;
                 MultiHeadAttention a(cfg, 1), b(cfg, 2);  // the same config, other bias_k / bias_v
                 KeyValueCache cache;
                 a.append_to_cache(cache, T({2, 4, 6}), T({2, 4, 7}));
                 (void)b.forward_cached(T({2, 1, 8}), cache);
               },
               R"(\bcache\b.*bias_k)"});
  c.push_back({"attend_kpm_positions",
               [] {
                 attend_with([](In& in, Keep& k) {
                   k.push_back(T({2, 5}, DType::Bool));
                   in.key_padding_mask = k.back().view();
                 });
               },
               R"(\bkey_padding_mask\b.*\[2, 4\])"});
  c.push_back({"attend_kpm_float_shape",
               [] {
                 attend_with([](In& in, Keep& k) {
                   k.push_back(T({2, 5}));
                   in.key_padding_mask = k.back().view();
                 });
               },
               R"(\bkey_padding_mask\b)"});
  c.push_back({"attend_unbatched_kpm",
               [] {
                 MultiHeadAttention m(bad_config());
                 KeyValueCache cache;
                 m.append_to_cache(cache, T({4, 6}), T({4, 7}));
                 In in;
                 const Tensor kpm = T({5}, DType::Bool);
                 in.key_padding_mask = kpm.view();
                 (void)m.forward_cached(T({1, 8}), cache, in);
               },
               R"(\bkey_padding_mask\b.*\[4\])"});
  c.push_back({"attend_key_lengths_count", [] { attend_with([](In& in, Keep&) { in.key_lengths = {4}; }); },
               R"(\bkey_lengths\b)"});
  c.push_back({"attend_key_lengths_past_cache", [] { attend_with([](In& in, Keep&) {
                                                       in.key_lengths = {4, 5};
                                                     }); },
               R"(\bkey_lengths\b.*S = 4)"});
  c.push_back({"attend_attn_mask_2d_columns",
               [] {
                 attend_with([](In& in, Keep& k) {
                   k.push_back(T({1, 3}, DType::Bool));
                   in.attn_mask = k.back().view();
                 });
               },
               R"(\battn_mask\b.*\[1, 4\])"});
  c.push_back({"attend_attn_mask_2d_rows",
               [] {
                 attend_with([](In& in, Keep& k) {
                   k.push_back(T({4, 4}, DType::Bool));
                   in.attn_mask = k.back().view();
                 });
               },
               R"(\battn_mask\b)"});
  c.push_back({"attend_attn_mask_3d",
               [] {
                 attend_with([](In& in, Keep& k) {
                   k.push_back(T({2, 1, 4}));
                   in.attn_mask = k.back().view();
                 });
               },
               R"(\battn_mask\b.*\[4, 1, 4\])"});
  return c;
}

class KvCacheBadInput : public ::testing::TestWithParam<BadCacheCall> {};

TEST_P(KvCacheBadInput, ThrowsErrorNamingTheArgument) {
  const BadCacheCall& c = GetParam();
  try {
    c.call();
    FAIL() << "no exception";
  } catch (const mha::Error& e) {
    EXPECT_TRUE(message_matches(e.what(), c.names_arg))
        << "message does not match /" << c.names_arg << "/: " << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, KvCacheBadInput, ::testing::ValuesIn(bad_calls()),
                         [](const ::testing::TestParamInfo<BadCacheCall>& info) {
                           return std::string(info.param.name);
                         });

// A failed append changes nothing: the cache keeps its length and contents.
TEST(KvCacheErrors, FailedAppendLeavesTheCacheUnchanged) {
  MultiHeadAttention m(bad_config());
  m.eval();
  Rng rng(16);
  KeyValueCache cache;
  m.append_to_cache(cache, random_tensor(DType::Float32, {2, 4, 6}, rng),
                    random_tensor(DType::Float32, {2, 4, 7}, rng));
  const Tensor q = random_tensor(DType::Float32, {2, 3, 8}, rng);
  const Tensor before = m.forward_cached(q, cache).out;
  EXPECT_THROW(m.append_to_cache(cache, T({3, 1, 6}), T({3, 1, 7})), mha::Error);
  EXPECT_THROW(m.append_to_cache(cache, T({2, 1, 6}), T({2, 2, 7})), mha::Error);
  EXPECT_EQ(cache.length(), 4);
  EXPECT_EQ(cache.batch(), 2);
  EXPECT_TRUE(bitwise_equal(m.forward_cached(q, cache).out, before));
}

// B = 0 is refused: an empty cache would otherwise take batch size 0 from it, and every later append
// of real keys would then be refused for its batch. A cleared cache refuses it too, and stays usable.
TEST(KvCacheErrors, AppendOfAnEmptyBatchIsRefused) {
  MultiHeadAttention m(bad_config());
  for (const bool cleared : {false, true}) {
    KeyValueCache cache;
    if (cleared) {
      m.append_to_cache(cache, T({3, 2, 6}), T({3, 2, 7}));
      cache.clear();
    }
    try {
      m.append_to_cache(cache, T({0, 2, 6}), T({0, 2, 7}));
      ADD_FAILURE() << "append_to_cache of B = 0 returned; cache.batch() = " << cache.batch();
    } catch (const mha::Error& e) {
      EXPECT_TRUE(message_matches(e.what(), R"(^key\b.*batch.*\[0, 2, 6\])")) << e.what();
    }
    EXPECT_EQ(cache.length(), 0);
    m.append_to_cache(cache, T({2, 1, 6}), T({2, 1, 7}));
    EXPECT_EQ(cache.batch(), 2);
    EXPECT_EQ(cache.length(), 1);
  }
}

}  // namespace
}  // namespace mha_test

namespace mha_test {
namespace {

// Two threads appending to one cache (and reading it) at once: each overlapping call is refused with
// mha::Error naming the misuse, never undefined behaviour (it was a heap-use-after-free under ASan:
// one append regrew the storage the other was writing). Every append that returned counts: the
// cache's length is their sum, and what it holds equals a cache filled by the same appends in order.
TEST(KvCacheThreads, OverlappingAppendsAreRefusedNotRaced) {
  MultiHeadAttentionConfig cfg;
  cfg.d_model = 16, cfg.num_heads = 2, cfg.batch_first = true;
  const MultiHeadAttention a(cfg, 1), b(cfg, 1);  // two layers, one cache (the misuse found)
  Rng rng(5);
  const std::int64_t chunk = 64;
  const Tensor x = random_tensor(DType::Float32, {1, chunk, 16}, rng);
  KeyValueCache cache;
  std::atomic<int> appended{0}, refused{0}, other_errors{0};
  auto hammer = [&](const MultiHeadAttention& layer) {
    for (int i = 0; i < 40; ++i) {
      try {
        layer.append_to_cache(cache, x.view(), x.view());
        ++appended;
      } catch (const mha::Error& e) {
        if (std::string(e.what()).find("in use by another call") != std::string::npos) ++refused;
        else ++other_errors;
      }
    }
  };
  std::thread first(hammer, std::cref(a)), second(hammer, std::cref(b));
  first.join();
  second.join();
  EXPECT_EQ(other_errors.load(), 0);
  EXPECT_EQ(appended + refused, 80);
  EXPECT_EQ(cache.length(), appended * chunk);
  // A call on a cache nobody else uses goes through again.
  EXPECT_NO_THROW(a.append_to_cache(cache, x.view(), x.view()));
  EXPECT_NO_THROW(cache.clear());
}

// forward_cached calls may overlap each other: two threads reading one cache are never refused and
// every call returns the same, bitwise.
TEST(KvCacheThreads, ConcurrentReadersShareTheCache) {
  MultiHeadAttentionConfig cfg;
  cfg.d_model = 16, cfg.num_heads = 2, cfg.batch_first = true;
  const MultiHeadAttention layer(cfg, 2);
  Rng rng(6);
  const Tensor x = random_tensor(DType::Float32, {1, 200, 16}, rng), q = random_tensor(DType::Float32, {1, 3, 16}, rng);
  KeyValueCache cache;
  layer.append_to_cache(cache, x.view(), x.view());
  const Tensor want = layer.forward_cached(q.view(), cache).out;
  std::atomic<int> mismatches{0}, errors{0};
  auto read = [&] {
    for (int i = 0; i < 30; ++i) {
      try {
        if (!bitwise_equal(layer.forward_cached(q.view(), cache).out, want)) ++mismatches;
      } catch (const mha::Error&) {
        ++errors;
      }
    }
  };
  std::thread first(read), second(read);
  first.join();
  second.join();
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(errors.load(), 0) << "readers must not refuse each other";
}

}  // namespace
}  // namespace mha_test
