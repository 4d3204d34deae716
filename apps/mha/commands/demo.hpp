// `mha demo`, the main job: trains the paper's encoder-decoder Transformer (examples/transformer, on
// mha::MultiHeadAttention) to normalise human-written dates to ISO 8601, then evaluates it on held-out
// dates and writes a report folder: attention maps of every layer and head of the three kinds of
// attention, the learning curve, an index.html with the settings and the accuracy, and the
// checkpoint that `mha translate` reads.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mha_cli {

struct DemoOptions {
  std::string out_dir = "mha-demo";  // the report folder; the checkpoint is <out_dir>/checkpoint.safetensors
  std::int64_t steps = 3000;
  std::int64_t batch_size = 64;
  std::int64_t d_model = 64;
  std::int64_t heads = 4;
  std::int64_t d_ff = 256;
  std::int64_t layers = 2;  // encoder and decoder layers each
  bool pre_norm = false;
  double dropout = 0.1;
  double attention_dropout = 0.0;
  double label_smoothing = 0.1;
  std::int64_t warmup = 200;
  double lr_factor = 0.5;
  std::uint64_t seed = 1;
  std::int64_t eval_examples = 1000;         // held-out examples of the final accuracy
  std::int64_t eval_every = 200;             // steps between the learning curve's accuracy points
  std::int64_t map_examples = 3;             // held-out examples drawn as attention maps
  std::string dtype = "float32";             // "bf16": mixed precision, after a float32 run for the side-by-side
  std::vector<std::int64_t> beams = {2, 4};  // beam widths decoded beside greedy (accuracy, time)
  int threads = 0;                           // 0: OpenMP's default
  bool progress = true;
};

// Trains, evaluates and writes the report. Returns 0; throws on a failure (bad settings, a file that
// cannot be written).
int run_demo(const DemoOptions& options);

}  // namespace mha_cli
