// ReadBandwidthProbe (read_bandwidth.hpp): four independent vector sums per thread (no dependency
// chain limits the loads), or eight independent multiply-add chains (four per loaded vector), dispatched
// to the best SIMD target of the machine like the library's kernels.
#include "bench/read_bandwidth.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bench/read_bandwidth.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <string>

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

// The same sum with four multiply-adds per loaded vector, as the float32 decode kernel does at least when
// four query rows read each key and value row (h / h_kv = 4): each vector, times four different factors,
// into its own four sums (eight chains of one multiply-add per two vectors: neither their latency nor the
// registers of a 16-register machine limit it). n a multiple of 2 vectors.
float SumFloatsWithFourMultiplyAdds(const float* HWY_RESTRICT x, std::int64_t n) {
  const hn::ScalableTag<float> d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const auto f0 = hn::Set(d, 0.5f), f1 = hn::Set(d, 0.25f), f2 = hn::Set(d, 0.125f), f3 = hn::Set(d, 2.0f);
  auto a0 = hn::Zero(d), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  for (std::int64_t i = 0; i < n; i += 2 * N) {
    const auto x0 = hn::Load(d, x + i), x1 = hn::Load(d, x + i + N);
    a0 = hn::MulAdd(x0, f0, a0), a1 = hn::MulAdd(x0, f1, a1), a2 = hn::MulAdd(x0, f2, a2), a3 = hn::MulAdd(x0, f3, a3);
    b0 = hn::MulAdd(x1, f0, b0), b1 = hn::MulAdd(x1, f1, b1), b2 = hn::MulAdd(x1, f2, b2), b3 = hn::MulAdd(x1, f3, b3);
  }
  const auto all = hn::Add(hn::Add(hn::Add(a0, a1), hn::Add(a2, a3)), hn::Add(hn::Add(b0, b1), hn::Add(b2, b3)));
  return hn::GetLane(hn::SumOfLanes(d, all));
}

}  // namespace mha_cli::bench::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha_cli::bench {

HWY_EXPORT(SumFloats);
HWY_EXPORT(SumFloatsWithFourMultiplyAdds);

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

ReadBandwidthProbe::ReadBandwidthProbe(std::int64_t bytes)
    : buffer_(mha::Tensor::uninitialized(mha::DType::Float32, {std::max<std::int64_t>(bytes / 4, 1)})) {
  float* x = buffer_.data_as<float>();
  const std::int64_t n = buffer_.numel();
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < n; ++i) x[i] = 1.0f;
}

ReadBandwidth ReadBandwidthProbe::measure(int reps, Work work) const {
  const int threads = mha::num_threads();
  constexpr std::int64_t kPart = 4096;  // floats: every thread's part a multiple of any 4 vectors
  const std::int64_t per_thread = std::max<std::int64_t>(1, buffer_.numel() / threads / kPart) * kPart;
  const int parts = static_cast<int>(std::min<std::int64_t>(threads, buffer_.numel() / per_thread));  // that fit
  const float* x = buffer_.data_as<float>();
  volatile float sink = 0;
  double best = 0;
  for (int rep = 0; rep < reps; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    float total = 0;
#pragma omp parallel for schedule(static) num_threads(parts) reduction(+ : total)
    for (int t = 0; t < parts; ++t)
      total += work == Work::Sum ? HWY_DYNAMIC_DISPATCH(SumFloats)(x + t * per_thread, per_thread)
                                 : HWY_DYNAMIC_DISPATCH(SumFloatsWithFourMultiplyAdds)(x + t * per_thread, per_thread);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    sink = sink + total;
    best = std::max(best, static_cast<double>(parts * per_thread) * 4 / s);
  }
  return {parts, best, parts * per_thread * 4};
}

}  // namespace mha_cli::bench
#endif  // HWY_ONCE
