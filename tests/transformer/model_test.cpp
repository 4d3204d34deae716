// The whole Transformer: its gradients against central differences (float64), greedy decoding through
// the KV cache against full recomputation, and a short training run on the date task.
#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "gradient_check.hpp"
#include "tiny_config.hpp"
#include "transformer/loss.hpp"
#include "transformer/training.hpp"
#include "transformer/transformer.hpp"

namespace transformer {
namespace {

using testing::add_parameter_slots;
using testing::expect_matches_finite_differences;
using testing::short_training;
using testing::Slot;
using testing::small_date_config;
using testing::tiny_config;

// B = 3 sources of lengths 6, 2, 4 (padded with 0) and targets of length 5.
TokenBatch tiny_batch(Rng& rng, std::int64_t vocab) {
  TokenBatch batch;
  batch.batch = 3;
  batch.source_lengths = {6, 2, 4};
  for (std::int64_t b = 0; b < 3; ++b)
    for (std::int64_t s = 0; s < 6; ++s)
      batch.source.push_back(s < batch.source_lengths[b] ? 3 + static_cast<int>(rng.next() % (vocab - 3)) : 0);
  for (std::int64_t i = 0; i < 3 * 5; ++i)  // <bos> then 4 tokens per row
    batch.target.push_back(i % 5 == 0 ? 1 : 3 + static_cast<int>(rng.next() % (vocab - 3)));
  return batch;
}

class ModelGradients : public ::testing::TestWithParam<bool> {};  // pre_norm

TEST_P(ModelGradients, EveryParameterThroughTheLabelSmoothedLoss) {
  Rng rng(21);
  Transformer<double> model(tiny_config(GetParam()), 5);
  const TokenBatch batch = tiny_batch(rng, 11);
  std::vector<int> targets;
  for (std::int64_t i = 0; i < 15; ++i) targets.push_back(2 + static_cast<int>(rng.next() % 9));
  LabelSmoothedCrossEntropy<double> criterion(0.1);
  auto loss = [&] { return criterion.forward(model.forward(batch), targets); };
  model.zero_grad();
  loss();
  model.backward(criterion.backward());
  std::vector<Slot> slots;
  add_parameter_slots(model.parameters(), slots);
  EXPECT_GT(slots.size(), 40u);
  expect_matches_finite_differences(loss, slots, 12);
}

INSTANTIATE_TEST_SUITE_P(PostAndPreNorm, ModelGradients, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "PreNorm" : "PostNorm"; });

TEST(ModelDropout, TrainingModeDropsAndEvaluationModeIsDeterministic) {
  Rng rng(22);
  Transformer<double> model(tiny_config(false, 0.3), 6);
  const TokenBatch batch = tiny_batch(rng, 11);
  const Matrix<double> a = model.forward(batch), b = model.forward(batch);
  EXPECT_NE(a.data, b.data);  // a new mask per call
  model.train(false);
  const Matrix<double> c = model.forward(batch), d = model.forward(batch);
  EXPECT_EQ(c.data, d.data);
}

// Greedy decoding through the library's KeyValueCache must write exactly the tokens that recomputing
// the whole prefix at every step writes, with the same logits up to rounding: float64 1e-10 relative
// to the largest logit; float32 2e-4 (the cache's products sum in another order and the errors
// travel through 2 x 3 attention and normalisation layers).
template <class T>
void expect_cached_equals_full(bool pre_norm, std::uint64_t seed, double tolerance) {
  Rng rng(seed);
  TransformerConfig config = tiny_config(pre_norm);
  config.d_model = 16;
  config.heads = 4;
  Transformer<T> model(config, seed);
  for (Parameter<T>* p : model.parameters())  // weights far from the initialisation
    if (p->shape.size() == 2)
      for (auto& v : p->value) v = static_cast<T>(rng.uniform(-1.0, 1.0));
  const TokenBatch batch = tiny_batch(rng, 11);
  std::vector<T> full_logits, cached_logits;
  const std::vector<int> full = model.greedy_decode(batch, 9, 1, /*use_cache=*/false, &full_logits);
  const std::vector<int> cached = model.greedy_decode(batch, 9, 1, /*use_cache=*/true, &cached_logits);
  EXPECT_EQ(full, cached);
  ASSERT_EQ(full_logits.size(), 3u * 9 * 11);
  ASSERT_EQ(cached_logits.size(), full_logits.size());
  double largest = 0.0, worst = 0.0;
  for (std::size_t i = 0; i < full_logits.size(); ++i) {
    largest = std::max(largest, std::abs(static_cast<double>(full_logits[i])));
    worst = std::max(worst, std::abs(static_cast<double>(full_logits[i]) - cached_logits[i]));
  }
  EXPECT_LE(worst, tolerance * largest) << "seed " << seed;
  EXPECT_GT(largest, 0.5);
}

TEST(CachedDecoding, EqualsFullRecomputation) {
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    expect_cached_equals_full<double>(seed % 2 == 0, seed, 1e-10);
    expect_cached_equals_full<float>(seed % 2 == 1, seed, 2e-4);
  }
}

TEST(Training, ShortRunOnDatesLowersTheLoss) {
  Vocabulary vocab;
  Transformer<float> model(small_date_config(vocab.size()), 3);
  const TrainingConfig config = short_training(/*steps=*/60, /*warmup=*/30, /*lr_factor=*/2.0, /*eval_every=*/30);
  const TrainingResult result = train_on_dates(model, vocab, config);
  ASSERT_EQ(result.curve.size(), 2u);
  // Uniform guessing over V tokens costs log V ~ 4.3 per token; after 60 steps the model has learnt at
  // least the fixed characters ("19"/"20", the dashes, <eos>): measured 2.24 (mean over steps 31-60)
  // on this seed; 2.8 leaves room for other thread counts.
  EXPECT_LT(result.curve.back().loss, 2.8);
  EXPECT_LT(result.curve.back().loss, result.curve.front().loss);
}

// A NaN weight makes the first step's loss NaN: training must stop there, naming the step, before the
// step updates anything (the progress callback is not called, the other weights keep their values).
TEST(Training, StopsAtTheFirstNonFiniteLossNamingTheStep) {
  Vocabulary vocab;
  TransformerConfig model_config = tiny_config(/*pre_norm=*/false);
  model_config.vocab = vocab.size();
  Transformer<float> model(model_config, 3);
  ParameterRefs<float> parameters = model.parameters();
  ASSERT_GE(parameters.size(), 2u);
  parameters.front()->value[0] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> before = parameters.back()->value;
  TrainingConfig config;
  config.steps = 5;
  config.batch_size = 4;
  config.eval_every = 5;
  config.eval_examples = 4;
  std::int64_t progress_calls = 0;
  try {
    train_on_dates(model, vocab, config, [&](const Progress&) { ++progress_calls; });
    ADD_FAILURE() << "train_on_dates returned although the loss was NaN";
  } catch (const TrainingDiverged& e) {
    EXPECT_NE(std::string(e.what()).find("step 1 of 5"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("nan"), std::string::npos) << e.what();
  }
  EXPECT_EQ(progress_calls, 0);
  EXPECT_EQ(parameters.back()->value, before) << parameters.back()->name << " changed";
}

}  // namespace
}  // namespace transformer
