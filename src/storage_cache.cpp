// The cache of freed tensor storage (storage_cache.hpp says why and how much).
#include "storage_cache.hpp"

#include <sys/mman.h>

#include <cstdlib>
#include <mutex>
#include <new>
#include <vector>

namespace mha::detail {
namespace {

constexpr std::size_t kPage = 4096;
constexpr std::size_t kDefaultCapacity = std::size_t{64} << 20;

bool cacheable(std::size_t bytes) { return bytes >= kStorageCacheMinBytes && bytes <= kStorageCacheMaxBytes; }

// The size actually allocated: whole pages in the cached range, so that sizes a few elements apart
// share blocks.
std::size_t rounded(std::size_t bytes) { return cacheable(bytes) ? (bytes + kPage - 1) / kPage * kPage : bytes; }

// Blocks of a huge page or more start on a huge-page boundary and ask the kernel for transparent huge
// pages (honoured when /sys/kernel/mm/transparent_hugepage/enabled is "madvise" or "always"): one fault
// per 2 MiB instead of 512. Measured on these virtual machines: first touch of 64 MiB in 4 KiB pages
// 160 ms (10 us a page), in huge pages 3 ms. The alignment depends on the size alone, so the block is
// freed with the alignment it was made with.
constexpr std::size_t kHugePage = std::size_t{2} << 20;

std::align_val_t alignment_for(std::size_t size) {
  return std::align_val_t{size >= kHugePage ? kHugePage : kStorageAlignment};
}

std::byte* allocate_block(std::size_t size) {
  auto* p = static_cast<std::byte*>(::operator new(size, alignment_for(size)));
  if (size >= kHugePage) madvise(p, size / kHugePage * kHugePage, MADV_HUGEPAGE);  // advice: failure is harmless
  return p;
}

void free_block(std::byte* p, std::size_t size) { ::operator delete(p, alignment_for(size)); }

std::size_t capacity_from_environment() {
  const char* text = std::getenv("MHA_STORAGE_CACHE_MIB");
  if (text == nullptr || *text == '\0') return kDefaultCapacity;
  char* end = nullptr;
  const unsigned long long mib = std::strtoull(text, &end, 10);
  if (*end != '\0' || mib > (std::size_t{1} << 20)) return kDefaultCapacity;  // not a count of MiB: ignored
  return static_cast<std::size_t>(mib) << 20;
}

struct Block {
  std::byte* p;
  std::size_t bytes;  // rounded
};

class StorageCache {
 public:
  StorageCache() : capacity_(capacity_from_environment()) {}

  std::byte* take(std::size_t bytes) {
    std::lock_guard lock(mutex_);
    for (std::size_t i = held_.size(); i-- > 0;) {  // newest first: its pages are likeliest in cache
      if (held_[i].bytes != bytes) continue;
      std::byte* p = held_[i].p;
      held_.erase(held_.begin() + static_cast<std::ptrdiff_t>(i));
      held_bytes_ -= bytes;
      return p;
    }
    return nullptr;
  }

  // Holds `block`, freeing the oldest held blocks to make room; false when it does not fit at all.
  // Throws std::bad_alloc when the list cannot grow (the block is then not held).
  bool give(Block block) {
    if (block.bytes > capacity_) return false;
    std::lock_guard lock(mutex_);
    while (held_bytes_ + block.bytes > capacity_) {
      free_block(held_.front().p, held_.front().bytes);
      held_bytes_ -= held_.front().bytes;
      held_.erase(held_.begin());
    }
    held_.push_back(block);
    held_bytes_ += block.bytes;
    return true;
  }

  std::size_t capacity() const { return capacity_; }
  std::size_t held_bytes() {
    std::lock_guard lock(mutex_);
    return held_bytes_;
  }

 private:
  const std::size_t capacity_;
  std::mutex mutex_;
  std::vector<Block> held_;  // oldest first
  std::size_t held_bytes_ = 0;
};

// Never destroyed: tensors in static storage may be freed after any destructor of this file's
// statics would have run. What it holds at exit stays reachable, so leak checkers do not report it.
StorageCache& cache() {
  static auto* instance = new StorageCache;
  return *instance;
}

}  // namespace

std::byte* acquire_storage(std::size_t bytes) {
  const std::size_t size = rounded(bytes);
  if (cacheable(bytes))
    if (std::byte* p = cache().take(size)) return p;
  return allocate_block(size);
}

void release_storage(std::byte* p, std::size_t bytes) noexcept {
  if (p == nullptr) return;
  const std::size_t size = rounded(bytes);
  try {
    if (cacheable(bytes) && cache().give({p, size})) return;
  } catch (const std::bad_alloc&) {  // the cache's list could not grow: free the block instead
  }
  free_block(p, size);
}

std::size_t storage_cache_capacity() { return cache().capacity(); }
std::size_t storage_cache_held_bytes() { return cache().held_bytes(); }

}  // namespace mha::detail
