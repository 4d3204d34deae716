// When a parallel region is worth opening. Waking the other threads costs microseconds on an idle
// machine and up to milliseconds on a busy one, so small products and small attention calls run on
// the calling thread. Results do not depend on this: every work item is computed the same way
// whichever thread runs it, and oneDNN's sgemm runs single-threaded either way (inside our regions
// because they are active, and here because the thread count is 1).
#pragma once

#include <omp.h>

namespace mha::detail {

// About 0.1 ms of one core's work at the GEMM rate here.
inline constexpr double kMinParallelFlops = 5e6;

// For the scope's lifetime, limits the calling thread's OpenMP regions (ours and oneDNN's) to one
// thread when `flops` is below kMinParallelFlops.
class SerialIfSmall {
 public:
  explicit SerialIfSmall(double flops) : saved_(omp_get_max_threads()), serial_(flops < kMinParallelFlops) {
    if (serial_) omp_set_num_threads(1);
  }
  ~SerialIfSmall() {
    if (serial_) omp_set_num_threads(saved_);
  }
  SerialIfSmall(const SerialIfSmall&) = delete;
  SerialIfSmall& operator=(const SerialIfSmall&) = delete;

 private:
  int saved_;
  bool serial_;
};

}  // namespace mha::detail
