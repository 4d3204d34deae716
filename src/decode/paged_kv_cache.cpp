// PagedKVCache (mha/paged_kv_cache.hpp): the page pool, the page tables, copy-on-write after a fork,
// the reader/writer hold every method takes (the threads contract in the header), and quantized pages
// (rows quantized as they are appended, read back by keys() / values(): the rules in decode/quantize.hpp).
//
// Legend: h_kv key/value heads, d_k key width, d_v value width, P tokens per page, n new tokens,
// T a sequence's length.
#include "mha/paged_kv_cache.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "checked_arithmetic.hpp"
#include "decode/quantize.hpp"
#include "decode/quantize_rows.hpp"
#include "dtype_dispatch.hpp"
#include "mha/error.hpp"

namespace mha {
namespace {

PagedKVCacheConfig resolved(PagedKVCacheConfig c) {
  if (c.value_dim == 0) c.value_dim = c.head_dim;
  const std::pair<const char*, std::int64_t> sizes[] = {{"num_kv_heads", c.num_kv_heads},
                                                        {"head_dim", c.head_dim},
                                                        {"value_dim", c.value_dim},
                                                        {"page_size", c.page_size}};
  for (const auto& [name, value] : sizes)
    if (value < 1) throw Error(std::string("PagedKVCache: ") + name + ": expected >= 1, got " + std::to_string(value));
  if (c.capacity_tokens < 0)
    throw Error("PagedKVCache: capacity_tokens: expected >= 0, got " + std::to_string(c.capacity_tokens));
  if (c.storage != KVStorage::Native && c.storage != KVStorage::Int8 && c.storage != KVStorage::Float8E4M3)
    throw Error("PagedKVCache: storage: expected Native, Int8 or Float8E4M3, got the value " +
                std::to_string(static_cast<int>(c.storage)));
  if (c.storage != KVStorage::Native && c.dtype != DType::Float32)
    throw Error(std::string("PagedKVCache: storage: int8 and float8_e4m3 caches hold float32 keys and values "
                            "quantized; dtype must be float32, got ") +
                dtype_name(c.dtype));
  if (!detail::is_floating(c.dtype))
    throw Error(std::string("PagedKVCache: dtype: expected ") + detail::floating_dtype_names() + ", got " +
                dtype_name(c.dtype));
  return c;
}

// ceil(tokens / page_size) for tokens >= 0, page_size >= 1, without the overflow of tokens + page_size - 1.
std::int64_t pages_for(std::int64_t tokens, std::int64_t page_size) {
  return tokens / page_size + (tokens % page_size != 0 ? 1 : 0);
}

// The elements of one page, h_kv * P * (d_k + d_v), each product checked: sizes such as page_size = 2^63 - 1
// or head_dim = 2^62 are refused by name instead of wrapping to a negative page.
std::int64_t checked_page_elements(const PagedKVCacheConfig& c) {
  const auto width = detail::checked_add(c.head_dim, c.value_dim);
  const auto elements = width ? detail::nonzero_size_product({c.num_kv_heads, c.page_size, *width}) : std::nullopt;
  if (!elements)
    throw Error("PagedKVCache: num_kv_heads, page_size, head_dim, value_dim: a page of num_kv_heads * page_size * "
                "(head_dim + value_dim) = " +
                std::to_string(c.num_kv_heads) + " * " + std::to_string(c.page_size) + " * (" +
                std::to_string(c.head_dim) + " + " + std::to_string(c.value_dim) +
                ") elements is larger than a tensor may be (at most " + std::to_string(detail::kMaxElements) + ")");
  return *elements;
}

// ceil(bytes / alignment) * alignment, for bytes >= 0 far below 2^63 (page sizes are checked first).
std::int64_t aligned_up(std::int64_t bytes, std::int64_t alignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

// Row `row` of every head of a quantized page, from token t of `view` [n, h_kv, width] (float32, float64
// or bfloat16, any strides): payloads into `payload` [h_kv, P, width], scales into `scales` [h_kv, P].
// Contiguous float32 and bfloat16 rows are quantized in vectors (quantize_rows.hpp: the same bits).
void quantize_rows(KVStorage storage, const TensorView& view, std::int64_t t, std::int64_t P, std::int64_t row,
                   std::byte* payload, float* scales) {
  detail::dispatch_floating(view.dtype(), [&](auto element) {
    using T = decltype(element);
    const std::int64_t width = view.size(2);
    for (std::int64_t head = 0; head < view.size(1); ++head) {
      const T* x = static_cast<const T*>(view.data()) + t * view.stride(0) + head * view.stride(1);
      auto* q_int8 = reinterpret_cast<std::int8_t*>(payload + (head * P + row) * width);
      auto* q_e4m3 = reinterpret_cast<std::uint8_t*>(q_int8);
      float& scale = scales[head * P + row];
      if constexpr (!std::is_same_v<T, double>) {
        if (view.stride(2) == 1) {
          scale = storage == KVStorage::Int8 ? detail::quantize_int8_row_vectors(x, width, q_int8)
                                             : detail::quantize_e4m3_row_vectors(x, width, q_e4m3);
          continue;
        }
      }
      scale = storage == KVStorage::Int8 ? detail::quantize_int8_row(x, width, q_int8, view.stride(2))
                                         : detail::quantize_e4m3_row(x, width, q_e4m3, view.stride(2));
    }
  });
}

// A quantized row read back: out [width] = float(q) * scale, in float32.
void dequantize_row(KVStorage storage, const std::byte* q, float scale, std::int64_t width, float* out) {
  if (storage == KVStorage::Int8)
    for (std::int64_t c = 0; c < width; ++c) out[c] = detail::dequantize_int8(static_cast<std::int8_t>(q[c]), scale);
  else
    for (std::int64_t c = 0; c < width; ++c) out[c] = detail::dequantize_e4m3(static_cast<std::uint8_t>(q[c]), scale);
}

// The caches this thread holds, and whether for writing: a hold nested in one of them does nothing
// (std::shared_mutex may not be locked twice by one thread).
struct HeldCache {
  const PagedKVCache* cache;
  bool write;
};
thread_local std::vector<HeldCache> held_by_this_thread;

}  // namespace

const char* kv_storage_name(KVStorage storage) {
  switch (storage) {
    case KVStorage::Native: return "native";
    case KVStorage::Int8: return "int8";
    case KVStorage::Float8E4M3: return "float8_e4m3";
  }
  return "unknown";
}

PagedKVCache::Hold::Hold(const PagedKVCache& cache, bool write) {
  for (const HeldCache& h : held_by_this_thread) {
    if (h.cache != &cache) continue;
    if (write && !h.write)
      throw Error(
          "PagedKVCache: a write (add_sequence, append, fork, release, forward_paged) inside this thread's read "
          "hold of the cache would wait for itself; end the read hold first");
    return;  // nested: this thread has the cache already
  }
  if (write) cache.mutex_.lock();
  else cache.mutex_.lock_shared();
  held_by_this_thread.push_back({&cache, write});
  cache_ = &cache, write_ = write;
}

PagedKVCache::Hold::~Hold() {
  if (cache_ == nullptr) return;
  for (auto it = held_by_this_thread.end(); it != held_by_this_thread.begin();)
    if ((--it)->cache == cache_) {
      held_by_this_thread.erase(it);
      break;
    }
  if (write_) cache_->mutex_.unlock();
  else cache_->mutex_.unlock_shared();
}

PagedKVCache::PagedKVCache(PagedKVCache&& other) noexcept
    : config_(other.config_),
      pool_(std::move(other.pool_)),
      users_(std::move(other.users_)),
      free_(std::move(other.free_)),
      sequences_(std::move(other.sequences_)),
      next_id_(other.next_id_) {}

PagedKVCache& PagedKVCache::operator=(PagedKVCache&& other) noexcept {
  config_ = other.config_, pool_ = std::move(other.pool_), users_ = std::move(other.users_);
  free_ = std::move(other.free_), sequences_ = std::move(other.sequences_), next_id_ = other.next_id_;
  return *this;
}

PagedKVCache::PagedKVCache(const PagedKVCacheConfig& config) : config_(resolved(config)) {
  const std::int64_t pages = pages_for(config_.capacity_tokens, config_.page_size);
  checked_page_elements(config_);  // then page_stride() cannot overflow either
  const std::int64_t page = page_stride() / static_cast<std::int64_t>(dtype_size(config_.dtype));  // pool elements
  if (pages > std::numeric_limits<std::int32_t>::max() || !detail::nonzero_size_product({pages, page}))
    throw Error("PagedKVCache: capacity_tokens: a pool of " + std::to_string(pages) + " pages of " +
                std::to_string(config_.page_size) + " tokens (" + std::to_string(page) +
                " elements each) is larger than a tensor may be (at most " +
                std::to_string(std::numeric_limits<std::int32_t>::max()) + " pages and " +
                std::to_string(detail::kMaxElements) + " elements)");
  pool_ = Tensor::uninitialized(config_.dtype, {pages, page});
  users_.assign(static_cast<std::size_t>(pages), 0);
  for (std::int64_t p = pages - 1; p >= 0; --p) free_.push_back(static_cast<std::int32_t>(p));  // page 0 first
}

std::int64_t PagedKVCache::page_elements() const {
  return config_.num_kv_heads * config_.page_size * (config_.head_dim + config_.value_dim);
}

std::int64_t PagedKVCache::element_bytes() const {
  return config_.storage == KVStorage::Native ? static_cast<std::int64_t>(dtype_size(config_.dtype)) : 1;
}

std::int64_t PagedKVCache::scales_offset() const { return aligned_up(page_elements(), 4); }

// Native pages lie back to back, as they always have; a quantized page, payloads and scales, is padded to
// 64 bytes so that every page starts on a cache line as the pool (a Tensor) does.
std::int64_t PagedKVCache::page_stride() const {
  if (config_.storage == KVStorage::Native) return page_elements() * element_bytes();
  return aligned_up(scales_offset() + 2 * config_.num_kv_heads * config_.page_size * 4, 64);
}

std::byte* PagedKVCache::page_bytes(std::int32_t page) {
  return static_cast<std::byte*>(pool_.data()) + static_cast<std::ptrdiff_t>(page) * page_stride();
}

const std::byte* PagedKVCache::checked_page(std::int32_t page) const {
  if (page < 0 || page >= page_count()) throw Error("PagedKVCache: page " + std::to_string(page) + " does not exist");
  return const_cast<PagedKVCache*>(this)->page_bytes(page);
}

const void* PagedKVCache::key_page(std::int32_t page) const {
  const Hold hold = read_hold();
  return checked_page(page);
}

const void* PagedKVCache::value_page(std::int32_t page) const {
  return static_cast<const std::byte*>(key_page(page)) +
         config_.num_kv_heads * config_.page_size * config_.head_dim * element_bytes();
}

const float* PagedKVCache::key_scales(std::int32_t page) const {
  const Hold hold = read_hold();
  const std::byte* base = checked_page(page);
  if (config_.storage == KVStorage::Native) return nullptr;
  return reinterpret_cast<const float*>(base + scales_offset());
}

const float* PagedKVCache::value_scales(std::int32_t page) const {
  const float* keys = key_scales(page);
  return keys ? keys + config_.num_kv_heads * config_.page_size : nullptr;
}

std::int32_t PagedKVCache::page_users(std::int32_t page) const {
  const Hold hold = read_hold();
  if (page < 0 || page >= page_count()) throw Error("PagedKVCache: page " + std::to_string(page) + " does not exist");
  return users_[static_cast<std::size_t>(page)];
}

PagedKVCache::Sequence& PagedKVCache::find(SequenceId sequence, const char* what) {
  return const_cast<Sequence&>(std::as_const(*this).find(sequence, what));
}

const PagedKVCache::Sequence& PagedKVCache::find(SequenceId sequence, const char* what) const {
  const auto it = sequences_.find(sequence);
  if (it == sequences_.end())
    throw Error(std::string("PagedKVCache::") + what + ": sequence " + std::to_string(sequence) +
                " is not in the cache (" + (sequence >= 0 && sequence < next_id_ ? "released" : "never added") + ")");
  return it->second;
}

PagedKVCache::SequenceId PagedKVCache::add_sequence() {
  const Hold hold = write_hold();
  sequences_.emplace(next_id_, Sequence{});
  return next_id_++;
}

bool PagedKVCache::contains(SequenceId sequence) const {
  const Hold hold = read_hold();
  return sequences_.count(sequence) != 0;
}

std::int64_t PagedKVCache::free_pages() const {
  const Hold hold = read_hold();
  return static_cast<std::int64_t>(free_.size());
}

std::vector<PagedKVCache::SequenceId> PagedKVCache::sequences() const {
  const Hold hold = read_hold();
  std::vector<SequenceId> ids;
  for (const auto& entry : sequences_) ids.push_back(entry.first);
  return ids;
}

std::int64_t PagedKVCache::length(SequenceId sequence) const {
  const Hold hold = read_hold();
  return find(sequence, "length").length;
}

std::span<const std::int32_t> PagedKVCache::page_table(SequenceId sequence) const {
  const Hold hold = read_hold();
  return find(sequence, "page_table").pages;
}

PagedKVCache::SequenceId PagedKVCache::fork(SequenceId parent) {
  const Hold hold = write_hold();
  Sequence child = find(parent, "fork");  // a copy of the page table
  for (std::int32_t page : child.pages) ++users_[static_cast<std::size_t>(page)];
  sequences_.emplace(next_id_, std::move(child));
  return next_id_++;
}

void PagedKVCache::release(SequenceId sequence) {
  const Hold hold = write_hold();
  const Sequence& s = find(sequence, "release");
  for (std::int32_t page : s.pages)
    if (--users_[static_cast<std::size_t>(page)] == 0) free_.push_back(page);
  sequences_.erase(sequence);
}

void PagedKVCache::append(SequenceId sequence, const TensorView& keys, const TensorView& values) {
  const Hold hold = write_hold();
  // Every check first: a refused call changes nothing.
  Sequence& s = find(sequence, "append");
  const std::int64_t h = config_.num_kv_heads, P = config_.page_size;
  const bool quantized = config_.storage != KVStorage::Native;
  // By position, not address: keys and values may be the same view (append(seq, x, x)).
  const std::pair<const char*, const TensorView*> inputs[] = {{"keys", &keys}, {"values", &values}};
  for (const bool is_keys : {true, false}) {
    const auto& [name, t] = inputs[is_keys ? 0 : 1];
    const std::int64_t width = is_keys ? config_.head_dim : config_.value_dim;
    if (quantized && !detail::is_floating(t->dtype()))
      throw Error(std::string("PagedKVCache::append: ") + name + ": expected " + detail::floating_dtype_names() +
                  " (the cache is quantized, " + kv_storage_name(config_.storage) + "), got " + dtype_name(t->dtype()));
    if (!quantized && t->dtype() != config_.dtype)
      throw Error(std::string("PagedKVCache::append: ") + name + ": expected the cache's dtype " +
                  dtype_name(config_.dtype) + ", got " + dtype_name(t->dtype()));
    if (t->rank() != 3 || t->size(1) != h || t->size(2) != width)
      throw Error(std::string("PagedKVCache::append: ") + name + ": expected [n, num_kv_heads, " +
                  (is_keys ? "head_dim" : "value_dim") + "] = [n, " + std::to_string(h) + ", " + std::to_string(width) +
                  "], got " + shape_str(t->shape()));
  }
  const std::int64_t n = keys.size(0);
  if (values.size(0) != n)
    throw Error("PagedKVCache::append: keys and values: expected as many tokens, got " + std::to_string(n) + " and " +
                std::to_string(values.size(0)));
  const bool shared_tail = s.length % P != 0 && users_[static_cast<std::size_t>(s.pages.back())] > 1;
  const std::int64_t needed = pages_for(s.length + n, P) - pages_for(s.length, P) + (shared_tail && n > 0 ? 1 : 0);
  if (needed > free_pages())
    throw Error("PagedKVCache::append: " + std::to_string(n) + " tokens need " + std::to_string(needed) +
                " free pages, " + std::to_string(free_pages()) + " are free (" + std::to_string(page_count()) +
                " pages of " + std::to_string(P) + " tokens in all)");
  if (n == 0) return;

  auto take_page = [&] {
    const std::int32_t page = free_.back();
    free_.pop_back();
    users_[static_cast<std::size_t>(page)] = 1;
    return page;
  };
  if (shared_tail) {  // copy-on-write: the shared, partly filled last page becomes this sequence's own
    const std::int32_t own = take_page();
    std::memcpy(page_bytes(own), page_bytes(s.pages.back()), static_cast<std::size_t>(page_stride()));
    --users_[static_cast<std::size_t>(s.pages.back())];
    s.pages.back() = own;
  }
  for (std::int64_t t = 0; t < n; ++t, ++s.length) {
    if (s.length % P == 0) s.pages.push_back(take_page());
    write_row(page_bytes(s.pages.back()), s.length % P, t, keys, values);
  }
}

// Token t of keys [n, h_kv, d_k] and values [n, h_kv, d_v] into row `row` of every head of `page`: copied
// (native storage) or quantized, each (token, head) row with its scale.
void PagedKVCache::write_row(std::byte* page, std::int64_t row, std::int64_t t, const TensorView& keys,
                             const TensorView& values) {
  const std::int64_t h = config_.num_kv_heads, P = config_.page_size, element = element_bytes();
  for (const bool is_keys : {true, false}) {  // by position: keys and values may be the same view
    const TensorView* view = is_keys ? &keys : &values;
    const std::int64_t width = is_keys ? config_.head_dim : config_.value_dim;
    std::byte* base = page + (is_keys ? 0 : h * P * config_.head_dim * element);
    if (config_.storage != KVStorage::Native) {
      auto* scales = reinterpret_cast<float*>(page + scales_offset()) + (is_keys ? 0 : h * P);
      quantize_rows(config_.storage, *view, t, P, row, base, scales);
      continue;
    }
    const auto* src = static_cast<const std::byte*>(view->data());
    for (std::int64_t head = 0; head < h; ++head) {
      std::byte* dst = base + (head * P + row) * width * element;
      const std::byte* row_src = src + (t * view->stride(0) + head * view->stride(1)) * element;
      if (view->stride(2) == 1) {
        std::memcpy(dst, row_src, static_cast<std::size_t>(width * element));
        continue;
      }
      for (std::int64_t c = 0; c < width; ++c)
        std::memcpy(dst + c * element, row_src + c * view->stride(2) * element, static_cast<std::size_t>(element));
    }
  }
}

Tensor PagedKVCache::gather(const Sequence& s, bool values) const {
  const std::int64_t h = config_.num_kv_heads, P = config_.page_size;
  const std::int64_t width = values ? config_.value_dim : config_.head_dim;
  const std::int64_t element = element_bytes();
  Tensor out = Tensor::uninitialized(config_.dtype, {h, s.length, width});  // float32 when quantized
  auto* dst = static_cast<std::byte*>(out.data());
  for (std::int64_t t = 0; t < s.length; ++t) {
    const std::int32_t page = s.pages[static_cast<std::size_t>(t / P)];
    const auto* base = static_cast<const std::byte*>(values ? value_page(page) : key_page(page));
    const float* scales = values ? value_scales(page) : key_scales(page);
    for (std::int64_t head = 0; head < h; ++head) {
      const std::byte* src = base + (head * P + t % P) * width * element;
      std::byte* row = dst + (head * s.length + t) * width * static_cast<std::int64_t>(dtype_size(config_.dtype));
      if (scales) dequantize_row(config_.storage, src, scales[head * P + t % P], width, reinterpret_cast<float*>(row));
      else std::memcpy(row, src, static_cast<std::size_t>(width * element));
    }
  }
  return out;
}

Tensor PagedKVCache::keys(SequenceId sequence) const {
  const Hold hold = read_hold();
  return gather(find(sequence, "keys"), false);
}

Tensor PagedKVCache::values(SequenceId sequence) const {
  const Hold hold = read_hold();
  return gather(find(sequence, "values"), true);
}

}  // namespace mha
