// The demo's report: index.html, written for a reader who has never read the paper (what a query, a
// key and a head are, what the three kinds of attention do here, what to look for in the maps, the
// formats in words, the range of dates the model reads), and summary.json, the same numbers for
// programs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "commands/date_variations.hpp"
#include "commands/demo.hpp"
#include "mha/paged_kv_cache.hpp"
#include "transformer/dates.hpp"
#include "transformer/next_char_distributions.hpp"
#include "transformer/training.hpp"

namespace mha_cli {

std::string minutes(double seconds);  // "1:05"

// Beam search on the held-out dates (transformer::beam_translate), beside greedy decoding.
struct BeamEvaluation {
  std::int64_t beams = 0;       // K
  double accuracy = 0;          // exact match
  double seconds = 0;           // decoding every example
  int differs_from_greedy = 0;  // answers unlike greedy decoding's
};

struct Evaluation {
  double accuracy = 0;
  double cached_seconds = 0, full_seconds = 0;                          // greedy decoding of every example, both ways
  bool same_outputs = false;                                            // the two ways wrote the same strings
  std::map<transformer::DateFormat, std::pair<int, int>> by_format;     // (correct, total)
  std::vector<std::pair<transformer::DateExample, std::string>> wrong;  // (example, what the model wrote)
  std::vector<BeamEvaluation> beams;                                    // one per --beams width
  // The decoder's self-attention cache as float32, int8 and fp8, on the model `mha translate` runs: each
  // one's exact match with each of cache_widths (1: greedy, then the --beams widths) and mean KL.
  std::vector<std::int64_t> cache_widths;
  std::vector<transformer::KVCacheEvaluation> caches;
};

// What the demo and `mha translate --kv-cache` call each cache dtype: "float32", "int8", "fp8".
const char* kv_cache_label(mha::KVStorage storage);
// A mean KL divergence as the demo prints it: "0" when it is 0, else 3 significant digits ("1.23e-05").
std::string kl_text(double kl);

struct MapFigure {
  std::string file, caption;
  bool best = false;  // the encoder-decoder head that reads the fields best (ExampleMaps::best)
};

// The maps of one kind of attention: [layer][head].
struct KindMaps {
  std::string name, slug;  // "encoder-decoder attention", "cross"
  std::vector<std::vector<MapFigure>> layers;
};

// One encoder-decoder head's field_share (demo_fields.hpp) on one example.
struct HeadShare {
  std::int64_t layer = 0, head = 0;
  double share = 0;
};

// One held-out example drawn as maps, with what its encoder-decoder heads read.
struct ExampleMaps {
  std::string source, target, predicted;
  transformer::DateFields fields;
  std::vector<KindMaps> kinds;          // encoder self, decoder self, encoder-decoder
  std::vector<HeadShare> cross_shares;  // every encoder-decoder head, layer by layer
  double even_share = 0;                // even_field_share: what spreading the weight evenly gives
  HeadShare best() const;               // the largest share (the first of equals)
};

// --dtype bf16: the float32 run of the same settings and seed, trained first in the same command.
struct Float32Run {
  double seconds = 0;              // training time
  double tokens_per_second = 0;    // target tokens per second of training
  double accuracy = 0;             // held-out exact match, the same dates as the bf16 run's
  double checkpoint_accuracy = 0;  // the bf16 run's float32 master weights, decoded in float32
};

// Everything the report shows.
struct DemoReport {
  const DemoOptions& options;
  std::int64_t parameters;
  const transformer::TrainingResult& training;
  const Evaluation& evaluation;
  std::size_t eval_count;
  double unsure_below;  // `mha translate`'s confidence threshold
  const std::vector<ExampleMaps>& examples;
  const std::vector<VariationResult>& variations;
  const std::vector<OutsideAnswer>& outside;  // what translate prints outside the range
  const Float32Run* float32 = nullptr;        // --dtype bf16 only
};

// Throw std::runtime_error when the file cannot be written.
void write_index(const std::filesystem::path& path, const DemoReport& report);
void write_summary(const std::filesystem::path& path, const DemoReport& report);

}  // namespace mha_cli
