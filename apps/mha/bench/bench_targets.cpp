// Each target: what is promised, the figure that decides it, met or missed, and by how much.
#include "bench/bench_targets.hpp"

#include <algorithm>
#include <functional>

#include <fmt/core.h>

#include "bench/bench_tables.hpp"

namespace mha_cli::bench {
namespace {

constexpr std::int64_t kCoreMinN = 2048;  // the roof targets hold from this N up
constexpr double kForwardRoofFraction = 0.75;
constexpr double kBackwardRoofFraction = 0.50;
constexpr std::int64_t kLayerN = 4096;  // the layer and causal targets' shape
constexpr int kLayerThreads = 2;
constexpr double kForwardSpeedup = 3.0;  // the layer forward against PyTorch
constexpr double kForwardBackwardSpeedup = 2.5;
constexpr double kMemoryRatio = 0.25;  // our peak RSS over PyTorch's, forward + backward
constexpr std::int64_t kBigN = 65536;
constexpr std::int64_t kBigMemoryBytes = std::int64_t(1) << 30;
constexpr double kThreadSpeedup = 1.8;  // 2 threads over 1 at B*h = 1
constexpr double kCausalSpeedup = 1.7;

std::string not_measured(const std::string& what) { return "not measured in this run (" + what + ")"; }

// "met with 5.2 points to spare" / "missed by 3.8 points", for fractions of the roof.
std::string points_margin(double value, double threshold) {
  const double points = 100 * (value - threshold);
  return value >= threshold ? fmt::format("met with {:.1f} percentage points to spare", points)
                            : fmt::format("missed by {:.1f} percentage points ({:.0f}% of the target)", -points,
                                          100 * value / threshold);
}

// For "at least" ratios: "met: 1.70x the target" / "missed: 0.85x the target".
std::string factor_margin(double value, double threshold, bool at_least = true) {
  const double factor = at_least ? value / threshold : threshold / value;
  return fmt::format("{}: {:.2f}x the target{}", factor >= 1 ? "met" : "missed", factor,
                     factor >= 1 ? "" : fmt::format(" (short by {:.1f}%)", 100 * (1 - factor)));
}

std::string core_label(const CoreResult& c) {
  return fmt::format("{} thread{}, N {}{}", c.threads, c.threads == 1 ? "" : "s", c.n, c.causal ? ", causal" : "");
}

TargetResult roof_target(const BenchResults& r, const std::string& name, double threshold,
                         const std::function<const KernelRate&(const CoreResult&)>& rate) {
  TargetResult t{name, "", std::nullopt, ""};
  const CoreResult* worst = nullptr;
  const CoreResult* best = nullptr;
  for (const CoreResult& c : r.core) {
    if (c.n < kCoreMinN) continue;
    if (!worst || rate(c).roof_fraction < rate(*worst).roof_fraction) worst = &c;
    if (!best || rate(c).roof_fraction > rate(*best).roof_fraction) best = &c;
  }
  if (!worst) {
    t.measured = not_measured(fmt::format("no size >= {}", kCoreMinN));
    return t;
  }
  t.measured = fmt::format("worst {:.1f}% ({}), best {:.1f}% ({})", 100 * rate(*worst).roof_fraction,
                           core_label(*worst), 100 * rate(*best).roof_fraction, core_label(*best));
  t.met = rate(*worst).roof_fraction >= threshold;
  t.margin = points_margin(rate(*worst).roof_fraction, threshold);
  return t;
}

const LayerResult* find_layer(const BenchResults& r, bool causal, const std::string& pass) {
  for (const LayerResult& l : r.layer)
    if (l.n == kLayerN && l.threads == kLayerThreads && l.causal == causal && l.pass == pass) return &l;
  return nullptr;
}

TargetResult speedup_target(const BenchResults& r, const std::string& name, const std::string& pass, double threshold) {
  TargetResult t{name, "", std::nullopt, ""};
  const LayerResult* l = find_layer(r, false, pass);
  if (!l || !l->speedup) {
    t.measured = not_measured(fmt::format("needs N {}, {} threads and PyTorch", kLayerN, kLayerThreads));
    return t;
  }
  const LayerResult* causal = find_layer(r, true, pass);
  t.measured = fmt::format("{:.2f}x non-causal (mha {:.1f} ms, torch {:.1f} ms){}", *l->speedup,
                           l->mha.timing.min_s * 1e3, l->torch.timing.min_s * 1e3,
                           causal && causal->speedup ? fmt::format("; causal {:.2f}x", *causal->speedup) : "");
  t.met = *l->speedup >= threshold;
  t.margin = factor_margin(*l->speedup, threshold);
  return t;
}

TargetResult memory_target(const BenchResults& r) {
  TargetResult t{
      fmt::format("peak memory at N = {} (forward + backward, {} threads) <= 1/4 of PyTorch's", kLayerN, kLayerThreads),
      "", std::nullopt, ""};
  const LayerResult* l = find_layer(r, false, "fwdbwd");
  if (!l || !l->memory_ratio) {
    t.measured = not_measured(fmt::format("needs N {}, {} threads and PyTorch", kLayerN, kLayerThreads));
    return t;
  }
  t.measured = fmt::format("ratio {:.3f}: mha {} (+{} over its baseline), torch {} (+{})", *l->memory_ratio,
                           format_bytes(l->mha.peak_rss_first_bytes),
                           format_bytes(l->mha.peak_rss_first_bytes - l->mha.baseline_rss_bytes),
                           format_bytes(l->torch.peak_rss_first_bytes),
                           format_bytes(l->torch.peak_rss_first_bytes - l->torch.baseline_rss_bytes));
  t.met = *l->memory_ratio <= kMemoryRatio;
  t.margin = factor_margin(*l->memory_ratio, kMemoryRatio, false);
  return t;
}

TargetResult big_memory_target(const BenchResults& r) {
  TargetResult t{fmt::format("N = {} forward under 1 GiB peak RSS", kBigN), "", std::nullopt, ""};
  const BigResult* worst = nullptr;
  std::string all;
  for (const BigResult& b : r.big) {
    if (!b.run.ok() || b.n != kBigN) continue;
    all += fmt::format("{}{}{}: {}", all.empty() ? "" : "; ", b.impl, b.causal ? " causal" : "",
                       format_bytes(b.run.peak_rss_first_bytes));
    if (!worst || b.run.peak_rss_first_bytes > worst->run.peak_rss_first_bytes) worst = &b;
  }
  if (!worst) {
    t.measured = not_measured(fmt::format("needs --big {}", kBigN));
    return t;
  }
  t.measured = fmt::format("N {}: {}", worst->n, all);
  t.met = worst->run.peak_rss_first_bytes < kBigMemoryBytes;
  t.margin =
      factor_margin(static_cast<double>(worst->run.peak_rss_first_bytes), static_cast<double>(kBigMemoryBytes), false);
  return t;
}

TargetResult thread_target(const BenchResults& r) {
  TargetResult t{
      fmt::format("2 threads >= {:.1f}x one thread also with B*h = 1 (forward and backward)", kThreadSpeedup), "",
      std::nullopt, ""};
  if (!r.scaling || r.scaling->threads != std::vector<int>{1, 2}) {
    t.measured = not_measured("needs --threads 1,2");
    return t;
  }
  const ScalingResult& s = *r.scaling;
  t.measured = fmt::format("N {}: forward {:.2f}x, backward {:.2f}x (the sgemm roof itself: {:.2f}x)", s.n,
                           s.forward_speedup, s.backward_speedup, s.roof_speedup);
  const double worst = std::min(s.forward_speedup, s.backward_speedup);
  t.met = worst >= kThreadSpeedup;
  t.margin = factor_margin(worst, kThreadSpeedup);
  return t;
}

TargetResult causal_target(const BenchResults& r) {
  TargetResult t{fmt::format("causal >= {:.1f}x faster than non-causal at N = {} ({} threads; forward and backward)",
                             kCausalSpeedup, kLayerN, kLayerThreads),
                 "", std::nullopt, ""};
  const CausalResult* at_target = nullptr;
  std::string all;
  for (const CausalResult& c : r.causal) {
    all += fmt::format("{}{} thread{}: forward {:.2f}x, backward {:.2f}x", all.empty() ? "" : "; ", c.threads,
                       c.threads == 1 ? "" : "s", c.forward_speedup, c.backward_speedup);
    if (c.n == kLayerN && c.threads == kLayerThreads) at_target = &c;
  }
  if (!at_target) {
    t.measured = not_measured(fmt::format("needs N {} and {} threads", kLayerN, kLayerThreads));
    return t;
  }
  t.measured = all;
  const double worst = std::min(at_target->forward_speedup, at_target->backward_speedup);
  t.met = worst >= kCausalSpeedup;
  t.margin = factor_margin(worst, kCausalSpeedup);
  return t;
}

}  // namespace

std::vector<TargetResult> evaluate_targets(const BenchResults& r) {
  return {
      roof_target(r,
                  fmt::format("forward attention core >= {:.0f}% of the roof at N >= {}, d = 64",
                              100 * kForwardRoofFraction, kCoreMinN),
                  kForwardRoofFraction, [](const CoreResult& c) -> const KernelRate& { return c.forward; }),
      roof_target(r,
                  fmt::format("backward attention core >= {:.0f}% of the roof at N >= {}, d = 64",
                              100 * kBackwardRoofFraction, kCoreMinN),
                  kBackwardRoofFraction, [](const CoreResult& c) -> const KernelRate& { return c.backward; }),
      speedup_target(r,
                     fmt::format("whole layer forward >= {:.1f}x faster than PyTorch 1.13 at N = {}, {} threads",
                                 kForwardSpeedup, kLayerN, kLayerThreads),
                     "fwd", kForwardSpeedup),
      speedup_target(
          r,
          fmt::format("whole layer forward+backward >= {:.1f}x faster than PyTorch 1.13 at N = {}, {} threads",
                      kForwardBackwardSpeedup, kLayerN, kLayerThreads),
          "fwdbwd", kForwardBackwardSpeedup),
      memory_target(r),
      big_memory_target(r),
      thread_target(r),
      causal_target(r),
  };
}

}  // namespace mha_cli::bench
