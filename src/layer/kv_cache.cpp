// KeyValueCache and MultiHeadAttention's incremental decoding: append the projected keys and values of
// new positions, then attend for new queries against everything cached, in place.
//
// Legend: B batch, L queries (new positions), S cached positions, S' = S + the extra positions,
// h heads, d_k, d_v per-head widths, E = d_model.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <string>
#include <tuple>

#include "dtype_dispatch.hpp"
#include "layer/attend.hpp"
#include "layer/inputs.hpp"
#include "layer/masks.hpp"
#include "layer/projections.hpp"
#include "layer/rotary_heads.hpp"
#include "mha/error.hpp"
#include "mha/multi_head_attention.hpp"

namespace mha {

namespace {

using namespace detail;

[[noreturn]] void fail(const std::string& message) { throw Error(message); }

std::string str(std::int64_t v) { return std::to_string(v); }

// The first append allocates room for at least this many positions, so that short decodes do not
// regrow at every step; beyond it the capacity doubles.
constexpr std::int64_t kMinCacheCapacity = 16;

// "h = 2, d_k = 4, d_v = 4, float64, add_bias_kv": what a cache and its layer must agree on (h_kv named
// when it differs from h).
std::string cache_signature(std::int64_t h, std::int64_t h_kv, std::int64_t d_k, std::int64_t d_v, DType dtype,
                            bool add_bias_kv, bool add_zero_attn) {
  return "h = " + str(h) + (h_kv != h ? ", h_kv = " + str(h_kv) : "") + ", d_k = " + str(d_k) + ", d_v = " + str(d_v) +
         ", " + dtype_name(dtype) + (add_bias_kv ? ", add_bias_kv" : "") + (add_zero_attn ? ", add_zero_attn" : "");
}

}  // namespace

KeyValueCache::Use::Use(const KeyValueCache& cache, bool write) : cache_(cache), write_(write) {
  int users = cache.users_.load();
  do {
    if (users < 0 || (write && users > 0))
      fail(std::string("cache: in use by another call (") + (users < 0 ? "an append or clear" : "forward_cached") +
           ") at the same time; a KeyValueCache takes concurrent forward_cached() calls only, and "
           "append_to_cache() / clear() / moving it alone");
  } while (!cache.users_.compare_exchange_weak(users, write ? -1 : users + 1));
}

KeyValueCache::Use::~Use() {
  if (write_) cache_.users_.store(0);
  else cache_.users_.fetch_sub(1);
}

KeyValueCache::KeyValueCache(KeyValueCache&& other) { *this = std::move(other); }

KeyValueCache& KeyValueCache::operator=(KeyValueCache&& other) {
  if (this == &other) return *this;
  const Use replaced(*this, /*write=*/true), moving(other, /*write=*/true);
  keys_ = std::move(other.keys_), values_ = std::move(other.values_);
  batch_ = other.batch_.load(), length_ = other.length_.load(), capacity_ = other.capacity_.load();
  num_heads_ = other.num_heads_, num_kv_heads_ = other.num_kv_heads_, d_k_ = other.d_k_, d_v_ = other.d_v_,
  dtype_ = other.dtype_;
  add_bias_kv_ = other.add_bias_kv_, add_zero_attn_ = other.add_zero_attn_;
  rotary_dim_ = other.rotary_dim_, rotary_base_ = other.rotary_base_, rotary_interleaved_ = other.rotary_interleaved_;
  other.batch_ = other.length_ = other.capacity_ = 0;
  return *this;
}

void KeyValueCache::clear() {
  const Use clearing(*this, /*write=*/true);
  length_ = 0;
}

void KeyValueCache::reserve(std::int64_t positions) {
  if (positions <= capacity_) return;
  const std::int64_t capacity = std::max({positions, 2 * capacity_, kMinCacheCapacity});
  const std::int64_t qk = num_kv_heads_ * d_k_, vw = num_kv_heads_ * d_v_;  // a row's key and value widths
  Tensor keys(dtype_, {batch_, capacity, qk}), values(dtype_, {batch_, capacity, vw});
  if (length_ > 0) {  // copy the rows held, batch by batch (the extra positions are rewritten by append)
    const std::size_t elem = dtype_size(dtype_);
    for (auto [to, from, width] : {std::tuple{&keys, &keys_, qk}, std::tuple{&values, &values_, vw}}) {
      const std::size_t old_batch = static_cast<std::size_t>(capacity_ * width) * elem;
      const std::size_t new_batch = static_cast<std::size_t>(capacity * width) * elem;
      for (std::int64_t b = 0; b < batch_; ++b)
        std::memcpy(static_cast<std::byte*>(to->data()) + static_cast<std::size_t>(b) * new_batch,
                    static_cast<const std::byte*>(from->data()) + static_cast<std::size_t>(b) * old_batch,
                    static_cast<std::size_t>(length_ * width) * elem);
    }
  }
  keys_ = std::move(keys);
  values_ = std::move(values);
  capacity_ = capacity;
}

void MultiHeadAttention::check_cache_layer(const KeyValueCache& cache) const {
  const auto& c = config_;
  if (cache.num_heads_ != c.num_heads || cache.num_kv_heads_ != c.num_kv_heads || cache.d_k_ != c.d_k ||
      cache.d_v_ != c.d_v || cache.dtype_ != c.dtype || cache.add_bias_kv_ != c.add_bias_kv ||
      cache.add_zero_attn_ != c.add_zero_attn)
    fail("cache: filled by a layer with " +
         cache_signature(cache.num_heads_, cache.num_kv_heads_, cache.d_k_, cache.d_v_, cache.dtype_,
                         cache.add_bias_kv_, cache.add_zero_attn_) +
         ", but this layer has " +
         cache_signature(c.num_heads, c.num_kv_heads, c.d_k, c.d_v, c.dtype, c.add_bias_kv, c.add_zero_attn) +
         "; use one cache per layer");
  if (cache.rotary_dim_ != c.rotary_dim ||
      (c.rotary_dim > 0 && (cache.rotary_base_ != c.rotary_base || cache.rotary_interleaved_ != c.rotary_interleaved)))
    fail("cache: filled by a layer with rotary_dim " + str(cache.rotary_dim_) + " (base " +
         std::to_string(cache.rotary_base_) + (cache.rotary_interleaved_ ? ", interleaved" : "") +
         "), but this layer has rotary_dim " + str(c.rotary_dim) + " (base " + std::to_string(c.rotary_base) +
         (c.rotary_interleaved ? ", interleaved" : "") + "): its keys are stored rotated; use one cache per layer");
  if (c.add_bias_kv && cache.length_ > 0) {  // position `length` of batch 0 holds the appending layer's bias_k / bias_v
    const std::size_t elem = dtype_size(c.dtype);
    const std::size_t qk = static_cast<std::size_t>(c.num_kv_heads * c.d_k),
                      vw = static_cast<std::size_t>(c.num_kv_heads * c.d_v);
    const auto* k_row =
        static_cast<const std::byte*>(cache.keys_.data()) + static_cast<std::size_t>(cache.length_) * qk * elem;
    const auto* v_row =
        static_cast<const std::byte*>(cache.values_.data()) + static_cast<std::size_t>(cache.length_) * vw * elem;
    if (std::memcmp(k_row, parameter("bias_k").data(), qk * elem) != 0 ||
        std::memcmp(v_row, parameter("bias_v").data(), vw * elem) != 0)
      fail("cache: its bias_k / bias_v differ from this layer's: it was filled by another layer, or the "
           "parameters changed since its last append");
  }
}

void MultiHeadAttention::append_to_cache(KeyValueCache& cache, const TensorView& key, const TensorView& value) const {
  const KeyValueCache::Use writing(cache, /*write=*/true);
  const auto& c = config_;
  const std::int64_t h = c.num_heads, qk = c.num_kv_heads * c.d_k, vw = c.num_kv_heads * c.d_v;  // row widths

  // ---- validate (nothing changes before this is done) ------------------------------------------
  check_input_rank(key, "key", c.batch_first, "S_new", "kdim");
  check_dtype(key, "key", c.dtype);
  check_dtype(value, "value", c.dtype);
  check_same_rank(value, "value", key, "key");
  const InputDims dims(c, key.rank());
  const std::int64_t B = dims.batch(key), S_new = dims.positions(key);
  check_width(key, "key", c.kdim, "kdim");
  check_width(value, "value", c.vdim, "vdim");
  check_same_batch(value, "value", dims, B, key, "key");
  if (dims.positions(value) != S_new)
    fail("value: expected " + str(S_new) + " positions like key " + shape_str(key.shape()) + ", got shape " +
         shape_str(value.shape()));
  if (S_new < 1) fail("key: expected at least one position to append, got shape " + shape_str(key.shape()));
  if (B < 1) fail("key: expected a batch of at least one (B >= 1), got shape " + shape_str(key.shape()));
  if (cache.length_ > 0) {
    check_cache_layer(cache);
    if (B != cache.batch_)
      fail("key: expected batch size " + str(cache.batch_) + " like the cache's (cache.batch()), got shape " +
           shape_str(key.shape()));
  } else {  // an empty cache (new or cleared) starts over with this layer and batch size
    const bool storage_fits = cache.batch_ == B && cache.dtype_ == c.dtype && cache.num_kv_heads_ * cache.d_k_ == qk &&
                              cache.num_kv_heads_ * cache.d_v_ == vw;
    if (!storage_fits) cache.keys_ = Tensor(), cache.values_ = Tensor(), cache.capacity_ = 0;
    cache.batch_ = B, cache.num_heads_ = h, cache.num_kv_heads_ = c.num_kv_heads, cache.d_k_ = c.d_k,
    cache.d_v_ = c.d_v, cache.dtype_ = c.dtype;
    cache.add_bias_kv_ = c.add_bias_kv, cache.add_zero_attn_ = c.add_zero_attn;
    cache.rotary_dim_ = c.rotary_dim, cache.rotary_base_ = c.rotary_base,
    cache.rotary_interleaved_ = c.rotary_interleaved;
  }

  // ---- project into rows [length, length + S_new) of every batch, then the extra positions -------
  const std::int64_t S0 = cache.length_, S1 = S0 + S_new;
  cache.reserve(S1 + extra_positions(c));
  Tensor copies[2];
  const TensorView k_in = contiguous_view(key, copies[0]), v_in = contiguous_view(value, copies[1]);
  const RowLayout rows = dims.rows(B, S_new);
  auto run = [&]<class T>(T) {
    const ProjectionWeights<T> w = projection_weights<T>(*this);
    T* keys = cache.keys_.data_as<T>();      // [B, capacity, h_kv*d_k]
    T* values = cache.values_.data_as<T>();  // [B, capacity, h_kv*d_v]
    project_per_batch<T>(k_in, rows, B, S_new, w.k, qk, w.k_bias, keys + S0 * qk, cache.capacity_);
    project_per_batch<T>(v_in, rows, B, S_new, w.v, vw, w.v_bias, values + S0 * vw, cache.capacity_);
    if (has_rotary(c)) {  // the new keys at their positions S0.., stored rotated
      const std::int64_t first[1] = {S0};
      rotate_heads(
          TensorView(keys + S0 * qk, c.dtype, {B, c.num_kv_heads, S_new, c.d_k}, {cache.capacity_ * qk, c.d_k, qk, 1}),
          c, first, /*inverse=*/false);
    }
    write_extra_positions<T>(*this, keys, values, B, cache.capacity_, S1);
  };
  dispatch_floating(c.dtype, run);
  cache.length_ = S1;
}

MultiHeadAttentionOutput MultiHeadAttention::forward_cached(const TensorView& query, const KeyValueCache& cache,
                                                            const MultiHeadAttentionInputs& in) const {
  const KeyValueCache::Use reading(cache, /*write=*/false);
  const auto& c = config_;
  const std::int64_t E = c.d_model, h = c.num_heads, qk = h * c.d_k;

  // ---- validate the inputs --------------------------------------------------------------------
  if (cache.length_ == 0)
    fail("cache: empty (length 0); append_to_cache() the keys and values of at least one position first");
  check_cache_layer(cache);
  check_input_rank(query, "query", c.batch_first, "L_new", "E");
  check_dtype(query, "query", c.dtype);
  check_width(query, "query", E, "d_model");
  const InputDims dims(c, query.rank());
  const std::int64_t B = dims.batch(query), L = dims.positions(query), S = cache.length_;
  const std::int64_t S2 = S + extra_positions(c);
  if (B != cache.batch_)
    fail("query: expected batch size " + str(cache.batch_) + " like the cache's (cache.batch()), got shape " +
         shape_str(query.shape()));

  refuse_rotary_positions(in, "forward_cached");
  if (!in.cu_seqlens.empty() || !in.cu_seqlens_k.empty())
    fail("cu_seqlens: forward_cached takes no packed sequences (a cache holds [B, length] positions); give each "
         "sequence its own batch row");
  // ---- masks over the cache's S positions, in kernel terms [B, h, L, S'] ----------------------
  KernelMasks masks = kernel_masks(in, c, dims.batched, B, L, S, c.sinks ? &parameter("sinks") : nullptr);
  AttentionOptions& o = masks.options;
  o.need_weights = in.need_weights;
  o.kernel = kernel_;  // evaluation mode: no dropout, no log-sum-exps
  const HeadGate gate = head_gate_of(in.head_gate, c, dims.batched, B);

  // ---- project the queries, attend to the cache in place, project back -------------------------
  Tensor query_copy;
  const TensorView q_in = contiguous_view(query, query_copy);
  const RowLayout q_rows = dims.rows(B, L), cache_rows{cache.capacity_, 1};
  QuerySide query_side = allocate_query_side(query, B * L, c);
  Tensor& q_proj = query_side.q_proj;
  Tensor& context = query_side.context;
  MultiHeadAttentionOutput result;
  result.out = std::move(query_side.out);

  auto run = [&]<class T>(T) {
    const ProjectionWeights<T> w = projection_weights<T>(*this);
    project<T>(q_in, q_rows, B, L, 0, w.q, qk, w.q_bias, q_proj);
    HeadViews heads;
    heads.q = heads_view(q_proj, B, h, L, c.d_k, q_rows);  // [B, h, L, d_k]
    const std::int64_t query_first[1] = {S - L};           // query i at i + S - L, as forward puts it
    if (has_rotary(c)) rotate_heads(heads.q, c, query_first, /*inverse=*/false);
    heads.k = heads_view(cache.keys_, B, c.num_kv_heads, S2, c.d_k, cache_rows);    // [B, h_kv, S', d_k]
    heads.v = heads_view(cache.values_, B, c.num_kv_heads, S2, c.d_v, cache_rows);  // [B, h_kv, S', d_v]
    heads.context = heads_view(context, B, h, L, c.d_v, q_rows);                    // [B, h, L, d_v]
    Tensor weights, lse;
    attend_and_project_out<T>(heads, o, w, gate, context, context.data_as<T>(), result.out, weights, lse);
    if (in.need_weights) result.weights = output_weights<T>(std::move(weights), in.average_attn_weights, dims.batched);
  };
  dispatch_floating(c.dtype, run);
  return result;
}

}  // namespace mha
