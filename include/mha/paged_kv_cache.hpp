/// \file
/// A paged key/value cache for decoding many sequences at once (as vLLM's PagedAttention stores one):
/// one layer's projected keys and values in a pool of fixed-size pages, preallocated to a stated
/// capacity, each sequence a list of pages (its page table). Sequences of different lengths share the
/// pool without padding; fork() starts a sequence that shares its parent's pages copy-on-write (beam
/// search, parallel sampling, a shared prompt).
///
/// Legend: h_kv key/value heads, d_k key width, d_v value width, P tokens per page, n new tokens.
///
/// A page holds P positions of every head: keys [h_kv, P, d_k] then values [h_kv, P, d_v], so the rows
/// one head reads from a page are adjacent. A quantized page (KVStorage::Int8 or ::Float8E4M3) is one
/// block of bytes: key payloads [h_kv, P, d_k] (one byte each), value payloads [h_kv, P, d_v], then, at
/// the next multiple of 4 bytes, key scales [h_kv, P] and value scales [h_kv, P] (float32), the page
/// padded to a multiple of 64 bytes so that every quantized page starts on a cache line. A sequence of
/// length T uses ceil(T / P) pages; its last page may be partly filled. Pages are counted by how many
/// sequences use them; a sequence writes only into its last page, and when another sequence shares that
/// page the writer first gets a copy of it, scales and all (the only copy a fork ever causes: the pages
/// before it are full and never written again).
///
/// Every refused call (unknown or released sequence, keys or values of the wrong shape or dtype, not
/// enough free pages) throws mha::Error naming the cause and leaves the cache exactly as it was.
///
/// Threads: every method may be called from several threads at once, on one cache. Readers (length,
/// contains, sequences, pages_in_use, free_pages, page_table, page_users, key_page, value_page,
/// key_scales, value_scales, keys, values, decode_attention) share the cache; writers (add_sequence,
/// append, fork, release, MultiHeadAttention::forward_paged) have it alone: a writer waits until the
/// reads in progress end, and reads wait for it. config() and page_count() never change. The span and
/// the pointers that page_table(), key_page(), value_page(), key_scales() and value_scales() return stay
/// valid only while no writer runs: a thread that uses them while other threads may write holds the
/// cache with read_hold() around the use. A thread may nest calls and holds on one cache (a read inside
/// its read or write hold, a write inside its write hold); a write inside its own read hold would wait
/// for itself for ever, and throws mha::Error instead. Moving a cache, and destroying it, need it alone
/// (no call in progress).
#pragma once

#if __cplusplus < 202002L
#error "mha needs C++20 (std::span): compile with -std=c++20 or later"
#endif

#include <cstdint>
#include <map>
#include <shared_mutex>
#include <span>
#include <vector>

#include "mha/tensor.hpp"

namespace mha {

/// How a cache stores its keys and values.
///
/// Native: as elements of the config's dtype, bitwise as appended. Int8 and Float8E4M3 (quantized): each
/// (token, kv head) row x [d] of keys, and of values, as d one-byte payloads q with one float32 scale s
/// of its own (symmetric), read back (by keys() / values() and by decode) as x' = float(q) * s in
/// float32; m = max |x| of the row, divisions in float64:
///   Int8:       s ~ m / 127, q = round(x / s) ties to even, in [-127, 127]; |x' - x| <= s / 2 per element
///               (exactly so for float32 and bfloat16 input; float64 input: up to the division's rounding).
///   Float8E4M3: s ~ m / 448, q = x / s rounded to float8 e4m3 "fn" (4 exponent bits, 3 mantissa bits, no
///               infinities, S.1111.111 the only NaN, largest 448, subnormals down to 2^-9) to nearest,
///               ties to even, saturating at +-448: no NaN from finite input.
/// "s ~ m / qmax": m / qmax rounded down to 17 significant bits (so that q s is exact in float32 and no
/// payload needs clamping), or, where that is below 2^-133, up to a multiple of 2^-149 (so that s > 0 and
/// m / s <= qmax when m / qmax underflows float32: tiny rows keep the error bound). An all-zero row: s = 0,
/// q = 0 (reads back 0). A row holding NaN, +-Inf or (float64 input) a value beyond float32's range: s =
/// NaN, q = 0, so every element of that row reads back as NaN (kept visible, never made finite); the
/// other rows are untouched. The rules in full: src/decode/quantize.hpp.
enum class KVStorage : std::uint8_t { Native, Int8, Float8E4M3 };
const char* kv_storage_name(KVStorage storage);  ///< "native", "int8", "float8_e4m3"

struct PagedKVCacheConfig {
  std::int64_t num_kv_heads = 0;     ///< h_kv >= 1
  std::int64_t head_dim = 0;         ///< d_k >= 1
  std::int64_t value_dim = 0;        ///< d_v; 0: head_dim
  std::int64_t page_size = 16;       ///< P >= 1 tokens per page
  std::int64_t capacity_tokens = 0;  ///< the pool holds ceil(capacity_tokens / P) pages
  /// Float32, Float64 or BFloat16 (native pages hold the bytes as given). With quantized storage it must
  /// be Float32: the dtype of keys() / values() and of decode's queries and results.
  DType dtype = DType::Float32;
  KVStorage storage = KVStorage::Native;  ///< Native, or quantized rows with a scale each (KVStorage)
};

class PagedKVCache {
 public:
  using SequenceId = std::int64_t;

  /// Allocates the whole pool. Throws mha::Error for sizes < 1 (value_dim and capacity may be 0), a
  /// dtype that is not floating, quantized storage with a dtype other than Float32, or a page or pool
  /// larger than a tensor may be (each product of the sizes is checked for overflow: page_size = 2^63 - 1
  /// or head_dim = 2^62 is refused by name).
  explicit PagedKVCache(const PagedKVCacheConfig& config);
  PagedKVCache(PagedKVCache&& other) noexcept;             ///< needs `other` alone (threads, above)
  PagedKVCache& operator=(PagedKVCache&& other) noexcept;  ///< needs both alone

  /// This thread's hold on the cache, for its scope (see Threads above): a read hold shares the cache
  /// with other readers, a write hold has it alone. Nested in a hold of this thread, a hold does nothing.
  class Hold {
   public:
    ~Hold();
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;

   private:
    friend class PagedKVCache;
    Hold(const PagedKVCache& cache, bool write);
    const PagedKVCache* cache_ = nullptr;  // null when nested: nothing to undo
    bool write_ = false;
  };
  [[nodiscard]] Hold read_hold() const { return Hold(*this, false); }
  [[nodiscard]] Hold write_hold() { return Hold(*this, true); }

  const PagedKVCacheConfig& config() const { return config_; }  ///< value_dim resolved

  /// A new, empty sequence; ids are never reused.
  SequenceId add_sequence();
  /// Appends n positions: keys [n, h_kv, d_k] and values [n, h_kv, d_v] of the cache's dtype, any
  /// strides (n may be 0). Refused, with nothing changed, when they do not fit in the free pages. A
  /// quantized cache takes Float32, Float64 or BFloat16 keys and values (each its own) and quantizes each
  /// row as it enters (KVStorage).
  void append(SequenceId sequence, const TensorView& keys, const TensorView& values);
  /// A new sequence holding the same positions as `parent`, sharing its pages (no copy now).
  SequenceId fork(SequenceId parent);
  /// Ends a sequence: its pages go back to the pool unless another sequence still uses them.
  void release(SequenceId sequence);

  std::int64_t length(SequenceId sequence) const;  ///< positions held
  bool contains(SequenceId sequence) const;        ///< added and not released
  std::vector<SequenceId> sequences() const;       ///< those held, in the order they were added
  std::int64_t page_count() const { return static_cast<std::int64_t>(users_.size()); }
  std::int64_t pages_in_use() const { return page_count() - free_pages(); }
  std::int64_t free_pages() const;

  /// The pages of a sequence, in order: position t is at row t % P of page page_table(s)[t / P]. The
  /// span, like the page pointers below, is valid until the next write (hold the cache to keep it).
  std::span<const std::int32_t> page_table(SequenceId sequence) const;
  /// How many sequences use a page (0: free).
  std::int32_t page_users(std::int32_t page) const;
  /// The storage of page `page`: keys [h_kv, P, d_k], then values [h_kv, P, d_v], contiguous; elements of
  /// the dtype, or for quantized storage one-byte payloads (std::int8_t, or float8 e4m3 bit patterns).
  const void* key_page(std::int32_t page) const;
  const void* value_page(std::int32_t page) const;
  /// Quantized storage: the scales of page `page`'s rows, keys' [h_kv, P] and values' [h_kv, P] (row t % P
  /// of head j at j * P + t % P; 4-byte aligned). nullptr for native storage.
  const float* key_scales(std::int32_t page) const;
  const float* value_scales(std::int32_t page) const;

  /// A sequence's keys [h_kv, T, d_k] and values [h_kv, T, d_v] gathered into new contiguous tensors
  /// (for checks and for kernels without page tables); for quantized storage the float32 values read
  /// back, x' = float(q) * s (exactly what decode reads).
  Tensor keys(SequenceId sequence) const;
  Tensor values(SequenceId sequence) const;

 private:
  struct Sequence {
    std::int64_t length = 0;
    std::vector<std::int32_t> pages;
  };
  const Sequence& find(SequenceId sequence, const char* what) const;  // throws naming `what` if absent
  Sequence& find(SequenceId sequence, const char* what);
  std::int64_t page_elements() const;  // payload elements of one page: keys and values
  std::int64_t element_bytes() const;  // bytes of one payload element: the dtype's, or 1 (quantized)
  std::int64_t scales_offset() const;  // quantized pages: where the key scales start, in bytes
  std::int64_t page_stride() const;    // bytes from one page to the next
  std::byte* page_bytes(std::int32_t page);
  const std::byte* checked_page(std::int32_t page) const;  // page_bytes, or mha::Error if no such page
  void write_row(std::byte* page, std::int64_t row, std::int64_t t, const TensorView& keys, const TensorView& values);
  Tensor gather(const Sequence& s, bool values) const;

  PagedKVCacheConfig config_;
  Tensor pool_;                               // [pages, page_stride() / dtype size] of the dtype
  std::vector<std::int32_t> users_;           // [pages]: sequences using each page
  std::vector<std::int32_t> free_;            // free pages, the next one taken from the back
  std::map<SequenceId, Sequence> sequences_;  // ordered by id, i.e. by when they were added
  SequenceId next_id_ = 0;
  mutable std::shared_mutex mutex_;  // shared by readers, exclusive for writers (Hold)
};

}  // namespace mha
