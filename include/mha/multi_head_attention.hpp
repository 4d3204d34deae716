/// \file
/// Multi-head attention (Vaswani et al., 2017, section 3.2.2):
///
///     MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O
///     head_i             = Attention(Q W_i^Q, K W_i^K, V W_i^V)
///
/// Legend: B batch, L queries, S keys, E = d_model, h heads, d_k, d_v per-head widths,
/// kdim / vdim the widths of the key and value inputs (E unless set).
///
/// Parameters carry PyTorch's nn.MultiheadAttention names and layouts (y = x W^T + b):
///
///     in_proj_weight [2*h*d_k + h*d_v, E]   when kdim == vdim == E and d_k == d_v (rows: q, k, v)
///     q_proj_weight [h*d_k, E], k_proj_weight [h*d_k, kdim], v_proj_weight [h*d_v, vdim]   otherwise
///     in_proj_bias [2*h*d_k + h*d_v]        when bias
///     bias_k [1, 1, h*d_k], bias_v [1, 1, h*d_v]   when add_bias_kv
///     out_proj.weight [E, h*d_v], out_proj.bias [E]  (bias when bias)
///
/// Unlike PyTorch, d_k and d_v are free: h*d_k need not equal E and d_k need not equal d_v.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "mha/attention.hpp"
#include "mha/paged_kv_cache.hpp"
#include "mha/rotary.hpp"
#include "mha/score.hpp"
#include "mha/tensor.hpp"

namespace mha {

struct MultiHeadAttentionConfig {
  std::int64_t d_model = 0;    ///< E
  std::int64_t num_heads = 0;  ///< h
  /// h_kv key/value heads, dividing h (grouped-query attention: query head i attends with key/value
  /// head i / (h / h_kv); 1 is multi-query attention); 0: num_heads, the paper's multi-head attention.
  /// W^K and W^V then project to h_kv d_k and h_kv d_v: the layer keeps them as k_proj_weight and
  /// v_proj_weight (never packed into in_proj_weight), in_proj_bias is [h d_k + h_kv d_k + h_kv d_v].
  std::int64_t num_kv_heads = 0;
  std::int64_t d_k = 0;        ///< 0: d_model / num_heads
  std::int64_t d_v = 0;        ///< 0: d_model / num_heads
  std::int64_t kdim = 0;       ///< 0: d_model
  std::int64_t vdim = 0;       ///< 0: d_model
  bool bias = true;            ///< in_proj_bias and out_proj.bias
  bool add_bias_kv = false;    ///< learned bias_k, bias_v appended as one more key/value position
  bool add_zero_attn = false;  ///< a zero key/value position appended (after bias_k/bias_v)
  double dropout = 0.0;        ///< dropout on the attention weights in training mode, in [0, 1)
  /// Learned attention sinks (mha/score.hpp): a parameter `sinks` [h], initialised to 0, one logit per
  /// head that joins every row's softmax with no value; trained like the other parameters (backward
  /// returns its gradient under "sinks"), saved and loaded with them. Used by forward, forward_cached
  /// and forward_paged; the inputs' own ScoreSpec::sinks is then refused (the layer's are its parameter).
  bool sinks = false;
  /// Rotary position embeddings (mha/rotary.hpp) of every query and key head, after the projection and
  /// in the layer's compute dtype (angles and their cos and sin in float64): rotary_dim > 0 rotates the
  /// first rotary_dim components of each head (even, <= d_k); 0, the default, none. Positions are the
  /// sequence's: key j at j, query i at i + S - L (the layer's bottom-right alignment; 0..L-1 for
  /// self-attention), the caches' new positions at their index in their sequence (forward_cached and
  /// forward_paged store keys already rotated). Not with add_bias_kv / add_zero_attn (their appended
  /// positions have no place in the sequence).
  std::int64_t rotary_dim = 0;
  double rotary_base = 10000.0;     ///< inv_freq_i = rotary_base^(-2i / rotary_dim); finite and > 0
  bool rotary_interleaved = false;  ///< pairs (2i, 2i + 1) (GPT-J); else (i, i + rotary_dim / 2) (GPT-NeoX, Llama)
  bool batch_first = true;          ///< inputs [B, L, E]; false: [L, B, E] (PyTorch's default)
  /// Float32, Float64 or BFloat16 (parameters, activations and gradients in bfloat16; products
  /// accumulate in float32, biases are added and sums taken in float32, results rounded once; float
  /// masks are kept in float32)
  DType dtype = DType::Float32;
};

/// The score's description (mha/score.hpp) over the S input keys, converted once into the kernel's
/// terms by the layer, and what concerns a layer call alone. Masks and causal concern the S input keys;
/// the positions appended by add_bias_kv / add_zero_attn are visible to every query (PyTorch pads its
/// masks with "allowed" there); key_padding_mask is [S] for unbatched inputs. A window over the S input
/// keys, ALiBi slopes [h] and soft-capping apply to forward, backward and forward_cached (whose positions
/// are the cache's); a layer with add_bias_kv / add_zero_attn refuses the window and ALiBi (its appended
/// positions have no place in the sequence); soft-capping applies to every logit. scale, softcap and each
/// slope must be 0 or a normal number of the layer's logit dtype (float32 for float32 and bfloat16
/// layers, float64 for float64), as attention.hpp says; others throw mha::Error naming them. Inputs may
/// have any non-negative strides.
struct MultiHeadAttentionInputs : ScoreSpec {
  bool need_weights = true;
  bool average_attn_weights = true;
  /// Training mode: backward() reads the caller's query, key and value instead of copies of them.
  /// Contract: the memory they view stays allocated and unmodified from forward() until the last
  /// backward() of that forward returns (the layer holds the views until its next forward()). A
  /// modified input is detected: the forward takes a 64-bit fingerprint of each borrowed input and
  /// backward() recomputes it, throwing mha::Error ("query changed between forward and backward;
  /// ...") rather than returning wrong gradients. Freed memory cannot be detected (undefined
  /// behaviour). An input with gaps between its rows (not contiguous) is still copied, since the
  /// products read plain rows. Default false: the layer keeps copies and the caller's arrays are
  /// free once forward() returns. Either way, inputs that are one array (same data, dtype, shape and
  /// strides: self-attention, or key is value) are kept once, not once per role.
  bool borrow_inputs = false;
  /// Per-head gate g: multiplies head i's attention output (head_i = softmax(...) V_i, [L, d_v]) before
  /// the concatenation that W^O projects, out = Concat(g_1 head_1, ..., g_h head_h) W^O + b_O. Shape [h]
  /// (one gate for every batch) or [B, h]; unbatched inputs take [h] only. Float32 or float64, converted
  /// to the layer's compute dtype (float32 for a bfloat16 layer); any strides; read during the call
  /// (the layer keeps its own copy for backward()). A gate of 0 removes that head's contribution (the
  /// head ablation of Michel et al. 2019); any value is allowed, and NaN or Inf propagate as the
  /// product says. The returned attention weights are not gated. Taken by forward() (a training-mode
  /// backward() then also returns dLoss/dg) and forward_cached(). Not given: no extra work; a gate of
  /// ones gives bitwise the results of no gate.
  std::optional<TensorView> head_gate{};
  /// Packed sequences (FlashAttention's varlen layout, mha/varlen.hpp): unbatched query [L_total, E] and
  /// key / value [S_total, *] holding n sequences one after another; cu_seqlens [n + 1] (prefix sums from
  /// 0 to L_total) says where each sequence's queries start, cu_seqlens_k where its keys start (empty:
  /// cu_seqlens again, self-attention). Sequence i attends only to its own keys, causal and window
  /// bottom-right aligned within it, and rotary positions count from 0 in each sequence; nothing is
  /// padded. forward and backward only (not forward_cached / forward_paged); masks over a [B, S] batch,
  /// add_bias_kv and add_zero_attn are refused; no weights are returned (need_weights is ignored: a
  /// packed batch's weights have no [L, S] layout).
  std::vector<std::int64_t> cu_seqlens{};
  std::vector<std::int64_t> cu_seqlens_k{};  ///< see cu_seqlens
  /// Explicit rotary positions (a layer with rotary_dim > 0), for left-padded batches: query row i of
  /// batch b is rotated at positions[b, i] ([B, L]) or positions[i] ([L], every batch row alike; unbatched
  /// inputs take [L] or [1, L]); integers >= 0, int64 or int32. nullopt, the default: query i at
  /// i + S - L. A view read during the call (the layer keeps its own copy for backward()).
  std::optional<PositionsView> positions{};
  /// The keys' rotary positions, [B, S] or [S] as positions. nullopt: key j at j without positions; with
  /// them, positions again when S = L (self-attention), refused when S != L (give both); key_positions
  /// without positions are refused too. forward() only: forward_cached and forward_paged place each
  /// position at its index in its sequence, and packed sequences (cu_seqlens) count from 0 in each; there
  /// both are refused, as they are without rotary_dim.
  std::optional<PositionsView> key_positions{};
  /// The dropout seed of this call (a training-mode forward with config.dropout > 0): the mask is the
  /// counter-based one of mha/attention.hpp keyed by it, and backward() regenerates it. nullopt, the
  /// default: the layer's own stream (from its construction seed, a new seed per call). Given, the call
  /// does not advance that stream: mha.torch draws it from torch's generator, so torch.manual_seed
  /// repeats a call's mask whichever layer object runs it.
  std::optional<std::uint64_t> dropout_seed{};
};

struct MultiHeadAttentionOutput {
  Tensor out;      ///< like query: [B, L, E], [L, B, E] or [L, E]
  Tensor weights;  ///< when need_weights: [B, L, S'] averaged or [B, h, L, S'] per head ([L, S'] /
                   ///< [h, L, S'] unbatched); S' = S + add_bias_kv + add_zero_attn
};

struct MultiHeadAttentionGradients {
  Tensor query, key, value;                  ///< shaped like the forward's inputs
  std::map<std::string, Tensor> parameters;  ///< by parameter name, shaped like the parameters
  /// dLoss/dg when the forward had a head_gate (else undefined), shaped like the gate and of its dtype:
  /// dLoss/dg_i = sum over (b, l, c) of dConcat[b, l, i*d_v + c] head_i[b, l, c] (a [B, h] gate: not
  /// summed over b), the head-importance score of Michel et al. 2019 ("Are Sixteen Heads Really
  /// Better than One?"). Summed in float64 in a fixed order (the same for any thread count).
  Tensor head_gate;
};

namespace detail {
struct SavedForward;  // what a training-mode forward keeps for backward()
class BufferPool;     // the buffers forward() and backward() reuse from one call to the next
}  // namespace detail

class MultiHeadAttention;

/// The projected keys and values of the positions seen so far, for incremental (autoregressive)
/// decoding with one MultiHeadAttention layer: append the new positions' keys and values
/// (MultiHeadAttention::append_to_cache), then attend for the new queries only
/// (MultiHeadAttention::forward_cached). O(length) attention work per new query instead of
/// recomputing everything.
///
/// Storage: projected keys [B, capacity, h*d_k] and values [B, capacity, h*d_v] in the layer's dtype,
/// position t of batch b in row b*capacity + t. Capacity grows geometrically (doubling; old rows are
/// copied), so appending costs amortised O(1) rows per position. With add_bias_kv / add_zero_attn the
/// rows just after the last position hold bias_k/bias_v and the zero position, rewritten by every
/// append, so that the attention reads [B, length + extra] keys in place.
///
/// A cache belongs to one layer (use one per layer and per decoding stream): it records the layer's h,
/// d_k, d_v, dtype, add_bias_kv, add_zero_attn and rotary embedding (keys are stored rotated), and the
/// calls throw mha::Error when another layer's differ (a layer with the same widths cannot be told
/// apart, except by its bias_k / bias_v).
///
/// Threads: forward_cached() calls on one cache may overlap each other (from one or several layers);
/// append_to_cache(), clear() and moving the cache need it alone. A call that would overlap an
/// incompatible one on the same cache (say, two threads appending to it) is detected and throws
/// mha::Error ("cache: in use by another call"); the cache is then unchanged. batch(), length() and
/// capacity() may be read at any time, from any thread (during an append: the value before or after
/// it). Move-only, like Tensor.
class KeyValueCache {
 public:
  KeyValueCache() = default;  ///< empty; the first append fixes the batch size
  KeyValueCache(KeyValueCache&& other);
  KeyValueCache& operator=(KeyValueCache&& other);

  std::int64_t batch() const { return batch_; }        ///< B (0 before the first append)
  std::int64_t length() const { return length_; }      ///< positions held (S so far)
  std::int64_t capacity() const { return capacity_; }  ///< positions the storage holds before it grows
  /// Length 0, keeps the storage (and batch() until the next append). The next append starts over:
  /// it may bring another batch size or layer, and then allocates anew.
  void clear();

 private:
  friend class MultiHeadAttention;

  // Registers one call on the cache for its scope: a writer (append, clear, move) needs the cache
  // alone, readers (forward_cached) may share it. Throws mha::Error when the call would overlap an
  // incompatible one.
  class Use {
   public:
    Use(const KeyValueCache& cache, bool write);
    ~Use();
    Use(const Use&) = delete;
    Use& operator=(const Use&) = delete;

   private:
    const KeyValueCache& cache_;
    bool write_;
  };

  // Makes room for `positions` rows per batch, copying the rows held; capacity at least doubles.
  void reserve(std::int64_t positions);

  Tensor keys_;    // [B, capacity, h*d_k]: projected keys, then the layer's extra positions
  Tensor values_;  // [B, capacity, h*d_v]: projected values, likewise
  // Atomic so that batch(), length() and capacity() may be read while another thread appends (they see
  // the value before or after it); only append_to_cache(), clear() and moves change them.
  std::atomic<std::int64_t> batch_ = 0, length_ = 0, capacity_ = 0;
  // The layer that appended: per-head widths, dtype and the positions it appends after the keys.
  std::int64_t num_heads_ = 0, num_kv_heads_ = 0, d_k_ = 0, d_v_ = 0;  // rows hold num_kv_heads_ heads
  DType dtype_ = DType::Float32;
  bool add_bias_kv_ = false, add_zero_attn_ = false;
  std::int64_t rotary_dim_ = 0;  // the appending layer's rotary embedding: its keys are stored rotated
  double rotary_base_ = 0;
  bool rotary_interleaved_ = false;
  mutable std::atomic<int> users_{0};  // readers in forward_cached(), or -1 while one call writes
};

/// Memory: besides what a training-mode forward keeps, a layer holds the internal buffers of its last
/// forward and backward (the projections, the concatenated heads, the intermediate gradients: about
/// 4 B L E + 4 B S E elements) for the next call of the same shapes to reuse; a buffer that no call
/// reused for one forward-backward cycle is freed.
///
/// Thread safety: forward() and backward() change the layer's state (the dropout counter, what a
/// training-mode forward keeps), so calls on one layer must not overlap; separate layers are
/// independent. append_to_cache() and forward_cached() are const: calls with different caches may
/// overlap each other on one layer, but not a forward(), backward() or parameter change. Each call uses
/// the library's OpenMP threads (set_num_threads) internally.
class MultiHeadAttention {
 public:
  /// Validates the config and initialises the parameters as PyTorch does, from `seed`:
  /// projection weights xavier_uniform, out_proj.weight uniform(+-1/sqrt(h*d_v)), biases 0,
  /// bias_k / bias_v xavier_normal. (Same distributions as PyTorch, not the same numbers.)
  explicit MultiHeadAttention(const MultiHeadAttentionConfig& config, std::uint64_t seed = 0);

  /// The config with every default resolved (d_k, d_v, kdim, vdim never 0).
  const MultiHeadAttentionConfig& config() const { return config_; }
  bool packed_in_proj() const;  ///< true when the q, k, v weights live in one in_proj_weight

  /// The parameter names in PyTorch's state_dict order, and access by name.
  std::vector<std::string> parameter_names() const;
  const Tensor& parameter(const std::string& name) const;
  /// Copies `value` into the parameter `name`, converting float32 <-> float64. Throws mha::Error on an
  /// unknown name or a wrong shape.
  void set_parameter(const std::string& name, const TensorView& value);
  /// Sets every parameter; throws (changing nothing) on an unknown, missing or mis-shaped entry.
  void load_state_dict(const std::map<std::string, TensorView>& state);
  std::map<std::string, TensorView> state_dict() const;  ///< views into this module's parameters

  /// Training mode (the default, as in PyTorch) applies dropout; evaluation mode does not.
  void train(bool on = true) { training_ = on; }
  void eval() { training_ = false; }
  bool training() const { return training_; }

  void set_kernel(Kernel kernel) { kernel_ = kernel; }
  Kernel kernel() const { return kernel_; }

  /// query [B, L, E], key [B, S, kdim], value [B, S, vdim] (batch_first), or [L, B, *] (not
  /// batch_first), or unbatched [L, E], [S, kdim], [S, vdim]. Inputs must have the module's dtype.
  /// Non-const: each training-mode call with dropout draws a new dropout seed, and a training-mode call
  /// keeps what backward() needs (copies of the inputs, or views with inputs.borrow_inputs; copies of
  /// the masks; the projections, the log-sum-exps).
  MultiHeadAttentionOutput forward(const TensorView& query, const TensorView& key, const TensorView& value,
                                   const MultiHeadAttentionInputs& inputs = {});

  /// The gradients of the last training-mode forward: given dout = dLoss/dout (shaped like that
  /// forward's out), returns dLoss/d(query, key, value) and dLoss/d(every parameter). Gradients are
  /// returned in new tensors: they overwrite nothing and accumulate nothing (sum them yourself when
  /// query, key and value are one tensor). No gradient flows through the returned attention weights.
  /// A key position that no query sees (padding, key_lengths, a masked attn_mask column, a window)
  /// changes no gradient: a NaN or Inf in its key or value row reaches neither the inputs' gradients
  /// nor the parameters' (dW_k = dK^T X reads such a row as 0, not as 0 * NaN).
  /// Throws mha::Error when there is no training-mode forward, when a parameter was set (set_parameter,
  /// load_state_dict) after it (as PyTorch refuses a backward through modified weights), when an input
  /// lent with borrow_inputs changed after it, or when dout has the wrong shape or dtype.
  MultiHeadAttentionGradients backward(const TensorView& dout);

  /// Bytes the last training-mode forward keeps for backward(): the copies of its inputs (none for
  /// borrowed or eval-mode inputs; one for an array passed in several roles), the projections, the
  /// concatenated heads (and the gated heads, with a head_gate), the log-sum-exps and the masks. 0 when nothing is kept
  /// (evaluation mode).
  std::int64_t saved_bytes() const;

  // ---- incremental decoding (see KeyValueCache) ------------------------------------------------
  /// Projects key [B, S_new, kdim] and value [B, S_new, vdim] (the layer's layout: batch_first, or
  /// [S_new, B, *] when not batch_first, or unbatched [S_new, kdim] with B = 1) with k_proj / v_proj
  /// (+ bias) and appends them to `cache`; B >= 1 and S_new >= 1. With add_bias_kv / add_zero_attn it also writes
  /// bias_k / bias_v and the zero position after the new last position. Throws mha::Error on a batch
  /// different from the cache's (unless the cache is empty), wrong ranks, widths or dtype, or a cache
  /// filled by a layer with other h, d_k, d_v, dtype, add_bias_kv or add_zero_attn.
  void append_to_cache(KeyValueCache& cache, const TensorView& key, const TensorView& value) const;

  /// Attends query [B, L_new, E] (layout as forward) to every position in `cache` and applies out_proj:
  /// exactly forward(query, K_all, V_all, inputs) in evaluation mode, where K_all / V_all are all the
  /// keys / values appended so far (S = cache.length()). inputs.causal is bottom-right aligned (query i
  /// of the L_new sees cache positions j <= length - L_new + i), so appending a step's key / value and
  /// then attending with causal = true (or false with L_new = 1) equals causal full recomputation.
  /// inputs.key_padding_mask [B, length] ([length] unbatched) and inputs.key_lengths (B values) refer
  /// to cache positions; attn_mask [L_new, length] or [B*h, L_new, length]; head_gate, need_weights /
  /// average_attn_weights as in forward (weights [B, L_new, length + extra] or per head). The
  /// add_bias_kv / add_zero_attn positions come after the cached ones and every query sees them, as in
  /// forward; a layer with add_bias_kv must be the one that appended (its bias_k / bias_v are checked).
  /// Uses the layer's kernel; never applies dropout and keeps nothing for backward (whatever train()
  /// says). Throws mha::Error on an empty cache, a batch mismatch, a cache of another layer, bad masks.
  MultiHeadAttentionOutput forward_cached(const TensorView& query, const KeyValueCache& cache,
                                          const MultiHeadAttentionInputs& inputs = {}) const;

  /// Self-attention decoding over a PagedKVCache, for n sequences of any lengths at once: query
  /// [n, q_len, E] (this layout whatever batch_first) holds each sequence's q_len new positions. Projects
  /// their keys and values from query itself, appends them to sequences[s] (PagedKVCache::append), then
  /// attends each sequence's q_len queries causally (bottom-right: query i sees that sequence's positions
  /// up to its own) to all its cached positions through decode_attention, and applies out_proj. Returns
  /// out [n, q_len, E]; no weights. The same as forward(x, x, x) with causal = true over each whole
  /// sequence x, for its last q_len rows. Evaluation only: no dropout, nothing kept for backward.
  /// The cache must be configured as paged_cache_config() gives (key/value heads, widths, dtype); each
  /// sequence may appear once. Not with add_bias_kv / add_zero_attn; inputs other than the defaults
  /// (masks, key_lengths, causal, head_gate) are refused; scale, window, alibi_slopes and softcap act as
  /// decode_attention takes them, over each sequence's own positions. Throws mha::Error naming the argument,
  /// before anything is appended, on bad input or when the cache lacks the pages the new positions need.
  /// Holds the cache for writing from its checks to its last read (PagedKVCache's threads contract): a
  /// concurrent call on the same cache waits, and never sees this one's appends without its decode.
  MultiHeadAttentionOutput forward_paged(const TensorView& query, PagedKVCache& cache,
                                         std::span<const PagedKVCache::SequenceId> sequences,
                                         const MultiHeadAttentionInputs& inputs = {}) const;
  /// The PagedKVCache configuration forward_paged needs for this layer: h_kv = num_kv_heads, head_dim
  /// d_k, value_dim d_v and the layer's dtype, with the given page size and capacity.
  PagedKVCacheConfig paged_cache_config(std::int64_t page_size, std::int64_t capacity_tokens) const;

 private:
  Tensor& mutable_parameter(const std::string& name);
  // Throws mha::Error unless `cache` was filled by a layer like this one (widths, dtype, extra positions).
  void check_cache_layer(const KeyValueCache& cache) const;
  // This layer's buffer pool (a new one when the layer was copied: copies never share buffers).
  detail::BufferPool& buffer_pool();

  MultiHeadAttentionConfig config_;
  std::map<std::string, Tensor> parameters_;
  bool training_ = true;
  Kernel kernel_ = Kernel::Flash;
  std::uint64_t dropout_seed_;
  std::uint64_t dropout_calls_ = 0;
  std::uint64_t parameters_version_ = 0;  // counts parameter changes, so backward() can refuse a stale forward
  std::shared_ptr<detail::SavedForward> saved_;
  std::shared_ptr<detail::BufferPool> pool_;
};

}  // namespace mha
