// `mha bench`: the measurement plan. Every group of measurements at one thread count and size is
// bracketed by roof measurements, so that each rate can be read against the machine's state at the time.
//
// Legend: B batch (1 here), h heads, N = L = S, d per-head width, E = d_model = h * d.
#include "bench/bench.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "bench/bench_grid.hpp"
#include "bench/bench_machine.hpp"
#include "bench/bench_measure.hpp"
#include "bench/bench_plot.hpp"
#include "bench/bench_process.hpp"
#include "bench/bench_results.hpp"
#include "bench/bench_runs.hpp"
#include "bench/bench_tables.hpp"
#include "bench/bench_targets.hpp"
#include "bench/bench_workloads.hpp"
#include "mha/attention.hpp"

namespace mha_cli {
namespace {

using namespace bench;

constexpr std::int64_t kQuickSizes[] = {512, 2048};
constexpr std::int64_t kScalingN = 4096;              // the B*h = 1 thread-scaling shape
constexpr std::int64_t kCausalSizes[] = {512, 4096};  // the causal / non-causal comparison
constexpr std::int64_t kLayoutMinN = 4096;            // the head-layout comparison, from this N up
constexpr std::int64_t kBlasCheckN = 4096;            // the one shape PyTorch also runs on the other BLAS libraries
constexpr const char* kBlasNames[] = {"onednn", "openblas", "installed"};  // the peers' order

// Timed calls in this process and in the per-shape processes (ours and PyTorch's).
const RepeatPolicy kPolicy{};
// The long --big runs and the other-BLAS check: one call each, no warm-up (see RepeatPolicy).
const RepeatPolicy kSingleCall{.warmup = 0, .min_reps = 1, .max_reps = 1, .min_time_s = 0, .max_time_s = 0};

// The plan, resolved from the options.
struct Plan {
  std::vector<int> threads;
  std::vector<std::int64_t> sizes;
  std::int64_t big = 0;
  int big_threads = 0;  // the largest thread count
  bool grid = true;     // the grid of small and mid shapes
  bool grid_only = false;
};

Plan make_plan(const BenchOptions& o) {
  Plan plan{o.threads, o.sizes, o.big, 0, !o.quick && o.grid, o.grid_only};
  if (o.quick) {
    plan.sizes.assign(std::begin(kQuickSizes), std::end(kQuickSizes));
    plan.big = 0;
  }
  if (o.grid_only) plan.grid = true;
  if (plan.grid && !o.grid_shapes.empty()) parse_grid_shapes(o.grid_shapes);  // refuses bad shapes before the run
  if (plan.threads.empty() || plan.sizes.empty())
    throw std::invalid_argument("--threads and --sizes must not be empty");
  for (int t : plan.threads)
    if (t < 1) throw std::invalid_argument(fmt::format("--threads: expected positive counts, got {}", t));
  for (std::int64_t n : plan.sizes)
    if (n < 1) throw std::invalid_argument(fmt::format("--sizes: expected positive sizes, got {}", n));
  plan.big_threads = *std::max_element(plan.threads.begin(), plan.threads.end());
  return plan;
}

KernelRate rate_of(const Timing& timing, double flops, const Roof& roof) {
  const double gflops = flops / timing.min_s * 1e-9;
  return {timing, flops * 1e-9, gflops, gflops / roof.gflops};
}

Roof take_roof(BenchResults& results, int threads) {
  Roof roof = measure_roof(threads);
  results.roofs.push_back(roof);
  mha::set_num_threads(threads);
  return roof;
}

// A group's roof, measured just before the group and again just after it. The better of the two is
// the group's roof (other work on the machine only slows the sgemm down); their ratio, the spread,
// shows how much the machine's load changed during the group.
class GroupRoof {
 public:
  GroupRoof(BenchResults& results, int threads) : results_(results), before_(take_roof(results, threads)) {}

  Roof finish() {
    const Roof after = take_roof(results_, before_.threads);
    Roof best = after.gflops > before_.gflops ? after : before_;
    best.spread = std::max(after.gflops, before_.gflops) / std::min(after.gflops, before_.gflops);
    return best;
  }

 private:
  BenchResults& results_;
  Roof before_;
};

// ---- the attention core, in this process ---------------------------------------------------------

struct CoreTimings {
  Timing forward, backward;
  double forward_flops = 0;  // per call; the backward does kBackwardFlopsRatio times as many

  KernelRate forward_rate(const Roof& roof) const { return rate_of(forward, forward_flops, roof); }
  KernelRate backward_rate(const Roof& roof) const {
    return rate_of(backward, kBackwardFlopsRatio * forward_flops, roof);
  }
};

// q, k, v [1, heads, n, d]: forward, then backward from that forward's out and lse.
CoreTimings measure_core(std::int64_t heads, std::int64_t n, bool causal, HeadLayout layout = HeadLayout::Contiguous) {
  CoreWorkload work(1, heads, n, kHeadWidth, causal, true, layout);
  CoreTimings t;
  t.forward_flops = attention_forward_flops(1, heads, n, kHeadWidth, causal);
  t.forward = measure([&] { work.forward(); }, kPolicy);
  t.backward = measure([&] { work.backward(); }, kPolicy);
  return t;
}

void run_core(BenchResults& results, const Plan& plan) {
  print_core_header(kHeads, kHeadWidth);
  for (int threads : plan.threads) {
    for (std::int64_t n : plan.sizes) {
      const TileRate tile = measure_tile_sgemm();
      GroupRoof group(results, threads);
      const CoreTimings full = measure_core(kHeads, n, false), causal = measure_core(kHeads, n, true);
      const Roof roof = group.finish();
      for (const auto& [is_causal, t] : {std::pair{false, full}, std::pair{true, causal}}) {
        const CoreResult row{
            threads, n, kHeads, kHeadWidth, is_causal, roof, tile, t.forward_rate(roof), t.backward_rate(roof)};
        results.core.push_back(row);
        print_core_row(row);
      }
    }
  }
}

void run_scaling(BenchResults& results, const Plan& plan) {
  ScalingResult s;
  s.n = kScalingN;
  s.d = kHeadWidth;
  for (int threads : plan.threads) {
    GroupRoof group(results, threads);
    const CoreTimings t = measure_core(1, kScalingN, false);
    const Roof roof = group.finish();
    s.threads.push_back(threads);
    s.roofs.push_back(roof);
    s.forward.push_back(t.forward_rate(roof));
    s.backward.push_back(t.backward_rate(roof));
  }
  s.forward_speedup = s.forward.front().timing.min_s / s.forward.back().timing.min_s;
  s.backward_speedup = s.backward.front().timing.min_s / s.backward.back().timing.min_s;
  s.roof_speedup = s.roofs.back().gflops / s.roofs.front().gflops;
  results.scaling = s;
  print_scaling(s);
}

// The core on both head layouts at each size from kLayoutMinN up, at the largest thread count.
void run_layout(BenchResults& results, const Plan& plan) {
  bool header = false;
  for (std::int64_t n : plan.sizes) {
    if (n < kLayoutMinN) continue;
    if (!header) print_layout_header();
    header = true;
    GroupRoof group(results, plan.big_threads);
    const CoreTimings contiguous = measure_core(kHeads, n, false, HeadLayout::Contiguous);
    const CoreTimings interleaved = measure_core(kHeads, n, false, HeadLayout::Interleaved);
    const Roof roof = group.finish();
    const LayoutResult row{plan.big_threads,
                           n,
                           roof,
                           contiguous.forward_rate(roof),
                           contiguous.backward_rate(roof),
                           interleaved.forward_rate(roof),
                           interleaved.backward_rate(roof)};
    results.layout.push_back(row);
    print_layout_row(row);
  }
}

// Non-causal time over causal time at kCausalSizes, from the core rows.
void derive_causal(BenchResults& results) {
  for (const CoreResult& full : results.core) {
    if (full.causal || std::find(std::begin(kCausalSizes), std::end(kCausalSizes), full.n) == std::end(kCausalSizes))
      continue;
    for (const CoreResult& causal : results.core) {
      if (causal.n != full.n || causal.threads != full.threads || !causal.causal) continue;
      results.causal.push_back({full.threads, full.n, full.forward.timing.min_s / causal.forward.timing.min_s,
                                full.backward.timing.min_s / causal.backward.timing.min_s});
    }
  }
  print_causal(results.causal);
}

// ---- one shape per process: ours and PyTorch's (bench_runs.hpp) ---------------------------------

void finish_layer_row(LayerResult& row) {
  if (row.mha.ok() && row.torch.ok()) {
    row.speedup = row.torch.timing.min_s / row.mha.timing.min_s;
    row.memory_ratio =
        static_cast<double>(row.mha.peak_rss_first_bytes) / static_cast<double>(row.torch.peak_rss_first_bytes);
  }
}

void run_layer(BenchResults& results, const Plan& plan, const BenchOptions& options) {
  const TorchRunner torch{options, results};
  print_layer_header(options.torch ? torch_label(options.torch_blas) : "nothing (--no-torch)");
  for (int threads : plan.threads) {
    for (std::int64_t n : plan.sizes) {
      GroupRoof group(results, threads);
      std::vector<LayerResult> rows;
      for (bool causal : {false, true}) {
        for (Pass pass : {Pass::Forward, Pass::ForwardBackward}) {
          const double flops = layer_flops(1, n, kDModel, kHeads, causal, pass);
          LayerResult row{threads, n, causal, pass_name(pass), flops * 1e-9, {}, {}, {}, {}, {}};
          row.mha = run_ours("mha", n, causal, threads, pass, kPolicy, flops);
          if (options.torch) row.torch = torch.run(n, causal, threads, pass, options.torch_blas, kPolicy, flops);
          else row.torch.status = kNoTorchStatus;
          finish_layer_row(row);
          rows.push_back(row);
        }
      }
      const Roof roof = group.finish();
      for (LayerResult& row : rows) {
        row.roof = roof;
        results.layer.push_back(row);
        print_layer_row(row);
      }
    }
  }
}

// PyTorch on each BLAS not used in the layer table, at one shape: how much the BLAS matters. Netlib's
// reference BLAS ("installed", unless Debian's alternatives point elsewhere) takes minutes at this
// shape: one call each. OpenBLAS, when its package is missing, gets a line saying how to install it.
void run_torch_blas_peer(BenchResults& results, const Plan& plan, const BenchOptions& options,
                         const std::string& blas) {
  const std::int64_t n = std::min(kBlasCheckN, *std::max_element(plan.sizes.begin(), plan.sizes.end()));
  BlasPeer peer{
      blas, fmt::format("{}, N {}{}", torch_label(blas), n, blas == "installed" ? " (one call each)" : ""), "ok", {}};
  if (const auto why = blas_unavailable(blas)) peer.status = *why;
  print_blas_peer(peer);
  if (peer.status == "ok") {
    const TorchRunner torch{options, results};
    const RepeatPolicy& policy = blas == "installed" ? kSingleCall : kPolicy;
    GroupRoof group(results, plan.big_threads);
    for (Pass pass : {Pass::Forward, Pass::ForwardBackward}) {
      const double flops = layer_flops(1, n, kDModel, kHeads, false, pass);
      LayerResult row{plan.big_threads, n, false, pass_name(pass), flops * 1e-9, {}, {}, {}, {}, {}};
      for (const LayerResult& l : results.layer)  // ours, as measured above at this shape
        if (l.threads == row.threads && l.n == n && !l.causal && l.pass == row.pass) row.mha = l.mha;
      row.torch = torch.run(n, false, plan.big_threads, pass, blas, policy, flops);
      finish_layer_row(row);
      peer.layer.push_back(row);
    }
    const Roof roof = group.finish();
    for (LayerResult& row : peer.layer) {
      row.roof = roof;
      print_layer_row(row);
    }
    if (!peer.layer.empty() && !peer.layer.front().torch.blas_library.empty())
      fmt::print("        PyTorch's process loaded {}\n", peer.layer.front().torch.blas_library);
  }
  results.torch_blas_peers.push_back(peer);
}

void run_torch_blas_check(BenchResults& results, const Plan& plan, const BenchOptions& options) {
  if (!options.torch) return;
  for (const char* blas : kBlasNames)
    if (blas != options.torch_blas) run_torch_blas_peer(results, plan, options, blas);
}

// The --big size, ours alone: the core's and the layer's forward (non-causal and causal), then the
// layer's training step (non-causal: causal changes the work, not what is kept for the backward).
void run_big(BenchResults& results, const Plan& plan) {
  if (plan.big <= 0) return;
  print_big_header();
  struct Run {
    const char* impl;
    Pass pass;
    bool causal;
  };
  const Run runs[] = {{"core", Pass::Forward, false},
                      {"core", Pass::Forward, true},
                      {"mha", Pass::Forward, false},
                      {"mha", Pass::Forward, true},
                      {"mha", Pass::ForwardBackward, false}};
  for (const Run& r : runs) {
    BigResult row{r.impl, pass_name(r.pass), plan.big, r.causal, plan.big_threads, {}, {}, 0, 0, 0};
    const double attention_forward = attention_forward_flops(1, kHeads, plan.big, kHeadWidth, r.causal);
    const double attention =
        r.pass == Pass::Forward ? attention_forward : (1 + kBackwardFlopsRatio) * attention_forward;
    const double flops = row.impl == "core" ? attention : layer_flops(1, plan.big, kDModel, kHeads, r.causal, r.pass);
    GroupRoof group(results, plan.big_threads);
    row.run = run_ours(r.impl, plan.big, r.causal, plan.big_threads, r.pass, kSingleCall, flops);
    row.roof = group.finish();
    row.attention_gflop = attention * 1e-9;
    if (row.run.ok()) {
      row.attention_gflops = attention / row.run.timing.min_s * 1e-9;
      row.roof_fraction = row.attention_gflops / row.roof.gflops;
    }
    results.big.push_back(row);
    print_big_row(row);
  }
}

// Fails early, before minutes of measurements, when a PyTorch run could not start.
void check_torch_setup(const BenchOptions& options) {
  if (!options.torch) return;
  for (const std::filesystem::path& file :
       {std::filesystem::path(options.python), std::filesystem::path(torch_script(options))})
    if (!std::filesystem::exists(file)) throw std::runtime_error(file.string() + " not found (or run with --no-torch)");
  if (const auto why = blas_unavailable(options.torch_blas))
    throw std::runtime_error("--torch-blas " + options.torch_blas + ": " + *why + " (or choose another --torch-blas)");
}

// A 1-minute load average (this run's own threads included) above the CPUs, at the start or the end,
// means other work competed for the cores and the run's threads were descheduled: a parallel region
// then waits for its slowest thread, which on 2 cores turned 0.3 ms calls into 50 ms (11:29 UTC,
// 2026-12-01, load 2.4-4). Said plainly, since the tables cannot show it.
void warn_if_busy(const BenchResults& results, int threads) {
  double worst = 0;
  for (const std::string& load : {results.load_start, results.load_end}) {
    try {
      worst = std::max(worst, std::stod(load));  // the 1-minute average, first of the three
    } catch (const std::exception&) {
    }
  }
  if (results.machine.logical_cpus > 0 && worst > results.machine.logical_cpus + 0.5)
    fmt::print("warning: the 1-minute load average reached {:.1f} on {} logical CPUs: other work competed for the "
               "cores, so figures at {} threads (above all the grid's small shapes) are unreliable; repeat on a quiet "
               "machine\n",
               worst, results.machine.logical_cpus, threads);
}

}  // namespace

int run_bench(const BenchOptions& options, const std::string& command) {
  if (std::find(std::begin(kBlasNames), std::end(kBlasNames), options.torch_blas) == std::end(kBlasNames))
    throw std::invalid_argument("--torch-blas: expected onednn, openblas or installed, got " + options.torch_blas);
  const Plan plan = make_plan(options);
  check_torch_setup(options);
  const std::filesystem::path out_dir = options.out_dir;
  std::filesystem::create_directories(out_dir);

  BenchResults results;
  results.machine = describe_machine();
  results.command = command;
  results.source_revision = source_revision();
  results.load_start = load_average();
  results.torch_blas = options.torch ? options.torch_blas : "";
  print_machine(results);
  if (options.quick)
    fmt::print("smoke run (--quick): sizes 512 and 2048, no N = 65536, no grid; it checks that the bench runs, a "
               "full run measures\n");
  if (!plan.grid_only) print_roof_note();

  if (!plan.grid_only) {
    run_core(results, plan);
    run_scaling(results, plan);
    derive_causal(results);
    run_layout(results, plan);
    run_layer(results, plan, options);
    run_torch_blas_check(results, plan, options);
    run_big(results, plan);
  }
  if (plan.grid) run_grid(results, plan.threads, options);
  else results.grid_status = options.quick ? "not run: --quick" : "not run: --no-grid";

  results.load_end = load_average();
  fmt::print("\nload average (1, 5, 15 min): {} at the start, {} at the end\n", results.load_start, results.load_end);
  warn_if_busy(results, plan.big_threads);
  results.targets = evaluate_targets(results);
  print_targets(results.targets, options.quick ? "smoke run, --quick: sizes 512 and 2048, no grid; a full "
                                                 "run decides the targets"
                                               : "");

  const std::filesystem::path json_path = out_dir / "bench.json", png_path = out_dir / "bench.png";
  {
    std::ofstream out(json_path);
    out << to_json(results).dump(2) << '\n';
    if (!out) throw std::runtime_error("cannot write " + json_path.string());
  }
  if (plan.grid_only) {  // the plot shows the layer table, which a grid-only run has not measured
    fmt::print("\nwrote {}\n", json_path.string());
    return 0;
  }
  write_bench_plot(png_path, results, plan.big_threads);
  fmt::print("\nwrote {} and {}\n", json_path.string(), png_path.string());
  return 0;
}

}  // namespace mha_cli
