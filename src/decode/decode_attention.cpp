// decode_attention (mha/decode.hpp): every check at the boundary, then the parameter object (page
// pointers of each sequence, in batch order) and the kernel of the cache's dtype.
//
// Legend: n sequences, Lq new queries per sequence, h query heads, h_kv key/value heads, d_k, d_v.
#include <cmath>
#include <string>
#include <type_traits>

#include "attention/attention_core.hpp"
#include "decode/decode_params.hpp"
#include "dtype_dispatch.hpp"
#include "logit_scalars.hpp"
#include "mha/error.hpp"

namespace mha {
namespace detail {
namespace {

void check_arguments(const TensorView& q, const PagedKVCache& cache,
                     std::span<const PagedKVCache::SequenceId> sequences, const DecodeOptions& options) {
  const PagedKVCacheConfig& c = cache.config();
  const std::string where = "decode_attention: ";
  const bool quantized = c.storage != KVStorage::Native;  // float32 or bfloat16 queries (widened exactly)
  if (q.dtype() != c.dtype && !(quantized && q.dtype() == DType::BFloat16))
    throw Error(where + "q: expected the cache's dtype " + dtype_name(c.dtype) +
                (quantized ? " or bfloat16 (the cache is quantized)" : "") + ", got " + dtype_name(q.dtype()));
  if (q.rank() != 4 || q.size(3) != c.head_dim)
    throw Error(where + "q: expected [n, q_len, num_heads, head_dim] with head_dim = the cache's " +
                std::to_string(c.head_dim) + ", got " + shape_str(q.shape()));
  const std::int64_t n = q.size(0), q_len = q.size(1), h = q.size(2);
  if (n == 0) throw Error(where + "q: expected at least one sequence (n >= 1), got " + shape_str(q.shape()));
  if (q_len == 0)
    throw Error(where + "q: expected at least one query per sequence (q_len >= 1), got " + shape_str(q.shape()));
  if (h == 0 || h % c.num_kv_heads != 0)
    throw Error(where + "q: num_heads " + std::to_string(h) + " must be a positive multiple of the cache's " +
                "num_kv_heads " + std::to_string(c.num_kv_heads) + " (grouped-query attention)");
  if (static_cast<std::int64_t>(sequences.size()) != n)
    throw Error(where + "sequences: expected one id per row of q (" + std::to_string(n) + "), got " +
                std::to_string(sequences.size()));
  for (std::size_t s = 0; s < sequences.size(); ++s) {
    const std::string name = where + "sequences[" + std::to_string(s) + "]: sequence " + std::to_string(sequences[s]);
    if (!cache.contains(sequences[s])) throw Error(name + " is not in the cache (released or never added)");
    const std::int64_t length = cache.length(sequences[s]);
    if (length < q_len)
      throw Error(name + " holds " + std::to_string(length) + " positions, fewer than q_len " + std::to_string(q_len) +
                  " (append the new tokens' keys and values before attending)");
  }
  const bool masks = options.key_padding_mask || !options.key_lengths.empty() || options.attn_mask;
  if (masks)
    throw Error(where +
                (options.attn_mask          ? "attn_mask"
                 : options.key_padding_mask ? "key_padding_mask"
                                            : "key_lengths") +
                ": not taken by decode (a sequence's keys are its cached positions: append only those it may see)");
  try {  // scale, window, ALiBi slopes [h], sinks [h] and softcap, in the logit dtype, as the prefill kernels take them
    validate_score(options, c.dtype, n, h, q_len, /*S: only the masks, refused above, would read it*/ 1);
  } catch (const Error& e) {
    throw Error(where + e.what());
  }
}

template <class T>
DecodeResult run(const TensorView& q, const PagedKVCache& cache, std::span<const PagedKVCache::SequenceId> sequences,
                 const DecodeOptions& options, DecodeMode mode) {
  using A = std::conditional_t<kQuantized<T>, float, compute_t<query_t<T>>>;
  const PagedKVCacheConfig& c = cache.config();
  DecodeParams<T, A> p;
  p.n = q.size(0), p.q_len = q.size(1), p.h = q.size(2), p.d_k = c.head_dim;
  p.h_kv = c.num_kv_heads, p.d_v = c.value_dim, p.page_size = c.page_size;
  p.q = static_cast<const query_t<T>*>(q.data());
  for (int d = 0; d < 4; ++d) p.q_stride[d] = q.stride(d);
  p.scale = static_cast<A>(options.scale.value_or(1.0 / std::sqrt(static_cast<double>(p.d_k))));
  p.causal = options.causal, p.window_left = options.window_left, p.window_right = options.window_right;
  p.alibi_slopes = per_head_values<A>(options.alibi_slopes);
  p.sinks = per_head_values<A>(options.sinks);
  p.softcap = static_cast<A>(options.softcap);
  for (PagedKVCache::SequenceId id : sequences) {
    p.lengths.push_back(cache.length(id));
    p.first_page.push_back(static_cast<std::int64_t>(p.k_pages.size()));
    for (std::int32_t page : cache.page_table(id)) {
      p.k_pages.push_back(static_cast<const T*>(cache.key_page(page)));
      p.v_pages.push_back(static_cast<const T*>(cache.value_page(page)));
      if constexpr (kQuantized<T>) {
        p.k_scale_pages.push_back(cache.key_scales(page));
        p.v_scale_pages.push_back(cache.value_scales(page));
      }
    }
  }
  DecodeResult result;
  result.out = Tensor::uninitialized(c.dtype, {p.n, p.q_len, p.h, p.d_v});
  p.out = static_cast<query_t<T>*>(result.out.data());
  if (options.need_lse) {
    result.lse = Tensor::uninitialized(dtype_of<A>(), {p.n, p.q_len, p.h});
    p.lse = static_cast<A*>(result.lse.data());
  }
  decode_attention_kernel(p, mode);
  return result;
}

}  // namespace

DecodeResult decode_attention_with_mode(const TensorView& q, const PagedKVCache& cache,
                                        std::span<const PagedKVCache::SequenceId> sequences,
                                        const DecodeOptions& options, DecodeMode mode) {
  const PagedKVCache::Hold hold = cache.read_hold();  // no writer until the kernel has read every page
  check_arguments(q, cache, sequences, options);
  const KVStorage storage = cache.config().storage;
  if (storage != KVStorage::Native) {  // float32 queries over int8 / float8 rows (bfloat16 ones widened first)
    Tensor widened;
    const TensorView q32 = q.dtype() == DType::Float32 ? q : (widened = Tensor::copy_of(q, DType::Float32)).view();
    return storage == KVStorage::Int8 ? run<std::int8_t>(q32, cache, sequences, options, mode)
                                      : run<Float8E4M3>(q32, cache, sequences, options, mode);
  }
  return dispatch_floating(q.dtype(),
                           [&](auto element) { return run<decltype(element)>(q, cache, sequences, options, mode); });
}

}  // namespace detail

DecodeResult decode_attention(const TensorView& q, const PagedKVCache& cache,
                              std::span<const PagedKVCache::SequenceId> sequences, const DecodeOptions& options) {
  return detail::decode_attention_with_mode(q, cache, sequences, options, detail::DecodeMode::GroupPacked);
}

}  // namespace mha
