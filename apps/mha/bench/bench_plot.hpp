// bench.png: the whole layer's effective GFLOP/s against N, ours and PyTorch's, forward and
// forward + backward side by side, with the sgemm roof for scale.
#pragma once

#include <filesystem>

#include "bench/bench_results.hpp"

namespace mha_cli::bench {

// Plots the runs at `threads` threads. Throws std::runtime_error when the file cannot be written.
void write_bench_plot(const std::filesystem::path& path, const BenchResults& results, int threads);

}  // namespace mha_cli::bench
