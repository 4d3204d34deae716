// What a quantized self-attention cache (mha::KVStorage Int8, Float8E4M3) does to the date model's
// decoding: the divergence of its next-character distributions from the float32 cache's, and the
// held-out exact match of greedy decoding and beam search with each cache.
//
// Legend: B dates, n = 11 decoder steps (10 characters and <eos>), V vocabulary.
//
// The divergence is taken along one path for every cache: the float32 (Native) cache's greedy answer
// y_1 .. y_m (through its first <eos>, at most n tokens), teacher-forced (Transformer::forced_decode),
// so that at step t every cache reads the same prefix <bos> y_1 .. y_{t-1} and the divergence is the
// cache's alone, not that of the answer it would have written. With p the float32 cache's next-character
// distribution and q the other cache's, in double from their log-softmax:
//   KL_t(p || q) = sum_j p_j (log p_j - log q_j)        (terms with p_j = 0 are 0)
//   mean KL = (1 / B) sum_b (1 / m_b) sum_{t <= m_b} KL_t
// Tests: tests/transformer/kv_cache_storage_test.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "mha/paged_kv_cache.hpp"
#include "transformer/dates.hpp"
#include "transformer/transformer.hpp"
#include "transformer/vocabulary.hpp"

namespace transformer {

// The mean KL divergence above for each of `storages` [storages.size()], over `examples` (their sources
// only), decoded `batch_size` dates at a time: 0 for Native (the float32 cache against itself; decoding
// is deterministic). Throws std::invalid_argument for a quantized storage in a model computing in bf16.
std::vector<double> mean_next_char_kl(Transformer<float>& model, const Vocabulary& vocab,
                                      const std::vector<DateExample>& examples,
                                      const std::vector<mha::KVStorage>& storages, std::int64_t batch_size = 250);

// One cache dtype on held-out dates.
struct KVCacheEvaluation {
  mha::KVStorage storage = mha::KVStorage::Native;
  std::vector<double> exact_match;  // [beam widths]: with each width (1: greedy decoding), in [0, 1]
  double mean_kl = 0.0;             // mean_next_char_kl against the float32 cache
  double seconds = 0.0;             // decoding the examples with every width (not the divergence)
};

// For each of `storages`: the exact match of beam_translate with each width of `beams` (1 is greedy
// decoding) and mean_next_char_kl, on `examples`.
std::vector<KVCacheEvaluation> evaluate_kv_caches(Transformer<float>& model, const Vocabulary& vocab,
                                                  const std::vector<DateExample>& examples,
                                                  const std::vector<std::int64_t>& beams,
                                                  const std::vector<mha::KVStorage>& storages);

}  // namespace transformer
