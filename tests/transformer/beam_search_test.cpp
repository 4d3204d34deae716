// Beam search (beam_search.hpp, Transformer::beam_decode): the bookkeeping on hand-made log-probabilities;
// one beam against greedy decoding; the best sequence against exhaustive search on a tiny vocabulary;
// every returned hypothesis's log-probabilities against the full forward (teacher forcing, no cache);
// on a briefly trained date model, beams against greedy by the full forward's scores.
//
// Legend: B sources, K beams, V vocabulary, n tokens of a hypothesis.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tiny_config.hpp"
#include "transformer/beam_search.hpp"
#include "transformer/training.hpp"
#include "transformer/transformer.hpp"

namespace transformer {
namespace {

using testing::short_training;
using testing::small_date_config;
using testing::tiny_config;
constexpr int kBos = 1, kEos = 2;

// B = 3 random sources of lengths 6, 2, 4 (padded with 0), ids in [3, vocab).
TokenBatch random_sources(Rng& rng, std::int64_t vocab) {
  TokenBatch batch;
  batch.batch = 3;
  batch.source_lengths = {6, 2, 4};
  for (std::int64_t b = 0; b < 3; ++b)
    for (std::int64_t s = 0; s < 6; ++s)
      batch.source.push_back(s < batch.source_lengths[static_cast<std::size_t>(b)]
                                 ? 3 + static_cast<int>(rng.next() % static_cast<std::uint64_t>(vocab - 3))
                                 : 0);
  return batch;
}

template <class T>
Transformer<T> random_model(TransformerConfig config, std::uint64_t seed) {
  Transformer<T> model(config, seed);
  Rng rng(seed + 100);
  for (Parameter<T>* p : model.parameters())  // weights large enough that the distributions are far from flat
    for (auto& v : p->value) v = static_cast<T>(rng.uniform(-1.0, 1.0));
  return model;
}

// log p(y_i | y_<i, source b) for every token of y, by one full forward over <bos> y_1 .. y_{n-1} of
// source b alone (teacher forcing; no cache), softmax in double.
template <class T>
std::vector<double> forward_log_probs(Transformer<T>& model, const TokenBatch& sources, std::int64_t b,
                                      const std::vector<int>& y) {
  const std::int64_t S = sources.source_len(), V = model.config().vocab;
  TokenBatch one;
  one.batch = 1;
  one.source.assign(sources.source.begin() + b * S, sources.source.begin() + (b + 1) * S);
  one.source_lengths = {sources.source_lengths[static_cast<std::size_t>(b)]};
  one.target = {kBos};
  one.target.insert(one.target.end(), y.begin(), y.end() - 1);
  model.train(false);
  const Matrix<T> logits = model.forward(one);  // [n, V]
  std::vector<double> out;
  for (std::size_t i = 0; i < y.size(); ++i) {
    const T* row = logits.row(static_cast<std::int64_t>(i));
    const double m = static_cast<double>(*std::max_element(row, row + V));
    double sum = 0.0;
    for (std::int64_t j = 0; j < V; ++j) sum += std::exp(static_cast<double>(row[j]) - m);
    out.push_back(static_cast<double>(row[y[i]]) - m - std::log(sum));
  }
  return out;
}

double sum_of(const std::vector<double>& x) {
  double s = 0.0;
  for (double v : x) s += v;
  return s;
}

// Greedy decoding's tokens of source b up to its first <eos> (included).
std::vector<int> greedy_answer(const std::vector<int>& tokens, std::int64_t b, std::int64_t steps) {
  std::vector<int> out;
  for (std::int64_t t = 0; t < steps; ++t) {
    out.push_back(tokens[static_cast<std::size_t>(b * steps + t)]);
    if (out.back() == kEos) break;
  }
  return out;
}

BeamOptions beam_options(std::int64_t beams, std::int64_t steps, std::int64_t page_size = 4) {
  BeamOptions o;
  o.beams = beams;
  o.steps = steps;
  o.bos = kBos;
  o.eos = kEos;
  o.page_size = page_size;
  return o;
}

// ---- the bookkeeping alone ---------------------------------------------------------------------------

// V = 3 (token 2 is <eos>), one source, two steps. Greedy takes token 0 (log p -0.5), then its best is
// -3.0 (total -3.5); token 1 (-1.0) continues with -0.1 (total -1.1), which 2 beams find.
TEST(BeamSearchBookkeeping, TwoBeamsFindWhatGreedyMisses) {
  const double ln = -std::numeric_limits<double>::infinity();
  auto run = [&](std::int64_t K) {
    BeamSearch search(1, K, 2, kEos);
    std::vector<double> step0(static_cast<std::size_t>(K * 3), -50.0);
    step0[0] = -0.5, step0[1] = -1.0, step0[2] = -4.0;  // slot 0; other slots are empty (ignored)
    const std::vector<std::int64_t> parent0 = search.advance(step0, 3);
    EXPECT_EQ(parent0[0], 0);
    std::vector<double> step1(static_cast<std::size_t>(K * 3), ln);
    step1[0] = -3.0, step1[1] = -3.2, step1[2] = -3.1;              // after token 0
    if (K == 2) step1[3] = -0.1, step1[4] = -2.0, step1[5] = -3.0;  // after token 1
    search.advance(step1, 3);
    EXPECT_TRUE(search.done());
    return search.best()[0];
  };
  const BeamHypothesis greedy = run(1), two = run(2);
  EXPECT_EQ(greedy.tokens, (std::vector<int>{0, 0}));
  EXPECT_DOUBLE_EQ(greedy.score, -3.5);
  EXPECT_EQ(two.tokens, (std::vector<int>{1, 0}));
  EXPECT_DOUBLE_EQ(two.score, -1.1);
  EXPECT_EQ(two.log_probs, (std::vector<double>{-1.0, -0.1}));
}

// <eos> finishes a hypothesis; once it scores at least the best live one, the source is done (scores
// never rise), before max_steps.
TEST(BeamSearchBookkeeping, StopsWhenTheBestFinishedBeatsEveryLiveBeam) {
  BeamSearch search(1, 2, 10, kEos);
  search.advance(std::vector<double>{-1.0, -2.0, -0.2, -50, -50, -50}, 3);  // <eos> first: finished at -0.2
  EXPECT_TRUE(search.done());
  EXPECT_EQ(search.best()[0].tokens, (std::vector<int>{kEos}));
  EXPECT_THROW(search.advance(std::vector<double>(6, -1.0), 3), std::logic_error);
}

TEST(BeamSearchBookkeeping, EqualScoresGoToTheLowerTokenAndBadSizesAreRefused) {
  BeamSearch search(1, 1, 3, kEos);
  search.advance(std::vector<double>{-0.7, -0.7, -0.7}, 3);
  EXPECT_EQ(search.next_tokens(kBos, 0), (std::vector<int>{0}));
  EXPECT_THROW(BeamSearch(1, 0, 3, kEos), std::invalid_argument);
  EXPECT_THROW(BeamSearch(1, 2, 0, kEos), std::invalid_argument);
}

// ---- the model ---------------------------------------------------------------------------------------

template <class T>
void expect_one_beam_is_greedy(bool pre_norm, std::uint64_t seed) {
  Transformer<T> model = random_model<T>(tiny_config(pre_norm), seed);
  Rng rng(seed);
  const TokenBatch sources = random_sources(rng, 11);
  const std::int64_t steps = 9;
  const std::vector<int> greedy = model.greedy_decode(sources, steps, kBos, /*use_cache=*/true);
  for (const std::int64_t page_size : {1, 3, 16}) {
    const std::vector<BeamHypothesis> beam = model.beam_decode(sources, beam_options(1, steps, page_size));
    ASSERT_EQ(beam.size(), 3u);
    for (std::int64_t b = 0; b < 3; ++b)
      EXPECT_EQ(beam[static_cast<std::size_t>(b)].tokens, greedy_answer(greedy, b, steps))
          << "seed " << seed << " source " << b << " page size " << page_size;
  }
}

TEST(BeamDecode, OneBeamWritesGreedyDecodingsTokens) {
  for (std::uint64_t seed = 1; seed <= 4; ++seed) {
    expect_one_beam_is_greedy<double>(seed % 2 == 0, seed);
    expect_one_beam_is_greedy<float>(seed % 2 == 1, seed);
  }
}

// Every finished hypothesis's log-probabilities (the n-best list, not only the best) are what the full
// forward gives its tokens: every beam read its own prefix's keys and values through the forks.
template <class T>
void expect_log_probs_match_the_forward(std::uint64_t seed, double tolerance) {
  Transformer<T> model = random_model<T>(tiny_config(seed % 2 == 0), seed);
  Rng rng(seed);
  const TokenBatch sources = random_sources(rng, 11);
  for (const std::int64_t K : {2, 3, 5})
    for (const std::int64_t page_size : {1, 2, 4}) {
      std::vector<std::vector<BeamHypothesis>> finished;
      model.beam_decode(sources, beam_options(K, 7, page_size), &finished);
      ASSERT_EQ(finished.size(), 3u);
      for (std::int64_t b = 0; b < 3; ++b) {
        ASSERT_GE(finished[static_cast<std::size_t>(b)].size(), 1u);
        for (const BeamHypothesis& h : finished[static_cast<std::size_t>(b)]) {
          const std::vector<double> expected = forward_log_probs(model, sources, b, h.tokens);
          ASSERT_EQ(h.log_probs.size(), expected.size());
          for (std::size_t i = 0; i < expected.size(); ++i)
            ASSERT_NEAR(h.log_probs[i], expected[i], tolerance) << "K " << K << " P " << page_size << " token " << i;
          EXPECT_NEAR(h.score, sum_of(expected), tolerance * static_cast<double>(expected.size()));
        }
      }
    }
}

TEST(BeamDecode, ScoresEqualTheFullForwardsLogProbabilities) {
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    expect_log_probs_match_the_forward<double>(seed, 1e-10);
    expect_log_probs_match_the_forward<float>(seed, 1e-4);
  }
}

// With K at least the number of candidates of any step, V (V-1)^(steps-1), nothing is pruned: the best
// sequence is exhaustive search's over all V^steps token strings (each cut after its first <eos>),
// scored by the full forward.
TEST(BeamDecode, EnoughBeamsFindExhaustiveSearchsBest) {
  for (const auto& [V, steps] : {std::pair<std::int64_t, std::int64_t>{5, 3}, {4, 4}}) {
    TransformerConfig config = tiny_config(false);
    config.vocab = V;
    Transformer<double> model = random_model<double>(config, 7);
    Rng rng(11);
    const TokenBatch sources = random_sources(rng, V);
    std::int64_t K = V;
    for (std::int64_t t = 1; t < steps; ++t) K *= V - 1;
    const std::vector<BeamHypothesis> beam = model.beam_decode(sources, beam_options(K, steps));
    for (std::int64_t b = 0; b < 3; ++b) {
      double best = -std::numeric_limits<double>::infinity();
      std::vector<int> best_tokens;
      std::vector<int> y(static_cast<std::size_t>(steps), 0);
      for (std::int64_t code = 0; code < static_cast<std::int64_t>(std::pow(V, steps)); ++code) {
        for (std::int64_t i = 0, c = code; i < steps; ++i, c /= V)
          y[static_cast<std::size_t>(i)] = static_cast<int>(c % V);
        const auto eos = std::find(y.begin(), y.end(), kEos);
        const std::vector<int> answer(y.begin(), eos == y.end() ? y.end() : eos + 1);
        const double score = sum_of(forward_log_probs(model, sources, b, answer));
        if (score > best) best = score, best_tokens = answer;
      }
      EXPECT_EQ(beam[static_cast<std::size_t>(b)].tokens, best_tokens) << "V " << V << " source " << b;
      EXPECT_NEAR(beam[static_cast<std::size_t>(b)].score, best, 1e-10);
    }
  }
}

TEST(BeamDecode, RefusesBadOptions) {
  Transformer<double> model = random_model<double>(tiny_config(false), 1);
  Rng rng(1);
  const TokenBatch sources = random_sources(rng, 11);
  EXPECT_THROW(model.beam_decode(sources, beam_options(0, 5)), std::invalid_argument);
  EXPECT_THROW(model.beam_decode(sources, beam_options(2, 0)), std::invalid_argument);
  EXPECT_THROW(model.beam_decode(sources, beam_options(2, 5, 0)), std::invalid_argument);
}

// A date model trained briefly (unsure enough that beams have choices to make: 49 of the 200 (K, date)
// pairs scored higher than greedy when this was written, with 1 or 2 threads): on
// 100 held-out dates, one beam writes greedy's answers, and 2 and 4 beams return answers that the full
// forward scores higher than greedy's far more often than lower, and at least as high in total. (Beam
// search does not promise beams >= greedy for each date: the greedy prefix can be pushed out of the
// beams by K better-scoring ones that later fall below it. Which dates that happens to depends on the
// trained weights, i.e. on the machine's float32 kernels (oneDNN's and Highway's ISA): none of the 200
// pairs on an AVX-512 Xeon, one (K 2, by 0.12) there with oneDNN capped at AVX2, while the pairs beams
// improve went from 29 to 53 over such changes. So a few are allowed.)
TEST(BeamDecode, OnATrainedModelBeamsScoreAtLeastGreedy) {
  Vocabulary vocab;
  Transformer<float> model(small_date_config(vocab.size()), 3);
  const TrainingConfig config = short_training(/*steps=*/300, /*warmup=*/100, /*lr_factor=*/1.0, /*eval_every=*/300);
  train_on_dates(model, vocab, config);
  const std::vector<DateExample> dates = sample_dates(Split::HeldOut, 5, 100);
  const TokenBatch sources = token_batch(make_batch(dates, vocab));
  const std::int64_t steps = 11;
  const std::vector<int> greedy = model.greedy_decode(sources, steps, kBos, /*use_cache=*/true);
  const std::vector<BeamHypothesis> one = model.beam_decode(sources, beam_options(1, steps));
  int improved = 0, worse = 0;
  std::string worse_pairs;
  for (const std::int64_t K : {2, 4}) {
    const std::vector<BeamHypothesis> beam = model.beam_decode(sources, beam_options(K, steps));
    double greedy_total = 0.0, beam_total = 0.0;
    for (std::int64_t b = 0; b < sources.batch; ++b) {
      const std::vector<int> greedy_tokens = greedy_answer(greedy, b, steps);
      EXPECT_EQ(one[static_cast<std::size_t>(b)].tokens, greedy_tokens) << dates[static_cast<std::size_t>(b)].source;
      const double greedy_score = sum_of(forward_log_probs(model, sources, b, greedy_tokens));
      const double beam_score = sum_of(forward_log_probs(model, sources, b, beam[static_cast<std::size_t>(b)].tokens));
      greedy_total += greedy_score, beam_total += beam_score;
      improved += beam_score > greedy_score + 1e-4;
      if (beam_score < greedy_score - 1e-4) {
        ++worse;
        worse_pairs += " (K " + std::to_string(K) + " " + dates[static_cast<std::size_t>(b)].source + ": " +
                       std::to_string(beam_score) + " < " + std::to_string(greedy_score) + ")";
      }
    }
    EXPECT_GE(beam_total, greedy_total - 1e-3) << "K " << K;
  }
  EXPECT_GT(improved, 0) << "the model is trained too far or too little for beams to differ from greedy";
  EXPECT_LE(worse, 10) << "beams below greedy on more than 5% of the (K, date) pairs:" << worse_pairs;
  EXPECT_GT(improved, 4 * worse) << "beams below greedy about as often as above:" << worse_pairs;
}

}  // namespace
}  // namespace transformer
