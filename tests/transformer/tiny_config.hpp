// The small model sizes the Transformer's tests share: small enough for float64 finite differences.
#pragma once

#include "transformer/transformer_config.hpp"

namespace transformer::testing {

// vocab 11, d_model 8, 2 heads, d_ff 12, 2 + 2 layers, no dropout unless asked.
inline TransformerConfig tiny_config(bool pre_norm, double dropout = 0.0) {
  TransformerConfig c;
  c.vocab = 11;
  c.d_model = 8;
  c.heads = 2;
  c.d_ff = 12;
  c.encoder_layers = 2;
  c.decoder_layers = 2;
  c.dropout = dropout;
  c.attention_dropout = dropout;
  c.pre_norm = pre_norm;
  return c;
}

}  // namespace transformer::testing
