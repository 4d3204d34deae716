// DecoderLayer<T> (section 3.1): masked (causal) self-attention over the target, encoder-decoder
// attention (queries from the decoder, keys and values from the encoder's output, the "memory"), then
// the feed-forward network, each inside a Residual.
// Legend: B batch, T target positions, S source positions, d = d_model.
#pragma once

#include <span>
#include <string>
#include <vector>

#include "mha/multi_head_attention.hpp"
#include "mha/paged_kv_cache.hpp"
#include "transformer/attention_block.hpp"
#include "transformer/feed_forward.hpp"
#include "transformer/residual.hpp"
#include "transformer/transformer_config.hpp"

namespace transformer {

// One decoder layer's state for incremental decoding: the target's keys and values so far, and the
// memory's keys and values (projected once per source).
struct DecoderLayerCache {
  mha::KeyValueCache self, cross;
};

template <class T>
class DecoderLayer {
 public:
  DecoderLayer(const std::string& name, const TransformerConfig& c, Rng& rng)
      : self_attn_(name + ".self_attn", c.d_model, c.heads, c.attention_dropout, rng.next(), c.compute),
        self_residual_(name + ".norm1", c.d_model, c.dropout, c.pre_norm, rng.next()),
        cross_attn_(name + ".cross_attn", c.d_model, c.heads, c.attention_dropout, rng.next(), c.compute),
        cross_residual_(name + ".norm2", c.d_model, c.dropout, c.pre_norm, rng.next()),
        ffn_(name + ".ffn", c.d_model, c.d_ff, rng, c.compute),
        ffn_residual_(name + ".norm3", c.d_model, c.dropout, c.pre_norm, rng.next()) {}

  // x [B*T, d], memory [B*S, d] -> [B*T, d].
  Matrix<T> forward(const Matrix<T>& x, const Matrix<T>& memory, std::int64_t B,
                    const std::vector<std::int64_t>& source_lengths) {
    B_ = B;
    Matrix<T> y =
        self_residual_.forward(x, [&](const Matrix<T>& u) { return self_attn_.forward(u, u, B, {}, /*causal=*/true); });
    y = cross_residual_.forward(
        y, [&](const Matrix<T>& u) { return cross_attn_.forward(u, memory, B, source_lengths, /*causal=*/false); });
    return ffn_residual_.forward(y, [&](const Matrix<T>& u) { return ffn_.forward(u); });
  }

  // dy [B*T, d] -> dx [B*T, d]; adds d(memory) [B*S, d] into dmemory.
  Matrix<T> backward(const Matrix<T>& dy, Matrix<T>& dmemory) {
    Matrix<T> d = ffn_residual_.backward(dy, [&](const Matrix<T>& g) { return ffn_.backward(g); });
    d = cross_residual_.backward(d, [&](const Matrix<T>& g) {
      auto grads = cross_attn_.backward(g, B_);
      add_to(dmemory, grads.key_value);
      return grads.query;
    });
    return self_residual_.backward(d, [&](const Matrix<T>& g) {
      auto grads = self_attn_.backward(g, B_);
      return sum(grads.query, grads.key_value);
    });
  }

  // Incremental decoding (evaluation mode). start: projects the memory into cache.cross.
  void start(DecoderLayerCache& cache, const Matrix<T>& memory, std::int64_t B) {
    cache.self.clear();
    project_memory(cache.cross, memory, B);
  }
  // memory [B*S, d]: its keys and values for the encoder-decoder attention, into an emptied `cross`.
  void project_memory(mha::KeyValueCache& cross, const Matrix<T>& memory, std::int64_t B) {
    cross.clear();
    cross_attn_.append(cross, memory, B);
  }
  // x [B*L_new, d]: the next L_new target positions -> [B*L_new, d]; their keys and values join
  // cache.self, and each attends to the positions before it and itself (causal, bottom-right).
  Matrix<T> step(const Matrix<T>& x, DecoderLayerCache& cache, std::int64_t B,
                 const std::vector<std::int64_t>& source_lengths) {
    Matrix<T> y = self_residual_.forward(x, [&](const Matrix<T>& u) {
      self_attn_.append(cache.self, u, B);
      return self_attn_.attend(u, cache.self, B, {}, /*causal=*/true);
    });
    y = cross_residual_.forward(
        y, [&](const Matrix<T>& u) { return cross_attn_.attend(u, cache.cross, B, source_lengths, false); });
    return ffn_residual_.forward(y, [&](const Matrix<T>& u) { return ffn_.forward(u); });
  }

  // Beam search's step (evaluation mode). x [B*K, d]: one new position of each of the B sources' K
  // beams -> [B*K, d]. The self-attention appends each beam's key and value to its sequence in `self`
  // (sequences [B*K]) and attends to all of that sequence; the encoder-decoder attention reads source
  // b's memory from `cross` (batch B, from project_memory) with the source's K beams as K queries.
  Matrix<T> beam_step(const Matrix<T>& x, mha::PagedKVCache& self,
                      std::span<const mha::PagedKVCache::SequenceId> sequences, const mha::KeyValueCache& cross,
                      std::int64_t B, const std::vector<std::int64_t>& source_lengths) {
    Matrix<T> y =
        self_residual_.forward(x, [&](const Matrix<T>& u) { return self_attn_.attend_paged(u, self, sequences); });
    y = cross_residual_.forward(
        y, [&](const Matrix<T>& u) { return cross_attn_.attend(u, cross, B, source_lengths, false); });
    return ffn_residual_.forward(y, [&](const Matrix<T>& u) { return ffn_.forward(u); });
  }

  void train(bool on) {
    self_attn_.train(on);
    cross_attn_.train(on);
    self_residual_.train(on);
    cross_residual_.train(on);
    ffn_residual_.train(on);
  }
  AttentionBlock<T>& self_attention() { return self_attn_; }
  AttentionBlock<T>& cross_attention() { return cross_attn_; }

  void collect(ParameterRefs<T>& out) {
    self_attn_.collect(out);
    self_residual_.collect(out);
    cross_attn_.collect(out);
    cross_residual_.collect(out);
    ffn_.collect(out);
    ffn_residual_.collect(out);
  }

 private:
  AttentionBlock<T> self_attn_;
  Residual<T> self_residual_;
  AttentionBlock<T> cross_attn_;
  Residual<T> cross_residual_;
  FeedForward<T> ffn_;
  Residual<T> ffn_residual_;
  std::int64_t B_ = 0;
};

}  // namespace transformer
