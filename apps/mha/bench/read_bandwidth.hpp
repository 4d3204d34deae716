// The machine's streaming read bandwidth, the roof of decoding (docs/DESIGN.md section 5): a SIMD sum
// of a buffer several times the last-level cache, split across the current OpenMP threads.
#pragma once

#include <cstdint>

namespace mha_cli::bench {

// The last-level cache of CPU 0 in bytes (sysfs), 32 MiB when it cannot be read.
std::int64_t last_level_cache_bytes();

struct ReadBandwidth {
  int threads = 0;
  double bytes_per_s = 0;  // the best of `reps` passes
  std::int64_t buffer_bytes = 0;
};

// Sums a buffer of `bytes` (filled once, first touched by the threads that read it) `reps` times
// with mha::num_threads() threads, each reading one contiguous part with Highway's widest vectors.
ReadBandwidth measure_read_bandwidth(std::int64_t bytes, int reps);

}  // namespace mha_cli::bench
