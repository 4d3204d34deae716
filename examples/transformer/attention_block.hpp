// AttentionBlock<T>: the library's mha::MultiHeadAttention as a block of the model, with its
// parameters mirrored as Parameter<T> so the optimizer, the checkpoint and the gradient checks treat
// them like every other parameter. The mirror is copied into the layer before each use (a few
// thousand numbers; the attention itself costs far more).
//
// Legend: B batch, L queries, S keys, E = d_model, h heads.
#pragma once

#include <string>
#include <vector>

#include "mha/multi_head_attention.hpp"
#include "transformer/matrix.hpp"
#include "transformer/parameter.hpp"

namespace transformer {

template <class T>
class AttentionBlock {
 public:
  AttentionBlock(const std::string& name, std::int64_t d_model, std::int64_t heads, double dropout, std::uint64_t seed)
      : layer_(config(d_model, heads, dropout), seed), prefix_(name + ".") {
    for (const auto& pname : layer_.parameter_names()) {
      const mha::Tensor& t = layer_.parameter(pname);
      Parameter<T> p(prefix_ + pname, t.shape());
      const auto* src = t.data_as<T>();
      p.value.assign(src, src + t.numel());
      params_.push_back(std::move(p));
    }
  }

  void train(bool on) { layer_.train(on); }
  // Keep the per-head weights [B, h, L, S] of the next forwards (for attention maps).
  void keep_weights(bool on) { keep_weights_ = on; }
  const mha::Tensor& weights() const { return weights_; }

  // query [B*L, E], key_value [B*S, E] -> [B*L, E]. key_lengths: B valid key counts (empty: all S);
  // causal: query i sees keys j <= i (L == S in the decoder's self-attention).
  Matrix<T> forward(const Matrix<T>& query, const Matrix<T>& key_value, std::int64_t B,
                    const std::vector<std::int64_t>& key_lengths, bool causal) {
    push_parameters();
    const std::int64_t E = query.cols, L = query.rows / B, S = key_value.rows / B;
    mha::MultiHeadAttentionInputs inputs;
    inputs.key_lengths = key_lengths;
    inputs.causal = causal;
    inputs.need_weights = keep_weights_;
    inputs.average_attn_weights = false;
    const mha::TensorView q(query.data.data(), mha::dtype_of<T>(), {B, L, E});
    const mha::TensorView kv(key_value.data.data(), mha::dtype_of<T>(), {B, S, E});
    mha::MultiHeadAttentionOutput out = layer_.forward(q, kv, kv, inputs);
    if (keep_weights_) weights_ = std::move(out.weights);
    return to_matrix(out.out, B * L, E);
  }

  // dout [B*L, E] -> d(query) [B*L, E] and d(key_value) [B*S, E] (the key's and value's gradients
  // summed: one tensor fed both); parameter gradients added to the mirrors.
  struct Gradients {
    Matrix<T> query, key_value;
  };
  Gradients backward(const Matrix<T>& dout, std::int64_t B) {
    const std::int64_t E = dout.cols, L = dout.rows / B;
    mha::MultiHeadAttentionGradients g = layer_.backward(mha::TensorView(std::span<const T>(dout.data), {B, L, E}));
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
    const mha::TensorView kv(key_value.data.data(), mha::dtype_of<T>(), {B, key_value.rows / B, key_value.cols});
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
    const mha::TensorView q(query.data.data(), mha::dtype_of<T>(), {B, L, E});
    return to_matrix(layer_.forward_cached(q, cache, inputs).out, B * L, E);
  }

  void collect(ParameterRefs<T>& out) {
    for (auto& p : params_) out.push_back(&p);
  }

 private:
  static mha::MultiHeadAttentionConfig config(std::int64_t d_model, std::int64_t heads, double dropout) {
    mha::MultiHeadAttentionConfig c;
    c.d_model = d_model;
    c.num_heads = heads;
    c.dropout = dropout;
    c.batch_first = true;
    c.dtype = mha::dtype_of<T>();
    return c;
  }
  static Matrix<T> to_matrix(const mha::Tensor& t, std::int64_t rows, std::int64_t cols) {
    Matrix<T> m(rows, cols);
    const T* src = t.data_as<T>();
    m.data.assign(src, src + rows * cols);
    return m;
  }
  // The layer's own names are the mirror's names after the block's prefix ("decoder.0.self_attn.").
  std::string layer_name(const Parameter<T>& p) const { return p.name.substr(prefix_.size()); }
  void push_parameters() {
    for (const auto& p : params_)
      layer_.set_parameter(layer_name(p), mha::TensorView(std::span<const T>(p.value), p.shape));
  }
  void add_parameter_gradients(const mha::MultiHeadAttentionGradients& g) {
    for (auto& p : params_) {
      const T* src = g.parameters.at(layer_name(p)).template data_as<T>();
      for (std::size_t i = 0; i < p.grad.size(); ++i) p.grad[i] += src[i];
    }
  }

  mha::MultiHeadAttention layer_;
  std::string prefix_;  // "encoder.0.self_attn."
  std::vector<Parameter<T>> params_;
  bool keep_weights_ = false;
  mha::Tensor weights_;
};

}  // namespace transformer
