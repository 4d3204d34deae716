// Each block of the Transformer: its backward against central differences in float64
// (gradient_check.hpp). Dropout is off here (a random mask per call has no derivative to check);
// dropout_test.cpp checks that its backward uses its forward's mask.
#include <gtest/gtest.h>

#include "gradient_check.hpp"
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

namespace transformer {
namespace {

using testing::add_parameter_slots;
using testing::expect_matches_finite_differences;
using testing::random_matrix;
using testing::Slot;
using testing::tiny_config;
using testing::weighted_sum;

// Runs the standard check for a block with one input: loss = sum(w * forward(x)).
template <class Block>
void check_one_input_block(Block& block, Matrix<double> x, std::int64_t out_cols, Rng& rng) {
  const Matrix<double> w = random_matrix(x.rows, out_cols, rng);
  ParameterRefs<double> params;
  block.collect(params);
  for (auto* p : params) std::fill(p->grad.begin(), p->grad.end(), 0.0);
  block.forward(x);
  const Matrix<double> dx = block.backward(w);
  std::vector<Slot> slots{{"x", &x.data, dx.data}};
  add_parameter_slots(params, slots);
  expect_matches_finite_differences([&] { return weighted_sum(block.forward(x), w); }, slots);
}

TEST(BlockGradients, Linear) {
  Rng rng(1);
  Linear<double> linear("linear", 7, 5, rng);
  check_one_input_block(linear, random_matrix(6, 7, rng), 5, rng);
}

TEST(BlockGradients, LayerNorm) {
  Rng rng(2);
  LayerNorm<double> norm("norm", 9);
  ParameterRefs<double> params;
  norm.collect(params);
  for (auto* p : params)  // away from gamma = 1, beta = 0, so their gradients matter
    for (auto& v : p->value) v = rng.uniform(-1.5, 1.5);
  check_one_input_block(norm, random_matrix(5, 9, rng, 3.0), 9, rng);
}

TEST(BlockGradients, FeedForward) {
  Rng rng(3);
  FeedForward<double> ffn("ffn", 6, 11, rng);
  check_one_input_block(ffn, random_matrix(7, 6, rng), 6, rng);
}

TEST(BlockGradients, EmbeddingLookupAndPreSoftmaxMapShareOneTable) {
  Rng rng(4);
  SharedEmbedding<double> embedding("embedding.weight", 10, 6, rng);
  const std::vector<int> ids{3, 1, 3, 9, 0};  // 3 twice: its gradient must be the sum
  Matrix<double> h = random_matrix(4, 6, rng);
  const Matrix<double> w_embed = random_matrix(5, 6, rng), w_logits = random_matrix(4, 10, rng);
  auto loss = [&] { return weighted_sum(embedding.embed(ids), w_embed) + weighted_sum(embedding.logits(h), w_logits); };
  ParameterRefs<double> params;
  embedding.collect(params);
  loss();
  embedding.embed_backward(w_embed, ids);
  const Matrix<double> dh = embedding.logits_backward(w_logits);
  std::vector<Slot> slots{{"h", &h.data, dh.data}};
  add_parameter_slots(params, slots);
  expect_matches_finite_differences(loss, slots, 60);
}

TEST(BlockGradients, LabelSmoothedCrossEntropy) {
  Rng rng(5);
  Matrix<double> logits = random_matrix(6, 8, rng, 4.0);
  const std::vector<int> targets{0, 7, 3, 3, 5, 1};
  LabelSmoothedCrossEntropy<double> loss(0.1);
  loss.forward(logits, targets);
  std::vector<Slot> slots{{"logits", &logits.data, loss.backward().data}};
  expect_matches_finite_differences([&] { return loss.forward(logits, targets); }, slots, 48);
}

struct AttentionCase {
  bool self;
  bool causal;
  std::vector<std::int64_t> key_lengths;
};

class AttentionBlockGradients : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(AttentionBlockGradients, QueryKeyValueAndParameters) {
  const AttentionCase c = GetParam();
  Rng rng(6);
  const std::int64_t B = 2, L = 5, S = c.self ? 5 : 7, E = 8;
  AttentionBlock<double> attention("attn", E, 2, 0.0, 11);
  Matrix<double> q = random_matrix(B * L, E, rng), kv = random_matrix(B * S, E, rng);
  const Matrix<double> w = random_matrix(B * L, E, rng);
  auto forward = [&] { return attention.forward(q, c.self ? q : kv, B, c.key_lengths, c.causal); };
  ParameterRefs<double> params;
  attention.collect(params);
  forward();
  auto g = attention.backward(w, B);
  std::vector<Slot> slots;
  if (c.self) slots.push_back({"x", &q.data, sum(g.query, g.key_value).data});
  else slots = {{"query", &q.data, g.query.data}, {"key_value", &kv.data, g.key_value.data}};
  add_parameter_slots(params, slots);
  expect_matches_finite_differences([&] { return weighted_sum(forward(), w); }, slots);
}

INSTANTIATE_TEST_SUITE_P(Cases, AttentionBlockGradients,
                         ::testing::Values(AttentionCase{true, false, {}}, AttentionCase{true, true, {}},
                                           AttentionCase{true, false, {5, 3}}, AttentionCase{false, false, {7, 2}}));

class LayerGradients : public ::testing::TestWithParam<bool> {};  // pre_norm

TEST_P(LayerGradients, ResidualAroundFeedForward) {
  Rng rng(7);
  FeedForward<double> ffn("ffn", 6, 10, rng);
  Residual<double> residual("norm", 6, 0.0, GetParam(), 1);
  Matrix<double> x = random_matrix(5, 6, rng);
  const Matrix<double> w = random_matrix(5, 6, rng);
  auto forward = [&] { return residual.forward(x, [&](const Matrix<double>& u) { return ffn.forward(u); }); };
  ParameterRefs<double> params;
  ffn.collect(params);
  residual.collect(params);
  forward();
  const Matrix<double> dx = residual.backward(w, [&](const Matrix<double>& g) { return ffn.backward(g); });
  std::vector<Slot> slots{{"x", &x.data, dx.data}};
  add_parameter_slots(params, slots);
  expect_matches_finite_differences([&] { return weighted_sum(forward(), w); }, slots);
}

TEST_P(LayerGradients, EncoderLayer) {
  Rng rng(8);
  const TransformerConfig config = tiny_config(GetParam());
  EncoderLayer<double> layer("encoder.0", config, rng);
  const std::int64_t B = 2, S = 6;
  const std::vector<std::int64_t> lengths{6, 4};
  Matrix<double> x = random_matrix(B * S, config.d_model, rng);
  const Matrix<double> w = random_matrix(B * S, config.d_model, rng);
  ParameterRefs<double> params;
  layer.collect(params);
  layer.forward(x, B, lengths);
  const Matrix<double> dx = layer.backward(w);
  std::vector<Slot> slots{{"x", &x.data, dx.data}};
  add_parameter_slots(params, slots);
  expect_matches_finite_differences([&] { return weighted_sum(layer.forward(x, B, lengths), w); }, slots);
}

TEST_P(LayerGradients, DecoderLayer) {
  Rng rng(9);
  const TransformerConfig config = tiny_config(GetParam());
  DecoderLayer<double> layer("decoder.0", config, rng);
  const std::int64_t B = 2, T = 4, S = 6;
  const std::vector<std::int64_t> lengths{3, 6};
  Matrix<double> x = random_matrix(B * T, config.d_model, rng), memory = random_matrix(B * S, config.d_model, rng);
  const Matrix<double> w = random_matrix(B * T, config.d_model, rng);
  ParameterRefs<double> params;
  layer.collect(params);
  layer.forward(x, memory, B, lengths);
  Matrix<double> dmemory(B * S, config.d_model);
  const Matrix<double> dx = layer.backward(w, dmemory);
  std::vector<Slot> slots{{"x", &x.data, dx.data}, {"memory", &memory.data, dmemory.data}};
  add_parameter_slots(params, slots);
  expect_matches_finite_differences([&] { return weighted_sum(layer.forward(x, memory, B, lengths), w); }, slots);
}

INSTANTIATE_TEST_SUITE_P(PostAndPreNorm, LayerGradients, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "PreNorm" : "PostNorm"; });

}  // namespace
}  // namespace transformer
