// Training and evaluating the Transformer on the date task (dates.hpp): the loop of section 5 (Adam
// with warm-up, label smoothing 0.1, residual dropout) on batches drawn fresh from the training split,
// and exact-match accuracy by greedy decoding through the KV cache.
#pragma once

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "transformer/adam.hpp"
#include "transformer/dates.hpp"
#include "transformer/transformer.hpp"
#include "transformer/vocabulary.hpp"

namespace transformer {

struct TrainingConfig {
  std::int64_t steps = 1500;
  std::int64_t batch_size = 64;
  double label_smoothing = 0.1;
  double lr_factor = 1.0;            // the schedule's factor (section 5.3 uses 1)
  std::int64_t warmup = 4000;        // steps of linear warm-up (section 5.3 uses 4000)
  std::uint64_t seed = 1;            // model initialisation, data stream and dropout
  std::int64_t eval_every = 100;     // steps between held-out accuracy points of the learning curve
  std::int64_t eval_examples = 200;  // held-out examples per learning-curve point
};

struct CurvePoint {
  std::int64_t step = 0;
  double loss = 0.0;       // mean training loss over the steps since the previous point
  double accuracy = -1.0;  // held-out exact match in [0, 1]; -1 when not evaluated at this point
  double seconds = 0.0;    // since training started
};

struct Progress {
  std::int64_t step = 0, steps = 0;
  double loss = 0.0;  // this step's
  double tokens_per_second = 0.0;
  double seconds = 0.0, seconds_left = 0.0;
};

struct TrainingResult {
  std::vector<CurvePoint> curve;
  double seconds = 0.0;
  std::int64_t target_tokens = 0;  // tokens the decoder predicted in training
};

// The model's input for a batch of date examples.
TokenBatch token_batch(const Batch& batch);

// What train_on_dates throws when a step's loss is not finite (NaN or infinite): the weights it would
// update from are no longer meaningful. what() names the step, e.g. "training stopped at step 7 of
// 40: the loss is nan".
class TrainingDiverged : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Trains `model` in place; `progress` is called after every step. Throws TrainingDiverged at the first
// step whose loss is not finite, before that step updates the parameters.
TrainingResult train_on_dates(Transformer<float>& model, const Vocabulary& vocab, const TrainingConfig& config,
                              const std::function<void(const Progress&)>& progress = {});

// Greedy decoding of each source, through the KV cache or (use_cache false) recomputing every prefix;
// returns the ISO strings the model writes.
std::vector<std::string> translate(Transformer<float>& model, const Vocabulary& vocab,
                                   const std::vector<std::string>& sources, std::int64_t batch_size = 250,
                                   bool use_cache = true);

// A translation with the decoder's confidence in it: the lowest probability (softmax of the step's
// logits) among the tokens greedy decoding chose, the 10 characters and <eos>.
struct Translation {
  std::string text;
  double confidence = 0.0;
};
std::vector<Translation> translate_with_confidence(Transformer<float>& model, const Vocabulary& vocab,
                                                   const std::vector<std::string>& sources,
                                                   std::int64_t batch_size = 250, bool use_cache = true);

// Beam search with `beams` beams (Transformer::beam_decode): each source's best-scoring answer, with
// the same confidence (the lowest probability among its tokens, <eos> included). beams = 1 gives
// translate_with_confidence's answers (with kv_storage Native). kv_storage: how the decoder's
// self-attention caches store keys and values (BeamOptions::kv_storage); a quantized one needs a model
// computing in float32. Throws std::invalid_argument for beams < 1 or a quantized cache in a bf16 model.
std::vector<Translation> beam_translate(Transformer<float>& model, const Vocabulary& vocab,
                                        const std::vector<std::string>& sources, std::int64_t beams,
                                        std::int64_t batch_size = 250,
                                        mha::KVStorage kv_storage = mha::KVStorage::Native);

// The confidence below which an answer is to be called unsure: the 1st percentile of the confidences of
// the correct translations of `examples` (held-out data), so that 1% of correct answers on data like
// the training data are flagged; 0 when none is correct.
double unsure_threshold(Transformer<float>& model, const Vocabulary& vocab, const std::vector<DateExample>& examples);

// Fraction of examples whose translation equals the target exactly.
double exact_match(Transformer<float>& model, const Vocabulary& vocab, const std::vector<DateExample>& examples);

}  // namespace transformer
