// The model sizes the Transformer's tests share: a tiny one for float64 finite differences, a small one that
// learns something about dates in a few hundred steps, and the short training run such tests give it.
#pragma once

#include "transformer/training.hpp"
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

// d_model 32, 2 heads, d_ff 64, one encoder and one decoder layer, over `vocab` tokens.
inline TransformerConfig small_date_config(std::int64_t vocab, Compute compute = Compute::Native) {
  TransformerConfig c;
  c.vocab = vocab;
  c.d_model = 32;
  c.heads = 2;
  c.d_ff = 64;
  c.encoder_layers = 1;
  c.decoder_layers = 1;
  c.compute = compute;
  return c;
}

// `steps` of training in batches of `batch_size` with the schedule's warm-up and factor, the held-out
// accuracy measured on `eval_examples` dates every `eval_every` steps.
inline TrainingConfig short_training(std::int64_t steps, std::int64_t warmup, double lr_factor, std::int64_t eval_every,
                                     std::int64_t batch_size = 32, std::int64_t eval_examples = 20) {
  TrainingConfig c;
  c.steps = steps;
  c.batch_size = batch_size;
  c.warmup = warmup;
  c.lr_factor = lr_factor;
  c.eval_every = eval_every;
  c.eval_examples = eval_examples;
  return c;
}

}  // namespace transformer::testing
