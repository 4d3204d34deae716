// TransformerConfig: the model's sizes and regularisation (section 3 of the paper, at small scale).
#pragma once

#include <cstdint>

namespace transformer {

// The precision the blocks compute in (the parameters and Adam's state are always the model's T).
//
// Native: everything in T (float32 for training, float64 for the gradient checks).
// BFloat16: mixed precision (T = float only), as PyTorch's autocast and Micikevicius et al. 2018 train:
// the float32 parameters are the master weights Adam updates; each forward's compute copies are the
// masters rounded to bfloat16 (to nearest, ties to even). The heavy products run on bf16 operands with
// float32 accumulation: the attention layers as mha::MultiHeadAttention in bf16 (attention_block.hpp),
// the linear maps, the feed-forward networks and the pre-softmax map through oneDNN's bf16 matmul
// (linear_products.hpp), which writes float32. Everything numerically sensitive stays float32: the
// activations between blocks, the residual sums, layer norm, dropout, the softmax cross-entropy and
// the loss. Gradients come back in bf16 (attention) or float32 (the other products) and are added to
// the float32 gradients Adam reads. No loss scaling: bfloat16 has float32's exponent range, so small
// gradients do not underflow as they would in float16.
enum class Compute { Native, BFloat16 };

struct TransformerConfig {
  std::int64_t vocab = 0;             // V: shared by source and target (section 3.4)
  std::int64_t d_model = 64;          // the paper's base model: 512
  std::int64_t heads = 4;             // h (8); d_k = d_v = d_model / h
  std::int64_t d_ff = 256;            // inner width of the feed-forward network (2048)
  std::int64_t encoder_layers = 2;    // N (6)
  std::int64_t decoder_layers = 2;    // N (6)
  double dropout = 0.1;               // residual dropout, P_drop (0.1)
  double attention_dropout = 0.0;     // on the attention weights
  bool pre_norm = false;              // false: the paper's post-norm
  Compute compute = Compute::Native;  // BFloat16: mixed-precision training (see Compute)
};

}  // namespace transformer
