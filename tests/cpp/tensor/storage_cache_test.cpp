// The cache of freed tensor storage (src/storage_cache.hpp): a freed mid-size block serves the next
// tensor of its size, zero-initialised tensors are still zero when their block is reused, the cache
// never holds more than its capacity, and small and large blocks are not held.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "storage_cache.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::detail::kStorageCacheMaxBytes;
using mha::detail::kStorageCacheMinBytes;
using mha::detail::storage_cache_capacity;
using mha::detail::storage_cache_held_bytes;

// A float32 element count whose byte size is in the cached range and unlikely to be any other test's.
constexpr std::int64_t kOddElements = (kStorageCacheMinBytes + 3 * 4096 + 52) / 4;

TEST(StorageCache, FreedBlockServesTheNextTensorOfItsSize) {
  if (storage_cache_capacity() == 0) GTEST_SKIP() << "MHA_STORAGE_CACHE_MIB=0";
  const void* first = nullptr;
  {
    Tensor a = Tensor::uninitialized(DType::Float32, {kOddElements});
    first = a.data();
  }
  const std::size_t held = storage_cache_held_bytes();
  EXPECT_GE(held, static_cast<std::size_t>(kOddElements) * 4);
  // A shape with the same element count, and one a few elements longer (same whole pages).
  Tensor b = Tensor::uninitialized(DType::Float32, {2, kOddElements / 2});
  EXPECT_EQ(b.data(), first);
  EXPECT_LT(storage_cache_held_bytes(), held);
  const void* second = b.data();
  b = Tensor();
  Tensor c = Tensor::uninitialized(DType::Float32, {kOddElements + 3});
  EXPECT_EQ(c.data(), second);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(c.data()) % 64, 0u);
}

TEST(StorageCache, ZeroInitialisedTensorIsZeroOnAReusedBlock) {
  for (DType dtype : {DType::Float32, DType::Float64, DType::Bool}) {
    const std::int64_t n = static_cast<std::int64_t>(kStorageCacheMinBytes * 2 / mha::dtype_size(dtype)) + 5;
    {
      Tensor dirty = Tensor::uninitialized(dtype, {n});
      std::memset(dirty.data(), 0x5a, dirty.nbytes());
    }
    Tensor t(dtype, {n});
    const auto* bytes = static_cast<const unsigned char*>(t.data());
    std::size_t nonzero = 0;
    for (std::size_t i = 0; i < t.nbytes(); ++i) nonzero += bytes[i] != 0;
    EXPECT_EQ(nonzero, 0u) << mha::dtype_name(dtype);
  }
}

TEST(StorageCache, HoldsAtMostItsCapacityAndOnlyMidSizes) {
  const std::size_t capacity = storage_cache_capacity();
  {
    std::vector<Tensor> big;
    const auto n = static_cast<std::int64_t>(kStorageCacheMaxBytes / 4);
    for (std::size_t bytes = 0; bytes <= capacity + 2 * kStorageCacheMaxBytes; bytes += kStorageCacheMaxBytes)
      big.push_back(Tensor::uninitialized(DType::Float32, {n}));
  }
  EXPECT_LE(storage_cache_held_bytes(), capacity);
  if (capacity >= 2 * kStorageCacheMaxBytes) {
    EXPECT_GE(storage_cache_held_bytes(), 2 * kStorageCacheMaxBytes);
  }

  const std::size_t before = storage_cache_held_bytes();
  { Tensor small = Tensor::uninitialized(DType::Float32, {static_cast<std::int64_t>(kStorageCacheMinBytes / 4) - 1}); }
  { Tensor large = Tensor::uninitialized(DType::Float32, {static_cast<std::int64_t>(kStorageCacheMaxBytes / 4) + 1}); }
  EXPECT_EQ(storage_cache_held_bytes(), before);  // neither was held (nor evicted anything)
}

// Tensors made on one thread and freed on another, from several threads at once: the cache's list
// stays consistent (run under ASan by make test-asan) and every tensor reads back what it was given.
TEST(StorageCache, ThreadsAllocateAndFreeConcurrently) {
  constexpr int kThreads = 4;
  std::vector<std::vector<Tensor>> made(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&made, t] {
      for (int i = 0; i < 40; ++i) {
        const std::int64_t n = kOddElements + 1024 * (i % 5);
        Tensor x = Tensor::uninitialized(DType::Float32, {n});
        float* p = x.data_as<float>();
        for (std::int64_t j = 0; j < n; ++j) p[j] = static_cast<float>(t * 1000 + i);
        bool same = true;
        for (std::int64_t j = 0; j < n; ++j) same = same && p[j] == static_cast<float>(t * 1000 + i);
        EXPECT_TRUE(same);
        if (i % 3 == 0) made[t].push_back(std::move(x));  // freed later, on the main thread
      }
    });
  for (auto& th : threads) th.join();
  made.clear();
  EXPECT_LE(storage_cache_held_bytes(), storage_cache_capacity());
}

}  // namespace
}  // namespace mha_test
