// `mha bench-one` (hidden): one shape, timed in a process of its own, so that the process's peak
// resident set is that shape's. `mha bench` runs it through /proc/self/exe; torch_mha.py is
// its PyTorch twin and prints the same JSON fields.
#pragma once

#include <cstdint>
#include <string>

#include "bench/bench_measure.hpp"

namespace mha_cli {

struct BenchOneOptions {
  std::string impl = "mha";  // "mha": the MultiHeadAttention layer; "core": the attention core
  std::int64_t n = 1024;     // N = L = S
  bool causal = false;
  int threads = 1;
  std::string pass = "fwd";  // "fwd" or "fwdbwd"
  std::int64_t batch = 1;    // B
  std::int64_t d_model = 512;
  std::int64_t heads = 8;
  std::string dtype = "float32";  // the layer's: "float32" or "bf16" (the core: float32 only)
  bench::RepeatPolicy policy;
};

// Prints one JSON object on stdout: impl, n, causal, threads, pass, median_s, min_s, reps,
// baseline_rss_bytes (before the first call), peak_rss_first_bytes (after it), peak_rss_bytes (at the end).
int run_bench_one(const BenchOneOptions& options);

}  // namespace mha_cli
