// PagedKVCache's threads contract (mha/paged_kv_cache.hpp): decodes and reads from some threads while
// others add, append to, fork and release sequences of the same cache. Every read sees the cache before
// or after each write, so a decode of a sequence nobody writes to is bitwise the one computed alone,
// however the writes interleave; a write inside the thread's own read hold throws instead of waiting for
// ever; holds nest. (Before the contract, decode read the page tables while fork / release reallocated
// them: a crash within seconds from Python.)
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "mha/decode.hpp"
#include "mha/error.hpp"
#include "mha/paged_kv_cache.hpp"
#include "support/message_matches.hpp"

namespace {

using mha::DType;
using mha::PagedKVCache;
using mha::Tensor;
using mha::TensorView;

constexpr std::int64_t kKvHeads = 2, kHeads = 4, kDim = 8, kPage = 4;

std::vector<float> random_values(std::int64_t n, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = u(gen);
  return v;
}

// n positions of keys and values [n, h_kv, d] from `seed`.
void append_random(PagedKVCache& cache, PagedKVCache::SequenceId s, std::int64_t n, std::uint32_t seed) {
  const std::vector<float> k = random_values(n * kKvHeads * kDim, seed), v = random_values(n * kKvHeads * kDim, ~seed);
  cache.append(s, TensorView(std::span<const float>(k), {n, kKvHeads, kDim}),
               TensorView(std::span<const float>(v), {n, kKvHeads, kDim}));
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && std::memcmp(a.data(), b.data(), static_cast<std::size_t>(a.numel()) * 4) == 0;
}

TEST(PagedKVCacheThreads, DecodesAndReadsStayExactWhileOtherThreadsForkAppendAndRelease) {
  PagedKVCache cache({.num_kv_heads = kKvHeads, .head_dim = kDim, .page_size = kPage, .capacity_tokens = 4096});
  const PagedKVCache::SequenceId base = cache.add_sequence();
  append_random(cache, base, 61, 1);  // 15 full pages and a partly filled one: every fork shares a tail
  const std::vector<float> q_values = random_values(kHeads * kDim, 2);
  const TensorView q(std::span<const float>(q_values), {1, 1, kHeads, kDim});
  const std::vector<PagedKVCache::SequenceId> ids = {base};
  const Tensor expected_out = mha::decode_attention(q, cache, ids).out;
  const Tensor expected_keys = cache.keys(base);

  constexpr int kRounds = 1500;
  std::atomic<int> mismatches{0}, errors{0};
  auto decoder = [&] {
    for (int r = 0; r < kRounds; ++r) {
      if (!same_bits(mha::decode_attention(q, cache, ids).out, expected_out)) ++mismatches;
      if (!same_bits(cache.keys(base), expected_keys)) ++mismatches;
      const PagedKVCache::Hold hold = cache.read_hold();  // the span and page pointers, used under a hold
      const auto table = cache.page_table(base);
      if (table.size() != 16 || cache.key_page(table.back()) == nullptr) ++mismatches;
    }
  };
  auto writer = [&](std::uint32_t seed) {
    try {
      for (int r = 0; r < kRounds; ++r) {
        const PagedKVCache::SequenceId child = cache.fork(base);
        append_random(cache, child, 1 + r % 9, seed + r);  // copy-on-write of the shared tail page
        const PagedKVCache::SequenceId other = cache.add_sequence();
        append_random(cache, other, 3 * kPage + 1, seed - r);
        cache.release(child);
        cache.release(other);
      }
    } catch (const mha::Error&) {
      ++errors;
    }
  };
  std::vector<std::thread> threads;
  threads.emplace_back(decoder);
  threads.emplace_back(decoder);
  threads.emplace_back(writer, 100u);
  threads.emplace_back(writer, 900u);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(errors.load(), 0);
  EXPECT_EQ(cache.sequences(), ids);
  EXPECT_EQ(cache.pages_in_use(), 16);  // every page the writers took came back
}

TEST(PagedKVCacheThreads, AWriteInsideThisThreadsReadHoldThrowsAndChangesNothing) {
  PagedKVCache cache({.num_kv_heads = kKvHeads, .head_dim = kDim, .page_size = kPage, .capacity_tokens = 64});
  const PagedKVCache::SequenceId s = cache.add_sequence();
  append_random(cache, s, 5, 3);
  {
    const PagedKVCache::Hold hold = cache.read_hold();
    const PagedKVCache::Hold nested = cache.read_hold();  // nested holds do nothing
    EXPECT_EQ(cache.length(s), 5);                        // reads inside the hold
    try {
      append_random(cache, s, 1, 4);
      ADD_FAILURE() << "append inside a read hold did not throw";
    } catch (const mha::Error& e) {
      EXPECT_TRUE(mha_test::message_matches(e.what(), "inside this thread's read hold.*would wait for itself"))
          << e.what();
    }
    EXPECT_THROW(cache.fork(s), mha::Error);
    EXPECT_THROW(cache.release(s), mha::Error);
    EXPECT_THROW(cache.add_sequence(), mha::Error);
    EXPECT_EQ(cache.length(s), 5);
    EXPECT_EQ(cache.sequences().size(), 1u);
  }
  append_random(cache, s, 1, 4);  // the hold has ended: writes go through
  EXPECT_EQ(cache.length(s), 6);
}

TEST(PagedKVCacheThreads, AWriteHoldMakesSeveralCallsOneAndNestsReadsAndWrites) {
  PagedKVCache cache({.num_kv_heads = kKvHeads, .head_dim = kDim, .page_size = kPage, .capacity_tokens = 64});
  const PagedKVCache::SequenceId s = cache.add_sequence();
  std::atomic<bool> reader_saw_half{false};
  std::thread reader;
  {
    const PagedKVCache::Hold hold = cache.write_hold();
    append_random(cache, s, 3, 5);
    // Another thread's read waits for the whole hold, so it never sees 3 positions.
    reader = std::thread([&] { reader_saw_half = cache.length(s) == 3; });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    append_random(cache, s, 3, 6);
    EXPECT_EQ(cache.length(s), 6);
  }
  reader.join();
  EXPECT_FALSE(reader_saw_half.load());
}

TEST(PagedKVCacheThreads, AMovedCacheKeepsItsSequencesAndTakesHoldsOfItsOwn) {
  PagedKVCache a({.num_kv_heads = kKvHeads, .head_dim = kDim, .page_size = kPage, .capacity_tokens = 64});
  const PagedKVCache::SequenceId s = a.add_sequence();
  append_random(a, s, 7, 8);
  const Tensor keys = a.keys(s);
  PagedKVCache b(std::move(a));
  EXPECT_TRUE(same_bits(b.keys(s), keys));
  std::vector<PagedKVCache> layers;
  layers.push_back(std::move(b));
  const PagedKVCache::Hold hold = layers[0].read_hold();
  EXPECT_EQ(layers[0].length(s), 7);
}

}  // namespace
