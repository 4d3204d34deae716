// EncoderLayer<T> (section 3.1): self-attention over the source, then the feed-forward network, each
// inside a Residual. Legend: B batch, S source positions, d = d_model.
#pragma once

#include <string>
#include <vector>

#include "transformer/attention_block.hpp"
#include "transformer/feed_forward.hpp"
#include "transformer/residual.hpp"
#include "transformer/transformer_config.hpp"

namespace transformer {

template <class T>
class EncoderLayer {
 public:
  EncoderLayer(const std::string& name, const TransformerConfig& c, Rng& rng)
      : self_attn_(name + ".self_attn", c.d_model, c.heads, c.attention_dropout, rng.next(), c.compute),
        self_residual_(name + ".norm1", c.d_model, c.dropout, c.pre_norm, rng.next()),
        ffn_(name + ".ffn", c.d_model, c.d_ff, rng, c.compute),
        ffn_residual_(name + ".norm2", c.d_model, c.dropout, c.pre_norm, rng.next()) {}

  // x [B*S, d] -> [B*S, d]; source_lengths: the B valid lengths (keys past them are padding).
  Matrix<T> forward(const Matrix<T>& x, std::int64_t B, const std::vector<std::int64_t>& source_lengths) {
    B_ = B;
    Matrix<T> y = self_residual_.forward(
        x, [&](const Matrix<T>& u) { return self_attn_.forward(u, u, B, source_lengths, /*causal=*/false); });
    return ffn_residual_.forward(y, [&](const Matrix<T>& u) { return ffn_.forward(u); });
  }

  // dy [B*S, d] -> dx [B*S, d].
  Matrix<T> backward(const Matrix<T>& dy) {
    Matrix<T> d = ffn_residual_.backward(dy, [&](const Matrix<T>& g) { return ffn_.backward(g); });
    return self_residual_.backward(d, [&](const Matrix<T>& g) {
      auto grads = self_attn_.backward(g, B_);  // query, key and value were all u
      return sum(grads.query, grads.key_value);
    });
  }

  void train(bool on) {
    self_attn_.train(on);
    self_residual_.train(on);
    ffn_residual_.train(on);
  }
  AttentionBlock<T>& self_attention() { return self_attn_; }

  void collect(ParameterRefs<T>& out) {
    self_attn_.collect(out);
    self_residual_.collect(out);
    ffn_.collect(out);
    ffn_residual_.collect(out);
  }

 private:
  AttentionBlock<T> self_attn_;
  Residual<T> self_residual_;
  FeedForward<T> ffn_;
  Residual<T> ffn_residual_;
  std::int64_t B_ = 0;
};

}  // namespace transformer
