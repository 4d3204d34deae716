// Freed tensor storage of mid sizes, kept for the next allocation of the same size.
//
// A training loop allocates the same tensors every step (the layer's output, its input and weight
// gradients). glibc hands a block of 128 KiB or more back to the system when it is freed (mmap, or the
// trimmed top of the heap), so each step gets it back as new pages, and every page of it costs a page
// fault (10-15 us on these virtual machines; measured at about half of a small training step, see
// docs/PERFORMANCE.md). Storage of kMinBytes to kMaxBytes is therefore held here when freed, up to
// capacity() bytes in all (oldest freed first out), and reused by the next tensor of the same rounded
// size. Smaller blocks come back from malloc's free lists, already mapped; larger ones cost a fault per
// page that is small against the work done on them.
//
// Blocks of 2 MiB or more are also aligned to 2 MiB and advised to use transparent huge pages, so that
// the larger ones, which are not cached, fault once per 2 MiB rather than once per 4 KiB.
//
// The capacity is 64 MiB, or MHA_STORAGE_CACHE_MIB from the environment when the first tensor is
// allocated (0: no cache). Thread-safe; a tensor's storage may be freed on another thread than the
// one that made it.
#pragma once

#include <cstddef>

namespace mha::detail {

inline constexpr std::size_t kStorageAlignment = 64;
inline constexpr std::size_t kStorageCacheMinBytes = std::size_t{64} << 10;
inline constexpr std::size_t kStorageCacheMaxBytes = std::size_t{16} << 20;

// Storage for `bytes` (> 0) bytes, at least kStorageAlignment-aligned, contents unspecified: a cached block of
// the same rounded size, or a new one. Throws std::bad_alloc.
std::byte* acquire_storage(std::size_t bytes);

// Gives back storage from acquire_storage(bytes): cached, or freed.
void release_storage(std::byte* p, std::size_t bytes) noexcept;

// The cache's capacity in bytes, and what it holds now (for tests and the bench).
std::size_t storage_cache_capacity();
std::size_t storage_cache_held_bytes();

}  // namespace mha::detail
