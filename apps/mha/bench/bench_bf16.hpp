// `mha bench --dtype bf16`: bfloat16 attention and layer beside oneDNN's bf16 matmul roof, our float32
// and PyTorch 1.13 in bf16 and float32 (bench_bf16.cpp says what it prints).
#pragma once

#include <string>

#include "bench/bench.hpp"

namespace mha_cli::bench {

// Prints the tables as it goes and writes out_dir/bench-bf16.json. Uses options.threads, options.sizes
// (N; --quick: 1024 alone), options.torch and the PyTorch settings.
int run_bench_bf16(const BenchOptions& options, const std::string& command);

}  // namespace mha_cli::bench
