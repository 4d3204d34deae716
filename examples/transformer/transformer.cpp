// Transformer<T>: forward, backward and greedy decoding of the encoder-decoder model (transformer.hpp).
#include "transformer/transformer.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace transformer {

template <class T>
Transformer<T>::Transformer(const TransformerConfig& config, std::uint64_t seed)
    : config_(config),
      rng_(seed),
      embedding_("embedding.weight", config.vocab, config.d_model, rng_, config.compute),
      source_dropout_(config.dropout, rng_.next()),
      target_dropout_(config.dropout, rng_.next()) {
  if (config.vocab <= 0 || config.d_model <= 0 || config.heads <= 0 || config.d_ff <= 0 || config.encoder_layers <= 0 ||
      config.decoder_layers <= 0)
    throw std::invalid_argument("Transformer: vocab, d_model, heads, d_ff and the layer counts must be positive");
  if (config.d_model % config.heads != 0)
    throw std::invalid_argument("Transformer: d_model = " + std::to_string(config.d_model) +
                                " is not a multiple of heads = " + std::to_string(config.heads));
  if (config.compute == Compute::BFloat16 && !std::is_same_v<T, float>)
    throw std::invalid_argument("Transformer: bfloat16 mixed precision keeps float32 master weights (T = float)");
  for (std::int64_t i = 0; i < config.encoder_layers; ++i)
    encoder_.push_back(std::make_unique<EncoderLayer<T>>("encoder." + std::to_string(i), config, rng_));
  for (std::int64_t i = 0; i < config.decoder_layers; ++i)
    decoder_.push_back(std::make_unique<DecoderLayer<T>>("decoder." + std::to_string(i), config, rng_));
  if (config.pre_norm) {
    encoder_norm_.emplace("encoder.norm", config.d_model);
    decoder_norm_.emplace("decoder.norm", config.d_model);
  }
}

template <class T>
ParameterRefs<T> Transformer<T>::parameters() {
  ParameterRefs<T> out;
  embedding_.collect(out);
  for (auto& layer : encoder_) layer->collect(out);
  if (encoder_norm_) encoder_norm_->collect(out);
  for (auto& layer : decoder_) layer->collect(out);
  if (decoder_norm_) decoder_norm_->collect(out);
  return out;
}

template <class T>
void Transformer<T>::zero_grad() {
  for (Parameter<T>* p : parameters()) std::fill(p->grad.begin(), p->grad.end(), T(0));
}

template <class T>
void Transformer<T>::train(bool on) {
  training_ = on;
  source_dropout_.train(on);
  target_dropout_.train(on);
  for (auto& layer : encoder_) layer->train(on);
  for (auto& layer : decoder_) layer->train(on);
}

template <class T>
void Transformer<T>::keep_attention_weights(bool on) {
  for (auto& layer : encoder_) layer->self_attention().keep_weights(on);
  for (auto& layer : decoder_) {
    layer->self_attention().keep_weights(on);
    layer->cross_attention().keep_weights(on);
  }
}

template <class T>
AttentionBlock<T>& Transformer<T>::attention_block(AttentionKind kind, std::int64_t layer) {
  if (layer < 0 || layer >= layers_of(kind))
    throw std::out_of_range("Transformer: no " + std::string(kind_name(kind)) + " in layer " + std::to_string(layer) +
                            " (the model has " + std::to_string(layers_of(kind)) + ")");
  const auto i = static_cast<std::size_t>(layer);
  if (kind == AttentionKind::EncoderSelf) return encoder_[i]->self_attention();
  return kind == AttentionKind::DecoderSelf ? decoder_[i]->self_attention() : decoder_[i]->cross_attention();
}

template <class T>
void Transformer<T>::set_head_gate(AttentionKind kind, std::int64_t layer, std::vector<T> gate) {
  attention_block(kind, layer).set_head_gate(std::move(gate));
}

template <class T>
void Transformer<T>::clear_head_gates() {
  for (AttentionKind kind : kAttentionKinds)
    for (std::int64_t layer = 0; layer < layers_of(kind); ++layer) set_head_gate(kind, layer, {});
}

template <class T>
const mha::Tensor& Transformer<T>::attention_weights(AttentionKind kind, std::int64_t layer) const {
  if (kind == AttentionKind::EncoderSelf) return encoder_self_weights(layer);
  return kind == AttentionKind::DecoderSelf ? decoder_self_weights(layer) : cross_weights(layer);
}

template <class T>
const AttentionBlock<T>& Transformer<T>::encoder_self_attention(std::int64_t layer) const {
  return encoder_.at(static_cast<std::size_t>(layer))->self_attention();
}

template <class T>
const mha::Tensor& Transformer<T>::encoder_self_weights(std::int64_t layer) const {
  return encoder_.at(static_cast<std::size_t>(layer))->self_attention().weights();
}
template <class T>
const mha::Tensor& Transformer<T>::decoder_self_weights(std::int64_t layer) const {
  return decoder_.at(static_cast<std::size_t>(layer))->self_attention().weights();
}
template <class T>
const mha::Tensor& Transformer<T>::cross_weights(std::int64_t layer) const {
  return decoder_.at(static_cast<std::size_t>(layer))->cross_attention().weights();
}

// ids [B*P] -> Dropout(E[ids] * sqrt(d) + PE) [B*P, d].
template <class T>
Matrix<T> Transformer<T>::embed(const std::vector<int>& ids, std::int64_t positions, Dropout<T>& dropout) {
  Matrix<T> x = embedding_.embed(ids);
  add_positional_encoding(x, positions);
  return dropout.forward(x);
}

template <class T>
Matrix<T> Transformer<T>::encode(const TokenBatch& batch) {
  Matrix<T> x = embed(batch.source, batch.source_len(), source_dropout_);
  for (auto& layer : encoder_) x = layer->forward(x, batch.batch, batch.source_lengths);
  return encoder_norm_ ? encoder_norm_->forward(x) : x;
}

template <class T>
Matrix<T> Transformer<T>::forward(const TokenBatch& batch) {
  batch_ = batch;
  const Matrix<T> memory = encode(batch);
  Matrix<T> y = embed(batch.target, batch.target_len(), target_dropout_);
  for (auto& layer : decoder_) y = layer->forward(y, memory, batch.batch, batch.source_lengths);
  if (decoder_norm_) y = decoder_norm_->forward(y);
  return embedding_.logits(y);
}

// The forward in reverse: the pre-softmax map, the decoder stack (collecting d(memory) from every
// encoder-decoder attention), the target embedding, then the encoder stack and the source embedding.
template <class T>
void Transformer<T>::backward(const Matrix<T>& dlogits) {
  Matrix<T> dy = embedding_.logits_backward(dlogits);
  if (decoder_norm_) dy = decoder_norm_->backward(dy);
  Matrix<T> dmemory(batch_.batch * batch_.source_len(), config_.d_model);
  for (auto layer = decoder_.rbegin(); layer != decoder_.rend(); ++layer) dy = (*layer)->backward(dy, dmemory);
  embedding_.embed_backward(target_dropout_.backward(dy), batch_.target);

  Matrix<T> dx = encoder_norm_ ? encoder_norm_->backward(dmemory) : dmemory;
  for (auto layer = encoder_.rbegin(); layer != encoder_.rend(); ++layer) dx = (*layer)->backward(dx);
  embedding_.embed_backward(source_dropout_.backward(dx), batch_.source);
}

template <class T>
std::vector<int> Transformer<T>::greedy_decode(const TokenBatch& source, std::int64_t steps, int bos, bool use_cache,
                                               std::vector<T>* step_logits) {
  const bool was_training = training_;
  train(false);
  const std::int64_t B = source.batch, V = config_.vocab;
  std::vector<int> tokens(static_cast<std::size_t>(B * steps));  // [B, steps]
  // Step t's token of every sequence: the argmax of row `row_of_b` of each sequence's `rows_per_b` rows.
  auto argmax_rows = [&](const Matrix<T>& logits, std::int64_t row_of_b, std::int64_t rows_per_b, std::int64_t t) {
    for (std::int64_t b = 0; b < B; ++b) {
      const T* row = logits.row(b * rows_per_b + row_of_b);
      if (step_logits) std::copy(row, row + V, step_logits->begin() + (b * steps + t) * V);
      tokens[static_cast<std::size_t>(b * steps + t)] = static_cast<int>(std::max_element(row, row + V) - row);
    }
  };
  if (step_logits) step_logits->assign(static_cast<std::size_t>(B * steps * V), T(0));
  const Matrix<T> memory = encode(source);
  if (!use_cache) {
    TokenBatch prefix = source;
    for (std::int64_t t = 0; t < steps; ++t) {  // the decoder on <bos> y1 .. y_t, all positions again
      prefix.target.clear();
      for (std::int64_t b = 0; b < B; ++b) {
        prefix.target.push_back(bos);
        for (std::int64_t j = 0; j < t; ++j) prefix.target.push_back(tokens[static_cast<std::size_t>(b * steps + j)]);
      }
      Matrix<T> y = embed(prefix.target, t + 1, target_dropout_);
      for (auto& layer : decoder_) y = layer->forward(y, memory, B, source.source_lengths);
      if (decoder_norm_) y = decoder_norm_->forward(y);
      argmax_rows(embedding_.apply_logits(y), t, t + 1, t);
    }
  } else {
    std::vector<DecoderLayerCache> caches(decoder_.size());
    for (std::size_t i = 0; i < decoder_.size(); ++i) decoder_[i]->start(caches[i], memory, B);
    std::vector<int> current(static_cast<std::size_t>(B), bos);
    for (std::int64_t t = 0; t < steps; ++t) {  // the decoder on position t only
      Matrix<T> y = embedding_.embed(current);
      add_positional_encoding(y, 1, t);
      for (std::size_t i = 0; i < decoder_.size(); ++i) y = decoder_[i]->step(y, caches[i], B, source.source_lengths);
      if (decoder_norm_) y = decoder_norm_->forward(y);
      argmax_rows(embedding_.apply_logits(y), 0, 1, t);
      for (std::int64_t b = 0; b < B; ++b)
        current[static_cast<std::size_t>(b)] = tokens[static_cast<std::size_t>(b * steps + t)];
    }
  }
  train(was_training);
  return tokens;
}

template class Transformer<float>;
template class Transformer<double>;

}  // namespace transformer
