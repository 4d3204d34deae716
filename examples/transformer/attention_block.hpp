// AttentionBlock<T>: the library's mha::MultiHeadAttention as a block of the model, with its
// parameters mirrored as Parameter<T> so the optimizer, the checkpoint and the gradient checks treat
// them like every other parameter. The mirror is copied into the layer before each use (a few
// thousand numbers; the attention itself costs far more).
//
// With Compute::BFloat16 (mixed precision, T = float; see TransformerConfig) the layer is a bf16
// mha::MultiHeadAttention: the mirror holds the float32 master weights (initialised as a float32
// layer of the same seed would be), set_parameter rounds them into the layer's bf16 compute copies
// before each use, the float32 inputs and output gradient are rounded to bf16 on the way in, and the
// layer's bf16 outputs and gradients are widened to float32 on the way out.
//
// A head gate (set_head_gate) multiplies each head's output before W^O: with gate g [h], the block
// computes Concat(g_1 head_1, ..., g_h head_h) W^O (the library's MultiHeadAttentionInputs::head_gate),
// so g_i = 0 removes head i exactly (`mha explore` switches heads off this way). The gate is fixed:
// backward gives the parameters' gradients of the gated block, not the gate's.
//
// Legend: B batch, L queries, S keys, E = d_model, h heads.
#pragma once

#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "mha/multi_head_attention.hpp"
#include "mha/paged_kv_cache.hpp"
#include "transformer/matrix.hpp"
#include "transformer/parameter.hpp"
#include "transformer/transformer_config.hpp"

namespace transformer {

template <class T>
class AttentionBlock {
 public:
  AttentionBlock(const std::string& name, std::int64_t d_model, std::int64_t heads, double dropout, std::uint64_t seed,
                 Compute compute = Compute::Native)
      : layer_(config(d_model, heads, dropout, compute), seed), prefix_(name + ".") {
    std::optional<mha::MultiHeadAttention> native;  // BFloat16: the masters' float32 initialisation
    if (compute != Compute::Native) native.emplace(config(d_model, heads, dropout, Compute::Native), seed);
    const mha::MultiHeadAttention& init = native ? *native : layer_;
    for (const auto& pname : init.parameter_names()) {
      const mha::Tensor& t = init.parameter(pname);
      Parameter<T> p(prefix_ + pname, t.shape());
      const auto* src = t.data_as<T>();
      p.value.assign(src, src + t.numel());
      params_.push_back(std::move(p));
    }
  }

  void train(bool on) { layer_.train(on); }

  // gate [h]: head i's output is multiplied by gate[i] before W^O in every forward and attend from now
  // on (and backward follows); an empty gate removes it. Throws std::invalid_argument for a gate of another size.
  void set_head_gate(std::vector<T> gate) {
    const std::int64_t h = layer_.config().num_heads;
    if (!gate.empty() && static_cast<std::int64_t>(gate.size()) != h)
      throw std::invalid_argument(prefix_ + "head gate: expected " + std::to_string(h) + " values, got " +
                                  std::to_string(gate.size()));
    head_gate_ = std::move(gate);
  }
  const std::vector<T>& head_gate() const { return head_gate_; }
  // Keep the per-head weights [B, h, L, S] of the next forwards (for attention maps).
  void keep_weights(bool on) { keep_weights_ = on; }
  const mha::Tensor& weights() const { return weights_; }

  // query [B*L, E], key_value [B*S, E] -> [B*L, E]. key_lengths: B valid key counts (empty: all S);
  // causal: query i sees keys j <= i (L == S in the decoder's self-attention).
  Matrix<T> forward(const Matrix<T>& query, const Matrix<T>& key_value, std::int64_t B,
                    const std::vector<std::int64_t>& key_lengths, bool causal) {
    push_parameters();
    const std::int64_t E = query.cols, L = query.rows / B;
    mha::MultiHeadAttentionInputs inputs;
    inputs.key_lengths = key_lengths;
    inputs.causal = causal;
    inputs.need_weights = keep_weights_;
    inputs.average_attn_weights = false;
    inputs.head_gate = head_gate_view();
    mha::Tensor q_copy, kv_copy;
    const mha::TensorView q = layer_input(query, B, q_copy);
    const mha::TensorView kv = &key_value == &query ? q : layer_input(key_value, B, kv_copy);
    mha::MultiHeadAttentionOutput out = layer_.forward(q, kv, kv, inputs);
    if (keep_weights_) weights_ = in_T(std::move(out.weights));
    return to_matrix(out.out, B * L, E);
  }

  // dout [B*L, E] -> d(query) [B*L, E] and d(key_value) [B*S, E] (the key's and value's gradients
  // summed: one tensor fed both); parameter gradients added to the mirrors.
  struct Gradients {
    Matrix<T> query, key_value;
  };
  Gradients backward(const Matrix<T>& dout, std::int64_t B) {
    const std::int64_t E = dout.cols, L = dout.rows / B;
    mha::Tensor dout_copy;
    mha::MultiHeadAttentionGradients g = layer_.backward(layer_input(dout, B, dout_copy));
    add_parameter_gradients(g);
    const std::int64_t S = g.key.size(1);
    Gradients out{to_matrix(g.query, B * L, E), to_matrix(g.key, B * S, E)};
    add_to(out.key_value, to_matrix(g.value, B * S, E));
    return out;
  }

  // Incremental decoding through the library's KeyValueCache (evaluation only).
  // key_value [B*S, E]: appended to the cache (projected once).
  void append(mha::KeyValueCache& cache, const Matrix<T>& key_value, std::int64_t B) {
    push_parameters();
    mha::Tensor kv_copy;
    const mha::TensorView kv = layer_input(key_value, B, kv_copy);
    layer_.append_to_cache(cache, kv, kv);
  }
  // query [B*L_new, E] attends to every cached position -> [B*L_new, E].
  Matrix<T> attend(const Matrix<T>& query, const mha::KeyValueCache& cache, std::int64_t B,
                   const std::vector<std::int64_t>& key_lengths, bool causal) {
    push_parameters();
    const std::int64_t E = query.cols, L = query.rows / B;
    mha::MultiHeadAttentionInputs inputs;
    inputs.key_lengths = key_lengths;
    inputs.causal = causal;
    inputs.need_weights = false;
    inputs.head_gate = head_gate_view();
    mha::Tensor q_copy;
    return to_matrix(layer_.forward_cached(layer_input(query, B, q_copy), cache, inputs).out, B * L, E);
  }

  // Incremental decoding of many sequences through the library's PagedKVCache (beam search;
  // evaluation only). query [n, E]: one new position of each of the n sequences; its key and value are
  // appended to the sequence's pages, then it attends to every position of its sequence -> [n, E].
  // Throws std::invalid_argument while a head gate is set (the layer's forward_paged takes none).
  Matrix<T> attend_paged(const Matrix<T>& query, mha::PagedKVCache& cache,
                         std::span<const mha::PagedKVCache::SequenceId> sequences) {
    if (!head_gate_.empty())
      throw std::invalid_argument(prefix_ + "attend_paged: head gates are not supported through the paged cache");
    push_parameters();
    const auto n = static_cast<std::int64_t>(sequences.size());
    mha::Tensor q_copy;
    return to_matrix(layer_.forward_paged(layer_input(query, n, q_copy), cache, sequences).out, query.rows, query.cols);
  }
  // The PagedKVCache config that attend_paged needs: the layer's key/value heads, widths and dtype.
  mha::PagedKVCacheConfig paged_cache_config(std::int64_t page_size, std::int64_t capacity_tokens) const {
    return layer_.paged_cache_config(page_size, capacity_tokens);
  }

  void collect(ParameterRefs<T>& out) {
    for (auto& p : params_) out.push_back(&p);
  }
  // The library's layer (its parameters are the compute copies: bf16 under Compute::BFloat16).
  const mha::MultiHeadAttention& layer() const { return layer_; }

 private:
  static mha::MultiHeadAttentionConfig config(std::int64_t d_model, std::int64_t heads, double dropout,
                                              Compute compute) {
    if (compute == Compute::BFloat16 && !std::is_same_v<T, float>)
      throw std::invalid_argument("AttentionBlock: bfloat16 compute needs float32 master weights (T = float)");
    mha::MultiHeadAttentionConfig c;
    c.d_model = d_model;
    c.num_heads = heads;
    c.dropout = dropout;
    c.batch_first = true;
    c.dtype = compute == Compute::BFloat16 ? mha::DType::BFloat16 : mha::dtype_of<T>();
    return c;
  }
  // m [B*n, E] as the layer's input [B, n, E]: a view of m when the layer computes in T, else m
  // rounded to the layer's dtype in `copy`.
  mha::TensorView layer_input(const Matrix<T>& m, std::int64_t B, mha::Tensor& copy) const {
    const mha::TensorView view(m.data.data(), mha::dtype_of<T>(), {B, m.rows / B, m.cols});
    if (layer_.config().dtype == view.dtype()) return view;
    copy = mha::Tensor::copy_of(view, layer_.config().dtype);
    return copy;
  }
  // t in T: itself, or (a bf16 output) widened.
  static mha::Tensor in_T(mha::Tensor t) {
    return t.dtype() == mha::dtype_of<T>() ? std::move(t) : mha::Tensor::copy_of(t, mha::dtype_of<T>());
  }
  // t's values in T: its own, or (a bf16 output or gradient) widened into `widened`.
  static const T* values_in_T(const mha::Tensor& t, mha::Tensor& widened) {
    if (t.dtype() == mha::dtype_of<T>()) return t.data_as<T>();
    widened = mha::Tensor::copy_of(t, mha::dtype_of<T>());
    return widened.data_as<T>();
  }
  static Matrix<T> to_matrix(const mha::Tensor& t, std::int64_t rows, std::int64_t cols) {
    Matrix<T> m(rows, cols);
    mha::Tensor widened;
    const T* src = values_in_T(t, widened);
    m.data.assign(src, src + rows * cols);
    return m;
  }
  // The layer's own names are the mirror's names after the block's prefix ("decoder.0.self_attn.").
  std::string layer_name(const Parameter<T>& p) const { return p.name.substr(prefix_.size()); }
  void push_parameters() {
    for (const auto& p : params_)
      layer_.set_parameter(layer_name(p), mha::TensorView(std::span<const T>(p.value), p.shape));
  }
  // The gate as the layer's input [h] (float32 or float64, as the library takes it), or none.
  std::optional<mha::TensorView> head_gate_view() const {
    if (head_gate_.empty()) return std::nullopt;
    return mha::TensorView(std::span<const T>(head_gate_), {static_cast<std::int64_t>(head_gate_.size())});
  }
  void add_parameter_gradients(const mha::MultiHeadAttentionGradients& g) {
    for (auto& p : params_) {
      mha::Tensor widened;
      const T* src = values_in_T(g.parameters.at(layer_name(p)), widened);
      for (std::size_t i = 0; i < p.grad.size(); ++i) p.grad[i] += src[i];
    }
  }

  mha::MultiHeadAttention layer_;
  std::string prefix_;  // "encoder.0.self_attn."
  std::vector<Parameter<T>> params_;
  bool keep_weights_ = false;
  mha::Tensor weights_;
  std::vector<T> head_gate_;  // [h], or empty: no gate
};

}  // namespace transformer
