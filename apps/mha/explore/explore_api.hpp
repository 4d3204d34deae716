// The JSON API of `mha explore`, apart from HTTP (explore_server.cpp routes requests here):
//
//   GET  /api/model     {encoder_layers, decoder_layers, heads, kinds: [{kind, name, layers}],
//                        unsure_below, held_out_examples, max_input_length}
//   POST /api/translate {"text": "5 March 2021", "heads_off": [[layer, "kind", head], ...]}
//                       -> {input, heads_off, normalized, translation, confidence, valid, confident,
//                           doubt, line, maps} (input_analysis.hpp)
//   POST /api/accuracy  {"heads_off": [...]} -> {heads_off, correct, examples, accuracy, cached}
//
// "heads_off" may be absent (no head off). A request that cannot be served throws RequestError.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "explore/accuracy_cache.hpp"
#include "explore/model_pool.hpp"
#include "transformer/dates.hpp"
#include "transformer/vocabulary.hpp"

namespace mha_cli::explore {

// Head sets whose accuracy the server remembers (a few bytes each; the least recently used go first).
inline constexpr std::size_t kAccuracyCacheCapacity = 1024;

class ExploreApi {
 public:
  // threads: OpenMP threads of each request's model work (mha::set_num_threads on its thread).
  // Throws std::runtime_error for a checkpoint whose metadata is not as `mha demo` writes it.
  ExploreApi(ModelPool& pool, const std::string& checkpoint, int threads);

  nlohmann::json model() const;
  nlohmann::json translate(const std::string& body);
  nlohmann::json accuracy(const std::string& body);

  const AccuracyCache& accuracy_cache() const { return cache_; }

 private:
  ModelPool& pool_;
  int threads_;
  transformer::Vocabulary vocab_;
  double unsure_below_ = 0.0;  // a checkpoint without the threshold: no confidence check, as translate
  std::vector<transformer::DateExample> held_out_;
  AccuracyCache cache_{kAccuracyCacheCapacity};
};

}  // namespace mha_cli::explore
