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
//
// Work::FourMultiplyAdds reads it while doing the float32 decode kernel's least arithmetic at h / h_kv = 4
// (four multiply-adds per loaded vector, nothing else): what a core streams while it computes that much,
// which on some machines is well below what it streams summing (docs/PERFORMANCE.md, issue 33).
class ReadBandwidthProbe {
 public:
  enum class Work { Sum, FourMultiplyAdds };
  explicit ReadBandwidthProbe(std::int64_t bytes);
  ReadBandwidth measure(int reps, Work work = Work::Sum) const;

 private:
  mha::Tensor buffer_;
};

}  // namespace mha_cli::bench
