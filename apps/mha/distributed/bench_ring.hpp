// `mpirun -np P mha bench-ring`: ring attention on P ranks of one thread each against one rank of one
// thread, in the same run (a benchmark, not a test: docs/PERFORMANCE.md records its figures).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mha_cli {

struct BenchRingOptions {
  std::vector<std::int64_t> sizes{8192, 16384};  // N = L = S
  std::int64_t heads = 8;
  std::int64_t dim = 64;  // d_k = d_v
  int reps = 2;           // timed runs per measurement (the fastest is kept), after one warm-up
  std::string out;        // optional JSON file of the results
};

// Returns 0; throws mha::Error on bad options and on options that differ among the ranks.
int run_bench_ring(const BenchRingOptions& options);

}  // namespace mha_cli
