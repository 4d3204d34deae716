/// \file
/// Attention over a packed batch of variable-length sequences: FlashAttention's flash_attn_varlen_func
/// layout and meaning. The n sequences of a batch lie one after another in the rows of q, k and v, with
/// no padding; cu_seqlens_q and cu_seqlens_k, the prefix sums of their lengths, say where each starts:
///
///     sequence i's queries are q's rows [cu_q[i], cu_q[i+1]),  L_i = cu_q[i+1] - cu_q[i]
///     sequence i's keys    are k's rows [cu_k[i], cu_k[i+1]),  S_i = cu_k[i+1] - cu_k[i]
///     out[cu_q[i] + r] = Attention(q_i, k_i, v_i)[r]           (sequence i attends to its own keys only)
///
/// The work is proportional to sum_i L_i S_i (nothing is padded to the longest sequence); each sequence
/// runs through the kernel of scaled_dot_product_attention (attention.hpp) on its rows, viewed in place.
///
/// Legend: n sequences, h query heads, h_kv key/value heads (h_kv dividing h: grouped-query attention as
/// in attention.hpp), total_q = sum_i L_i query rows, total_k = sum_i S_i key rows, d_k query/key width,
/// d_v value width.
///
/// Positions are per sequence: query r of sequence i sits at r' = r + S_i - L_i, so causal is
/// bottom-right aligned within each sequence (query r sees key j iff j <= r + S_i - L_i; with L_i > S_i
/// the first L_i - S_i queries see nothing), and the window and ALiBi's distance |r' - j| are measured
/// there too (score.hpp). The options' scale, causal, window, alibi_slopes, softcap, sinks, dropout and
/// need_lse apply as in scaled_dot_product_attention. attn_mask, key_padding_mask and key_lengths are
/// refused (mha::Error naming them): they are laid out over a [B, S] (or [L, S]) batch that a packed
/// batch does not have; so is need_weights (a packed batch's weights have no [B, h, L, S] layout).
///
/// Empty sequences are fine: L_i = 0 computes nothing; S_i = 0 gives that sequence's rows output 0 and
/// log-sum-exp -inf (sinks[head] with sinks), the library's rule for a row with no allowed key.
///
/// Dropout: weight (r, j) of head `head` in sequence i is dropped when the hash of scaled_dot_product_
/// attention (attention.hpp) at (dropout_seed, batch 0, head, cu_q[i] + r + dropout_query_offset,
/// cu_k[i] + j + dropout_key_offset) falls below dropout_p: each sequence draws its own mask, at its
/// packed positions (the mask one [1, h, total_q, total_k] call would draw on its diagonal blocks),
/// independent of the number of threads.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "mha/attention.hpp"

namespace mha {

/// cu_seqlens: the offsets of n sequences in packed rows, [n + 1] prefix sums of their lengths
/// (cu[0] = 0, non-decreasing, cu[n] = the number of packed rows), int32 (FlashAttention's) or int64.
/// A view of the caller's memory, like TensorView (the offsets must outlive it); mha::Error names the
/// argument when the offsets are not such prefix sums. C++ has no rank or dtype to get wrong here; the
/// Python binding refuses arrays of another dtype or rank by name.
class CuSeqlens {
 public:
  // Implicit, as a span is: a call takes the offsets as they are (a std::vector, a std::span).
  CuSeqlens(std::span<const std::int32_t> offsets) : int32_(offsets) {}
  CuSeqlens(std::span<const std::int64_t> offsets) : int64_(offsets), is_int64_(true) {}
  CuSeqlens(const std::vector<std::int32_t>& offsets) : CuSeqlens(std::span<const std::int32_t>(offsets)) {}
  CuSeqlens(const std::vector<std::int64_t>& offsets) : CuSeqlens(std::span<const std::int64_t>(offsets)) {}

  /// n + 1, the number of offsets.
  std::int64_t size() const { return static_cast<std::int64_t>(is_int64_ ? int64_.size() : int32_.size()); }
  /// Offset i (0 <= i < size()).
  std::int64_t operator[](std::int64_t i) const {
    const auto at = static_cast<std::size_t>(i);
    return is_int64_ ? int64_[at] : static_cast<std::int64_t>(int32_[at]);
  }

 private:
  std::span<const std::int32_t> int32_;
  std::span<const std::int64_t> int64_;
  bool is_int64_ = false;
};

struct VarlenResult {
  Tensor out;  ///< [total_q, h, d_v], q's dtype
  /// [h, total_q] when need_lse (FlashAttention's layout): log(sum_j exp(logit_j)) over each row's allowed
  /// keys of its sequence (and its sink), before dropout; float32 for bfloat16 q, else q's dtype
  Tensor lse;
};

/// q: [total_q, h, d_k], k: [total_k, h_kv, d_k], v: [total_k, h_kv, d_v] (h_kv dividing h), all float32,
/// all float64 or all bfloat16, any strides; cu_seqlens_q, cu_seqlens_k: [n + 1] each, the same n, ending
/// at total_q and total_k. Throws mha::Error on any invalid argument, naming it.
VarlenResult varlen_attention(const TensorView& q, const TensorView& k, const TensorView& v, CuSeqlens cu_seqlens_q,
                              CuSeqlens cu_seqlens_k, const AttentionOptions& options = {});

/// The backward of varlen_attention, scaled_dot_product_attention_backward's (attention.hpp) per
/// sequence: dout, out [total_q, h, d_v] and lse [h, total_q] (float32 for bfloat16 q) from a forward
/// with the same inputs and options (need_lse = true). Returns dq [total_q, h, d_k], dk [total_k, h_kv,
/// d_k] and dv [total_k, h_kv, d_v] (grouped heads summed over their group) in new tensors: nothing is
/// overwritten or accumulated into. Keys of a sequence without queries get zero gradients. Masks get no
/// gradient; sinks do: dsinks [h] in the sinks' dtype, summed over the sequences in order in float64.
AttentionGradients varlen_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                                             const TensorView& v, const TensorView& out, const TensorView& lse,
                                             CuSeqlens cu_seqlens_q, CuSeqlens cu_seqlens_k,
                                             const AttentionOptions& options = {});

}  // namespace mha
