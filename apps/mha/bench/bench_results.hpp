// Everything one `mha bench` run measures, as it goes to the tables, bench.json and the plot.
//
// Legend: N = L = S sequence length, h heads, d per-head width, E = d_model. Rates are GFLOP/s;
// "% of roof" is a rate over the oneDNN sgemm roof measured just before, at the same thread count.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench_machine.hpp"
#include "bench/bench_measure.hpp"

namespace mha_cli::bench {

// One timed call of the attention core, measured in this process.
struct KernelRate {
  Timing timing;
  double gflop = 0;   // FLOPs per call / 1e9
  double gflops = 0;  // gflop / best time
  double roof_fraction = 0;
};

// The attention core (Kernel::Flash) on q, k, v [1, h, N, d].
struct CoreResult {
  int threads = 0;
  std::int64_t n = 0, heads = 0, d = 0;
  bool causal = false;
  Roof roof;      // measured just before this shape's group
  TileRate tile;  // one thread's rate on the forward's tile products, measured with the roof
  KernelRate forward, backward;
};

inline constexpr const char* kNoTorchStatus = "skipped: --no-torch";

// One shape timed in its own process (`mha bench-one` or torch_mha.py).
struct ProcessRun {
  std::string status = "ok";  // "ok", or why there is no figure: "skipped: ...", "failed: ...", "timed out ..."
  Timing timing;
  std::int64_t baseline_rss_bytes = 0;    // before the first call
  std::int64_t peak_rss_first_bytes = 0;  // after the first call
  std::int64_t peak_rss_bytes = 0;        // at the end
  double gflops = 0;                      // the FLOPs of what ran (layer or core) over the best time
  std::string blas_library;               // PyTorch's runs: the BLAS library its process loaded
  bool ok() const { return status == "ok"; }
};

// The whole layer, ours against PyTorch's, at one shape and pass.
struct LayerResult {
  int threads = 0;
  std::int64_t n = 0;
  bool causal = false;
  std::string pass;  // "fwd" or "fwdbwd"
  double gflop = 0;  // projections + attention (causal attention counted half), per call
  Roof roof;         // measured just before this shape's group
  ProcessRun mha, torch;
  std::optional<double> speedup;       // torch time / our time
  std::optional<double> memory_ratio;  // our peak RSS / torch's
};

// 2 threads against 1 at B*h = 1 (q [1, 1, N, d]): does one head keep both cores busy?
struct ScalingResult {
  std::int64_t n = 0, d = 0;
  std::vector<int> threads;                                            // each thread count measured
  std::vector<Roof> roofs;                                             // per thread count
  std::vector<KernelRate> forward;                                     // per thread count
  std::vector<KernelRate> backward;                                    // per thread count
  double forward_speedup = 0, backward_speedup = 0, roof_speedup = 0;  // last thread count over the first
};

// The core on the two head layouts, back to back: contiguous [B, h, N, d] (the core table) against
// the layer's [B, N, h, d] (row stride h*d), to separate the layout's cost from the layer's own.
struct LayoutResult {
  int threads = 0;
  std::int64_t n = 0;
  Roof roof;
  KernelRate contiguous_forward, contiguous_backward, interleaved_forward, interleaved_backward;
};

// Causal against non-causal at one N, from the core results.
struct CausalResult {
  int threads = 0;
  std::int64_t n = 0;
  double forward_speedup = 0, backward_speedup = 0;  // non-causal time / causal time
};

// The --big size, ours alone, each in its own process: the core's and the layer's forward, and the
// layer's training step (forward + backward, train mode), whose peak RSS is the memory target's.
struct BigResult {
  std::string impl;  // "core" or "mha"
  std::string pass;  // "fwd" or "fwdbwd"
  std::int64_t n = 0;
  bool causal = false;
  int threads = 0;
  Roof roof;
  ProcessRun run;
  double attention_gflop = 0;   // the attention core's FLOPs per call (forward and backward for "fwdbwd")
  double attention_gflops = 0;  // attention FLOPs over the time (for the layer: including its projections' time)
  double roof_fraction = 0;
};

// PyTorch on a BLAS other than the layer table's, at one shape: how much the BLAS matters.
struct BlasPeer {
  std::string blas;                // "onednn", "installed" or "openblas"
  std::string label;               // what it is, in words
  std::string status = "ok";       // "ok", or why it was not measured (e.g. not installed, and how to install it)
  std::vector<LayerResult> layer;  // ours as in the layer table, PyTorch on this BLAS
};

// One shape of the grid of small and mid shapes (bench_grid.hpp), at one thread count: our layer
// against PyTorch's nn.MultiheadAttention, forward (eval) and training step (train: forward + backward).
struct GridTime {
  std::string status = "ok";  // "ok", or why there is no time
  Timing timing;
  bool ok() const { return status == "ok"; }
};
struct GridRow {
  std::int64_t batch = 0, n = 0, d_model = 0, heads = 0;  // B, N = L = S, E, h
  int threads = 0;
  GridTime mha_forward, torch_forward, mha_train, torch_train;
  std::optional<double> forward_speedup, train_speedup;  // torch time / our time
};

struct TargetResult {
  std::string name;         // what is promised, e.g. "forward attention core >= 75% of the roof at N >= 2048"
  std::string measured;     // the figure(s), e.g. "worst 71.2% (1 thread, N 16384, causal)"
  std::optional<bool> met;  // empty when not measured in this run
  std::string margin;       // by how much it is met or missed
};

struct BenchResults {
  MachineInfo machine;
  std::string command;               // the command line of this run
  std::string source_revision;       // `git describe --always --dirty` of the source tree during the run
  std::string load_start, load_end;  // load averages (1, 5, 15 min) when the run started and ended
  std::string torch_version, python_version;
  std::string torch_blas;   // the BLAS under PyTorch's products in `layer` (see BenchOptions::torch_blas)
  std::vector<Roof> roofs;  // every roof measurement, in order
  std::vector<CoreResult> core;
  std::vector<LayerResult> layer;
  std::vector<BlasPeer> torch_blas_peers;  // PyTorch on the other BLAS libraries, at one shape
  std::optional<ScalingResult> scaling;
  std::vector<LayoutResult> layout;
  std::vector<CausalResult> causal;
  std::vector<BigResult> big;
  std::string grid_status;  // "ok" when the grid ran, else why not ("--no-grid", "--quick")
  RepeatPolicy grid_policy;
  std::vector<GridRow> grid;
  std::vector<TargetResult> targets;
};

nlohmann::json to_json(const BenchResults& results);

}  // namespace mha_cli::bench
