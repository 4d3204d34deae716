// `mha bench --variants`: what issue 31's attention variants cost, each beside the same call without it
// (packed against padded, sinks, the layer's rotary embedding), in one run (bench_variants.cpp says what
// it prints; results in docs/PERFORMANCE.md).
#pragma once

#include <string>

#include "bench/bench.hpp"

namespace mha_cli::bench {

// Prints the tables as it goes and writes out_dir/bench-variants.json. Uses options.threads and the
// variants_* options.
int run_bench_variants(const BenchOptions& options, const std::string& command);

}  // namespace mha_cli::bench
