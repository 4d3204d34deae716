// Timing protocol, the oneDNN sgemm roof, and the peak resident set.
#include "bench/bench_measure.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include <oneapi/dnnl/dnnl.h>

#include "mha/attention.hpp"

namespace mha_cli::bench {
namespace {

double seconds_of(const std::function<void()>& call) {
  const auto start = std::chrono::steady_clock::now();
  call();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

Timing measure(const std::function<void()>& call, const RepeatPolicy& policy) {
  std::vector<double> times;
  for (int i = 0; i < policy.warmup; ++i) {
    const double warmup_s = seconds_of(call);
    if (warmup_s > policy.max_time_s) times.push_back(warmup_s);  // long enough to be its own warm-up
  }
  double elapsed = 0;
  for (double t : times) elapsed += t;
  while (static_cast<int>(times.size()) < policy.max_reps &&
         (static_cast<int>(times.size()) < policy.min_reps || elapsed < policy.min_time_s)) {
    if (!times.empty() && elapsed > policy.max_time_s) break;
    times.push_back(seconds_of(call));
    elapsed += times.back();
  }
  std::sort(times.begin(), times.end());
  const std::size_t n = times.size();
  const double median = n % 2 == 1 ? times[n / 2] : 0.5 * (times[n / 2 - 1] + times[n / 2]);
  return {times.front(), median, static_cast<int>(n)};
}

Roof measure_roof(int threads) {
  constexpr std::int64_t n = kRoofSize;
  // A, B, C: [n, n] row-major, allocated once: the roof is measured many times in a run.
  static std::vector<float> a, b, c;
  if (a.empty()) {
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    a.resize(n * n);
    b.resize(n * n);
    c.resize(n * n);
    for (float& x : a) x = uniform(rng);
    for (float& x : b) x = uniform(rng);
  }
  mha::set_num_threads(threads);
  const RepeatPolicy policy{.warmup = 1, .min_reps = 5, .max_reps = 20, .min_time_s = 0.5, .max_time_s = 3.0};
  const Timing timing = measure(
      [&] {
        if (dnnl_sgemm('N', 'N', n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n) != dnnl_success)
          throw std::runtime_error("dnnl_sgemm failed in the roof measurement");
      },
      policy);
  const double flops = 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
  return {threads, flops / timing.min_s * 1e-9, timing};
}

TileRate measure_tile_sgemm() {
  constexpr std::int64_t keys = 4096, block = kTileKeys, d = kTileWidth;
  const std::int64_t rows = tile_rows();
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> q(rows * d), k(keys * d), v(keys * d), s(rows * block), acc(rows * d, 0.0f);
  for (auto* x : {&q, &k, &v, &s})
    for (float& e : *x) e = uniform(rng);
  mha::set_num_threads(1);
  const RepeatPolicy policy{.warmup = 1, .min_reps = 5, .max_reps = 1000, .min_time_s = 0.3, .max_time_s = 2.0};
  const Timing timing = measure(
      [&] {
        for (std::int64_t j0 = 0; j0 < keys; j0 += block) {
          // S [rows, block] = Q [rows, d] K_blk^T;  acc [rows, d] += S V_blk [block, d]
          dnnl_sgemm('N', 'T', rows, block, d, 1.0f, q.data(), d, &k[j0 * d], d, 0.0f, s.data(), block);
          dnnl_sgemm('N', 'N', rows, d, block, 1.0f, s.data(), block, &v[j0 * d], d, 1.0f, acc.data(), d);
        }
      },
      policy);
  const double flops = 2.0 * (2.0 * rows * static_cast<double>(keys) * d);
  return {flops / timing.min_s * 1e-9, timing};
}

std::int64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string key;
  std::int64_t kib = 0;
  while (status >> key) {
    if (key == "VmHWM:" && status >> kib) return kib * 1024;  // "VmHWM:   123456 kB"
  }
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<std::int64_t>(usage.ru_maxrss) * 1024;  // Linux reports KiB
}

}  // namespace mha_cli::bench
