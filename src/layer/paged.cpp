// MultiHeadAttention::forward_paged: self-attention decoding over a PagedKVCache (mha/decode.hpp's
// decode_attention), n sequences of different lengths at once.
//
// Legend: n sequences, q_len new positions each, E = d_model, h heads, h_kv key/value heads, d_k and
// d_v per-head widths, P tokens per page.
#include <set>
#include <string>
#include <vector>

#include "attention/attention_core.hpp"
#include "dtype_dispatch.hpp"
#include "layer/inputs.hpp"
#include "layer/linear.hpp"
#include "layer/projections.hpp"
#include "layer/rotary_heads.hpp"
#include "mha/decode.hpp"
#include "mha/error.hpp"
#include "mha/multi_head_attention.hpp"

namespace mha {

namespace {

[[noreturn]] void fail(const std::string& message) { throw Error(message); }

std::string str(std::int64_t v) { return std::to_string(v); }

// Pages the cache must have free for q_len more positions in each sequence: the new pages past each
// one's last, and a copy of its last page where that page is partly filled and shared (a fork's).
std::int64_t pages_needed(const PagedKVCache& cache, std::span<const PagedKVCache::SequenceId> sequences,
                          std::int64_t q_len) {
  const std::int64_t P = cache.config().page_size;
  std::int64_t pages = 0;
  for (PagedKVCache::SequenceId s : sequences) {
    const std::int64_t length = cache.length(s);
    pages += (length + q_len + P - 1) / P - (length + P - 1) / P;
    const auto table = cache.page_table(s);
    if (length % P != 0 && cache.page_users(table.back()) > 1) ++pages;
  }
  return pages;
}

// The decode's score from the inputs (their scale, window, ALiBi slopes, softcap) and the layer's sinks, checked as
// decode_attention checks them (before anything is appended); masks, causal and head_gate are refused
// (each sequence's queries attend causally to its own positions).
DecodeOptions decode_score(const MultiHeadAttentionInputs& in, DType dtype, std::int64_t n, std::int64_t h,
                           std::int64_t q_len, const Tensor* sinks) {
  detail::refuse_rotary_positions(in, "forward_paged");
  if (!in.cu_seqlens.empty() || !in.cu_seqlens_k.empty())
    fail("cu_seqlens: forward_paged takes no packed sequences (query holds [n, q_len] rows, one sequence each)");
  if (in.key_padding_mask || in.attn_mask || !in.key_lengths.empty() || in.causal || in.head_gate)
    fail("inputs: forward_paged takes no masks, causal or head_gate (each sequence's queries attend causally to "
         "its own positions); leave them at their defaults");
  DecodeOptions o;
  o.scale = in.scale, o.window_left = in.window_left, o.window_right = in.window_right;
  o.alibi_slopes = in.alibi_slopes, o.softcap = in.softcap;
  if (in.sinks)
    fail("sinks: a layer's sinks are its parameter `sinks` (MultiHeadAttentionConfig::sinks = true), not an input");
  if (sinks) o.sinks = sinks->view();  // float32 for a bfloat16 layer (the caller's copy)
  detail::validate_score(o, dtype, n, h, q_len, 1);
  return o;
}

}  // namespace

PagedKVCacheConfig MultiHeadAttention::paged_cache_config(std::int64_t page_size, std::int64_t capacity_tokens) const {
  PagedKVCacheConfig p;
  p.num_kv_heads = config_.num_kv_heads, p.head_dim = config_.d_k, p.value_dim = config_.d_v;
  p.page_size = page_size, p.capacity_tokens = capacity_tokens, p.dtype = config_.dtype;
  return p;
}

MultiHeadAttentionOutput MultiHeadAttention::forward_paged(const TensorView& query, PagedKVCache& cache,
                                                           std::span<const PagedKVCache::SequenceId> sequences,
                                                           const MultiHeadAttentionInputs& inputs) const {
  const auto& c = config_;
  const std::int64_t E = c.d_model, qk = c.num_heads * c.d_k, kk = c.num_kv_heads * c.d_k;
  const std::int64_t vw = c.num_heads * c.d_v, kv = c.num_kv_heads * c.d_v;

  // The cache alone from the checks to the last read: no other thread's write can take the pages
  // checked free, or change a page between this call's append and its decode.
  const PagedKVCache::Hold hold = cache.write_hold();
  // ---- validate (nothing changes before this is done) ------------------------------------------
  if (query.rank() != 3 || query.size(2) != E)
    fail("query: expected [n, q_len, E] with E = d_model = " + str(E) + ", got " + shape_str(query.shape()));
  detail::check_dtype(query, "query", c.dtype);
  if (c.add_bias_kv || c.add_zero_attn) fail("forward_paged: not available with add_bias_kv / add_zero_attn");
  const std::int64_t n = query.size(0), q_len = query.size(1);
  const Tensor sinks =
      c.sinks ? Tensor::copy_of(parameter("sinks"), c.dtype == DType::BFloat16 ? DType::Float32 : c.dtype) : Tensor();
  const DecodeOptions score = decode_score(inputs, c.dtype, n, c.num_heads, q_len, c.sinks ? &sinks : nullptr);
  if (static_cast<std::int64_t>(sequences.size()) != n)
    fail("sequences: expected n = " + str(n) + " ids, one per row of query " + shape_str(query.shape()) + ", got " +
         str(static_cast<std::int64_t>(sequences.size())));
  if (n < 1 || q_len < 1)
    fail("query: expected at least one sequence and one position, got " + shape_str(query.shape()));
  const PagedKVCacheConfig& pc = cache.config();
  if (pc.num_kv_heads != c.num_kv_heads || pc.head_dim != c.d_k || pc.value_dim != c.d_v || pc.dtype != c.dtype)
    fail("cache: holds h_kv = " + str(pc.num_kv_heads) + ", head_dim = " + str(pc.head_dim) +
         ", value_dim = " + str(pc.value_dim) + ", " + dtype_name(pc.dtype) +
         "; this layer needs h_kv = " + str(c.num_kv_heads) + ", head_dim = " + str(c.d_k) +
         ", value_dim = " + str(c.d_v) + ", " + dtype_name(c.dtype) + " (paged_cache_config())");
  std::set<PagedKVCache::SequenceId> seen;
  for (PagedKVCache::SequenceId s : sequences) {
    if (!cache.contains(s)) fail("sequences: " + str(s) + " is not in the cache (never added, or released)");
    if (!seen.insert(s).second) fail("sequences: " + str(s) + " appears twice; each sequence may appear once");
  }
  if (const std::int64_t need = pages_needed(cache, sequences, q_len); need > cache.free_pages())
    fail("cache: " + str(n * q_len) + " new positions need " + str(need) + " free pages, the cache has " +
         str(cache.free_pages()) + "; nothing was appended");

  // ---- project, append, attend, project back ------------------------------------------------------
  Tensor query_copy;
  const TensorView x = detail::contiguous_view(query, query_copy);  // [n q_len, E]
  const std::int64_t rows = n * q_len;
  Tensor q_proj(c.dtype, {n, q_len, c.num_heads, c.d_k}), keys(c.dtype, {rows, kk}), values(c.dtype, {rows, kv});
  MultiHeadAttentionOutput result;
  result.out = Tensor(c.dtype, {n, q_len, E});
  detail::dispatch_floating(c.dtype, [&]<class T>(T) {
    const detail::ProjectionWeights<T> w = detail::projection_weights<T>(*this);
    const T* xp = x.data_as<T>();
    detail::linear_forward(xp, E, rows, E, w.q, qk, w.q_bias, q_proj.data_as<T>(), qk);
    detail::linear_forward(xp, E, rows, E, w.k, kk, w.k_bias, keys.data_as<T>(), kk);
    detail::linear_forward(xp, E, rows, E, w.v, kv, w.v_bias, values.data_as<T>(), kv);
    if (detail::has_rotary(c)) {  // each sequence's new queries and keys at its positions length..
      std::vector<std::int64_t> first;
      for (PagedKVCache::SequenceId s : sequences) first.push_back(cache.length(s));
      detail::rotate_heads(
          TensorView(q_proj.data(), c.dtype, {n, c.num_heads, q_len, c.d_k}, {q_len * qk, c.d_k, qk, 1}), c, first,
          /*inverse=*/false);
      detail::rotate_heads(
          TensorView(keys.data(), c.dtype, {n, c.num_kv_heads, q_len, c.d_k}, {q_len * kk, c.d_k, kk, 1}), c, first,
          /*inverse=*/false);
    }
    for (std::int64_t s = 0; s < n; ++s) {  // sequence s's q_len rows: keys [q_len, h_kv, d_k], values likewise
      const std::int64_t first = s * q_len;
      cache.append(sequences[static_cast<std::size_t>(s)],
                   TensorView(keys.data_as<T>() + first * kk, c.dtype, {q_len, c.num_kv_heads, c.d_k}),
                   TensorView(values.data_as<T>() + first * kv, c.dtype, {q_len, c.num_kv_heads, c.d_v}));
    }
    const DecodeResult attended =
        decode_attention(q_proj, cache, sequences, score);  // [n, q_len, h, d_v]: the heads concatenated
    detail::linear_forward(attended.out.data_as<T>(), vw, rows, vw, w.out, E, w.out_bias, result.out.data_as<T>(), E);
  });
  return result;
}

}  // namespace mha
