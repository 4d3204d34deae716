// Ring attention against the single-process call: each rank builds the whole seeded problem, runs its
// shard through the ring, and checks its rows of the results (out, lse, dq, dk, dv) against the same
// rows of the single-process ones. float64: within 1e-12 of the single-process result; float32: within
// the kernels' rule against the fp64 reference (error <= 4 x the single-process float32 error + slack).
// Run on 1, 2, 3 and 4 ranks by ctest (tests/CMakeLists.txt).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <ostream>
#include <string>

#include "ring_support.hpp"
#include "support/test_util.hpp"  // kUnderSanitizers

namespace ring_test {
namespace {

using mha::distributed::Layout;

struct RingCase {
  const char* name;
  std::int64_t B, h, L, S, d_k, d_v;
  bool causal;
  Layout layout;
  bool padding = false;                              // a random bool key_padding_mask (and one batch padded whole)
  bool lengths = false;                              // key_lengths {S, S / 3, 0, ...}
  double dropout = 0.0;                              // dropout_p
  bool nan_key = false;                              // a NaN in key 5 of batch 0, head 0
  double scale = 0;                                  // the logit scale; 0: the default 1 / sqrt(d_k)
  std::int64_t window_left = -1, window_right = -1;  // a sliding window over the whole sequence's positions
  bool alibi = false;                                // ALiBi slopes {0.5, 0.25, ...}
  double softcap = 0;                                // logit soft-capping
};

// Rows for the case whose shards span several kernel blocks (128 or 256 query rows, kBlockK 256): 600 is 5 x 3
// blocks in one process, 300 (under the sanitizers, 4x less work) 3 x 2 and still 2 query blocks per rank
// on 2 ranks.
constexpr std::int64_t kSeveralBlocks = mha_test::kUnderSanitizers ? 300 : 600;

const RingCase kCases[] = {
    {"plain", 2, 2, 37, 37, 16, 16, false, Layout::Zigzag},
    {"causal_zigzag", 1, 3, 301, 301, 32, 24, true, Layout::Zigzag},
    {"causal_contiguous", 2, 2, 131, 131, 16, 16, true, Layout::Contiguous},
    {"cross_attention", 2, 2, 29, 53, 16, 8, false, Layout::Contiguous},
    {"cross_attention_zigzag", 1, 2, 41, 23, 8, 8, false, Layout::Zigzag},
    {"padding", 2, 2, 45, 45, 16, 16, true, Layout::Zigzag, true},
    {"key_lengths", 3, 1, 50, 50, 8, 8, false, Layout::Zigzag, false, true},
    {"dropout", 1, 2, 70, 70, 16, 16, true, Layout::Zigzag, false, false, 0.2},
    {"dropout_padding_contiguous", 2, 1, 33, 33, 8, 8, false, Layout::Contiguous, true, false, 0.3},
    {"fewer_rows_than_chunks", 1, 1, 3, 3, 4, 4, true, Layout::Zigzag},
    {"nan_in_a_key", 1, 2, 40, 40, 8, 8, true, Layout::Zigzag, false, false, 0.0, true},
    {"several_kernel_blocks", 1, 2, kSeveralBlocks, kSeveralBlocks, 64, 64, false, Layout::Zigzag},
    {"own_scale", 2, 1, 31, 31, 8, 8, true, Layout::Zigzag, true, false, 0.0, false, 0.7},
    // The score's variants at whole-sequence positions: windows narrow enough that whole key chunks
    // fall outside them (chunks of 301 / 8 rows on 4 zigzag ranks), ALiBi's distances across chunks,
    // soft-capping; cross-attention, where queries sit at i + S - L.
    {"window_causal", 1, 2, 301, 301, 16, 16, true, Layout::Zigzag, false, false, 0.0, false, 0, 40},
    {"window_two_sided_contiguous", 2, 2, 150, 150, 16, 8, false, Layout::Contiguous, true, false, 0.0, false, 0, 20,
     30},
    {"alibi_softcap_causal", 1, 3, 131, 131, 16, 16, true, Layout::Zigzag, false, true, 0.2, false, 0, -1, -1, true,
     3.0},
    {"cross_attention_window_alibi", 2, 2, 29, 53, 16, 8, false, Layout::Zigzag, false, false, 0.0, false, 0, 5, 7,
     true},
    {"several_kernel_blocks_window", 1, 2, kSeveralBlocks, kSeveralBlocks, 32, 32, true, Layout::Zigzag, false, false,
     0.0, false, 0, 200, -1, true},
};

void PrintTo(const RingCase& c, std::ostream* os) { *os << c.name; }

// The whole problem, built alike on every rank.
struct Problem {
  Tensor q, k, v, dout, padding;  // padding: bool [B, S] or undefined
  std::vector<std::int64_t> lengths;
  Tensor slopes;  // ALiBi's, float32 [h], or undefined
};

Problem make_problem(const RingCase& c, DType dtype, std::uint64_t seed) {
  Problem p{normal(dtype, {c.B, c.h, c.L, c.d_k}, seed),
            normal(dtype, {c.B, c.h, c.S, c.d_k}, seed + 1),
            normal(dtype, {c.B, c.h, c.S, c.d_v}, seed + 2),
            normal(dtype, {c.B, c.h, c.L, c.d_v}, seed + 3),
            {},
            {},
            {}};
  if (c.nan_key) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    if (dtype == DType::Float64) p.k.data_as<double>()[5 * c.d_k] = nan;
    else p.k.data_as<float>()[5 * c.d_k] = static_cast<float>(nan);
  }
  if (c.padding) {
    p.padding = Tensor(DType::Bool, {c.B, c.S});
    std::mt19937_64 gen(seed + 4);
    auto* m = static_cast<bool*>(p.padding.data());
    for (std::int64_t i = 0; i < c.B * c.S; ++i) m[i] = gen() % 4 == 0;
    for (std::int64_t s = 0; s < c.S; ++s) m[(c.B - 1) * c.S + s] = true;  // a batch with no key at all
  }
  if (c.lengths)
    for (std::int64_t b = 0; b < c.B; ++b) p.lengths.push_back(b == 0 ? c.S : b == 1 ? c.S / 3 : 0);
  if (c.alibi) {
    p.slopes = Tensor(DType::Float32, {c.h});
    for (std::int64_t head = 0; head < c.h; ++head) p.slopes.data_as<float>()[head] = 0.5f / float(1 << head);
  }
  return p;
}

mha::AttentionOptions single_options(const RingCase& c, const Problem& p, mha::Kernel kernel) {
  mha::AttentionOptions o;
  o.causal = c.causal;
  if (c.scale > 0) o.scale = c.scale;
  if (p.padding.defined()) o.key_padding_mask = p.padding.view();
  o.key_lengths = p.lengths;
  o.dropout_p = c.dropout;
  o.dropout_seed = 1234;
  o.window_left = c.window_left, o.window_right = c.window_right;
  if (p.slopes.defined()) o.alibi_slopes = p.slopes.view();
  o.softcap = c.softcap;
  o.need_lse = true;
  o.kernel = kernel;
  return o;
}

struct Results {
  Tensor out, lse, dq, dk, dv;
};

Results single_process(const RingCase& c, const Problem& p, mha::Kernel kernel) {
  const mha::AttentionOptions o = single_options(c, p, kernel);
  mha::AttentionResult r = mha::scaled_dot_product_attention(p.q, p.k, p.v, o);
  mha::AttentionGradients g = mha::scaled_dot_product_attention_backward(p.dout, p.q, p.k, p.v, r.out, r.lse, o);
  return {std::move(r.out), std::move(r.lse), std::move(g.dq), std::move(g.dk), std::move(g.dv)};
}

// This rank's rows of the ring results.
Results ring(const RingCase& c, const Problem& p) {
  const int P = world_size(), r = world_rank();
  auto shard = [&](const Tensor& t, std::int64_t dim) {
    return mha::distributed::shard_sequence(t, dim, P, r, c.layout);
  };
  const Tensor q = shard(p.q, 2), k = shard(p.k, 2), v = shard(p.v, 2), dout = shard(p.dout, 2);
  Tensor padding;
  mha::distributed::RingOptions o;
  o.causal = c.causal;
  if (c.scale > 0) o.scale = c.scale;
  o.layout = c.layout;
  if (p.padding.defined()) padding = shard(p.padding, 1), o.key_padding_mask = padding.view();
  o.key_lengths = p.lengths;
  o.dropout_p = c.dropout;
  o.dropout_seed = 1234;
  o.window_left = c.window_left, o.window_right = c.window_right;
  if (p.slopes.defined()) o.alibi_slopes = p.slopes.view();
  o.softcap = c.softcap;
  mha::distributed::RingResult f = mha::distributed::ring_attention(q, k, v, MPI_COMM_WORLD, o);
  mha::AttentionGradients g = mha::distributed::ring_attention_backward(dout, q, k, v, f.out, f.lse, MPI_COMM_WORLD, o);
  return {std::move(f.out), std::move(f.lse), std::move(g.dq), std::move(g.dk), std::move(g.dv)};
}

// max |got - want| where want is finite; non-finite values must match exactly (NaN with NaN).
double max_error(const std::vector<double>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return std::numeric_limits<double>::infinity();
  double e = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i])) e = std::max(e, std::isnan(got[i]) ? 0.0 : HUGE_VAL);
    else if (std::isinf(want[i])) e = std::max(e, got[i] == want[i] ? 0.0 : HUGE_VAL);
    else e = std::max(e, std::isfinite(got[i]) ? std::fabs(got[i] - want[i]) : HUGE_VAL);
  }
  return e;
}

double max_finite(const std::vector<double>& x) {
  double m = 1;
  for (double e : x)
    if (std::isfinite(e)) m = std::max(m, std::fabs(e));
  return m;
}

class RingParity : public ::testing::TestWithParam<std::tuple<RingCase, DType>> {};

TEST_P(RingParity, MatchesOneProcess) {
  const auto& [c, dtype] = GetParam();
  const int P = world_size(), r = world_rank();
  const Problem p = make_problem(c, dtype, 42);
  const Results got = ring(c, p);
  // The single-process fp64 reference, and (float32) the single-process float32 call.
  Problem p64{Tensor::copy_of(p.q, DType::Float64),
              Tensor::copy_of(p.k, DType::Float64),
              Tensor::copy_of(p.v, DType::Float64),
              Tensor::copy_of(p.dout, DType::Float64),
              p.padding.defined() ? p.padding.clone() : Tensor(),
              p.lengths,
              p.slopes.defined() ? p.slopes.clone() : Tensor()};
  const Results ref64 = single_process(c, p64, mha::Kernel::Reference);
  const Results one = single_process(c, p, mha::Kernel::Flash);
  auto mine = [&](const Tensor& t, std::int64_t dim) {
    return doubles(mha::distributed::shard_sequence(t, dim, P, r, c.layout));
  };
  const std::pair<const char*, std::pair<const Tensor*, std::int64_t>> fields[] = {
      {"out", {&got.out, 0}}, {"lse", {&got.lse, 1}}, {"dq", {&got.dq, 2}}, {"dk", {&got.dk, 3}}, {"dv", {&got.dv, 4}}};
  const Tensor* ref_fields[] = {&ref64.out, &ref64.lse, &ref64.dq, &ref64.dk, &ref64.dv};
  const Tensor* one_fields[] = {&one.out, &one.lse, &one.dq, &one.dk, &one.dv};
  for (const auto& [name, field] : fields) {
    const auto [tensor, index] = field;
    const std::vector<double> want = mine(*ref_fields[index], 2), single = mine(*one_fields[index], 2);
    const std::vector<double> have = doubles(*tensor);
    const double error = max_error(have, want);
    const double bound =
        dtype == DType::Float64 ? 1e-12 * max_finite(want) : 4 * max_error(single, want) + 1e-5 * max_finite(want);
    EXPECT_LE(error, bound) << name << " of rank " << r << " of " << P << ", case " << c.name;
  }
}

TEST_P(RingParity, SameBitsOnEveryRun) {
  const auto& [c, dtype] = GetParam();
  const Problem p = make_problem(c, dtype, 7);
  const Results a = ring(c, p), b = ring(c, p);
  for (const auto& [x, y] :
       {std::pair{&a.out, &b.out}, {&a.lse, &b.lse}, {&a.dq, &b.dq}, {&a.dk, &b.dk}, {&a.dv, &b.dv}})
    if (x->nbytes() > 0) {
      EXPECT_EQ(std::memcmp(x->data(), y->data(), x->nbytes()), 0) << c.name;
    }
}

INSTANTIATE_TEST_SUITE_P(Cases, RingParity,
                         ::testing::Combine(::testing::ValuesIn(kCases),
                                            ::testing::Values(DType::Float32, DType::Float64)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param).name) +
                                  (std::get<1>(info.param) == DType::Float64 ? "_f64" : "_f32");
                         });

TEST(SequenceLayout, ShardsJoinBackToTheWhole) {
  for (Layout layout : {Layout::Contiguous, Layout::Zigzag})
    for (int P = 1; P <= 5; ++P)
      for (std::int64_t n : {0, 1, 7, 10, 33}) {
        const Tensor full = normal(DType::Float32, {2, n, 3}, 5);
        std::vector<Tensor> shards;
        std::int64_t rows = 0;
        for (int r = 0; r < P; ++r) {
          shards.push_back(mha::distributed::shard_sequence(full, 1, P, r, layout));
          rows += shards.back().size(1);
        }
        EXPECT_EQ(rows, n);
        std::vector<TensorView> views(shards.begin(), shards.end());
        const Tensor joined = mha::distributed::unshard_sequence(views, 1, layout);
        ASSERT_EQ(joined.shape(), full.shape());
        if (n > 0) {
          EXPECT_EQ(std::memcmp(joined.data(), full.data(), full.nbytes()), 0) << "P " << P << " n " << n;
        }
      }
}

TEST(SequenceLayout, ZigzagGivesEachRankOneEarlyAndOneLateChunk) {
  using mha::distributed::SequenceChunk;
  // 10 rows, 2 ranks: 4 chunks of 3, 3, 2, 2 rows; rank 0 holds the first and the last.
  EXPECT_EQ(mha::distributed::shard_chunks(10, 2, 0, Layout::Zigzag), (std::vector<SequenceChunk>{{0, 3}, {8, 2}}));
  EXPECT_EQ(mha::distributed::shard_chunks(10, 2, 1, Layout::Zigzag), (std::vector<SequenceChunk>{{3, 3}, {6, 2}}));
  EXPECT_EQ(mha::distributed::shard_chunks(10, 3, 2, Layout::Contiguous), (std::vector<SequenceChunk>{{7, 3}}));
  EXPECT_THROW(mha::distributed::shard_chunks(10, 2, 2, Layout::Zigzag), mha::Error);
  EXPECT_THROW(mha::distributed::shard_chunks(-1, 2, 0, Layout::Zigzag), mha::Error);
}

}  // namespace
}  // namespace ring_test
