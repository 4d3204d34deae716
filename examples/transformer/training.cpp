// The training loop and evaluation of the date task (training.hpp).
#include "transformer/training.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>

#include "transformer/loss.hpp"

namespace transformer {

TokenBatch token_batch(const Batch& batch) {
  TokenBatch t;
  t.batch = batch.batch;
  t.source = batch.source;
  t.source_lengths = batch.source_lengths;
  t.target = batch.target_in;
  return t;
}

namespace {

// Batches of similar source lengths, as section 5.1 batches sentence pairs "by approximate sequence
// length": draws kBucketBatches batches' worth of examples, sorts them by source length, cuts them into
// batches and hands those out in a shuffled order. Less padding, the same examples.
class BucketedBatches {
 public:
  static constexpr std::int64_t kBucketBatches = 4;

  BucketedBatches(std::uint64_t seed, std::int64_t batch_size)
      : data_(Split::Train, seed), order_rng_(seed ^ 0x6275636b6574ULL), batch_size_(batch_size) {}

  std::vector<DateExample> next() {
    if (pending_.empty()) refill();
    std::vector<DateExample> batch = std::move(pending_.back());
    pending_.pop_back();
    return batch;
  }

 private:
  void refill() {
    std::vector<DateExample> pool;
    for (std::int64_t i = 0; i < kBucketBatches * batch_size_; ++i) pool.push_back(data_.next());
    std::stable_sort(pool.begin(), pool.end(),
                     [](const DateExample& a, const DateExample& b) { return a.source.size() < b.source.size(); });
    for (std::int64_t b = 0; b < kBucketBatches; ++b)
      pending_.emplace_back(pool.begin() + b * batch_size_, pool.begin() + (b + 1) * batch_size_);
    for (std::size_t i = pending_.size(); i > 1; --i)  // Fisher-Yates
      std::swap(pending_[i - 1], pending_[order_rng_.next() % i]);
  }

  DateSampler data_;
  Rng order_rng_;
  std::int64_t batch_size_;
  std::vector<std::vector<DateExample>> pending_;
};

}  // namespace

TrainingResult train_on_dates(Transformer<float>& model, const Vocabulary& vocab, const TrainingConfig& config,
                              const std::function<void(const Progress&)>& progress) {
  using Clock = std::chrono::steady_clock;
  AdamConfig adam_config;
  adam_config.factor = config.lr_factor;
  adam_config.warmup = config.warmup;
  adam_config.d_model = model.config().d_model;
  Adam<float> adam(adam_config, model.parameters());
  LabelSmoothedCrossEntropy<float> criterion(config.label_smoothing);
  BucketedBatches train_data(config.seed, config.batch_size);
  const std::vector<DateExample> held_out = sample_dates(Split::HeldOut, config.seed + 1, config.eval_examples);

  TrainingResult result;
  const auto start = Clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  double loss_since_point = 0.0;
  std::int64_t steps_since_point = 0;
  model.train(true);
  model.zero_grad();
  for (std::int64_t step = 1; step <= config.steps; ++step) {
    const std::vector<DateExample> examples = train_data.next();
    const Batch batch = make_batch(examples, vocab);
    const Matrix<float> logits = model.forward(token_batch(batch));
    const double loss = criterion.forward(logits, batch.target_out);
    if (!std::isfinite(loss))
      throw TrainingDiverged("training stopped at step " + std::to_string(step) + " of " +
                             std::to_string(config.steps) + ": the loss is " + std::to_string(loss));
    model.backward(criterion.backward());
    adam.step();  // also zeroes the gradients
    result.target_tokens += static_cast<std::int64_t>(batch.target_out.size());
    loss_since_point += loss;
    ++steps_since_point;

    const bool point = step % config.eval_every == 0 || step == config.steps;
    if (point) {
      CurvePoint p;
      p.step = step;
      p.loss = loss_since_point / static_cast<double>(steps_since_point);
      p.accuracy = exact_match(model, vocab, held_out);  // decodes in evaluation mode, then restores training
      p.seconds = elapsed();
      result.curve.push_back(p);
      loss_since_point = 0.0;
      steps_since_point = 0;
    }
    if (progress) {
      const double s = elapsed();
      progress({step, config.steps, loss, static_cast<double>(result.target_tokens) / s, s,
                s / static_cast<double>(step) * static_cast<double>(config.steps - step)});
    }
  }
  result.seconds = elapsed();
  model.train(false);
  return result;
}

namespace {

// The model's input for sources[first, last) (the targets, unused, are placeholders).
TokenBatch source_batch(const std::vector<std::string>& sources, std::size_t first, std::size_t last,
                        const Vocabulary& vocab) {
  std::vector<DateExample> examples;
  for (std::size_t i = first; i < last; ++i) examples.push_back({sources[i], std::string(kIsoLength, '0'), {}});
  return token_batch(make_batch(examples, vocab));
}

}  // namespace

std::vector<Translation> translate_with_confidence(Transformer<float>& model, const Vocabulary& vocab,
                                                   const std::vector<std::string>& sources, std::int64_t batch_size,
                                                   bool use_cache) {
  std::vector<Translation> out;
  const auto steps = static_cast<std::int64_t>(kIsoLength) + 1;  // 10 characters and <eos>
  const std::int64_t V = model.config().vocab;
  std::vector<float> logits;  // [B, steps, V]
  for (std::size_t first = 0; first < sources.size(); first += static_cast<std::size_t>(batch_size)) {
    const std::size_t last = std::min(sources.size(), first + static_cast<std::size_t>(batch_size));
    const TokenBatch batch = source_batch(sources, first, last, vocab);
    const std::vector<int> tokens = model.greedy_decode(batch, steps, Vocabulary::kBos, use_cache, &logits);
    for (std::int64_t b = 0; b < batch.batch; ++b) {
      double confidence = 1.0;
      for (std::int64_t t = 0; t < steps; ++t) {  // p(chosen) = 1 / sum_j exp(l_j - l_chosen), l_chosen the max
        const float* row = logits.data() + (b * steps + t) * V;
        const float chosen = row[tokens[static_cast<std::size_t>(b * steps + t)]];
        double sum = 0.0;
        for (std::int64_t j = 0; j < V; ++j) sum += std::exp(static_cast<double>(row[j]) - chosen);
        confidence = std::min(confidence, 1.0 / sum);
        if (tokens[static_cast<std::size_t>(b * steps + t)] == Vocabulary::kEos) break;  // nothing after <eos> counts
      }
      out.push_back({vocab.decode(std::span<const int>(tokens).subspan(static_cast<std::size_t>(b * steps),
                                                                       static_cast<std::size_t>(steps))),
                     confidence});
    }
  }
  return out;
}

std::vector<Translation> beam_translate(Transformer<float>& model, const Vocabulary& vocab,
                                        const std::vector<std::string>& sources, std::int64_t beams,
                                        std::int64_t batch_size, mha::KVStorage kv_storage) {
  BeamOptions options;
  options.beams = beams;
  options.kv_storage = kv_storage;
  options.steps = static_cast<std::int64_t>(kIsoLength) + 1;  // 10 characters and <eos>
  options.bos = Vocabulary::kBos;
  options.eos = Vocabulary::kEos;
  std::vector<Translation> out;
  for (std::size_t first = 0; first < sources.size(); first += static_cast<std::size_t>(batch_size)) {
    const std::size_t last = std::min(sources.size(), first + static_cast<std::size_t>(batch_size));
    for (const BeamHypothesis& h : model.beam_decode(source_batch(sources, first, last, vocab), options)) {
      const double lowest = *std::min_element(h.log_probs.begin(), h.log_probs.end());
      out.push_back({vocab.decode(h.tokens), std::exp(lowest)});
    }
  }
  return out;
}

std::vector<std::string> translate(Transformer<float>& model, const Vocabulary& vocab,
                                   const std::vector<std::string>& sources, std::int64_t batch_size, bool use_cache) {
  std::vector<std::string> out;
  for (Translation& t : translate_with_confidence(model, vocab, sources, batch_size, use_cache))
    out.push_back(std::move(t.text));
  return out;
}

double unsure_threshold(Transformer<float>& model, const Vocabulary& vocab, const std::vector<DateExample>& examples) {
  std::vector<std::string> sources;
  for (const auto& e : examples) sources.push_back(e.source);
  const std::vector<Translation> answers = translate_with_confidence(model, vocab, sources);
  std::vector<double> correct;
  for (std::size_t i = 0; i < examples.size(); ++i)
    if (answers[i].text == examples[i].target) correct.push_back(answers[i].confidence);
  if (correct.empty()) return 0.0;
  std::sort(correct.begin(), correct.end());
  return correct[correct.size() / 100];  // the 1st percentile
}

double exact_match(Transformer<float>& model, const Vocabulary& vocab, const std::vector<DateExample>& examples) {
  if (examples.empty()) return 0.0;
  std::vector<std::string> sources;
  for (const auto& e : examples) sources.push_back(e.source);
  const std::vector<std::string> predicted = translate(model, vocab, sources);
  std::size_t correct = 0;
  for (std::size_t i = 0; i < examples.size(); ++i) correct += predicted[i] == examples[i].target;
  return static_cast<double>(correct) / static_cast<double>(examples.size());
}

}  // namespace transformer
