/// \file
/// Sequence-parallel attention over the ranks of an MPI communicator: ring attention (Liu et al., 2023,
/// "Ring Attention with Blockwise Transformers for Near-Infinite Context"), exact, forward and backward.
/// An optional component: the CMake target mha::distributed, built when MPI is found; link it and
/// run under mpirun.
///
/// Legend: B batch, h heads, L queries and S keys of the whole sequence, L_r and S_r those rank r holds,
/// d_k query/key width, d_v value width, P ranks.
///
/// Each rank holds one shard of the sequence: its query rows and its key/value rows. The key/value
/// shards travel around the ring (rank r sends to r + 1 and receives from r - 1), the next transfer
/// overlapped with the current block's compute, and each rank merges its partial results by their
/// log-sum-exp. The result is the single-process one (same rule as the kernels' parity with the
/// reference: only the order of the additions differs), and bitwise the same on every run for a given
/// number of ranks and threads.
///
/// Layouts. The sequence (of L rows for q, of S rows for k and v) is cut into chunks of nearly equal
/// length (the first n % C chunks one row longer):
///   - Layout::Contiguous: P chunks, rank r holds chunk r;
///   - Layout::Zigzag: 2P chunks, rank r holds chunk r followed by chunk 2P - 1 - r. With causal
///     attention a plain split leaves the first ranks idle (their queries see few keys); zigzag gives
///     every rank one early and one late chunk, so each does nearly the same work.
/// shard_chunks() says which rows a rank holds; shard_sequence() and unshard_sequence() cut and join.
///
/// The score across shards (RingOptions is a ScoreSpec, mha/score.hpp): positions are those of the
/// whole sequence, query i at i' = i + S - L as in one call, so causal (needs L == S), the sliding
/// window and ALiBi's distances are the single-process ones; key padding (each rank passes the mask of
/// its own keys; it travels with them), key lengths (over the whole sequence, the same on every rank),
/// softcap, sinks and dropout (drawn at global positions, so the mask equals the single-process one).
/// Key chunks wholly outside a query chunk's causal or window reach are skipped. A per-position
/// attn_mask would need L_r x S memory per rank and is refused, as is a float key_padding_mask.
///
/// Errors: every rank first checks its arguments, then one small collective (an allgather of each
/// rank's sizes, options and error) runs before any exchange, so inconsistent shapes, dtypes or options
/// across ranks, or a bad argument on any rank, make every rank throw the same mha::Error naming the
/// rank. All ranks of the communicator must make the call. After that point only a failure of the
/// machine (memory, the network) can stop a rank; MPI's default handler then ends the job.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "mha/attention.hpp"
#include "mha/error.hpp"
#include "mha/multi_head_attention.hpp"
#include "mha/score.hpp"
#include "mha/tensor.hpp"

namespace mha::distributed {

/// How a sequence is cut among the ranks (see above).
enum class Layout { Contiguous, Zigzag };

/// Rows [start, start + length) of the whole sequence.
struct SequenceChunk {
  std::int64_t start = 0;
  std::int64_t length = 0;
  bool operator==(const SequenceChunk&) const = default;
};

/// The chunks of a sequence of n rows that rank `rank` of `ranks` holds, in the order its shard stores
/// them (one chunk for Contiguous, two for Zigzag). Throws mha::Error unless n >= 0 and
/// 0 <= rank < ranks.
std::vector<SequenceChunk> shard_chunks(std::int64_t n, int ranks, int rank, Layout layout);

/// Rank `rank`'s shard of `full` along dimension `dim`: the rows of shard_chunks(full.size(dim), ...),
/// concatenated, in a new contiguous tensor.
Tensor shard_sequence(const TensorView& full, std::int64_t dim, int ranks, int rank, Layout layout);

/// The whole sequence from every rank's shard (shards[r] is rank r's) along dimension `dim`: the
/// inverse of shard_sequence. The shards must agree in every other dimension and in dtype.
Tensor unshard_sequence(const std::vector<TensorView>& shards, std::int64_t dim, Layout layout);

/// The score (ScoreSpec: scale, causal, key_padding_mask, key_lengths, window, ALiBi, softcap, sinks) over
/// the whole sequence, and what concerns the ring call. Every rank must pass the same options (the key
/// padding mask excepted: its own keys'); the agreement compares them, slopes and sinks by a digest.
///   - causal: over the whole sequence; needs L == S.
///   - key_padding_mask: bool [B, S_r], this rank's keys, true = padding (a float one is refused).
///   - key_lengths: B lengths in [0, S] over the whole sequence.
///   - attn_mask: refused (not taken across ranks).
///   - window_left / window_right, alibi_slopes [h], softcap: as in one call over the whole sequence.
///   - sinks [h]: each row's sink joins its softmax once, after the ring's last merge. The backward then
///     also returns dsinks [h], the same on every rank: each rank's rows summed in float64, the ranks'
///     sums added in rank order.
struct RingOptions : ScoreSpec {
  Layout layout = Layout::Zigzag;
  double dropout_p = 0.0;  ///< in [0, 1); the mask of the single-process call
  std::uint64_t dropout_seed = 0;
  Kernel kernel = Kernel::Flash;  ///< the kernel each block runs (float64 always runs the reference)
};

struct RingResult {
  Tensor out;  ///< [B, h, L_r, d_v]: this rank's rows of the output
  Tensor lse;  ///< [B, h, L_r]: their log-sum-exp over every key of the sequence (for the backward)
};

/// q: [B, h, L_r, d_k], k: [B, h, S_r, d_k], v: [B, h, S_r, d_v] on rank r, float32 or float64, any
/// strides; L_r and S_r as the layout prescribes for L = sum of L_r and S = sum of S_r. Collective over
/// comm. Throws mha::Error (on every rank) on invalid or inconsistent arguments.
RingResult ring_attention(const TensorView& q, const TensorView& k, const TensorView& v, MPI_Comm comm,
                          const RingOptions& options = {});

/// The backward of ring_attention: dout and out [B, h, L_r, d_v], lse [B, h, L_r] from the forward with
/// the same arguments. dK and dV travel around the ring with their K and V, each rank adding its part;
/// dQ stays local. Returns this rank's dq [B, h, L_r, d_k], dk [B, h, S_r, d_k], dv [B, h, S_r, d_v].
AttentionGradients ring_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                                           const TensorView& v, const TensorView& out, const TensorView& lse,
                                           MPI_Comm comm, const RingOptions& options = {});

/// What a sequence-sharded layer call takes besides its inputs (see RingMultiHeadAttention).
struct RingLayerInputs {
  std::optional<TensorView> key_padding_mask;  ///< bool [B, S_r]: this rank's keys, true = padding
  std::vector<std::int64_t> key_lengths;       ///< B lengths in [0, S] over the whole sequence
  bool causal = false;                         ///< over the whole sequence; needs L == S
  std::uint64_t dropout_seed = 0;              ///< keys the attention dropout (config().dropout, training mode only)
};

/// A MultiHeadAttention layer run over sequence-sharded inputs: the projections of each rank's rows
/// locally, the attention core over the ring (ring_attention), the parameter gradients summed over the
/// ranks in rank order (every rank gets the same sums, bitwise equal from run to run).
///
/// It uses the wrapped layer's parameters and configuration as they are at each call (so an optimizer
/// may update them between steps; every rank must hold the same values, as with data parallelism).
/// Inputs are batched: query [B, L_r, E] (batch_first) or [L_r, B, E], key [B, S_r, kdim] and value
/// [B, S_r, vdim] likewise, of the layer's dtype, L_r and S_r as the layout cuts L and S. Not offered
/// across shards: add_bias_kv and add_zero_attn (one extra key for the whole sequence), attn_mask
/// (O(L_r S) memory per rank) and the attention weights (O(L_r S)). The layer's dropout applies in
/// training mode, drawn at global positions from RingLayerInputs::dropout_seed. A rotary layer
/// (rotary_dim > 0) rotates each rank's query and key rows at their positions in the whole sequence
/// (query i at i + S - L, key j at j, the rows of both zigzag chunks each at its own), as the
/// single-process layer does; explicit rotary positions are not taken. The layer's configuration,
/// like its parameters, must be the same on every rank.
class RingMultiHeadAttention {
 public:
  RingMultiHeadAttention(MultiHeadAttention& layer, MPI_Comm comm, Layout layout = Layout::Zigzag);
  ~RingMultiHeadAttention();
  RingMultiHeadAttention(RingMultiHeadAttention&&) noexcept;
  RingMultiHeadAttention& operator=(RingMultiHeadAttention&&) noexcept;

  /// This rank's rows of the layer's output, shaped like query. In training mode it keeps what
  /// backward() needs. Collective; throws mha::Error (on every rank) on invalid or inconsistent input.
  Tensor forward(const TensorView& query, const TensorView& key, const TensorView& value,
                 const RingLayerInputs& inputs = {});

  /// Gradients of the last training-mode forward given dout (shaped like its output): query, key and
  /// value of this rank's rows, and every parameter's gradient summed over all ranks. Collective.
  MultiHeadAttentionGradients backward(const TensorView& dout);

  struct Saved;  ///< what a training-mode forward keeps (ring_layer.cpp)

 private:
  MultiHeadAttention* layer_;
  MPI_Comm comm_;
  Layout layout_;
  std::unique_ptr<Saved> saved_;
};

}  // namespace mha::distributed
