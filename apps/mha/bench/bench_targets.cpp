// Each target: what is promised, the figure that decides it, met or missed, and by how much.
#include "bench/bench_targets.hpp"

#include <algorithm>
#include <functional>

#include <fmt/core.h>

#include "bench/bench_grid.hpp"
#include "bench/bench_tables.hpp"

namespace mha_cli::bench {
namespace {

constexpr std::int64_t kCoreMinN = 2048;  // the core's roof targets hold from this N up
constexpr double kForwardRoofFraction = 0.80;
constexpr double kBackwardRoofFraction = 0.60;
constexpr std::int64_t kLayerSizes[] = {4096, 16384};  // the layer's roof targets
constexpr double kLayerForwardRoofFraction = 0.75;
constexpr double kLayerTrainRoofFraction = 0.60;
constexpr std::int64_t kLayerCoreN = 16384;  // the layer against the core on contiguous heads
constexpr double kLayerCoreFraction = 0.90;  // "within 10%"
constexpr int kLayerThreads = 2;
constexpr std::int64_t kTorchN = 4096;   // the layer against PyTorch
constexpr double kForwardSpeedup = 2.5;  // the layer forward against PyTorch
constexpr double kForwardBackwardSpeedup = 2.2;
constexpr std::int64_t kBigN = 65536;
constexpr std::int64_t kBigMemoryBytes = std::int64_t(2) << 30;  // the training step's peak RSS
struct CausalTarget {
  std::int64_t n;
  double speedup;
};
constexpr CausalTarget kCausalTargets[] = {{4096, 1.85}, {512, 1.5}};  // ideal: 2x (half the work)
constexpr double kGridFloor = 1.0;           // the grid: never slower than PyTorch, nor 2 threads than 1
constexpr std::int64_t kGridTokens = 2048;   // from this B*N up, the grid's higher targets:
constexpr double kGridForwardSpeedup = 1.5;  // forward against PyTorch
constexpr double kGridTrainSpeedup = 1.3;    // training step against PyTorch

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

std::string threads_label(int threads) { return fmt::format("{} thread{}", threads, threads == 1 ? "" : "s"); }

TargetResult roof_target(const BenchResults& r, const std::string& name, double threshold,
                         const std::function<const KernelRate&(const CoreResult&)>& rate) {
  TargetResult t{name, "", std::nullopt, ""};
  const CoreResult* worst[2] = {nullptr, nullptr};  // non-causal, causal
  for (const CoreResult& c : r.core) {
    const CoreResult*& w = worst[c.causal ? 1 : 0];
    if (c.n >= kCoreMinN && (!w || rate(c).roof_fraction < rate(*w).roof_fraction)) w = &c;
  }
  if (!worst[0] && !worst[1]) {
    t.measured = not_measured(fmt::format("no size >= {}", kCoreMinN));
    return t;
  }
  const CoreResult* all = worst[0];
  for (const CoreResult* w : worst) {
    if (!w) continue;
    t.measured += fmt::format("{}worst {}causal {:.1f}% ({})", t.measured.empty() ? "" : "; ", w->causal ? "" : "non-",
                              100 * rate(*w).roof_fraction, core_label(*w));
    if (!all || rate(*w).roof_fraction < rate(*all).roof_fraction) all = w;
  }
  t.met = rate(*all).roof_fraction >= threshold;
  t.margin = points_margin(rate(*all).roof_fraction, threshold);
  return t;
}

const LayerResult* find_layer(const std::vector<LayerResult>& rows, std::int64_t n, bool causal,
                              const std::string& pass) {
  for (const LayerResult& l : rows)
    if (l.n == n && l.threads == kLayerThreads && l.causal == causal && l.pass == pass) return &l;
  return nullptr;
}

// The layer's rate over its group's roof at kLayerSizes, 2 threads, non-causal; the worst decides.
TargetResult layer_roof_target(const BenchResults& r, const std::string& pass, double threshold) {
  TargetResult t{fmt::format("whole layer {} (projections included) >= {:.0f}% of the roof at N = 4096 and 16384, "
                             "{} threads (E 512, h 8, B 1, non-causal)",
                             pass == "fwd" ? "forward" : "forward+backward", 100 * threshold, kLayerThreads),
                 "", std::nullopt, ""};
  std::optional<double> worst;
  for (std::int64_t n : kLayerSizes) {
    const LayerResult* l = find_layer(r.layer, n, false, pass);
    if (!l || !l->mha.ok()) {
      t.measured += fmt::format("{}N {}: not in this run", t.measured.empty() ? "" : "; ", n);
      continue;
    }
    const double fraction = l->mha.gflops / l->roof.gflops;
    t.measured += fmt::format("{}N {}: {:.1f}% ({:.1f} of {:.1f} GFLOP/s)", t.measured.empty() ? "" : "; ", n,
                              100 * fraction, l->mha.gflops, l->roof.gflops);
    worst = worst ? std::min(*worst, fraction) : fraction;
  }
  if (!worst) t.measured = not_measured("needs N 4096 or 16384 and 2 threads");
  if (worst) {
    t.met = *worst >= threshold;
    t.margin = points_margin(*worst, threshold) + " (the worst size)";
  }
  return t;
}

// The layer against the core on contiguous heads [1, 8, N, 64] (the head-layout table), same threads:
// each as a fraction of its own group's roof, so that a change in the machine's load between the two
// groups does not count. The layer's figure counts its projection FLOPs too (about 6% of its forward's
// at N 16384; they run as large GEMMs), so it is the whole layer's rate, not its attention's alone.
TargetResult layer_core_target(const BenchResults& r) {
  TargetResult t{
      fmt::format("whole layer within {:.0f}% of the core on contiguous heads at N = {}, {} threads: the "
                  "layer's GFLOP/s (projections + attention FLOPs over the layer's time) as a fraction of its "
                  "roof >= {:.0f}% of the core's fraction (forward; forward+backward)",
                  100 * (1 - kLayerCoreFraction), kLayerCoreN, kLayerThreads, 100 * kLayerCoreFraction),
      "", std::nullopt, ""};
  const LayoutResult* core = nullptr;
  for (const LayoutResult& l : r.layout)
    if (l.n == kLayerCoreN && l.threads == kLayerThreads) core = &l;
  const LayerResult* fwd = find_layer(r.layer, kLayerCoreN, false, "fwd");
  const LayerResult* train = find_layer(r.layer, kLayerCoreN, false, "fwdbwd");
  if (!core || !fwd || !train || !fwd->mha.ok() || !train->mha.ok()) {
    t.measured = not_measured(fmt::format("needs N {} and {} threads", kLayerCoreN, kLayerThreads));
    return t;
  }
  const KernelRate &cf = core->contiguous_forward, &cb = core->contiguous_backward;
  const double core_fwd = cf.roof_fraction;
  const double core_train = (cf.gflop + cb.gflop) / (cf.timing.min_s + cb.timing.min_s) / core->roof.gflops;
  const double layer_fwd = fwd->mha.gflops / fwd->roof.gflops, layer_train = train->mha.gflops / train->roof.gflops;
  const double worst = std::min(layer_fwd / core_fwd, layer_train / core_train);
  t.measured =
      fmt::format("forward: layer {:.1f}% of its roof, core {:.1f}% ({:.2f}x); forward+backward: layer {:.1f}%, "
                  "core {:.1f}% ({:.2f}x)",
                  100 * layer_fwd, 100 * core_fwd, layer_fwd / core_fwd, 100 * layer_train, 100 * core_train,
                  layer_train / core_train);
  t.met = worst >= kLayerCoreFraction;
  t.margin = factor_margin(worst, kLayerCoreFraction);
  return t;
}

// The layer table's rows when PyTorch ran on `blas` there, else the peer's rows on `blas`.
const std::vector<LayerResult>* torch_rows(const BenchResults& r, const std::string& blas, std::string& status) {
  if (r.torch_blas == blas) return &r.layer;
  for (const BlasPeer& p : r.torch_blas_peers) {
    if (p.blas != blas) continue;
    status = p.status;
    return p.status == "ok" ? &p.layer : nullptr;
  }
  status = r.torch_blas.empty() ? "--no-torch" : "not in this run";
  return nullptr;
}

TargetResult speedup_target(const BenchResults& r, const std::string& blas, const std::string& pass, double threshold) {
  TargetResult t{fmt::format("whole layer {} >= {:.1f}x faster than PyTorch 1.13 on {} at N = {}, {} threads",
                             pass == "fwd" ? "forward" : "forward+backward", threshold,
                             blas == "onednn" ? "oneDNN's sgemm (the preload)" : "OpenBLAS", kTorchN, kLayerThreads),
                 "", std::nullopt, ""};
  std::string status;
  const std::vector<LayerResult>* rows = torch_rows(r, blas, status);
  const LayerResult* l = rows ? find_layer(*rows, kTorchN, false, pass) : nullptr;
  if (!l || !l->speedup) {
    t.measured = !rows && status.rfind("not measured", 0) == 0
                     ? status
                     : not_measured(fmt::format("needs N {}, {} threads and PyTorch{}", kTorchN, kLayerThreads,
                                                status.empty() ? "" : ": " + status));
    return t;
  }
  const LayerResult* causal = find_layer(*rows, kTorchN, true, pass);
  t.measured = fmt::format("{:.2f}x non-causal (mha {:.1f} ms, torch {:.1f} ms){}", *l->speedup,
                           l->mha.timing.min_s * 1e3, l->torch.timing.min_s * 1e3,
                           causal && causal->speedup ? fmt::format("; causal {:.2f}x", *causal->speedup) : "");
  t.met = *l->speedup >= threshold;
  t.margin = factor_margin(*l->speedup, threshold);
  return t;
}

TargetResult big_memory_target(const BenchResults& r) {
  TargetResult t{fmt::format("training step (the layer's forward + backward, train mode) at N = {} under {} peak RSS, "
                             "in a process of its own",
                             kBigN, format_bytes(kBigMemoryBytes)),
                 "", std::nullopt, ""};
  const BigResult* train = nullptr;
  std::string others;
  for (const BigResult& b : r.big) {
    if (!b.run.ok() || b.n != kBigN) continue;
    if (b.impl == "mha" && b.pass == "fwdbwd" && !b.causal) train = &b;
    else
      others += fmt::format("; {} {}{}: {}", b.impl, b.pass, b.causal ? " causal" : "",
                            format_bytes(b.run.peak_rss_first_bytes));
  }
  if (!train) {
    t.measured = not_measured(fmt::format("needs --big {}", kBigN));
    return t;
  }
  t.measured = fmt::format("{} ({} threads; +{} over its baseline of inputs and parameters){}",
                           format_bytes(train->run.peak_rss_first_bytes), train->threads,
                           format_bytes(train->run.peak_rss_first_bytes - train->run.baseline_rss_bytes), others);
  t.met = train->run.peak_rss_first_bytes < kBigMemoryBytes;
  t.margin =
      factor_margin(static_cast<double>(train->run.peak_rss_first_bytes), static_cast<double>(kBigMemoryBytes), false);
  return t;
}

TargetResult causal_target(const BenchResults& r, const CausalTarget& target) {
  TargetResult t{fmt::format("causal >= {:.2f}x faster than non-causal at N = {} (the core; forward and backward, "
                             "every thread count)",
                             target.speedup, target.n),
                 "", std::nullopt, ""};
  std::optional<double> worst;
  for (const CausalResult& c : r.causal) {
    if (c.n != target.n) continue;
    t.measured += fmt::format("{}{}: forward {:.2f}x, backward {:.2f}x", t.measured.empty() ? "" : "; ",
                              threads_label(c.threads), c.forward_speedup, c.backward_speedup);
    const double w = std::min(c.forward_speedup, c.backward_speedup);
    worst = worst ? std::min(*worst, w) : w;
  }
  if (!worst) {
    t.measured = not_measured(fmt::format("needs N {} in --sizes", target.n));
    return t;
  }
  t.met = *worst >= target.speedup;
  t.margin = factor_margin(*worst, target.speedup);
  return t;
}

// ---- the grid of small and mid shapes -------------------------------------------------------------------

// Why the grid has no figures: "--no-grid", "--quick" (results.grid_status "not run: --no-grid").
std::string grid_not_run(const BenchResults& r) {
  const std::string prefix = "not run: ";
  if (r.grid_status.empty()) return "the grid did not run";
  return r.grid_status.rfind(prefix, 0) == 0 ? r.grid_status.substr(prefix.size()) : r.grid_status;
}

std::string grid_cell(const GridRow& g) {
  return fmt::format("B {}, N {}, E {}, h {}, {}", g.batch, g.n, g.d_model, g.heads, threads_label(g.threads));
}

std::string time_us(double s) {
  return s < 1e-3 ? fmt::format("{:.1f} us", s * 1e6) : fmt::format("{:.2f} ms", s * 1e3);
}

// Torch time over ours in every grid cell with B*N >= min_tokens; the smallest decides.
TargetResult grid_speedup_target(const BenchResults& r, bool train, double threshold, std::int64_t min_tokens) {
  TargetResult t{fmt::format("grid: layer {} >= {:.1f}x PyTorch's speed (torch time / ours) in every cell{}",
                             train ? "training step (forward + backward)" : "forward", threshold,
                             min_tokens > 0 ? fmt::format(" with B*N >= {}", min_tokens) : " (never slower)"),
                 "", std::nullopt, ""};
  if (r.grid_status != "ok") {
    t.measured = not_measured(grid_not_run(r));
    return t;
  }
  const GridRow* worst = nullptr;
  int cells = 0, below = 0;
  for (const GridRow& g : r.grid) {
    const std::optional<double>& ratio = train ? g.train_speedup : g.forward_speedup;
    if (g.batch * g.n < min_tokens || !ratio) continue;
    ++cells;
    below += *ratio < threshold ? 1 : 0;
    if (!worst || *ratio < *(train ? worst->train_speedup : worst->forward_speedup)) worst = &g;
  }
  if (!worst) {
    t.measured = not_measured(fmt::format("no grid cell{} with both times", min_tokens > 0 ? " with B*N >= 2048" : ""));
    return t;
  }
  const double ratio = *(train ? worst->train_speedup : worst->forward_speedup);
  const GridTime &ours = train ? worst->mha_train : worst->mha_forward,
                 &theirs = train ? worst->torch_train : worst->torch_forward;
  t.measured =
      fmt::format("worst {:.2f}x at {} (mha {}, torch {}); {} of {} cells below {:.1f}x", ratio, grid_cell(*worst),
                  time_us(ours.timing.min_s), time_us(theirs.timing.min_s), below, cells, threshold);
  t.met = ratio >= threshold;
  t.margin = factor_margin(ratio, threshold);
  return t;
}

TargetResult grid_thread_target(const BenchResults& r) {
  TargetResult t{"grid: ours with 2 threads never slower than with 1 (every shape, forward and training step)", "",
                 std::nullopt, ""};
  const std::vector<GridThreadRatio> ratios = grid_thread_ratios(r.grid);
  if (ratios.empty()) {
    t.measured = not_measured(r.grid_status != "ok" ? grid_not_run(r) : "needs the grid at 1 and 2 threads");
    return t;
  }
  const auto worst =
      std::min_element(ratios.begin(), ratios.end(), [](const auto& a, const auto& b) { return a.ratio < b.ratio; });
  const auto slower = std::count_if(ratios.begin(), ratios.end(), [](const auto& x) { return x.ratio < kGridFloor; });
  const GridTime& one = worst->pass == "forward" ? worst->first->mha_forward : worst->first->mha_train;
  const GridTime& two = worst->pass == "forward" ? worst->last->mha_forward : worst->last->mha_train;
  t.measured =
      fmt::format("worst {:.2f}x ({} at B {}, N {}, E {}: {} {}, {} {}); {} of {} cells slower with {}", worst->ratio,
                  worst->pass, worst->first->batch, worst->first->n, worst->first->d_model,
                  threads_label(worst->first->threads), time_us(one.timing.min_s), threads_label(worst->last->threads),
                  time_us(two.timing.min_s), slower, ratios.size(), threads_label(worst->last->threads));
  t.met = worst->ratio >= kGridFloor;
  t.margin = factor_margin(worst->ratio, kGridFloor);
  return t;
}

std::vector<TargetResult> grid_targets(const BenchResults& r) {
  return {grid_speedup_target(r, false, kGridFloor, 0), grid_speedup_target(r, true, kGridFloor, 0),
          grid_speedup_target(r, false, kGridForwardSpeedup, kGridTokens),
          grid_speedup_target(r, true, kGridTrainSpeedup, kGridTokens), grid_thread_target(r)};
}

}  // namespace

std::vector<TargetResult> evaluate_targets(const BenchResults& r) {
  std::vector<TargetResult> targets = {
      roof_target(r,
                  fmt::format("forward attention core >= {:.0f}% of the roof at N >= {}, h 8, d 64, every thread count "
                              "(causal rows included)",
                              100 * kForwardRoofFraction, kCoreMinN),
                  kForwardRoofFraction, [](const CoreResult& c) -> const KernelRate& { return c.forward; }),
      roof_target(r,
                  fmt::format("backward attention core >= {:.0f}% of the roof at N >= {}, h 8, d 64, every thread "
                              "count (causal rows included)",
                              100 * kBackwardRoofFraction, kCoreMinN),
                  kBackwardRoofFraction, [](const CoreResult& c) -> const KernelRate& { return c.backward; }),
      layer_roof_target(r, "fwd", kLayerForwardRoofFraction),
      layer_roof_target(r, "fwdbwd", kLayerTrainRoofFraction),
      layer_core_target(r),
  };
  for (const CausalTarget& c : kCausalTargets) targets.push_back(causal_target(r, c));
  targets.push_back(big_memory_target(r));
  for (const char* blas : {"onednn", "openblas"}) {
    targets.push_back(speedup_target(r, blas, "fwd", kForwardSpeedup));
    targets.push_back(speedup_target(r, blas, "fwdbwd", kForwardBackwardSpeedup));
  }
  for (TargetResult& t : grid_targets(r)) targets.push_back(std::move(t));
  return targets;
}

}  // namespace mha_cli::bench
