// The machine's streaming read bandwidth, the roof of decoding (docs/DESIGN.md section 5): a SIMD sum
// of a buffer several times the last-level cache, split across the current OpenMP threads.
#pragma once

#include <cstdint>

#include "mha/tensor.hpp"

namespace mha_cli::bench {

// The last-level cache of CPU 0 in bytes (sysfs), 32 MiB when it cannot be read.
std::int64_t last_level_cache_bytes();

struct ReadBandwidth {
  int threads = 0;
  double bytes_per_s = 0;  // the best of `reps` passes
  std::int64_t buffer_bytes = 0;
};

// A buffer of `bytes` to sum again and again: allocated and filled once (as a mha::Tensor, so on the same
// huge-page storage as a PagedKVCache's pool), then each measure() sums it `reps` times with
// mha::num_threads() threads, each reading one contiguous part with Highway's widest vectors.
class ReadBandwidthProbe {
 public:
  explicit ReadBandwidthProbe(std::int64_t bytes);
  ReadBandwidth measure(int reps) const;

 private:
  mha::Tensor buffer_;
};

}  // namespace mha_cli::bench
