// PagedKVCache (mha/paged_kv_cache.hpp): what a sequence holds equals what was appended to it, for
// every page size, ragged and interleaved; forks share pages and a write after a fork never changes
// the other sequence (bitwise), at every fork position inside a page; refused calls leave the cache
// bitwise unchanged; pages are counted and returned.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <vector>

#include "mha/error.hpp"
#include "mha/paged_kv_cache.hpp"

namespace {

using mha::DType;
using mha::PagedKVCache;
using mha::Tensor;
using mha::TensorView;

constexpr std::int64_t kHeads = 3, kDk = 4, kDv = 5;

mha::PagedKVCacheConfig config(std::int64_t page_size, std::int64_t capacity, DType dtype = DType::Float32) {
  return {.num_kv_heads = kHeads,
          .head_dim = kDk,
          .value_dim = kDv,
          .page_size = page_size,
          .capacity_tokens = capacity,
          .dtype = dtype};
}

// What a sequence should hold: per position, h_kv x d_k keys and h_kv x d_v values.
struct Expected {
  std::vector<float> keys, values;  // [T, h_kv, d], appended in order
  std::int64_t length() const { return static_cast<std::int64_t>(keys.size()) / (kHeads * kDk); }
};

// n new positions of distinct values, appended to the cache and to the expectation.
void append_random(PagedKVCache& cache, PagedKVCache::SequenceId s, Expected& e, std::int64_t n, std::mt19937& gen) {
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> k(static_cast<std::size_t>(n * kHeads * kDk)), v(static_cast<std::size_t>(n * kHeads * kDv));
  for (float& x : k) x = u(gen);
  for (float& x : v) x = u(gen);
  cache.append(s, TensorView(std::span<const float>(k), {n, kHeads, kDk}),
               TensorView(std::span<const float>(v), {n, kHeads, kDv}));
  e.keys.insert(e.keys.end(), k.begin(), k.end());
  e.values.insert(e.values.end(), v.begin(), v.end());
}

// The cache's gathered [h_kv, T, d] against the expectation's [T, h_kv, d], bitwise.
::testing::AssertionResult holds(const PagedKVCache& cache, PagedKVCache::SequenceId s, const Expected& e) {
  if (cache.length(s) != e.length())
    return ::testing::AssertionFailure() << "length " << cache.length(s) << ", expected " << e.length();
  const Tensor k = cache.keys(s), v = cache.values(s);
  const std::int64_t T = e.length();
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t h = 0; h < kHeads; ++h) {
      if (std::memcmp(k.data_as<float>() + (h * T + t) * kDk, e.keys.data() + (t * kHeads + h) * kDk, kDk * 4) != 0)
        return ::testing::AssertionFailure() << "keys differ at position " << t << " head " << h;
      if (std::memcmp(v.data_as<float>() + (h * T + t) * kDv, e.values.data() + (t * kHeads + h) * kDv, kDv * 4) != 0)
        return ::testing::AssertionFailure() << "values differ at position " << t << " head " << h;
    }
  return ::testing::AssertionSuccess();
}

TEST(PagedKVCache, HoldsWhatWasAppendedForEveryPageSizeRaggedAndInterleaved) {
  for (std::int64_t page_size : {1, 2, 3, 7, 16}) {
    PagedKVCache cache(config(page_size, 400));
    std::mt19937 gen(static_cast<unsigned>(page_size));
    std::map<PagedKVCache::SequenceId, Expected> expected;
    for (int i = 0; i < 4; ++i) expected[cache.add_sequence()];
    for (int round = 0; round < 12; ++round)
      for (auto& [s, e] : expected) append_random(cache, s, e, static_cast<std::int64_t>(gen() % 7), gen);
    std::int64_t pages = 0;
    for (const auto& [s, e] : expected) {
      EXPECT_TRUE(holds(cache, s, e)) << "page size " << page_size << ", sequence " << s;
      EXPECT_EQ(static_cast<std::int64_t>(cache.page_table(s).size()), (e.length() + page_size - 1) / page_size);
      pages += (e.length() + page_size - 1) / page_size;
    }
    EXPECT_EQ(cache.pages_in_use(), pages);
    EXPECT_EQ(cache.free_pages(), cache.page_count() - pages);
  }
}

TEST(PagedKVCache, WritesAfterAForkNeverChangeTheOtherSequenceAtAnyForkPosition) {
  constexpr std::int64_t P = 4;
  for (std::int64_t at = 0; at <= 2 * P + 1; ++at) {
    PagedKVCache cache(config(P, 64));
    std::mt19937 gen(static_cast<unsigned>(at));
    Expected parent_e;
    const auto parent = cache.add_sequence();
    append_random(cache, parent, parent_e, at, gen);
    const std::int64_t pages_before = cache.pages_in_use();
    const auto child = cache.fork(parent);
    Expected child_e = parent_e;
    EXPECT_EQ(cache.pages_in_use(), pages_before) << "a fork copies nothing";
    for (std::int32_t page : cache.page_table(child)) EXPECT_EQ(cache.page_users(page), 2);
    append_random(cache, child, child_e, 3, gen);  // into the shared last page when it is partly filled
    EXPECT_TRUE(holds(cache, parent, parent_e)) << "fork at " << at << ": the child's write changed the parent";
    append_random(cache, parent, parent_e, 2, gen);
    EXPECT_TRUE(holds(cache, child, child_e)) << "fork at " << at << ": the parent's write changed the child";
    EXPECT_TRUE(holds(cache, parent, parent_e)) << "fork at " << at;
    // Only full pages stay shared: the fork's pages minus a partly filled last one.
    std::int64_t shared = 0;
    for (std::int32_t page : cache.page_table(parent)) shared += cache.page_users(page) == 2;
    EXPECT_EQ(shared, at / P) << "fork at " << at;
    cache.release(parent);
    EXPECT_TRUE(holds(cache, child, child_e)) << "releasing the parent changed the child";
    cache.release(child);
    EXPECT_EQ(cache.pages_in_use(), 0);
  }
}

// Everything observable about a cache, to compare before and after a refused call.
struct Snapshot {
  std::vector<PagedKVCache::SequenceId> ids;
  std::vector<std::vector<std::int32_t>> tables;
  std::vector<std::int64_t> lengths;
  std::vector<std::int32_t> users;
  std::vector<std::vector<float>> contents;
  bool operator==(const Snapshot&) const = default;
};

Snapshot snapshot(const PagedKVCache& cache) {
  Snapshot s;
  s.ids = cache.sequences();
  for (auto id : s.ids) {
    const auto table = cache.page_table(id);
    s.tables.emplace_back(table.begin(), table.end());
    s.lengths.push_back(cache.length(id));
    for (const Tensor& t : {cache.keys(id), cache.values(id)})
      s.contents.emplace_back(t.data_as<float>(), t.data_as<float>() + t.numel());
  }
  for (std::int32_t p = 0; p < cache.page_count(); ++p) s.users.push_back(cache.page_users(p));
  return s;
}

TEST(PagedKVCache, RefusedCallsLeaveTheCacheBitwiseUnchanged) {
  PagedKVCache cache(config(4, 16));  // 4 pages
  std::mt19937 gen(1);
  Expected e1;
  const auto a = cache.add_sequence();
  append_random(cache, a, e1, 6, gen);  // 2 pages, the last half full
  const auto b = cache.fork(a);
  const Snapshot before = snapshot(cache);
  const std::vector<float> k(static_cast<std::size_t>(20 * kHeads * kDk)),
      v(static_cast<std::size_t>(20 * kHeads * kDv));
  const std::vector<double> k64(k.size()), v64(v.size());
  auto keys = [&](std::int64_t n) { return TensorView(std::span<const float>(k), {n, kHeads, kDk}); };
  auto values = [&](std::int64_t n) { return TensorView(std::span<const float>(v), {n, kHeads, kDv}); };
  // b's write needs a copy of the shared half page plus pages for the rest: 7 tokens need 1 + 2 > 2 free.
  EXPECT_THROW(cache.append(b, keys(7), values(7)), mha::Error);
  EXPECT_THROW(cache.append(a, keys(3), TensorView(std::span<const float>(v), {3, kHeads, kDv - 1})), mha::Error);
  EXPECT_THROW(cache.append(a, keys(3), values(2)), mha::Error);
  EXPECT_THROW(cache.append(a, TensorView(std::span<const double>(k64), {3, kHeads, kDk}),
                            TensorView(std::span<const double>(v64), {3, kHeads, kDv})),
               mha::Error);
  EXPECT_THROW(cache.append(99, keys(1), values(1)), mha::Error);
  EXPECT_THROW(cache.fork(99), mha::Error);
  EXPECT_EQ(snapshot(cache), before);
  // Exactly what fits is taken: 6 tokens for b = a copy of the half page + 1 new page.
  cache.append(b, keys(6), values(6));
  EXPECT_EQ(cache.free_pages(), 0);
}

TEST(PagedKVCache, ErrorsNameTheCause) {
  PagedKVCache cache(config(4, 8));
  const auto s = cache.add_sequence();
  cache.release(s);
  try {
    cache.length(s);
    FAIL() << "a released sequence was accepted";
  } catch (const mha::Error& e) {
    EXPECT_NE(std::string(e.what()).find("sequence 0 is not in the cache (released)"), std::string::npos) << e.what();
  }
  try {
    cache.release(7);
    FAIL();
  } catch (const mha::Error& e) {
    EXPECT_NE(std::string(e.what()).find("never added"), std::string::npos) << e.what();
  }
  const std::vector<float> k(static_cast<std::size_t>(9 * kHeads * kDk)), v(static_cast<std::size_t>(9 * kHeads * kDv));
  const auto t = cache.add_sequence();
  try {
    cache.append(t, TensorView(std::span<const float>(k), {9, kHeads, kDk}),
                 TensorView(std::span<const float>(v), {9, kHeads, kDv}));
    FAIL();
  } catch (const mha::Error& e) {
    EXPECT_NE(std::string(e.what()).find("9 tokens need 3 free pages, 2 are free"), std::string::npos) << e.what();
  }
  EXPECT_THROW(PagedKVCache(config(0, 8)), mha::Error);
  EXPECT_THROW(PagedKVCache(config(4, -1)), mha::Error);
  EXPECT_THROW(PagedKVCache(config(4, 8, DType::Bool)), mha::Error);
}

TEST(PagedKVCache, TakesStridedKeys) {
  // keys given transposed in memory: [n, h, d] viewed over a [d, h, n] buffer.
  PagedKVCache cache(config(3, 30));
  const std::int64_t n = 5;
  std::vector<float> buffer(static_cast<std::size_t>(kDk * kHeads * n)),
      v(static_cast<std::size_t>(n * kHeads * kDv), 0.5f);
  for (std::size_t i = 0; i < buffer.size(); ++i) buffer[i] = static_cast<float>(i);
  const TensorView keys(buffer.data(), DType::Float32, {n, kHeads, kDk}, {1, n, kHeads * n});
  const auto s = cache.add_sequence();
  cache.append(s, keys, TensorView(std::span<const float>(v), {n, kHeads, kDv}));
  const Tensor k = cache.keys(s);  // [h, n, d_k]
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t h = 0; h < kHeads; ++h)
      for (std::int64_t c = 0; c < kDk; ++c)
        EXPECT_EQ(k.data_as<float>()[(h * n + t) * kDk + c],
                  buffer[static_cast<std::size_t>(c * kHeads * n + h * n + t)]);
}

// Sizes whose products overflow std::int64_t (issue 30): refused naming the sizes, never "a pool of -1
// pages" or a negative shape from a product that wrapped before the check.
TEST(PagedKVCache, SizesWhoseProductsOverflowAreRefusedByName) {
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  struct Case {
    mha::PagedKVCacheConfig config;
    const char* names;
  };
  const Case cases[] = {
      {{.num_kv_heads = 1, .head_dim = 4, .page_size = kMax, .capacity_tokens = 10}, "page_size"},
      {{.num_kv_heads = 1, .head_dim = std::int64_t{1} << 62, .page_size = 16, .capacity_tokens = 10}, "head_dim"},
      {{.num_kv_heads = 1,
        .head_dim = std::int64_t{1} << 62,
        .value_dim = std::int64_t{1} << 62,
        .page_size = 1,
        .capacity_tokens = 1},
       "value_dim"},
      {{.num_kv_heads = std::int64_t{1} << 62, .head_dim = 4, .page_size = 4, .capacity_tokens = 4}, "num_kv_heads"},
      {{.num_kv_heads = 1,
        .head_dim = 4,
        .page_size = std::int64_t{1} << 62,
        .capacity_tokens = (std::int64_t{1} << 62) + 1},
       "page_size"},
      {{.num_kv_heads = 1, .head_dim = 4, .page_size = 1, .capacity_tokens = kMax}, "capacity_tokens"},
  };
  for (const Case& c : cases) {
    try {
      PagedKVCache cache(c.config);
      ADD_FAILURE() << "accepted page_size " << c.config.page_size << ", head_dim " << c.config.head_dim;
    } catch (const mha::Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(c.names), std::string::npos) << message;
      EXPECT_NE(message.find("larger than a tensor may be"), std::string::npos) << message;
      EXPECT_EQ(message.find(" -"), std::string::npos) << "a wrapped, negative size: " << message;
    }
  }
}

}  // namespace
