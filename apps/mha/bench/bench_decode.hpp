// `mha bench --decode`: one decode step over a paged KV cache against the machine's read bandwidth
// (issue 13's benchmark; bench_decode.cpp says what it prints).
#pragma once

#include <string>

#include "bench/bench.hpp"

namespace mha_cli::bench {

// Prints the tables as it goes and writes out_dir/bench-decode.json. Uses options.threads and the
// decode_* options.
int run_bench_decode(const BenchOptions& options, const std::string& command);

}  // namespace mha_cli::bench
