// `mpirun -np P mha ring-check`: ring attention (mha::distributed) forward and backward on P ranks,
// checked against the single-process kernel on rank 0.
#pragma once

#include <cstdint>
#include <string>

namespace mha_cli {

struct RingCheckOptions {
  std::int64_t n = 1000;  // sequence length N = L = S
  std::int64_t batch = 1;
  std::int64_t heads = 4;
  std::int64_t dim = 64;  // d_k = d_v
  bool causal = false;
  std::string layout = "zigzag";  // or "contiguous"
  std::string dtype = "float32";  // or "float64"
  std::uint64_t seed = 0;
  int threads = 1;  // per rank
};

// Runs the check on the ranks of MPI_COMM_WORLD (initialising MPI); returns 0 within the rule, 1
// outside it. Throws mha::Error on bad options and on options that differ among the ranks (the same
// error on every rank).
int run_ring_check(const RingCheckOptions& options);

}  // namespace mha_cli
