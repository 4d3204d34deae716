// The date model's decoding with each self-attention cache dtype (next_char_distributions.hpp).
#include "transformer/next_char_distributions.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <string>

#include "transformer/training.hpp"

namespace transformer {
namespace {

constexpr auto kSteps = static_cast<std::int64_t>(kIsoLength) + 1;  // n: 10 characters and <eos>

BeamOptions date_options(mha::KVStorage storage) {
  BeamOptions o;
  o.beams = 1;
  o.steps = kSteps;
  o.bos = Vocabulary::kBos;
  o.eos = Vocabulary::kEos;
  o.kv_storage = storage;
  return o;
}

// KL(p || q) = sum_j p_j (log p_j - log q_j) of two rows of log-probabilities [V]; p_j = 0 adds nothing
// (where log q_j may be -inf too).
double kl_divergence(const double* log_p, const double* log_q, std::int64_t V) {
  double sum = 0.0;
  for (std::int64_t j = 0; j < V; ++j)
    if (const double p = std::exp(log_p[j]); p > 0.0) sum += p * (log_p[j] - log_q[j]);
  return sum;
}

// The float32 cache's greedy answers of a batch as the tokens to force [B, n] (<eos> after each answer's
// end, never read), and each answer's length m_b [B].
std::vector<int> greedy_path(Transformer<float>& model, const TokenBatch& batch, std::vector<std::int64_t>& lengths) {
  const std::vector<BeamHypothesis> greedy = model.beam_decode(batch, date_options(mha::KVStorage::Native));
  std::vector<int> forced(static_cast<std::size_t>(batch.batch * kSteps), Vocabulary::kEos);
  lengths.clear();
  for (std::int64_t b = 0; b < batch.batch; ++b) {
    const std::vector<int>& y = greedy[static_cast<std::size_t>(b)].tokens;  // 1 to n tokens
    std::copy(y.begin(), y.end(), forced.begin() + b * kSteps);
    lengths.push_back(static_cast<std::int64_t>(y.size()));
  }
  return forced;
}

}  // namespace

std::vector<double> mean_next_char_kl(Transformer<float>& model, const Vocabulary& vocab,
                                      const std::vector<DateExample>& examples,
                                      const std::vector<mha::KVStorage>& storages, std::int64_t batch_size) {
  if (batch_size < 1)
    throw std::invalid_argument("mean_next_char_kl: batch_size must be at least 1, got " + std::to_string(batch_size));
  const std::int64_t V = model.config().vocab;
  std::vector<double> total(storages.size(), 0.0);  // sum over dates of each date's mean KL
  for (std::size_t first = 0; first < examples.size(); first += static_cast<std::size_t>(batch_size)) {
    const std::size_t last = std::min(examples.size(), first + static_cast<std::size_t>(batch_size));
    const TokenBatch batch =
        token_batch(make_batch(std::vector<DateExample>(examples.begin() + static_cast<std::ptrdiff_t>(first),
                                                        examples.begin() + static_cast<std::ptrdiff_t>(last)),
                               vocab));
    std::vector<std::int64_t> lengths;  // [B]
    const std::vector<int> forced = greedy_path(model, batch, lengths);
    const std::vector<double> p = model.forced_decode(batch, forced, date_options(mha::KVStorage::Native));
    for (std::size_t s = 0; s < storages.size(); ++s) {
      const std::vector<double> q = model.forced_decode(batch, forced, date_options(storages[s]));  // [B, n, V]
      for (std::int64_t b = 0; b < batch.batch; ++b) {
        const std::int64_t m = lengths[static_cast<std::size_t>(b)];
        double sum = 0.0;
        for (std::int64_t t = 0; t < m; ++t)
          sum += kl_divergence(p.data() + (b * kSteps + t) * V, q.data() + (b * kSteps + t) * V, V);
        total[s] += sum / static_cast<double>(m);
      }
    }
  }
  if (!examples.empty())
    for (double& t : total) t /= static_cast<double>(examples.size());
  return total;
}

std::vector<KVCacheEvaluation> evaluate_kv_caches(Transformer<float>& model, const Vocabulary& vocab,
                                                  const std::vector<DateExample>& examples,
                                                  const std::vector<std::int64_t>& beams,
                                                  const std::vector<mha::KVStorage>& storages) {
  using Clock = std::chrono::steady_clock;
  std::vector<std::string> sources;
  for (const DateExample& e : examples) sources.push_back(e.source);
  std::vector<KVCacheEvaluation> out;
  const std::vector<double> kl = mean_next_char_kl(model, vocab, examples, storages);
  for (std::size_t s = 0; s < storages.size(); ++s) {
    KVCacheEvaluation e;
    e.storage = storages[s];
    e.mean_kl = kl[s];
    const auto t1 = Clock::now();
    for (const std::int64_t k : beams) {
      const std::vector<Translation> answers = beam_translate(model, vocab, sources, k, 250, storages[s]);
      std::size_t correct = 0;
      for (std::size_t i = 0; i < examples.size(); ++i) correct += answers[i].text == examples[i].target;
      e.exact_match.push_back(examples.empty() ? 0.0
                                               : static_cast<double>(correct) / static_cast<double>(examples.size()));
    }
    e.seconds = std::chrono::duration<double>(Clock::now() - t1).count();
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace transformer
