// decode_attention (mha/decode.hpp) against scaled_dot_product_attention's reference kernel on each
// sequence's gathered keys and values (cache.keys / cache.values), K/V heads repeated per group, causal:
// float64 caches within 1e-12 relative; float32 within the float rule (error against float64 at most
// 2x the float32 reference's, plus 1e-6); bfloat16 within the bfloat16 rule (2x the error of the exact
// result rounded to bfloat16, plus 2^-14 of the result's scale). Page sizes {1, 3, 16, 64}, ragged
// batches, q_len 1..5, h_kv in {1, 2, h}, head widths that are not a multiple of the vector width, and
// sequences long enough to be split into several chunks. Then the properties: bitwise the same for 1
// and 2 threads, alone or in a batch, group-packed or per head; forks at every position inside a page
// leave the parent's result bitwise unchanged; a NaN reaches exactly the queries that see it; refused
// calls throw mha::Error naming the cause.
//
// Legend: n sequences, Lq new queries per sequence, h query heads, h_kv key/value heads, g = h / h_kv,
// d_k, d_v, P tokens per page, T a sequence's length.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "decode/decode_params.hpp"
#include "decode/split_kv.hpp"
#include "support/bitwise.hpp"
#include "support/kernel_compare.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::PagedKVCache;
using Ids = std::vector<PagedKVCache::SequenceId>;

struct Shape5 {
  std::int64_t h, h_kv, d_k, d_v, P;
};

// A cache of `dtype` holding sequences of the given lengths, random values representable in `dtype`.
struct Batch {
  PagedKVCache cache;
  Ids ids;
};

void append_random(PagedKVCache& cache, PagedKVCache::SequenceId id, std::int64_t n, Rng& rng) {
  const mha::PagedKVCacheConfig& c = cache.config();
  const Tensor k = make_tensor(c.dtype, {n, c.num_kv_heads, c.head_dim},
                               random_values(n * c.num_kv_heads * c.head_dim, rng, -2.0, 2.0));
  const Tensor v =
      make_tensor(c.dtype, {n, c.num_kv_heads, c.value_dim}, random_values(n * c.num_kv_heads * c.value_dim, rng));
  cache.append(id, k, v);
}

Batch make_batch(DType dtype, const Shape5& s, const std::vector<std::int64_t>& lengths, Rng& rng,
                 std::int64_t spare = 64) {
  std::int64_t total = spare;
  for (std::int64_t T : lengths) total += T + s.P;
  Batch b{PagedKVCache({.num_kv_heads = s.h_kv,
                        .head_dim = s.d_k,
                        .value_dim = s.d_v,
                        .page_size = s.P,
                        .capacity_tokens = total,
                        .dtype = dtype}),
          {}};
  for (std::int64_t T : lengths) {
    b.ids.push_back(b.cache.add_sequence());
    append_random(b.cache, b.ids.back(), T, rng);
  }
  return b;
}

// q [n, Lq, h, d_k] of `dtype` (values representable in it).
Tensor random_q(DType dtype, std::int64_t n, std::int64_t Lq, std::int64_t h, std::int64_t d_k, Rng& rng) {
  return make_tensor(dtype, {n, Lq, h, d_k}, random_values(n * Lq * h * d_k, rng, -2.0, 2.0));
}

std::vector<double> decode(const Tensor& q, const Batch& b, const Ids& ids, std::vector<double>* lse = nullptr,
                           mha::detail::DecodeMode mode = mha::detail::DecodeMode::GroupPacked) {
  mha::DecodeOptions o;
  o.need_lse = lse != nullptr;
  const mha::DecodeResult r = mha::detail::decode_attention_with_mode(q, b.cache, ids, o, mode);
  EXPECT_EQ(r.out.shape(), (Shape{q.size(0), q.size(1), q.size(2), b.cache.config().value_dim}));
  if (lse) *lse = to_doubles(r.lse);
  return to_doubles(r.out);
}

// The reference: for each sequence, scaled_dot_product_attention (Kernel::Reference, causal) of q's rows
// [1, h, Lq, d_k] over the gathered keys and values with K/V heads repeated per group, in `dtype`, laid
// out as decode's out [n, Lq, h, d_v] (and lse [n, Lq, h]).
std::vector<double> reference(const Tensor& q, const Batch& b, const Ids& ids, DType dtype,
                              std::vector<double>* lse = nullptr) {
  const std::int64_t n = q.size(0), Lq = q.size(1), h = q.size(2), d_k = q.size(3);
  const std::int64_t h_kv = b.cache.config().num_kv_heads, d_v = b.cache.config().value_dim, g = h / h_kv;
  const std::vector<double> qd = to_doubles(q);
  std::vector<double> out(static_cast<std::size_t>(n * Lq * h * d_v));
  if (lse) lse->assign(static_cast<std::size_t>(n * Lq * h), 0.0);
  for (std::int64_t s = 0; s < n; ++s) {
    const std::vector<double> keys = to_doubles(b.cache.keys(ids[static_cast<std::size_t>(s)]));
    const std::vector<double> values = to_doubles(b.cache.values(ids[static_cast<std::size_t>(s)]));
    const std::int64_t T = b.cache.length(ids[static_cast<std::size_t>(s)]);
    std::vector<double> q1, k1, v1;  // [1, h, Lq, d_k], [1, h, T, d_k], [1, h, T, d_v]
    for (std::int64_t head = 0; head < h; ++head) {
      for (std::int64_t i = 0; i < Lq; ++i)
        for (std::int64_t c = 0; c < d_k; ++c)
          q1.push_back(qd[static_cast<std::size_t>(((s * Lq + i) * h + head) * d_k + c)]);
      const std::int64_t kv = head / g;
      k1.insert(k1.end(), keys.begin() + kv * T * d_k, keys.begin() + (kv + 1) * T * d_k);
      v1.insert(v1.end(), values.begin() + kv * T * d_v, values.begin() + (kv + 1) * T * d_v);
    }
    mha::AttentionOptions o;
    o.causal = true;
    o.need_lse = true;
    o.kernel = mha::Kernel::Reference;
    const mha::AttentionResult r = mha::scaled_dot_product_attention(make_tensor(dtype, {1, h, Lq, d_k}, q1),
                                                                     make_tensor(dtype, {1, h, T, d_k}, k1),
                                                                     make_tensor(dtype, {1, h, T, d_v}, v1), o);
    const std::vector<double> o1 = to_doubles(r.out), l1 = to_doubles(r.lse);
    for (std::int64_t head = 0; head < h; ++head)
      for (std::int64_t i = 0; i < Lq; ++i) {
        for (std::int64_t e = 0; e < d_v; ++e)
          out[static_cast<std::size_t>(((s * Lq + i) * h + head) * d_v + e)] =
              o1[static_cast<std::size_t>((head * Lq + i) * d_v + e)];
        if (lse)
          (*lse)[static_cast<std::size_t>((s * Lq + i) * h + head)] = l1[static_cast<std::size_t>(head * Lq + i)];
      }
  }
  return out;
}

// decode in `dtype` against the reference under the dtype's rule.
void expect_matches_reference(const Tensor& q, const Batch& b, const Ids& ids) {
  const DType dtype = q.dtype();
  std::vector<double> lse, lse64, lse32;
  const std::vector<double> got = decode(q, b, ids, &lse);
  const std::vector<double> ref64 = reference(q, b, ids, DType::Float64, &lse64);
  const Shape shape{q.size(0), q.size(1), q.size(2), b.cache.config().value_dim};
  if (dtype == DType::Float64) {
    const double bound = 1e-12 * max_abs_finite(ref64);
    EXPECT_LE(max_abs_error(got, ref64).value, bound) << "out";
    EXPECT_LE(max_abs_error(lse, lse64).value, 1e-12 * max_abs_finite(lse64)) << "lse";
    return;
  }
  const std::vector<double> ref32 = reference(q, b, ids, DType::Float32, &lse32);
  if (dtype == DType::Float32) {
    EXPECT_TRUE(within_rule("out", got, ref32, ref64, 2.0, shape));
  } else {  // bfloat16: the exact result rounded once is what bfloat16 must lose anyway
    EXPECT_TRUE(within_rule("out", got, rounded_to(DType::BFloat16, ref64), ref64, 2.0, shape,
                            0x1.0p-14 * max_abs_finite(ref64) + kRuleSlack));
  }
  EXPECT_TRUE(within_rule("lse", lse, lse32, lse64, 2.0, {q.size(0), q.size(1), q.size(2)}));
}

// ---- against the reference --------------------------------------------------------------------------

class DecodeVsReference : public ::testing::TestWithParam<std::tuple<DType, std::int64_t, int>> {};

TEST_P(DecodeVsReference, RaggedBatchesEveryQueryCount) {
  const auto [dtype, P, kv_choice] = GetParam();
  const std::int64_t h = 4, h_kv = kv_choice == 0 ? 1 : kv_choice == 1 ? 2 : h;
  Rng rng(static_cast<std::uint64_t>(P * 10 + kv_choice) + 7 * static_cast<std::uint64_t>(dtype));
  // Widths that are not a multiple of any vector width, beside whole vectors; d_v != d_k.
  const std::int64_t widths[][2] = {{19, 19}, {5, 33}, {64, 48}, {128, 128}};
  const std::int64_t long_length = kUnderSanitizers ? 300 : 1100;  // several chunks for h_kv = 1, 2
  for (const auto& [d_k, d_v] : widths) {
    if (kUnderSanitizers && d_k != 5 && d_k != 64) continue;  // a tail and whole vectors, in ~1/3 of the time
    const Shape5 s{h, h_kv, d_k, d_v, P};
    const Batch b = make_batch(dtype, s, {1 + rng.integer(0, 6), 37, long_length, 5 + rng.integer(0, 90)}, rng);
    for (std::int64_t Lq = 1; Lq <= 5; ++Lq) {
      SCOPED_TRACE("d_k " + std::to_string(d_k) + " d_v " + std::to_string(d_v) + " q_len " + std::to_string(Lq));
      const Ids ids = {b.ids[1], b.ids[2], b.ids[3], b.ids[0]};  // not in cache order; the first is 1..7 long
      if (b.cache.length(b.ids[0]) < Lq) continue;
      expect_matches_reference(random_q(dtype, 4, Lq, h, d_k, rng), b, ids);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, DecodeVsReference,
                         ::testing::Combine(::testing::Values(DType::Float32, DType::Float64, DType::BFloat16),
                                            ::testing::Values<std::int64_t>(1, 3, 16, 64), ::testing::Values(0, 1, 2)),
                         [](const auto& info) {
                           const int kv = std::get<2>(info.param);
                           return std::string(mha::dtype_name(std::get<0>(info.param))) + "_P" +
                                  std::to_string(std::get<1>(info.param)) + "_hkv" +
                                  (kv == 0   ? "1"
                                   : kv == 1 ? "2"
                                             : "h");
                         });

// Long sequences are split into many chunks (and merged): still the reference's result.
TEST(DecodeAttention, LongSequencesSplitIntoManyChunks) {
  Rng rng(11);
  const Shape5 s{8, 2, 32, 32, 16};
  const std::int64_t T = kUnderSanitizers ? 1500 : 9000;
  ASSERT_GT(T, 4 * mha::detail::decode::chunk_pages(T, s.P) * s.P) << "at least 4 chunks";
  for (DType dtype : {DType::Float32, DType::Float64}) {
    const Batch b = make_batch(dtype, s, {T, 300}, rng);
    expect_matches_reference(random_q(dtype, 2, 3, s.h, s.d_k, rng), b, b.ids);
  }
}

// ---- properties ----------------------------------------------------------------------------------------

TEST(DecodeAttention, BitwiseTheSameForOneAndTwoThreadsAloneOrInABatchPackedOrPerHead) {
  Rng rng(5);
  const int saved = mha::num_threads();
  for (DType dtype : {DType::Float32, DType::BFloat16, DType::Float64}) {
    // The long sequence's chunks are sized by its length (kChunksPerSequence), not by kMinChunkPositions:
    // a chunk size that followed the thread count would show.
    const Shape5 s{16, 8, 40, 24, 16};
    const std::int64_t T = kUnderSanitizers ? 4800 : 6000;
    ASSERT_GT(mha::detail::decode::chunk_pages(T, s.P) * s.P, mha::detail::decode::kMinChunkPositions);
    const Batch b = make_batch(dtype, s, {T, 3, 600}, rng);
    const Tensor q = random_q(dtype, 3, 2, s.h, s.d_k, rng);
    mha::set_num_threads(1);
    const std::vector<double> one = decode(q, b, b.ids);
    mha::set_num_threads(2);
    const std::vector<double> two = decode(q, b, b.ids);
    EXPECT_TRUE(same_bits(one, two)) << mha::dtype_name(dtype) << ": 1 vs 2 threads";
    EXPECT_TRUE(same_bits(one, decode(q, b, b.ids, nullptr, mha::detail::DecodeMode::PerHead)))
        << mha::dtype_name(dtype) << ": group-packed vs per head";
    // The last sequence alone: its rows of the batch's result, bitwise.
    const std::int64_t row = 2 * s.h * s.d_v;  // one sequence's [Lq, h, d_v]
    const std::vector<double> q_values = to_doubles(q);
    const Tensor q_last = make_tensor(dtype, {1, 2, s.h, s.d_k},
                                      std::vector<double>(q_values.begin() + 2 * 2 * s.h * s.d_k, q_values.end()));
    const std::vector<double> alone = decode(q_last, b, {b.ids[2]});
    EXPECT_TRUE(same_bits(alone, std::vector<double>(one.begin() + 2 * row, one.end()))) << "alone vs in the batch";
  }
  mha::set_num_threads(saved);
}

TEST(DecodeAttention, DuplicateIdsGiveTheSameRows) {
  Rng rng(6);
  const Shape5 s{2, 1, 8, 8, 3};
  const Batch b = make_batch(DType::Float32, s, {10}, rng);
  const std::vector<double> q1 = rounded_to(DType::Float32, random_values(1 * s.h * s.d_k, rng));
  std::vector<double> q2 = q1;
  q2.insert(q2.end(), q1.begin(), q1.end());
  const std::vector<double> out = decode(make_tensor(DType::Float32, {2, 1, s.h, s.d_k}, q2), b, {b.ids[0], b.ids[0]});
  const std::size_t half = out.size() / 2;
  EXPECT_TRUE(same_bits(std::vector<double>(out.begin(), out.begin() + half),
                        std::vector<double>(out.begin() + half, out.end())));
}

// q through strides (its rows laid out [n, h, Lq, d_k] in memory, read as [n, Lq, h, d_k]): bitwise what
// the contiguous q gives.
TEST(DecodeAttention, TakesStridedQueries) {
  Rng rng(8);
  const Shape5 s{4, 2, 24, 8, 3};
  const Batch b = make_batch(DType::Float32, s, {20, 9}, rng);
  const std::int64_t n = 2, Lq = 3;
  const Tensor q = random_q(DType::Float32, n, Lq, s.h, s.d_k, rng);
  const std::vector<double> values = to_doubles(q);
  Tensor transposed(DType::Float32, {n, s.h, Lq, s.d_k});
  for (std::int64_t i = 0; i < n * Lq * s.h * s.d_k; ++i) {
    const std::int64_t c = i % s.d_k, head = i / s.d_k % s.h, t = i / (s.d_k * s.h) % Lq, seq = i / (s.d_k * s.h * Lq);
    transposed.data_as<float>()[((seq * s.h + head) * Lq + t) * s.d_k + c] =
        static_cast<float>(values[static_cast<std::size_t>(i)]);
  }
  const TensorView strided(transposed.data(), DType::Float32, {n, Lq, s.h, s.d_k},
                           {s.h * Lq * s.d_k, s.d_k, Lq * s.d_k, 1});
  const mha::DecodeResult r = mha::decode_attention(strided, b.cache, b.ids);
  EXPECT_TRUE(same_bits(to_doubles(r.out), decode(q, b, b.ids)));
}

// Forked at every position inside a page (and on its edges), the child and the parent then appended
// differently: the parent's result is bitwise what it was before the fork, the child's the reference's.
TEST(DecodeAttention, ForksAtEveryPositionInsideAPageLeaveTheParentUnchanged) {
  for (std::int64_t P : {3, 16}) {
    for (std::int64_t at = 2 * P; at <= 3 * P; ++at) {
      SCOPED_TRACE("P " + std::to_string(P) + ", fork at " + std::to_string(at));
      Rng rng(static_cast<std::uint64_t>(100 * P + at));
      const Shape5 s{4, 2, 16, 16, P};
      Batch b = make_batch(DType::Float32, s, {at}, rng, 200);
      const PagedKVCache::SequenceId parent = b.ids[0];
      const Tensor q = random_q(DType::Float32, 1, 2, s.h, s.d_k, rng);
      const std::vector<double> before = decode(q, b, {parent});
      const PagedKVCache::SequenceId child = b.cache.fork(parent);
      append_random(b.cache, child, 1 + at % 5, rng);
      EXPECT_TRUE(same_bits(decode(q, b, {parent}), before)) << "the child's append changed the parent's result";
      expect_matches_reference(q, b, {child});
      const std::vector<double> child_out = decode(q, b, {child});
      append_random(b.cache, parent, 2, rng);
      EXPECT_TRUE(same_bits(decode(q, b, {child}), child_out)) << "the parent's append changed the child's result";
      expect_matches_reference(random_q(DType::Float32, 2, 2, s.h, s.d_k, rng), b, {parent, child});
    }
  }
}

// A NaN in one sequence's last position, in kv head 1's key and in column 2 of kv head 0's value: only
// that sequence's last query (the one that sees the position) turns NaN, wholly in the heads reading kv
// head 1 and in column 2 of the others; the earlier queries, which may not see the position, stay finite
// (a value is not read where its weight is 0); the other sequence's rows are bitwise what they were.
TEST(DecodeAttention, ANaNReachesExactlyTheQueriesThatSeeIt) {
  Rng rng(9);
  const Shape5 s{4, 2, 8, 40, 4};  // d_v 40: whole vectors and a tail
  for (DType dtype : {DType::Float32, DType::BFloat16, DType::Float64}) {
    Batch b = make_batch(dtype, s, {10, 7}, rng);
    const Tensor q = random_q(dtype, 2, 3, s.h, s.d_k, rng);
    const std::vector<double> clean = decode(q, b, b.ids);
    std::vector<double> k(static_cast<std::size_t>(s.h_kv * s.d_k), 0.5),
        v(static_cast<std::size_t>(s.h_kv * s.d_v), 0.25);
    k[static_cast<std::size_t>(s.d_k + 3)] = kNaN;  // kv head 1's key
    v[2] = kNaN;                                    // kv head 0's value
    b.cache.append(b.ids[0], make_tensor(dtype, {1, s.h_kv, s.d_k}, k), make_tensor(dtype, {1, s.h_kv, s.d_v}, v));
    const std::vector<double> out = decode(q, b, b.ids);
    for (std::int64_t i = 0; i < 3; ++i)
      for (std::int64_t head = 0; head < s.h; ++head)
        for (std::int64_t e = 0; e < s.d_v; ++e) {
          const double x = out[static_cast<std::size_t>(((0 * 3 + i) * s.h + head) * s.d_v + e)];
          // kv head 1's NaN key makes the whole row NaN; kv head 0's NaN value only its own column
          EXPECT_EQ(std::isnan(x), i == 2 && (head / (s.h / s.h_kv) == 1 || e == 2))
              << mha::dtype_name(dtype) << " query " << i << " head " << head << " column " << e;
        }
    const std::size_t half = out.size() / 2;
    EXPECT_TRUE(same_bits(std::vector<double>(out.begin() + half, out.end()),
                          std::vector<double>(clean.begin() + half, clean.end())))
        << mha::dtype_name(dtype) << ": the NaN reached the other sequence";
  }
}

// ---- refused calls ---------------------------------------------------------------------------------------

void expect_error(const std::function<void()>& call, const std::string& says) {
  try {
    call();
    ADD_FAILURE() << "accepted; expected an error saying \"" << says << "\"";
  } catch (const mha::Error& e) {
    EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
  }
}

TEST(DecodeAttention, RefusesBadCallsNamingTheCause) {
  Rng rng(3);
  const Shape5 s{4, 2, 8, 6, 4};
  Batch b = make_batch(DType::Float32, s, {5, 2}, rng);
  const PagedKVCache::SequenceId released = b.cache.add_sequence();
  b.cache.release(released);
  const Tensor q = random_q(DType::Float32, 2, 1, 4, 8, rng);
  auto call = [&](const Tensor& query, Ids ids, mha::DecodeOptions o = {}) {
    return [&b, &query, ids, o] { (void)mha::decode_attention(query, b.cache, ids, o); };
  };
  expect_error(call(q, {b.ids[0], released}),
               "sequences[1]: sequence " + std::to_string(released) + " is not in the cache");
  expect_error(call(q, {b.ids[0], 99}), "sequence 99 is not in the cache");
  expect_error(call(q, {b.ids[0]}), "sequences: expected one id per row of q (2), got 1");
  const Tensor q64 = random_q(DType::Float64, 2, 1, 4, 8, rng);
  expect_error(call(q64, b.ids), "q: expected the cache's dtype float32, got float64");
  const Tensor wide = random_q(DType::Float32, 2, 1, 4, 9, rng);
  expect_error(call(wide, b.ids), "head_dim = the cache's 8");
  const Tensor three = random_q(DType::Float32, 2, 1, 3, 8, rng);
  expect_error(call(three, b.ids), "num_heads 3 must be a positive multiple of the cache's num_kv_heads 2");
  const Tensor long_q = random_q(DType::Float32, 2, 3, 4, 8, rng);
  expect_error(call(long_q, b.ids),
               "sequences[1]: sequence " + std::to_string(b.ids[1]) + " holds 2 positions, fewer than q_len 3");
  const Tensor no_queries(DType::Float32, {2, 0, 4, 8});
  expect_error(call(no_queries, b.ids), "q_len >= 1");
  const Tensor no_sequences(DType::Float32, {0, 1, 4, 8});
  expect_error(call(no_sequences, {}), "n >= 1");
  const Tensor rank3(DType::Float32, {2, 4, 8});
  expect_error(call(rank3, b.ids), "q: expected [n, q_len, num_heads, head_dim]");
  mha::DecodeOptions nan_scale;
  nan_scale.scale = kNaN;
  expect_error(call(q, b.ids, nan_scale), "scale: expected 0 or a finite number");
}

}  // namespace
}  // namespace mha_test
