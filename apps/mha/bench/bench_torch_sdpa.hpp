// `mha bench --torch-sdpa`: issue 34's benchmark. mha.torch.scaled_dot_product_attention (the registered
// operator, python/torch_ops) against the best torch 1.13 does by hand, softmax(q k^T * scale + mask) v, in
// float32 (on the BLAS of --torch-blas) and bfloat16 (oneDNN), forward and forward+backward, causal and not:
// speed and peak memory; and the per-call overhead over the C++ kernel at [1, 8, 64, 64] (bench_torch_sdpa.cpp
// says what it prints; the Python side is apps/mha/bench/torch_sdpa.py; results in docs/PERFORMANCE.md).
#pragma once

#include <string>

#include "bench/bench.hpp"

namespace mha_cli::bench {

// Prints the tables as it goes and writes out_dir/bench-torch-sdpa.json. Uses options.threads, sizes,
// variants_repeats (--repeats), torch_blas, python, torch_script (default: torch_sdpa.py of the source
// tree), torch_memory_limit_gib and torch_timeout_s.
int run_bench_torch_sdpa(const BenchOptions& options, const std::string& command);

}  // namespace mha_cli::bench
