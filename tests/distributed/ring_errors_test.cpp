// Errors, not hangs: a bad or inconsistent argument on any rank makes every rank throw the same
// mha::Error, naming the rank, before any exchange. Each test then runs a correct call, so a rank that
// had gone on to exchange messages would hang or corrupt it (and ctest's timeout would fail the test).
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "ring_support.hpp"

namespace ring_test {
namespace {

using mha::distributed::Layout;
using mha::distributed::RingOptions;

struct Shards {
  Tensor q, k, v;
};

// This rank's zigzag shards of a [1, 2, n, d] problem.
Shards shards(std::int64_t n, std::int64_t d, DType dtype = DType::Float32) {
  auto shard = [&](const Tensor& t) {
    return mha::distributed::shard_sequence(t, 2, world_size(), world_rank(), Layout::Zigzag);
  };
  return {shard(normal(dtype, {1, 2, n, d}, 1)), shard(normal(dtype, {1, 2, n, d}, 2)),
          shard(normal(dtype, {1, 2, n, d}, 3))};
}

// The message every rank got; empty when no rank threw. Fails the test when ranks disagree.
std::string error_of(const std::function<void()>& call) {
  std::string message;
  try {
    call();
  } catch (const mha::Error& e) {
    message = e.what();
  }
  // Every rank must hold the same message: compare lengths and bytes with rank 0's.
  long length = static_cast<long>(message.size()), length0 = length;
  MPI_Bcast(&length0, 1, MPI_LONG, 0, MPI_COMM_WORLD);
  std::string message0 = message;
  message0.resize(static_cast<std::size_t>(length0));
  MPI_Bcast(message0.data(), static_cast<int>(length0), MPI_CHAR, 0, MPI_COMM_WORLD);
  EXPECT_EQ(message, message0) << "rank " << world_rank() << " got a different error from rank 0's";
  return message;
}

void expect_a_correct_call_still_works() {
  const Shards s = shards(20, 8);
  const auto r = mha::distributed::ring_attention(s.q, s.k, s.v, MPI_COMM_WORLD);
  EXPECT_EQ(r.out.shape(), s.q.shape());
}

TEST(RingErrors, OneRanksBadArgumentIsEveryRanksError) {
  const int bad = world_size() - 1;
  const Shards s = shards(20, 8);
  const Tensor wrong_q = normal(DType::Float32, {1, 2, s.q.size(2), 4}, 9);  // d_k 4 against k's 8
  const std::string e = error_of(
      [&] { mha::distributed::ring_attention(world_rank() == bad ? wrong_q : s.q, s.k, s.v, MPI_COMM_WORLD); });
  EXPECT_NE(e.find("ring_attention: rank " + std::to_string(bad) + ": "), std::string::npos) << e;
  EXPECT_NE(e.find("d_k"), std::string::npos) << e;
  expect_a_correct_call_still_works();
}

TEST(RingErrors, RanksThatDisagreeOnAnOption) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  const Shards s = shards(20, 8);
  RingOptions o;
  o.causal = world_rank() == 1;
  const std::string e = error_of([&] { mha::distributed::ring_attention(s.q, s.k, s.v, MPI_COMM_WORLD, o); });
  EXPECT_NE(e.find("rank 1: differs from rank 0 in causal"), std::string::npos) << e;
  expect_a_correct_call_still_works();
}

TEST(RingErrors, RanksThatDisagreeOnTheDtype) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  const Shards s = shards(20, 8, world_rank() == 1 ? DType::Float64 : DType::Float32);
  const std::string e = error_of([&] { mha::distributed::ring_attention(s.q, s.k, s.v, MPI_COMM_WORLD); });
  EXPECT_NE(e.find("rank 1: differs from rank 0 in dtype float64, rank 0 float32"), std::string::npos) << e;
  expect_a_correct_call_still_works();
}

TEST(RingErrors, RanksThatDisagreeOnTheLayoutOrKernelAreToldTheirNames) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  const Shards s = shards(20, 8);
  RingOptions o;
  o.layout = world_rank() == 1 ? Layout::Contiguous : Layout::Zigzag;
  std::string e = error_of([&] { mha::distributed::ring_attention(s.q, s.k, s.v, MPI_COMM_WORLD, o); });
  EXPECT_NE(e.find("rank 1: differs from rank 0 in layout contiguous, rank 0 zigzag"), std::string::npos) << e;
  RingOptions k;
  k.kernel = world_rank() == 1 ? mha::Kernel::Reference : mha::Kernel::Flash;
  e = error_of([&] { mha::distributed::ring_attention(s.q, s.k, s.v, MPI_COMM_WORLD, k); });
  EXPECT_NE(e.find("rank 1: differs from rank 0 in kernel reference, rank 0 flash"), std::string::npos) << e;
  expect_a_correct_call_still_works();
}

TEST(RingErrors, AShardOfTheWrongLength) {
  // Rank 0 holds three query rows too many for the layout (on one rank any length is a whole sequence).
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  const Shards s = shards(20, 8);
  const Tensor longer = normal(DType::Float32, {1, 2, s.q.size(2) + 3, 8}, 4);
  const std::string e =
      error_of([&] { mha::distributed::ring_attention(world_rank() == 0 ? longer : s.q, s.k, s.v, MPI_COMM_WORLD); });
  EXPECT_NE(e.find("ring_attention: rank 0: holds "), std::string::npos) << e;
  EXPECT_NE(e.find("zigzag layout over " + std::to_string(world_size()) +
                   " ranks that the shards fit best, of L = 20 and S = 20"),
            std::string::npos)
      << e;
  expect_a_correct_call_still_works();
}

TEST(RingErrors, AShortShardIsBlamedOnTheRankThatHoldsIt) {
  // Rank 1's rows three short: measured by their sum (17), rank 0's right shard looked wrong.
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  const Shards s = shards(20, 8);
  const Tensor short_q = normal(DType::Float32, {1, 2, s.q.size(2) - 3, 8}, 4),
               short_k = normal(DType::Float32, {1, 2, s.k.size(2) - 3, 8}, 5);
  const bool one = world_rank() == 1;
  std::string e = error_of([&] { mha::distributed::ring_attention(one ? short_q : s.q, s.k, s.v, MPI_COMM_WORLD); });
  std::int64_t rows_of_1 = 0;  // rank 1's rows of 20, as every rank sees them
  for (auto c : mha::distributed::shard_chunks(20, world_size(), 1, Layout::Zigzag)) rows_of_1 += c.length;
  EXPECT_EQ(e.find("ring_attention: rank 1: holds " + std::to_string(rows_of_1 - 3) + " query and " +
                   std::to_string(rows_of_1) + " key rows"),
            0u)
      << e;
  EXPECT_NE(e.find("of L = 20 and S = 20"), std::string::npos) << e;
  // Every shard of rank 1 short, as if cut from a shorter sequence: no key rows to tell L by.
  e = error_of([&] {
    mha::distributed::ring_attention(one ? short_q : s.q, one ? short_k : s.k, one ? short_k : s.v, MPI_COMM_WORLD);
  });
  EXPECT_EQ(e.find("ring_attention: rank 1: holds "), 0u) << e;
  expect_a_correct_call_still_works();
}

TEST(RingErrors, UnshardBlamesTheShortShard) {
  // No collective: every rank joins all the shards itself.
  const int P = std::max(world_size(), 2);
  const Tensor full = normal(DType::Float32, {1, 2, 20, 8}, 7);
  for (Layout layout : {Layout::Zigzag, Layout::Contiguous}) {
    std::vector<Tensor> owned;
    for (int r = 0; r < P; ++r) owned.push_back(mha::distributed::shard_sequence(full, 2, P, r, layout));
    std::vector<mha::TensorView> shards(owned.begin(), owned.end());
    const mha::Shape shape{1, 2, owned[1].size(2) - 3, 8};
    shards[1] = mha::TensorView(owned[1].data(), DType::Float32, shape, owned[1].strides());
    try {
      mha::distributed::unshard_sequence(shards, 2, layout);
      ADD_FAILURE() << "a short shard was joined";
    } catch (const mha::Error& error) {
      const std::string e = error.what();
      EXPECT_EQ(e.find("unshard_sequence: shard 1 has " + std::to_string(shape[2]) + " rows in dim 2"), 0u) << e;
    }
  }
}

TEST(RingErrors, GroupedQueryHeadsAreRefusedOnEveryRank) {
  const Shards s = shards(20, 8);
  auto one_head = [&](std::uint64_t seed) {  // [1, 1, n, d]: one key/value head for q's two
    return mha::distributed::shard_sequence(normal(DType::Float32, {1, 1, 20, 8}, seed), 2, world_size(), world_rank(),
                                            Layout::Zigzag);
  };
  const Tensor k = one_head(2), v = one_head(3);
  const std::string e = error_of([&] { mha::distributed::ring_attention(s.q, k, v, MPI_COMM_WORLD); });
  EXPECT_NE(e.find("grouped-query attention across ranks is not built yet"), std::string::npos) << e;
  expect_a_correct_call_still_works();
}

TEST(RingErrors, CausalNeedsAsManyQueriesAsKeys) {
  const Shards s = shards(20, 8);
  const Tensor q = mha::distributed::shard_sequence(normal(DType::Float32, {1, 2, 13, 8}, 5), 2, world_size(),
                                                    world_rank(), Layout::Zigzag);
  RingOptions o;
  o.causal = true;
  const std::string e = error_of([&] { mha::distributed::ring_attention(q, s.k, s.v, MPI_COMM_WORLD, o); });
  EXPECT_NE(e.find("causal needs as many queries as keys"), std::string::npos) << e;
  expect_a_correct_call_still_works();
}

TEST(RingErrors, KeyLengthsBeyondTheWholeSequence) {
  const Shards s = shards(20, 8);
  RingOptions o;
  o.key_lengths = {21};
  const std::string e = error_of([&] { mha::distributed::ring_attention(s.q, s.k, s.v, MPI_COMM_WORLD, o); });
  EXPECT_NE(e.find("key_lengths: expected lengths in [0, S = 20], got 21"), std::string::npos) << e;
  expect_a_correct_call_still_works();
}

TEST(RingErrors, AnAttnMaskIsRefusedByName) {
  const Shards s = shards(20, 8);
  const Tensor mask(DType::Bool, {s.q.size(2), 20});
  RingOptions o;
  o.attn_mask = mask.view();
  const std::string e = error_of([&] { mha::distributed::ring_attention(s.q, s.k, s.v, MPI_COMM_WORLD, o); });
  EXPECT_EQ(e.find("ring_attention: rank 0: attn_mask: not taken across ranks"), 0u) << e;
  expect_a_correct_call_still_works();
}

TEST(RingErrors, BadScoreValuesAreRefusedByName) {
  // The single-process checks of the score, on each rank's arguments: the same message everywhere.
  const Shards s = shards(20, 8);
  const Tensor one_slope(DType::Float32, {1});  // [1] for q's two heads
  std::vector<std::pair<std::function<void(RingOptions&)>, std::string>> cases = {
      {[](RingOptions& o) { o.softcap = 1e39; }, "softcap: expected 0 (none) or a finite number in "},
      {[](RingOptions& o) { o.window_left = -2; }, "window: expected extents >= 0, or -1 for unbounded"},
      {[&](RingOptions& o) { o.alibi_slopes = one_slope.view(); }, "alibi_slopes: expected one slope per query head"},
  };
  for (const auto& [set, message] : cases) {
    RingOptions o;
    set(o);
    const std::string e = error_of([&] { mha::distributed::ring_attention(s.q, s.k, s.v, MPI_COMM_WORLD, o); });
    EXPECT_EQ(e.find("ring_attention: rank 0: " + message), 0u) << e;
  }
  expect_a_correct_call_still_works();
}

TEST(RingErrors, RanksThatDisagreeOnTheScoresVariants) {
  if (world_size() < 2) GTEST_SKIP() << "needs two ranks";
  const Shards s = shards(20, 8);
  const bool one = world_rank() == 1;
  const Tensor slopes = normal(DType::Float32, {2}, one ? 8 : 9);  // other values on rank 1
  std::vector<std::pair<std::function<void(RingOptions&)>, std::string>> cases = {
      {[&](RingOptions& o) { o.window_left = one ? 3 : -1; }, "window_left 3, rank 0 -1"},
      {[&](RingOptions& o) { o.window_right = one ? 5 : 4; }, "window_right 5, rank 0 4"},
      {[&](RingOptions& o) { o.softcap = one ? 2.5 : 0.0; }, "softcap 2.5, rank 0 0"},
      {[&](RingOptions& o) { o.alibi_slopes = slopes.view(); }, "alibi_slopes (a digest)"},
  };
  for (const auto& [set, message] : cases) {
    RingOptions o;
    set(o);
    const std::string e = error_of([&] { mha::distributed::ring_attention(s.q, s.k, s.v, MPI_COMM_WORLD, o); });
    EXPECT_EQ(e.find("ring_attention: rank 1: differs from rank 0 in " + message), 0u) << e;
  }
  expect_a_correct_call_still_works();
}

TEST(RingErrors, TheBackwardChecksItsExtraArguments) {
  const Shards s = shards(20, 8);
  const auto r = mha::distributed::ring_attention(s.q, s.k, s.v, MPI_COMM_WORLD);
  const Tensor wrong_lse = normal(DType::Float32, {1, 2, s.q.size(2) + (world_rank() == 0 ? 1 : 0)}, 6);
  const std::string e = error_of(
      [&] { mha::distributed::ring_attention_backward(r.out, s.q, s.k, s.v, r.out, wrong_lse, MPI_COMM_WORLD); });
  EXPECT_NE(e.find("ring_attention_backward: rank 0: "), std::string::npos) << e;
  EXPECT_NE(e.find("lse"), std::string::npos) << e;
  expect_a_correct_call_still_works();
}

}  // namespace
}  // namespace ring_test
