// Head gates on the Transformer's attention blocks (Transformer::set_head_gate, the library's
// MultiHeadAttentionInputs::head_gate): a gate of ones changes nothing, a gate of 0 on head i gives the
// model whose W^O has head i's columns zeroed by hand (Concat(head_1..head_h) W^O without head i's
// block), on the teacher-forced forward and on greedy decoding through the KV cache, for each kind of
// attention; and the gated model's parameter gradients match finite differences (float64).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "gradient_check.hpp"
#include "tiny_config.hpp"
#include "transformer/loss.hpp"
#include "transformer/transformer.hpp"

namespace transformer {
namespace {

using testing::tiny_config;

// B = 2 sources of lengths 5 and 3 (padded with 0), targets <bos> + 3 tokens.
TokenBatch gate_batch() {
  TokenBatch batch;
  batch.batch = 2;
  batch.source = {3, 4, 5, 6, 7, 8, 9, 10, 0, 0};
  batch.source_lengths = {5, 3};
  batch.target = {1, 4, 6, 8, 1, 9, 3, 5};
  return batch;
}

std::string block_prefix(AttentionKind kind, std::int64_t layer) {
  const std::string l = std::to_string(layer);
  if (kind == AttentionKind::EncoderSelf) return "encoder." + l + ".self_attn.";
  return "decoder." + l + (kind == AttentionKind::DecoderSelf ? ".self_attn." : ".cross_attn.");
}

// The model's out_proj.weight [E, h*d_v] of one block with head `head`'s columns set to 0.
void zero_head_columns(Transformer<float>& model, AttentionKind kind, std::int64_t layer, std::int64_t head) {
  const std::string name = block_prefix(kind, layer) + "out_proj.weight";
  for (Parameter<float>* p : model.parameters()) {
    if (p->name != name) continue;
    const std::int64_t E = p->shape[0], hd = p->shape[1], d_v = hd / model.config().heads;
    for (std::int64_t e = 0; e < E; ++e)
      for (std::int64_t c = head * d_v; c < (head + 1) * d_v; ++c) p->value[static_cast<std::size_t>(e * hd + c)] = 0;
    return;
  }
  FAIL() << "no parameter " << name;
}

// The same model (seed 7) every time, in evaluation mode.
std::unique_ptr<Transformer<float>> evaluation_model() {
  auto model = std::make_unique<Transformer<float>>(tiny_config(/*pre_norm=*/false), 7);
  model->train(false);
  return model;
}

TEST(HeadGate, OnesOnEveryBlockAreBitwiseNoGate) {
  const auto owner = evaluation_model();
  Transformer<float>& model = *owner;
  const TokenBatch batch = gate_batch();
  const std::vector<float> plain = model.forward(batch).data;
  for (AttentionKind kind : kAttentionKinds)
    for (std::int64_t layer = 0; layer < model.layers_of(kind); ++layer) model.set_head_gate(kind, layer, {1.f, 1.f});
  EXPECT_EQ(model.forward(batch).data, plain);
}

class HeadGateOff : public ::testing::TestWithParam<AttentionKind> {};

TEST_P(HeadGateOff, EqualsTheModelWithTheHeadsColumnsOfWOZeroed) {
  const AttentionKind kind = GetParam();
  const TokenBatch batch = gate_batch();
  const auto gated_model = evaluation_model(), zeroed_model = evaluation_model();
  Transformer<float>&gated = *gated_model, &zeroed = *zeroed_model;
  const std::vector<float> plain = gated.forward(batch).data;
  gated.set_head_gate(kind, 1, {1.f, 0.f});
  zero_head_columns(zeroed, kind, 1, 1);
  const std::vector<float> with_gate = gated.forward(batch).data, by_hand = zeroed.forward(batch).data;
  ASSERT_EQ(with_gate.size(), by_hand.size());
  float changed = 0;
  for (std::size_t i = 0; i < by_hand.size(); ++i) {
    EXPECT_NEAR(with_gate[i], by_hand[i], 1e-5f) << i;
    changed = std::max(changed, std::abs(with_gate[i] - plain[i]));
  }
  EXPECT_GT(changed, 1e-3f) << "the gate changed nothing";
  // Greedy decoding through the KV cache (the attend path) and by recomputation agree with the
  // zeroed model's.
  std::vector<float> gated_logits, zeroed_logits;
  const std::vector<int> by_cache = gated.greedy_decode(batch, 4, 1, /*use_cache=*/true, &gated_logits);
  EXPECT_EQ(by_cache, zeroed.greedy_decode(batch, 4, 1, /*use_cache=*/true, &zeroed_logits));
  EXPECT_EQ(by_cache, gated.greedy_decode(batch, 4, 1, /*use_cache=*/false));
  for (std::size_t i = 0; i < zeroed_logits.size(); ++i) EXPECT_NEAR(gated_logits[i], zeroed_logits[i], 1e-5f) << i;
  // Removing the gate restores the model.
  gated.clear_head_gates();
  EXPECT_EQ(gated.forward(batch).data, plain);
}

INSTANTIATE_TEST_SUITE_P(EachKind, HeadGateOff,
                         ::testing::Values(AttentionKind::EncoderSelf, AttentionKind::DecoderSelf,
                                           AttentionKind::Cross),
                         [](const auto& info) { return std::string(kind_slug(info.param)); });

TEST(HeadGate, TheGatedModelsGradientsMatchFiniteDifferences) {
  Transformer<double> model(tiny_config(/*pre_norm=*/false), 5);
  model.set_head_gate(AttentionKind::EncoderSelf, 0, {0.0, 1.5});
  model.set_head_gate(AttentionKind::DecoderSelf, 1, {0.5, 1.0});
  model.set_head_gate(AttentionKind::Cross, 1, {1.0, 0.0});
  const TokenBatch batch = gate_batch();
  const std::vector<int> targets = {4, 6, 8, 2, 9, 3, 5, 2};
  LabelSmoothedCrossEntropy<double> criterion(0.1);
  auto loss = [&] { return criterion.forward(model.forward(batch), targets); };
  model.zero_grad();
  loss();
  model.backward(criterion.backward());
  std::vector<testing::Slot> slots;
  testing::add_parameter_slots(model.parameters(), slots);
  testing::expect_matches_finite_differences(loss, slots, 12);
  // Head 0 of encoder layer 0 is off: its query, key and value projections get no gradient at all.
  for (const Parameter<double>* p : model.parameters()) {
    if (p->name != "encoder.0.self_attn.in_proj_weight") continue;
    const std::int64_t E = p->shape[1], d_k = E / 2;  // rows: q (h * d_k), k, v; head 0 first in each
    for (std::int64_t block = 0; block < 3; ++block)
      for (std::int64_t r = block * E; r < block * E + d_k; ++r)
        for (std::int64_t c = 0; c < E; ++c) EXPECT_EQ(p->grad[static_cast<std::size_t>(r * E + c)], 0.0) << r << c;
  }
}

TEST(HeadGate, ABadGateOrLayerIsRefusedByName) {
  const auto owner = evaluation_model();
  Transformer<float>& model = *owner;
  try {
    model.set_head_gate(AttentionKind::Cross, 0, {1.f, 0.f, 1.f});
    FAIL() << "a gate of 3 values for 2 heads was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("expected 2 values, got 3"), std::string::npos) << e.what();
  }
  EXPECT_THROW(model.set_head_gate(AttentionKind::EncoderSelf, 2, {1.f, 0.f}), std::out_of_range);
  EXPECT_THROW(model.set_head_gate(AttentionKind::DecoderSelf, -1, {1.f, 0.f}), std::out_of_range);
}

}  // namespace
}  // namespace transformer
