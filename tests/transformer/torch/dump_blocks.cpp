// transformer_dump_blocks OUT_DIR: runs each block of the Transformer forward and backward in float64
// on fixed random inputs and writes everything needed to redo the computation in PyTorch to
// OUT_DIR/<case>.safetensors. tests/python/test_transformer_torch.py rebuilds each case from torch
// primitives and compares the outputs and every gradient with torch autograd.
//
// Each file holds (all float64; integer data such as token ids and key lengths as float64 values):
//   param.<name>        every parameter of the block, after the values below were set
//   grad.<name>         its gradient from the block's backward (zeroed before the one backward)
//   input.<name>        the block's inputs: x, query, key_value, memory, ids, key_lengths, ...
//   out, dout           the block's output and the random gradient given to its backward
//                       (embedding: out.embed / out.logits and dout.embed / dout.logits; loss and
//                       transformer: out = the loss [1], dout = [1] = 1)
//   grad_input.<name>   the gradient of each differentiable input
// and metadata: "case", "block" (the kind) and the sizes (B, L, S, d_model, heads, d_ff, pre_norm, ...).
//
// Every 1-D parameter (biases, LayerNorm gamma and beta) is set to random values, away from their
// initial 0 / 1, so that a forward that ignored one, or a backward that assumed gamma = 1, shows.
// Dropout is 0 throughout: a random mask has no counterpart in torch.
// Legend: B batch, L queries, S keys (source positions), T target positions, d = d_model, V vocabulary.
#include <cstdint>
#include <exception>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "mha/io.hpp"
#include "tiny_config.hpp"
#include "transformer/attention_block.hpp"
#include "transformer/decoder_layer.hpp"
#include "transformer/embedding.hpp"
#include "transformer/encoder_layer.hpp"
#include "transformer/feed_forward.hpp"
#include "transformer/layer_norm.hpp"
#include "transformer/linear.hpp"
#include "transformer/loss.hpp"
#include "transformer/residual.hpp"
#include "transformer/transformer.hpp"

namespace transformer {
namespace {

using M = Matrix<double>;

M random_matrix(std::int64_t rows, std::int64_t cols, Rng& rng, double scale = 1.0) {
  M m(rows, cols);
  for (auto& v : m.data) v = scale * rng.uniform(-1.0, 1.0);
  return m;
}

std::vector<int> random_ids(std::int64_t n, std::int64_t vocab, Rng& rng) {
  std::vector<int> ids(static_cast<std::size_t>(n));
  for (auto& id : ids) id = static_cast<int>(rng.next() % static_cast<std::uint64_t>(vocab));
  return ids;
}

// Biases and LayerNorm parameters (every 1-D parameter) -> U(-1.5, 1.5); zeroes every gradient.
void randomize_vectors_zero_grads(const ParameterRefs<double>& params, Rng& rng) {
  for (Parameter<double>* p : params) {
    if (p->shape.size() == 1)
      for (auto& v : p->value) v = rng.uniform(-1.5, 1.5);
    std::fill(p->grad.begin(), p->grad.end(), 0.0);
  }
}

// One case's tensors and metadata, written as one safetensors file.
class Dump {
 public:
  Dump(std::string name, std::string block) : name_(std::move(name)) {
    meta_["case"] = name_;
    meta_["block"] = std::move(block);
  }

  void meta(const std::string& key, const std::string& value) { meta_[key] = value; }
  void meta(const std::string& key, std::int64_t value) { meta_[key] = std::to_string(value); }
  void meta(const std::string& key, bool value) { meta_[key] = value ? "true" : "false"; }

  void tensor(const std::string& key, std::vector<double> values, std::vector<std::int64_t> shape) {
    tensors_[key] = {std::move(values), std::move(shape)};
  }
  void matrix(const std::string& key, const M& m) { tensor(key, m.data, {m.rows, m.cols}); }
  void scalar(const std::string& key, double v) { tensor(key, {v}, {1}); }
  template <class Int>
  void integers(const std::string& key, const std::vector<Int>& v, std::vector<std::int64_t> shape) {
    tensor(key, std::vector<double>(v.begin(), v.end()), std::move(shape));
  }
  void parameters(const ParameterRefs<double>& params) {
    for (const Parameter<double>* p : params) {
      tensor("param." + p->name, p->value, p->shape);
      tensor("grad." + p->name, p->grad, p->shape);
    }
  }

  void write(const std::filesystem::path& dir) const {
    std::map<std::string, mha::TensorView> views;
    for (const auto& [key, t] : tensors_)
      views.emplace(key, mha::TensorView(t.values.data(), mha::DType::Float64, t.shape));
    mha::write_safetensors((dir / (name_ + ".safetensors")).string(), views, meta_);
  }

 private:
  struct Stored {
    std::vector<double> values;
    std::vector<std::int64_t> shape;
  };
  std::string name_;
  std::map<std::string, Stored> tensors_;
  std::map<std::string, std::string> meta_;
};

// The entries every block with one input x has: x, out, dout, d x and the parameters with their gradients.
Dump one_input_dump(const std::string& name, const std::string& kind, const M& x, const M& out, const M& dout,
                    const M& dx, const ParameterRefs<double>& params) {
  Dump d(name, kind);
  d.matrix("input.x", x);
  d.matrix("out", out);
  d.matrix("dout", dout);
  d.matrix("grad_input.x", dx);
  d.parameters(params);
  return d;
}

// y = x W^T + b: x [6, 7] -> [6, 5].
Dump dump_linear() {
  Rng rng(101);
  Linear<double> linear("linear", 7, 5, rng);
  ParameterRefs<double> params;
  linear.collect(params);
  randomize_vectors_zero_grads(params, rng);
  const M x = random_matrix(6, 7, rng), dout = random_matrix(6, 5, rng);
  const M out = linear.forward(x);
  const M dx = linear.backward(dout);
  Dump d = one_input_dump("linear", "linear", x, out, dout, dx, params);
  d.meta("in", std::int64_t{7});
  d.meta("out", std::int64_t{5});
  return d;
}

// LayerNorm over d = 9 with random gamma, beta; x of scale 3 [5, 9].
Dump dump_layer_norm() {
  Rng rng(102);
  LayerNorm<double> norm("norm", 9);
  ParameterRefs<double> params;
  norm.collect(params);
  randomize_vectors_zero_grads(params, rng);
  const M x = random_matrix(5, 9, rng, 3.0), dout = random_matrix(5, 9, rng);
  const M out = norm.forward(x);
  const M dx = norm.backward(dout);
  Dump d = one_input_dump("layer_norm", "layer_norm", x, out, dout, dx, params);
  d.meta("d_model", std::int64_t{9});
  return d;
}

// linear1 (6 -> 11) -> ReLU -> linear2 (11 -> 6) on x [7, 6].
Dump dump_feed_forward() {
  Rng rng(103);
  FeedForward<double> ffn("ffn", 6, 11, rng);
  ParameterRefs<double> params;
  ffn.collect(params);
  randomize_vectors_zero_grads(params, rng);
  const M x = random_matrix(7, 6, rng), dout = random_matrix(7, 6, rng);
  const M out = ffn.forward(x);
  const M dx = ffn.backward(dout);
  Dump d = one_input_dump("feed_forward", "feed_forward", x, out, dout, dx, params);
  d.meta("d_model", std::int64_t{6});
  d.meta("d_ff", std::int64_t{11});
  return d;
}

// One table E [V=10, d=6]: embed(ids) = sqrt(d) E[ids] (ids repeat, so their rows' gradients add) and
// logits(h) = h E^T; the table's gradient is the sum from both uses.
Dump dump_embedding() {
  Rng rng(104);
  SharedEmbedding<double> embedding("embedding.weight", 10, 6, rng);
  ParameterRefs<double> params;
  embedding.collect(params);
  randomize_vectors_zero_grads(params, rng);
  const std::vector<int> ids{3, 1, 3, 9, 0, 7, 3};
  const M h = random_matrix(4, 6, rng);
  const M dembed = random_matrix(7, 6, rng), dlogits = random_matrix(4, 10, rng);
  const M embedded = embedding.embed(ids);
  const M logits = embedding.logits(h);
  embedding.embed_backward(dembed, ids);
  const M dh = embedding.logits_backward(dlogits);
  Dump d("embedding", "embedding");
  d.meta("vocab", std::int64_t{10});
  d.meta("d_model", std::int64_t{6});
  d.integers("input.ids", ids, {7});
  d.matrix("input.h", h);
  d.matrix("out.embed", embedded);
  d.matrix("out.logits", logits);
  d.matrix("dout.embed", dembed);
  d.matrix("dout.logits", dlogits);
  d.matrix("grad_input.h", dh);
  d.parameters(params);
  return d;
}

// mha::MultiHeadAttention as a block: B = 2, L = 5, d = 8, 2 heads; self-attention (S = L, one input
// x fed as query, key and value) or cross-attention (S = 7, query and key_value).
Dump dump_attention(const std::string& name, bool self, bool causal, const std::vector<std::int64_t>& key_lengths) {
  Rng rng(105);
  const std::int64_t B = 2, L = 5, S = self ? 5 : 7, E = 8, heads = 2;
  AttentionBlock<double> attention("attn", E, heads, 0.0, 11);
  ParameterRefs<double> params;
  attention.collect(params);
  randomize_vectors_zero_grads(params, rng);
  const M q = random_matrix(B * L, E, rng), kv = random_matrix(B * S, E, rng), dout = random_matrix(B * L, E, rng);
  const M out = attention.forward(q, self ? q : kv, B, key_lengths, causal);
  const auto g = attention.backward(dout, B);
  Dump d(name, self ? "self_attention" : "cross_attention");
  d.meta("B", B);
  d.meta("L", L);
  d.meta("S", S);
  d.meta("d_model", E);
  d.meta("heads", heads);
  d.meta("causal", causal);
  if (!key_lengths.empty()) d.integers("input.key_lengths", key_lengths, {B});
  if (self) {
    d.matrix("input.x", q);
    d.matrix("grad_input.x", sum(g.query, g.key_value));
  } else {
    d.matrix("input.query", q);
    d.matrix("input.key_value", kv);
    d.matrix("grad_input.query", g.query);
    d.matrix("grad_input.key_value", g.key_value);
  }
  d.matrix("out", out);
  d.matrix("dout", dout);
  d.parameters(params);
  return d;
}

// Residual around a FeedForward (d = 6, d_ff = 10): LN(x + FFN(x)) or x + FFN(LN(x)); x [5, 6].
Dump dump_residual(bool pre_norm) {
  Rng rng(106);
  FeedForward<double> ffn("ffn", 6, 10, rng);
  Residual<double> residual("norm", 6, 0.0, pre_norm, 1);
  ParameterRefs<double> params;
  ffn.collect(params);
  residual.collect(params);
  randomize_vectors_zero_grads(params, rng);
  const M x = random_matrix(5, 6, rng), dout = random_matrix(5, 6, rng);
  const M out = residual.forward(x, [&](const M& u) { return ffn.forward(u); });
  const M dx = residual.backward(dout, [&](const M& g) { return ffn.backward(g); });
  Dump d = one_input_dump(pre_norm ? "residual_ffn_pre_norm" : "residual_ffn_post_norm", "residual_ffn", x, out, dout,
                          dx, params);
  d.meta("d_model", std::int64_t{6});
  d.meta("d_ff", std::int64_t{10});
  d.meta("pre_norm", pre_norm);
  return d;
}

void config_metadata(Dump& d, const TransformerConfig& c) {
  d.meta("d_model", c.d_model);
  d.meta("heads", c.heads);
  d.meta("d_ff", c.d_ff);
  d.meta("pre_norm", c.pre_norm);
}

// EncoderLayer "encoder.0": B = 2, S = 6, source lengths {6, 4}; x [B*S, d].
Dump dump_encoder_layer(bool pre_norm) {
  Rng rng(107);
  const TransformerConfig c = testing::tiny_config(pre_norm);
  EncoderLayer<double> layer("encoder.0", c, rng);
  const std::int64_t B = 2, S = 6;
  const std::vector<std::int64_t> lengths{6, 4};
  ParameterRefs<double> params;
  layer.collect(params);
  randomize_vectors_zero_grads(params, rng);
  const M x = random_matrix(B * S, c.d_model, rng), dout = random_matrix(B * S, c.d_model, rng);
  const M out = layer.forward(x, B, lengths);
  const M dx = layer.backward(dout);
  Dump d = one_input_dump(pre_norm ? "encoder_layer_pre_norm" : "encoder_layer_post_norm", "encoder_layer", x, out,
                          dout, dx, params);
  config_metadata(d, c);
  d.meta("prefix", std::string("encoder.0"));
  d.meta("B", B);
  d.meta("S", S);
  d.integers("input.key_lengths", lengths, {B});
  return d;
}

// DecoderLayer "decoder.0": B = 2, T = 4, S = 6, source lengths {3, 6}; x [B*T, d], memory [B*S, d].
Dump dump_decoder_layer(bool pre_norm) {
  Rng rng(108);
  const TransformerConfig c = testing::tiny_config(pre_norm);
  DecoderLayer<double> layer("decoder.0", c, rng);
  const std::int64_t B = 2, T = 4, S = 6;
  const std::vector<std::int64_t> lengths{3, 6};
  ParameterRefs<double> params;
  layer.collect(params);
  randomize_vectors_zero_grads(params, rng);
  const M x = random_matrix(B * T, c.d_model, rng), memory = random_matrix(B * S, c.d_model, rng);
  const M dout = random_matrix(B * T, c.d_model, rng);
  const M out = layer.forward(x, memory, B, lengths);
  M dmemory(B * S, c.d_model);
  const M dx = layer.backward(dout, dmemory);
  Dump d(pre_norm ? "decoder_layer_pre_norm" : "decoder_layer_post_norm", "decoder_layer");
  config_metadata(d, c);
  d.meta("prefix", std::string("decoder.0"));
  d.meta("B", B);
  d.meta("T", T);
  d.meta("S", S);
  d.integers("input.key_lengths", lengths, {B});
  d.matrix("input.x", x);
  d.matrix("input.memory", memory);
  d.matrix("out", out);
  d.matrix("dout", dout);
  d.matrix("grad_input.x", dx);
  d.matrix("grad_input.memory", dmemory);
  d.parameters(params);
  return d;
}

// Mean label-smoothed cross-entropy (eps 0.1) of logits [6, 8] (scale 4) against targets [6].
Dump dump_loss() {
  Rng rng(109);
  const M logits = random_matrix(6, 8, rng, 4.0);
  const std::vector<int> targets{0, 7, 3, 3, 5, 1};
  LabelSmoothedCrossEntropy<double> loss(0.1);
  const double value = loss.forward(logits, targets);
  Dump d("label_smoothed_cross_entropy", "label_smoothed_cross_entropy");
  d.meta("smoothing", std::string("0.1"));
  d.matrix("input.logits", logits);
  d.integers("input.targets", targets, {6});
  d.scalar("out", value);
  d.scalar("dout", 1.0);
  d.matrix("grad_input.logits", loss.backward());
  return d;
}

// The whole model (vocab 11, d 8, 2 heads, d_ff 12, 2 + 2 layers): B = 3, S = 6 with source lengths
// {6, 2, 4}, T = 5; loss = label-smoothed cross-entropy (0.1) of the logits against random targets.
Dump dump_transformer(bool pre_norm) {
  Rng rng(110);
  const TransformerConfig c = testing::tiny_config(pre_norm);
  Transformer<double> model(c, 7);
  randomize_vectors_zero_grads(model.parameters(), rng);
  const std::int64_t B = 3, S = 6, T = 5;
  TokenBatch batch;
  batch.batch = B;
  batch.source = random_ids(B * S, c.vocab, rng);
  batch.source_lengths = {6, 2, 4};
  batch.target = random_ids(B * T, c.vocab, rng);
  const std::vector<int> targets = random_ids(B * T, c.vocab, rng);
  LabelSmoothedCrossEntropy<double> loss(0.1);
  const M logits = model.forward(batch);
  const double value = loss.forward(logits, targets);
  model.backward(loss.backward());
  Dump d(pre_norm ? "transformer_pre_norm" : "transformer_post_norm", "transformer");
  config_metadata(d, c);
  d.meta("vocab", c.vocab);
  d.meta("encoder_layers", c.encoder_layers);
  d.meta("decoder_layers", c.decoder_layers);
  d.meta("smoothing", std::string("0.1"));
  d.meta("B", B);
  d.meta("S", S);
  d.meta("T", T);
  d.integers("input.source", batch.source, {B, S});
  d.integers("input.source_lengths", batch.source_lengths, {B});
  d.integers("input.target", batch.target, {B, T});
  d.integers("input.targets", targets, {B * T});
  d.matrix("logits", logits);
  d.scalar("out", value);
  d.scalar("dout", 1.0);
  d.parameters(model.parameters());
  return d;
}

}  // namespace
}  // namespace transformer

int main(int argc, char** argv) {
  using namespace transformer;
  if (argc != 2) {
    std::cerr << "usage: transformer_dump_blocks OUT_DIR\n";
    return 2;
  }
  try {
    const std::filesystem::path dir(argv[1]);
    std::filesystem::create_directories(dir);
    const std::vector<Dump> dumps{
        dump_linear(),
        dump_layer_norm(),
        dump_feed_forward(),
        dump_embedding(),
        dump_attention("attention_self", true, false, {}),
        dump_attention("attention_self_causal", true, true, {}),
        dump_attention("attention_self_key_lengths", true, false, {5, 3}),
        dump_attention("attention_self_causal_key_lengths", true, true, {4, 2}),
        dump_attention("attention_cross_key_lengths", false, false, {7, 2}),
        dump_residual(false),
        dump_residual(true),
        dump_encoder_layer(false),
        dump_encoder_layer(true),
        dump_decoder_layer(false),
        dump_decoder_layer(true),
        dump_loss(),
        dump_transformer(false),
        dump_transformer(true),
    };
    for (const Dump& d : dumps) d.write(dir);
  } catch (const std::exception& e) {
    std::cerr << "transformer_dump_blocks: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
