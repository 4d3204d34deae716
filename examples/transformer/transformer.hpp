// Transformer<T>: the encoder-decoder model of section 3 on mha::MultiHeadAttention.
//
//   source ids [B, S] -> E * sqrt(d) + PE -> Dropout -> N x EncoderLayer (-> LayerNorm if pre-norm) = memory
//   target ids [B, T] -> E * sqrt(d) + PE -> Dropout -> N x DecoderLayer(memory) (-> LayerNorm) -> h E^T = logits
//
// One embedding table E [V, d] serves the source, the target and the pre-softmax map (section 3.4).
// Legend: B batch, S source length, T target length, V vocabulary, d = d_model.
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "mha/paged_kv_cache.hpp"
#include "transformer/attention_kind.hpp"
#include "transformer/beam_search.hpp"
#include "transformer/decoder_layer.hpp"
#include "transformer/embedding.hpp"
#include "transformer/encoder_layer.hpp"
#include "transformer/transformer_config.hpp"

namespace transformer {

// A batch of token ids: source [B, S] padded after source_lengths[b]; target [B, T] (no padding).
struct TokenBatch {
  std::int64_t batch = 0;
  std::vector<int> source;                   // [B, S]
  std::vector<std::int64_t> source_lengths;  // [B]
  std::vector<int> target;                   // [B, T]: the decoder's input (<bos> y1 ... y_{T-1})
  std::int64_t source_len() const { return static_cast<std::int64_t>(source.size()) / batch; }
  std::int64_t target_len() const { return static_cast<std::int64_t>(target.size()) / batch; }
};

// What Transformer::beam_decode searches.
struct BeamOptions {
  std::int64_t beams = 4;  // K >= 1 hypotheses kept per source
  std::int64_t steps = 0;  // at most this many tokens after <bos> (>= 1)
  int bos = 1, eos = 2;    // Vocabulary::kBos, kEos
  // Positions per page of the self-attention caches. Small, because the date task's answers have 11
  // positions: beams then share the full pages of their common prefix, and a fork copies at most 3 rows.
  std::int64_t page_size = 4;
  // How the self-attention caches store their keys and values (mha::KVStorage): Native (the model's
  // dtype), or Int8 / Float8E4M3, each (position, head) row with a float32 scale of its own (needs a
  // float32 model computing in float32). The encoder-decoder attention's memory stays in the model's dtype.
  mha::KVStorage kv_storage = mha::KVStorage::Native;
};

template <class T>
class Transformer {
 public:
  Transformer(const TransformerConfig& config, std::uint64_t seed);

  const TransformerConfig& config() const { return config_; }
  // Every parameter, in a fixed order, named like "decoder.1.cross_attn.in_proj_weight".
  ParameterRefs<T> parameters();
  void zero_grad();

  void train(bool on = true);  // dropout on or off (training is the default)
  bool training() const { return training_; }

  // logits [B*T, V] for every target position (teacher forcing). Keeps what backward needs.
  Matrix<T> forward(const TokenBatch& batch);
  // dlogits [B*T, V] -> adds every parameter's gradient into Parameter::grad.
  void backward(const Matrix<T>& dlogits);

  // Greedy decoding of `steps` tokens after <bos> for each source: the argmax token at each step.
  // With use_cache, each step runs the decoder on the new position only, through the library's
  // KeyValueCache (O(t) attention work at step t); without, each step recomputes the whole prefix.
  // Returns [B, steps] ids; step_logits, when given, receives each step's logits [B, steps, V].
  // Runs in evaluation mode (restores the mode afterwards).
  std::vector<int> greedy_decode(const TokenBatch& source, std::int64_t steps, int bos, bool use_cache,
                                 std::vector<T>* step_logits = nullptr);

  // Beam search (beam_search.hpp: plain log-probability scores, exact early stopping) with
  // options.beams beams per source and at most options.steps tokens after <bos>: the best hypothesis
  // of each source [B]. The decoder's self-attention keeps its keys and values in one mha::PagedKVCache
  // per layer: a beam that survives a step continues as a fork of its parent's sequence (sharing its
  // pages; a write copies only a partly filled last page), and the sequences of the step before are
  // released. The encoder-decoder attention reads each source's memory, projected once, from a
  // KeyValueCache of batch B, the source's K beams being K queries. Beams = 1 writes greedy_decode's
  // tokens up to its first <eos>. Runs in evaluation mode (restores the mode afterwards). Throws
  // std::invalid_argument for beams, steps or page_size < 1, or a quantized kv_storage in a model that
  // is not float32 throughout (beam_decode.cpp). finished, when given, receives every hypothesis that
  // finished, per source [B][...], in the order they finished.
  std::vector<BeamHypothesis> beam_decode(const TokenBatch& source, const BeamOptions& options,
                                          std::vector<std::vector<BeamHypothesis>>* finished = nullptr);
  // beam_decode's decoder and caches with the next tokens forced instead of searched (teacher forcing):
  // forced [B, n] holds y_1 .. y_n of each source, n = options.steps; the decoder reads <bos> y_1 ..
  // y_{n-1}. Returns log p(. | y_<t, x) for t = 1 .. n, [B, n, V], log_softmax_rows of the logits.
  // Uses options' steps, bos, page_size and kv_storage (beams and eos are not used); refuses what
  // beam_decode refuses, and a `forced` not of B*n tokens.
  std::vector<double> forced_decode(const TokenBatch& source, std::span<const int> forced, const BeamOptions& options);

  // Head gates (AttentionBlock::set_head_gate): gate [h] multiplies each head's output before W^O in
  // the attention block `kind` of layer `layer` (0 removes the head); an empty gate removes the gate.
  // Throws std::out_of_range for a layer the model lacks, std::invalid_argument for a gate not of size h.
  void set_head_gate(AttentionKind kind, std::int64_t layer, std::vector<T> gate);
  void clear_head_gates();  // every block's gate removed
  std::int64_t layers_of(AttentionKind kind) const {
    return kind == AttentionKind::EncoderSelf ? encoder_layers() : decoder_layers();
  }

  // Attention maps: after keep_attention_weights(true), forward() keeps every attention block's
  // per-head weights [B, h, L, S]; read them with the accessors.
  void keep_attention_weights(bool on);
  std::int64_t encoder_layers() const { return static_cast<std::int64_t>(encoder_.size()); }
  std::int64_t decoder_layers() const { return static_cast<std::int64_t>(decoder_.size()); }
  const mha::Tensor& encoder_self_weights(std::int64_t layer) const;
  const mha::Tensor& decoder_self_weights(std::int64_t layer) const;
  const mha::Tensor& cross_weights(std::int64_t layer) const;
  const mha::Tensor& attention_weights(AttentionKind kind, std::int64_t layer) const;
  // An encoder layer's self-attention block (its layer() holds the compute copies of the parameters).
  const AttentionBlock<T>& encoder_self_attention(std::int64_t layer) const;

  // The encoder alone: source [B, S] -> memory [B*S, d] (keeps what backward needs).
  Matrix<T> encode(const TokenBatch& batch);

 private:
  // beam_decode's and forced_decode's decoder over the paged self-attention caches (beam_decode.cpp).
  mha::PagedKVCacheConfig self_cache_config(std::size_t layer, const BeamOptions& options, std::int64_t sequences);
  Matrix<T> paged_step(const std::vector<int>& tokens, std::int64_t t, std::vector<mha::PagedKVCache>& self,
                       std::span<const mha::PagedKVCache::SequenceId> sequences,
                       const std::vector<mha::KeyValueCache>& cross, std::int64_t B,
                       const std::vector<std::int64_t>& source_lengths);
  AttentionBlock<T>& attention_block(AttentionKind kind, std::int64_t layer);
  Matrix<T> embed(const std::vector<int>& ids, std::int64_t positions, Dropout<T>& dropout);

  TransformerConfig config_;
  Rng rng_;
  SharedEmbedding<T> embedding_;
  Dropout<T> source_dropout_, target_dropout_;
  std::vector<std::unique_ptr<EncoderLayer<T>>> encoder_;
  std::vector<std::unique_ptr<DecoderLayer<T>>> decoder_;
  std::optional<LayerNorm<T>> encoder_norm_, decoder_norm_;  // pre-norm only
  bool training_ = true;

  // Kept by forward() for backward().
  TokenBatch batch_;
};

extern template class Transformer<float>;
extern template class Transformer<double>;

}  // namespace transformer
