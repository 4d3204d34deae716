/// \file
/// Scaled dot-product attention (Vaswani et al., 2017, section 3.2.1):
///
///     Attention(Q, K, V) = softmax(Q K^T * scale + mask) V,   scale = 1 / sqrt(d_k) by default
///
/// Legend: B batch, h (query) heads, h_kv key/value heads, L queries, S keys, d_k query/key width, d_v
/// value width.
///
/// Grouped-query attention (Ainslie et al., 2023): k and v may have fewer heads than q, h_kv dividing
/// h; query head i attends with key/value head i / (h / h_kv) (h_kv = 1 is multi-query attention,
/// Shazeer 2019; h_kv = h is the paper's multi-head attention). The gradients of k and v then sum the
/// contributions of their group's query heads, in a fixed order. The fused kernel takes each K/V
/// block through all the query heads of its group while it is in cache.
///
/// Masking rules (PyTorch's nn.MultiheadAttention conventions):
///   - a boolean mask element `true` means "may not attend" (the logit becomes -inf);
///   - a float attn_mask is added to the logits (use -inf to forbid a position);
///   - key padding (boolean [B, S], true = padding, or per-batch lengths) forbids whole key columns; a
///     float key_padding_mask [B, S] is added to every logit of its key (-inf forbids), at O(B S)
///     memory. It adds to a float attn_mask and combines with a bool attn_mask like any two masks.
///     (PyTorch 1.13 reads a float key_padding_mask as boolean, nonzero = padding, when attn_mask is
///     bool, and refuses it with a float attn_mask; we add it in every case.)
///   - causal is bottom-right aligned: query i may attend to key j only when j <= i + S - L, so with
///     L == S it is the usual lower triangle and with L < S (decoding after a prefix) the last query
///     sees every key; with L > S the first L - S queries see nothing;
///   - all masks combine: a position is allowed only if every mask allows it; additive values add.
///
/// A query row whose keys are all forbidden attends to nothing: its output row and its weights are 0
/// and its log-sum-exp is -inf. (PyTorch 1.13 returns NaN there; we return a defined result.)
/// Masked keys are never read, so NaN or Inf stored at a masked position cannot reach any output.
///
/// NaN and Inf (both kernels, forward and backward, every mask kind): a NaN or Inf in a query row, in
/// an allowed key or value, or in an allowed additive mask entry reaches exactly the outputs and
/// gradients that depend on it, never as a finite number: the row's output, weights (at its allowed
/// keys) and log-sum-exp become non-finite, other rows are unchanged. Logits that overflow to +inf
/// give NaN rows likewise. IEEE arithmetic decides the corner cases: a logit of -inf (an infinite key
/// component against the sign of q's) is weight 0, so that row's output stays finite, as in PyTorch;
/// a row whose allowed logits are all -inf is 0 / 0, NaN. A forbidden key's weight is exactly 0 and its
/// gradients stay 0 whatever the row holds; only a row with no allowed key gets output 0, weights 0
/// and log-sum-exp -inf.
///
/// Sizes: B, h, L, S and d_v may be 0 (the results are then empty or, for S = 0, zero); d_k >= 1.
/// key_padding_mask and key_lengths may be given together (both apply).
/// A float attn_mask must have q's dtype (MultiHeadAttention converts the other float dtype for you);
/// with bfloat16 q it may also be float32, the dtype the logits are computed in.
///
/// The numbers a logit is formed with, scale, softcap and the ALiBi slopes, must each be 0 or a normal
/// finite number of the dtype the logits are computed in: float32 for float32 and bfloat16 inputs
/// (magnitude in [1.1754944e-38, 3.4028235e+38]), float64 for float64 inputs (magnitude in
/// [2.2250738585072014e-308, 1.7976931348623157e+308]); softcap is also >= 0, scale and slopes may be
/// negative. Anything else (NaN, Inf, 1e39 or 1e-40 for float32, a subnormal float64) throws mha::Error
/// naming the argument and the range: converted to float32, 1e39 would be inf (every output NaN where the
/// float64 result is finite) and softcap 5e-324 would be 0, "none". Within the range, a logit that
/// overflows still follows the NaN and Inf rules above (scale 1e38 with q . k = 10 gives +inf logits).
///
/// bfloat16 (DType::BFloat16): q, k, v, out, weights and the gradients are bfloat16; the log-sum-exp is
/// float32 (and the backward takes it as float32). Both products of a tile take bfloat16 operands with
/// float32 accumulation; the online softmax, its reference (the row's running max, moved only when a
/// logit exceeds it by more than 8, so P is at most e^8 before normalisation) and sum and the output
/// accumulator are float32; P is rounded to bfloat16 for the P V product and dS for the backward's products, as
/// FlashAttention does (to nearest even; where the CPU has AVX512-BF16 by its conversion instruction,
/// which rounds a subnormal P or dS, below 2^-126, to zero); each result is rounded to bfloat16 once. The
/// softmax's exp is evaluated to 4e-7 relative (float32 kernels: within 2 ULP), which keeps the
/// log-sum-exp within the float32 rule and P far below its rounding to bfloat16 (2^-9). The reference
/// kernel computes bfloat16 in float32 (inputs widened exactly, results rounded once).
///
/// The bfloat16 products run on one of two paths, chosen once per process by which ran faster at first use
/// (the kernels' tiles timed for a few ms on one thread): oneDNN's matmul primitive on the CPU's bf16
/// instructions (AMX or AVX512-BF16), or sgemm over the operands widened exactly to float32 (always,
/// without bf16 instructions). `mha bench --dtype bf16` prints which and why; the environment variable
/// MHA_BF16_GEMM=onednn|sgemm|auto forces one (another value is ignored, with a message on stderr). The
/// two paths round differently. On the sgemm path the fused kernel computes bfloat16 attention as the
/// reference does: q, k, v (and the backward's out and dout) widened once per call, the float32 kernel
/// run on them, each result rounded to bfloat16 once; P and dS stay float32 (more accurate than rounding
/// them, and faster there than widening every tile's operands again) and the exp is the float32 kernels'. The layer's
/// projections on that path widen their operands and round each product's result once, as on the other. Beyond that the
/// paths sum the float32 products in different orders, and the bf16 instructions treat subnormal inputs and results as
/// zero (measured with AMX) where sgemm keeps them. So a bfloat16 result can differ between the paths by a unit in its
/// last place or more (P rounded or not); both stay within the bfloat16 error rule, and a process's results are bitwise
/// the same for every thread count; for results bitwise the same from one process to the next, set MHA_BF16_GEMM (a
/// measured choice is stable while one path is clearly faster: oneDNN is kept unless sgemm is over 10% faster).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "mha/score.hpp"
#include "mha/tensor.hpp"

namespace mha {

/// Which implementation computes the attention core.
enum class Kernel {
  Flash,      ///< src/attention/flash_*.cpp: FlashAttention-2, tiled, O(L + S) extra memory; float32
              ///< and bfloat16 (float64 inputs run the reference: float64 is the verification dtype)
  Reference,  ///< src/attention/reference.cpp: plain loops, the specification
};

/// The score's description (mha/score.hpp: scale, causal, masks, key lengths, window, ALiBi, softcap)
/// and what concerns one call: dropout, the results to return, the kernel. A ScoreSpec and its fields
/// are set as members (`o.causal = true`) or by aggregate initialisation of the base:
/// `AttentionOptions{{.causal = true}}`.
struct AttentionOptions : ScoreSpec {
  double dropout_p = 0.0;          ///< probability of zeroing a weight, in [0, 1)
  std::uint64_t dropout_seed = 0;  ///< keys the counter-based dropout mask
  /// Positions of q's first row and k's first row in the whole sequence (>= 0), used only by dropout's
  /// hash: a shard of a longer sequence (mha::distributed) draws the mask the whole sequence would.
  std::int64_t dropout_query_offset = 0;
  std::int64_t dropout_key_offset = 0;  ///< see dropout_query_offset
  bool need_weights = false;            ///< return the probabilities [B, h, L, S]
  bool need_lse = false;                ///< return the log-sum-exp of each row [B, h, L]
  Kernel kernel = Kernel::Flash;
};

struct AttentionResult {
  Tensor out;      ///< [B, h, L, d_v]
  Tensor weights;  ///< [B, h, L, S] when need_weights (after dropout, as PyTorch returns them), else undefined
  Tensor lse;      ///< [B, h, L] when need_lse: log(sum_j exp(logit_j)) over allowed keys, before dropout
};

/// q: [B, h, L, d_k], k: [B, h_kv, S, d_k], v: [B, h_kv, S, d_v] (h_kv dividing h), all float32, all
/// float64 or all bfloat16, any strides.
/// Dropout (dropout_p > 0) zeroes weight (b, h, i, j) when a hash of (dropout_seed, b, h,
/// i + dropout_query_offset, j + dropout_key_offset) falls
/// below dropout_p and scales the kept ones by 1 / (1 - dropout_p); the result does not depend on the
/// number of threads. The fused kernel's blocks hold 128 query rows, or 256 where a core has at least 2 MiB
/// of L2 (faster there; MHA_QUERY_BLOCK=128|256 forces one): the backward's sums over query blocks, and so
/// the last bits of dK and dV, differ between the two, both within the rules. Throws mha::Error on any
/// invalid argument.
AttentionResult scaled_dot_product_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                                             const AttentionOptions& options = {});

struct AttentionGradients {
  Tensor dq;  ///< [B, h, L, d_k]
  Tensor dk;  ///< [B, h_kv, S, d_k]: for grouped heads, summed over each group's query heads
  Tensor dv;  ///< [B, h_kv, S, d_v], likewise
  /// [h] when options.sinks is given, in the sinks' dtype: -sum over b and i of
  /// exp(sinks[head] - lse) * (dout . out), summed in float64 in the order b, then i
  Tensor dsinks{};
};

/// The backward of scaled_dot_product_attention (Vaswani et al., in FlashAttention-2's formulation):
///
///     D = rowsum(dO * O);  P recomputed from q, k and lse;  dV = P^T dO;  dP = dO V^T;
///     dS = P * (dP - D);   dQ = dS K * scale;  dK = dS^T Q * scale
///
/// with dropout's mask regenerated from options.dropout_seed. dout and out: [B, h, L, d_v], lse:
/// [B, h, L] (float32 for bfloat16 q), from a forward with the same q, k, v and options (need_lse = true). The
/// gradients are returned in new tensors (they overwrite nothing and accumulate into nothing). Masks get no gradient;
/// sinks do (dsinks).
AttentionGradients scaled_dot_product_attention_backward(const TensorView& dout, const TensorView& q,
                                                         const TensorView& k, const TensorView& v,
                                                         const TensorView& out, const TensorView& lse,
                                                         const AttentionOptions& options = {});

/// Sets the number of OpenMP threads the library's calls made **from the calling thread** use, in
/// [1, max_num_threads()]; throws mha::Error naming the value and the bound otherwise (and changes
/// nothing).
///
/// Scope: this is OpenMP's per-thread count (the nthreads-var ICV, omp_set_num_threads), so it holds
/// for the calling thread only, silently: a call from another thread (a std::thread, a Python
/// threading.Thread) runs with that thread's own count, which starts at OpenMP's default
/// (OMP_NUM_THREADS, else one per core) whatever was set here, and setting it there leaves this
/// thread's alone. It is also the count of any other OpenMP code the calling thread runs (OpenMP has
/// one count per thread, not one per library). Call it from each thread that calls the library when
/// the default does not suit.
void set_num_threads(int threads);
/// The count the calling thread's library calls use (OpenMP's omp_get_max_threads()).
int num_threads();
/// The largest count set_num_threads() accepts: max(64, 4 x the cores std::thread reports). Each
/// OpenMP thread costs a stack (8 MiB reserved by default) and the kernels a workspace per thread,
/// and beyond a few threads per core nothing runs faster, so a larger count only risks the process:
/// 100000 made libgomp crash, 1000 under a memory limit made it abort. 64 whatever the machine, so
/// that a program which fixes a count for reproducible timing (such as 16) runs anywhere.
int max_num_threads();

}  // namespace mha
