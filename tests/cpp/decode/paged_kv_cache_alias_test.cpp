// PagedKVCache::append with one view passed as both keys and values (append(seq, x, x)): each half of
// the page gets its copy of x, for native and quantized storage, and a width that fits only the keys is
// refused by the values' name. (The halves were once told apart by the views' addresses, so the same
// view twice wrote the keys twice and left the values as the pool held them.)
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "mha/error.hpp"
#include "mha/paged_kv_cache.hpp"
#include "support/message_matches.hpp"

namespace {

using mha::DType;
using mha::KVStorage;
using mha::PagedKVCache;
using mha::Tensor;
using mha::TensorView;

constexpr std::int64_t kHeads = 2, kDim = 8, kTokens = 5;

TEST(PagedKVCacheAlias, OneViewAsKeysAndValuesFillsBoth) {
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> x(kTokens * kHeads * kDim);
  for (float& e : x) e = u(gen);
  const TensorView view(std::span<const float>(x), {kTokens, kHeads, kDim});
  for (const KVStorage storage : {KVStorage::Native, KVStorage::Int8, KVStorage::Float8E4M3}) {
    for (const std::int64_t page_size : {1, 3, 16}) {
      PagedKVCache cache({.num_kv_heads = kHeads,
                          .head_dim = kDim,
                          .page_size = page_size,
                          .capacity_tokens = 2 * kTokens,
                          .storage = storage});
      // The pool's pages hold something else first: a released sequence's values of 7.
      const auto other = cache.add_sequence();
      const std::vector<float> sevens(x.size(), 7.0f);
      cache.append(other, view, TensorView(std::span<const float>(sevens), {kTokens, kHeads, kDim}));
      cache.release(other);
      const auto s = cache.add_sequence();
      cache.append(s, view, view);
      const Tensor k = cache.keys(s), v = cache.values(s);  // [h_kv, T, d] each
      ASSERT_EQ(std::memcmp(k.data(), v.data(), static_cast<std::size_t>(k.numel()) * 4), 0)
          << "storage " << static_cast<int>(storage) << ", pages of " << page_size;
      if (storage != KVStorage::Native) continue;  // quantized rows: keys() equals values(), checked above
      for (std::int64_t t = 0; t < kTokens; ++t)
        for (std::int64_t h = 0; h < kHeads; ++h)
          ASSERT_EQ(
              std::memcmp(v.data_as<float>() + (h * kTokens + t) * kDim, x.data() + (t * kHeads + h) * kDim, kDim * 4),
              0);
    }
  }
}

TEST(PagedKVCacheAlias, OneViewOfTheKeysWidthIsRefusedAsValues) {
  PagedKVCache cache({.num_kv_heads = kHeads, .head_dim = kDim, .value_dim = kDim + 1, .capacity_tokens = 16});
  const auto s = cache.add_sequence();
  const std::vector<float> x(kTokens * kHeads * kDim, 1.0f);
  const TensorView view(std::span<const float>(x), {kTokens, kHeads, kDim});
  EXPECT_THROW(
      try { cache.append(s, view, view); } catch (const mha::Error& e) {
        EXPECT_TRUE(mha_test::message_matches(e.what(), "values.*value_dim")) << e.what();
        throw;
      },
      mha::Error);
  EXPECT_EQ(cache.length(s), 0);
}

}  // namespace
