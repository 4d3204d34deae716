// The grid of small and mid shapes: our MultiHeadAttention layer against PyTorch's
// nn.MultiheadAttention on self-attention, batch_first, float32, at every B x N x E of the grid and
// every thread count of the run, forward (eval) and training step (train mode: forward + backward).
//
// At these sizes a call takes microseconds to a few hundred milliseconds, so starting a process per
// shape (as the layer table does, to read each shape's peak memory) would cost more than timing it:
// each implementation runs its whole grid in one process per thread count (ours: the hidden
// `mha bench-grid`; PyTorch's: torch_mha.py --shapes), printing one JSON line per shape and pass.
// No memory figures here: a process's peak over many shapes says nothing about one.
//
// Legend: B batch, N = L = S, E = d_model, h heads (h = E / 64 unless given: d = 64).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/bench.hpp"
#include "bench/bench_measure.hpp"
#include "bench/bench_results.hpp"

namespace mha_cli::bench {

struct GridShape {
  std::int64_t batch = 1, n = 1, d_model = 64, heads = 1;  // B, N, E, h
};

// Every B in {1, 8, 64}, N in {16, 64, 256, 512}, E in {64, 256, 512} (h = E / 64: 1, 4, 8), B outermost.
std::vector<GridShape> default_grid_shapes();

// "B:N:E" or "B:N:E:h" entries, comma-separated (h = E / 64 when not given: E must then be a multiple
// of 64). Throws std::invalid_argument naming the entry that is wrong and why.
std::vector<GridShape> parse_grid_shapes(const std::string& spec);
std::string format_grid_shapes(const std::vector<GridShape>& shapes);  // "B:N:E:h,..."

// The grid's timing: a warm-up call, then at least 5 calls and 0.2 s, at most 2000 calls or 2 s; the
// best call counts. Short because the grid has hundreds of cells; enough calls that the best of them is
// a call the machine's other work left alone.
inline constexpr RepeatPolicy kGridPolicy{
    .warmup = 2, .min_reps = 5, .max_reps = 2000, .min_time_s = 0.2, .max_time_s = 2.0};

// Runs the grid (options.grid_shapes, or the default) at each of `threads`, printing its table as it
// goes; fills results.grid.
void run_grid(BenchResults& results, const std::vector<int>& threads, const BenchOptions& options);

// Ours at `last` threads over ours at `first` (time at first / time at last) for each shape and pass
// of the grid that has both; the worst is what the thread target of the grid checks.
struct GridThreadRatio {
  const GridRow* first = nullptr;
  const GridRow* last = nullptr;
  std::string pass;  // "forward" or "training step"
  double ratio = 0;
};
std::vector<GridThreadRatio> grid_thread_ratios(const std::vector<GridRow>& rows);

}  // namespace mha_cli::bench

namespace mha_cli {

// `mha bench-grid` (hidden): our layer on each shape, forward then training step, in this process.
struct BenchGridOptions {
  std::string shapes;  // as parse_grid_shapes reads them
  int threads = 1;
  bench::RepeatPolicy policy = bench::kGridPolicy;
};

// Prints one JSON object per shape and pass on stdout: impl, batch, n, d_model, heads, threads, pass,
// min_s, median_s, reps.
int run_bench_grid(const BenchGridOptions& options);

}  // namespace mha_cli
