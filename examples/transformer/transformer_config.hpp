// TransformerConfig: the model's sizes and regularisation (section 3 of the paper, at small scale).
#pragma once

#include <cstdint>

namespace transformer {

struct TransformerConfig {
  std::int64_t vocab = 0;           // V: shared by source and target (section 3.4)
  std::int64_t d_model = 64;        // the paper's base model: 512
  std::int64_t heads = 4;           // h (8); d_k = d_v = d_model / h
  std::int64_t d_ff = 256;          // inner width of the feed-forward network (2048)
  std::int64_t encoder_layers = 2;  // N (6)
  std::int64_t decoder_layers = 2;  // N (6)
  double dropout = 0.1;             // residual dropout, P_drop (0.1)
  double attention_dropout = 0.0;   // on the attention weights
  bool pre_norm = false;            // false: the paper's post-norm
};

}  // namespace transformer
