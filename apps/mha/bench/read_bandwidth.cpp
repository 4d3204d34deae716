// measure_read_bandwidth (read_bandwidth.hpp): four independent vector sums per thread (no dependency
// chain limits the loads), dispatched to the best SIMD target of the machine like the library's kernels.
#include "bench/read_bandwidth.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bench/read_bandwidth.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <string>

#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "mha/attention.hpp"

HWY_BEFORE_NAMESPACE();
namespace mha_cli::bench::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// The sum of x[0, n), n a multiple of 4 vectors.
float SumFloats(const float* HWY_RESTRICT x, std::int64_t n) {
  const hn::ScalableTag<float> d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  auto s0 = hn::Zero(d), s1 = hn::Zero(d), s2 = hn::Zero(d), s3 = hn::Zero(d);
  for (std::int64_t i = 0; i < n; i += 4 * N) {
    s0 = hn::Add(s0, hn::Load(d, x + i));
    s1 = hn::Add(s1, hn::Load(d, x + i + N));
    s2 = hn::Add(s2, hn::Load(d, x + i + 2 * N));
    s3 = hn::Add(s3, hn::Load(d, x + i + 3 * N));
  }
  return hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(s0, s1), hn::Add(s2, s3))));
}

}  // namespace mha_cli::bench::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha_cli::bench {

HWY_EXPORT(SumFloats);

std::int64_t last_level_cache_bytes() {
  std::int64_t best = 0;
  for (int index = 0; index < 8; ++index) {
    std::ifstream file("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/size");
    std::string size;
    if (!(file >> size) || size.empty()) continue;
    std::int64_t value = std::stoll(size);
    if (size.back() == 'K') value <<= 10;
    if (size.back() == 'M') value <<= 20;
    best = std::max(best, value);
  }
  return best > 0 ? best : std::int64_t{32} << 20;
}

ReadBandwidth measure_read_bandwidth(std::int64_t bytes, int reps) {
  const int threads = mha::num_threads();
  constexpr std::int64_t kPart = 4096;  // floats: every thread's part a multiple of any 4 vectors
  const std::int64_t per_thread = std::max<std::int64_t>(1, bytes / 4 / threads / kPart) * kPart;
  const std::int64_t n = per_thread * threads;
  auto buffer = hwy::AllocateAligned<float>(static_cast<std::size_t>(n));
  volatile float sink = 0;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int t = 0; t < threads; ++t) std::fill(buffer.get() + t * per_thread, buffer.get() + (t + 1) * per_thread, 1.0f);
  double best = 0;
  for (int rep = 0; rep < reps; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    float total = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : total)
    for (int t = 0; t < threads; ++t)
      total += HWY_DYNAMIC_DISPATCH(SumFloats)(buffer.get() + t * per_thread, per_thread);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    sink = sink + total;
    best = std::max(best, static_cast<double>(n) * 4 / s);
  }
  return {threads, best, n * 4};
}

}  // namespace mha_cli::bench
#endif  // HWY_ONCE
