/// \file
/// Decoding attention over a PagedKVCache: each sequence's few new queries attend to that sequence's
/// cached keys and values, read through its page table (no gather), for a whole batch of sequences of
/// different lengths at once.
///
///     out[s, i, head] = softmax_j(scale q[s, i, head] . k_j) v_j   over positions j <= T_s - q_len + i
///
/// (causal, the default; DecodeOptions below takes the score's other variants)
///
/// Legend: n sequences, q_len new queries per sequence, h query heads, h_kv key/value heads, d_k key
/// width, d_v value width, T_s the length of sequence s.
///
/// The last q_len positions a sequence holds are its new tokens themselves (append them first): query
/// i sees the positions up to and including its own, T_s - q_len + i, as a causal forward over the
/// whole sequence would (bottom-right aligned). q_len 1 is greedy decoding; a few are speculative
/// decoding or a chunk of a prefill.
///
/// Grouped-query attention: h must be a multiple of h_kv, and query head i uses key/value head
/// i / (h / h_kv) (h_kv = 1 is multi-query attention, h_kv = h plain multi-head attention).
///
/// How it runs (flash-decoding): each sequence's positions are split into chunks of whole pages, the
/// chunk size chosen from the sequence's length and the page size alone; a work item is one chunk of one
/// sequence, and computes, for each key/value head in turn (reading each page's keys and values in
/// address order) and the h / h_kv query heads that share it, the softmax's partial max, sum and
/// unnormalised output over its chunk, so each key/value byte is read once per group. The partials are
/// then merged by log-sum-exp in a fixed order. So a sequence's result is bitwise the same whatever the
/// thread count and whatever else is in the batch.
///
/// int8 caches on CPUs with AMX-INT8 (where Linux grants the tile state), with two or more query rows per
/// key/value head (h / h_kv times q_len): the products run on AMX tiles, the query rows rounded at 30 bits
/// and each block's weights at 31 bits as exact integer digits, the sums combined in float32; elsewhere
/// (plain multi-head attention with one new query too, where the vectors were faster), and for rows the
/// tiles cannot represent (not finite, or largest magnitude outside [2^-60, 2^60]), float32 vectors widen
/// the payloads. Both compute attention over the dequantized cache within float32's accuracy, not bitwise
/// alike: a process's results stay the same for every thread count and batch; MHA_DECODE_AMX=off makes
/// the vectors run everywhere. float8 caches run on the vectors on every CPU: on AMX-BF16 (bfloat16 holds
/// every e4m3 value) the widening into the tiles' layout through memory cost what the tiles saved, and
/// the step was slower (docs/PERFORMANCE.md).
///
/// Page size: float32 and bfloat16 pages of 16 and of 128 tokens decode about equally fast (measured on a
/// Zen 3); int8 and float8 pages of 16 tokens (a kv head's rows of one page are then 2 KiB at d 128)
/// decode 4-15% slower from memory than pages of 32 or more (measured on an Intel Xeon, AMX tiles or not;
/// see docs/PERFORMANCE.md). Smaller pages waste less memory per sequence and copy less on a write after
/// fork().
///
/// While it computes one block of positions the kernel prefetches the next into the L1 or the L2 cache,
/// whichever the processor reads faster from memory (the L2 on AMD family 25, the L1 elsewhere:
/// measured in docs/PERFORMANCE.md); MHA_DECODE_PREFETCH=l1|l2 forces one. Results do not depend on it.
///
/// dtypes: q has the cache's dtype. float32 and bfloat16 compute in float32 (bfloat16 keys and values
/// are widened exactly; each result is rounded to bfloat16 once); float64 computes in float64.
///
/// NaN and Inf: a NaN or Inf in a query, or in a key or value a query may see, reaches exactly that
/// query's outputs (as in scaled_dot_product_attention); nothing reaches other queries or sequences.
/// A value whose weight is exactly 0 is not read. A query whose visible logits are all -inf gets NaN
/// (0 / 0), as scaled_dot_product_attention does.
#pragma once

#if __cplusplus < 202002L
#error "mha needs C++20 (std::span): compile with -std=c++20 or later"
#endif

#include <optional>
#include <span>

#include "mha/paged_kv_cache.hpp"
#include "mha/score.hpp"
#include "mha/tensor.hpp"

namespace mha {

/// The score (mha/score.hpp) of a decode step, and whether to return each query's log-sum-exp.
/// Positions are the sequence's own: query i of sequence s sits at i' = T_s - q_len + i (the last q_len
/// positions are the new tokens). causal, the default here, lets query i see positions <= i' (false: all
/// T_s); window, ALiBi and softcap act as in scaled_dot_product_attention over those positions, and a
/// chunk of positions wholly before every query's window is not read. scale, softcap and the slopes must
/// be 0 or normal numbers of the logit dtype (float32 for float32 and bfloat16 caches, float64 for
/// float64), as attention.hpp says: 1e300 would be inf in float32 and every output NaN. The masks
/// (key_padding_mask, key_lengths, attn_mask) are refused: a sequence's keys are its cached positions.
struct DecodeOptions : ScoreSpec {
  DecodeOptions() { causal = true; }
  bool need_lse = false;  ///< also return each query's log-sum-exp
};

struct DecodeResult {
  Tensor out;  ///< [n, q_len, h, d_v], q's dtype
  Tensor lse;  ///< [n, q_len, h] when need_lse (float32 for bfloat16, else q's dtype), else undefined
};

/// q: [n, q_len, h, d_k] of the cache's dtype, any strides; `sequences`: n ids of sequences in the
/// cache (an id may appear more than once), each holding at least q_len positions. Returns out
/// [n, q_len, h, d_v]: row s attends to sequences[s]. Throws mha::Error, naming the argument, for an
/// unknown or released sequence, q of the wrong rank, dtype or width, h not a multiple of h_kv, n not
/// the number of ids, q_len 0 or longer than a sequence, n 0, or a scale outside the range above.
DecodeResult decode_attention(const TensorView& q, const PagedKVCache& cache,
                              std::span<const PagedKVCache::SequenceId> sequences, const DecodeOptions& options = {});

}  // namespace mha
