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

#include "bench/bench_machine.hpp"
#include "bench/bench_measure.hpp"
#include "bench/bench_plot.hpp"
#include "bench/bench_process.hpp"
#include "bench/bench_results.hpp"
#include "bench/bench_tables.hpp"
#include "bench/bench_targets.hpp"
#include "bench/bench_workloads.hpp"
#include "mha/attention.hpp"

namespace mha_cli {
namespace {

using namespace bench;

constexpr std::int64_t kHeads = 8;                     // h
constexpr std::int64_t kDModel = 512;                  // E
constexpr std::int64_t kHeadWidth = kDModel / kHeads;  // d = 64
constexpr std::int64_t kQuickSizes[] = {512, 2048};
constexpr std::int64_t kScalingN = 4096;                    // the B*h = 1 thread-scaling shape
constexpr std::int64_t kCausalN = 4096;                     // the causal / non-causal comparison
constexpr std::int64_t kLayoutMinN = 4096;                  // the head-layout comparison, from this N up
constexpr std::int64_t kBlasCheckN = 4096;                  // the one shape PyTorch also runs on the other BLAS
constexpr double kOwnTimeoutS = 3600;                       // our own processes: the --big ones take minutes
constexpr const char* kBlasShim = "libmha_onednn_blas.so";  // built beside this program

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
};

Plan make_plan(const BenchOptions& o) {
  Plan plan{o.threads, o.sizes, o.big, 0};
  if (o.quick) {
    plan.sizes.assign(std::begin(kQuickSizes), std::end(kQuickSizes));
    plan.big = 0;
  }
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

// Non-causal time over causal time at kCausalN, from the core rows.
void derive_causal(BenchResults& results) {
  for (const CoreResult& full : results.core) {
    if (full.n != kCausalN || full.causal) continue;
    for (const CoreResult& causal : results.core) {
      if (causal.n != full.n || causal.threads != full.threads || !causal.causal) continue;
      results.causal.push_back({full.threads, full.n, full.forward.timing.min_s / causal.forward.timing.min_s,
                                full.backward.timing.min_s / causal.backward.timing.min_s});
    }
  }
  print_causal(results.causal);
}

// ---- one shape per process: ours and PyTorch's ----------------------------------------------------

std::vector<std::string> policy_args(const RepeatPolicy& p) {
  return {"--warmup",   std::to_string(p.warmup),       "--min-reps", std::to_string(p.min_reps),
          "--max-reps", std::to_string(p.max_reps),     "--min-time", fmt::format("{}", p.min_time_s),
          "--max-time", fmt::format("{}", p.max_time_s)};
}

// Reads the JSON line a per-shape process prints last; `flops` per call gives its rate.
ProcessRun parse_run(const ProcessResult& process, double timeout_s, double flops, nlohmann::json* raw) {
  ProcessRun run;
  if (process.timed_out) {
    run.status = fmt::format("timed out after {:.0f} s", timeout_s);
    return run;
  }
  const std::string out = process.out.substr(0, process.out.find_last_not_of("\n ") + 1);
  const std::string last_line = out.substr(out.find_last_of('\n') + 1);
  if (process.exit_code != 0 || last_line.empty()) {
    const std::string err = process.err.substr(0, process.err.find_last_not_of("\n ") + 1);
    run.status = fmt::format("failed (exit {}): {}", process.exit_code, err.substr(err.find_last_of('\n') + 1));
    return run;
  }
  try {
    const nlohmann::json j = nlohmann::json::parse(last_line);
    run.timing = {j.at("min_s").get<double>(), j.at("median_s").get<double>(), j.at("reps").get<int>()};
    run.baseline_rss_bytes = j.at("baseline_rss_bytes").get<std::int64_t>();
    run.peak_rss_first_bytes = j.at("peak_rss_first_bytes").get<std::int64_t>();
    run.peak_rss_bytes = j.at("peak_rss_bytes").get<std::int64_t>();
    run.gflops = flops / run.timing.min_s * 1e-9;
    if (raw) *raw = j;
  } catch (const nlohmann::json::exception& e) {
    run.status = fmt::format("failed: unreadable output ({}): {}", e.what(), last_line);
  }
  return run;
}

// `mha bench-one` in a new process of this program.
ProcessRun run_ours(const std::string& impl, std::int64_t n, bool causal, int threads, Pass pass,
                    const RepeatPolicy& policy, double flops) {
  std::vector<std::string> argv = {
      kSelfExecutable,   "bench-one",    "--impl",           impl,        "--n",
      std::to_string(n), "--causal",     causal ? "1" : "0", "--threads", std::to_string(threads),
      "--pass",          pass_name(pass)};
  for (std::string& a : policy_args(policy)) argv.push_back(std::move(a));
  return parse_run(run_process(argv, {}, kOwnTimeoutS), kOwnTimeoutS, flops, nullptr);
}

// PyTorch materialises the [B*h, N, N] logits and weights. Peak RSS measured at N = 1024..4096
// (2 threads) was the interpreter and torch (~0.25 GiB) plus about this many float32 [h, N, N]
// tensors: 1.1-1.6 forward (no mask: the fused eval path), 2.3-2.5 forward with the causal mask,
// 3.3-4.6 forward + backward. The estimate takes the upper ends.
double torch_memory_estimate_bytes(std::int64_t n, bool causal, Pass pass) {
  const double tensors = pass == Pass::ForwardBackward ? 4.0 : causal ? 2.5 : 1.6;
  const double one = 4.0 * static_cast<double>(kHeads) * static_cast<double>(n) * static_cast<double>(n);
  return 0.3 * (1 << 30) + tensors * one;
}

std::string torch_script(const BenchOptions& options) {
  if (!options.torch_script.empty()) return options.torch_script;
  return std::string(MHA_SOURCE_DIR) + "/apps/mha/bench/torch_mha.py";
}

struct TorchRunner {
  const BenchOptions& options;
  BenchResults& results;

  // torch_mha.py in a new Python process, on `blas` ("onednn" or "installed").
  ProcessRun run(std::int64_t n, bool causal, int threads, Pass pass, const std::string& blas,
                 const RepeatPolicy& policy, double flops) const {
    const double need = torch_memory_estimate_bytes(n, causal, pass);
    if (need > options.torch_memory_limit_gib * (1 << 30)) {
      ProcessRun skipped;
      skipped.status = fmt::format("skipped: would need ~{:.1f} GiB (limit {:.0f} GiB; --torch-memory-limit)",
                                   need / (1 << 30), options.torch_memory_limit_gib);
      return skipped;
    }
    std::vector<std::string> argv = {options.python, torch_script(options), "--n",       std::to_string(n),
                                     "--causal",     causal ? "1" : "0",    "--threads", std::to_string(threads),
                                     "--pass",       pass_name(pass),       "--d-model", std::to_string(kDModel),
                                     "--heads",      std::to_string(kHeads)};
    for (std::string& a : policy_args(policy)) argv.push_back(std::move(a));
    std::vector<std::string> env;
    if (blas == "onednn") env.push_back("LD_PRELOAD=" + (self_directory() / kBlasShim).string());
    nlohmann::json raw;
    ProcessRun run = parse_run(run_process(argv, env, options.torch_timeout_s), options.torch_timeout_s, flops, &raw);
    if (run.ok()) {
      results.torch_version = raw.value("version", "");
      results.python_version = raw.value("python", "");
    }
    return run;
  }
};

void finish_layer_row(LayerResult& row) {
  if (row.mha.ok() && row.torch.ok()) {
    row.speedup = row.torch.timing.min_s / row.mha.timing.min_s;
    row.memory_ratio =
        static_cast<double>(row.mha.peak_rss_first_bytes) / static_cast<double>(row.torch.peak_rss_first_bytes);
  }
}

std::string torch_label(const std::string& blas) {
  return blas == "onednn" ? "PyTorch 1.13 with its sgemm_ calls sent to oneDNN (LD_PRELOAD libmha_onednn_blas.so)"
                          : "PyTorch 1.13 on Debian's default BLAS (libblas.so.3)";
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

// PyTorch on the BLAS not used above, at one shape, one call each: how much the BLAS matters.
void run_torch_blas_check(BenchResults& results, const Plan& plan, const BenchOptions& options) {
  if (!options.torch) return;
  const std::int64_t n = std::min(kBlasCheckN, *std::max_element(plan.sizes.begin(), plan.sizes.end()));
  const std::string other = options.torch_blas == "onednn" ? "installed" : "onednn";
  results.torch_other_blas = other;
  const TorchRunner torch{options, results};
  print_layer_header(torch_label(other) + " (one call each)");
  GroupRoof group(results, plan.big_threads);
  std::vector<LayerResult> rows;
  for (Pass pass : {Pass::Forward, Pass::ForwardBackward}) {
    const double flops = layer_flops(1, n, kDModel, kHeads, false, pass);
    LayerResult row{plan.big_threads, n, false, pass_name(pass), flops * 1e-9, {}, {}, {}, {}, {}};
    for (const LayerResult& l : results.layer)  // ours, as measured above at this shape
      if (l.threads == row.threads && l.n == n && !l.causal && l.pass == row.pass) row.mha = l.mha;
    row.torch = torch.run(n, false, plan.big_threads, pass, other, kSingleCall, flops);
    finish_layer_row(row);
    rows.push_back(row);
  }
  const Roof roof = group.finish();
  for (LayerResult& row : rows) {
    row.roof = roof;
    results.torch_other_blas_layer.push_back(row);
    print_layer_row(row);
  }
}

void run_big(BenchResults& results, const Plan& plan) {
  if (plan.big <= 0) return;
  print_big_header();
  for (const char* impl : {"core", "mha"}) {
    for (bool causal : {false, true}) {
      BigResult row{impl, plan.big, causal, plan.big_threads, {}, {}, 0, 0, 0};
      const double attention = attention_forward_flops(1, kHeads, plan.big, kHeadWidth, causal);
      const double flops =
          row.impl == "core" ? attention : layer_flops(1, plan.big, kDModel, kHeads, causal, Pass::Forward);
      GroupRoof group(results, plan.big_threads);
      row.run = run_ours(impl, plan.big, causal, plan.big_threads, Pass::Forward, kSingleCall, flops);
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
}

// The source tree's commit, "-dirty" when it has uncommitted changes, at the time of the run (the
// binary was built from the tree as it was at build time).
std::string source_revision() {
  try {
    const ProcessResult git =
        run_process({"/usr/bin/git", "-C", MHA_SOURCE_DIR, "describe", "--always", "--dirty"}, {}, 10);
    if (git.exit_code == 0) return git.out.substr(0, git.out.find_last_not_of("\n ") + 1);
  } catch (const std::runtime_error&) {
  }
  return "unknown";
}

// Fails early, before minutes of measurements, when a PyTorch run could not start.
void check_torch_setup(const BenchOptions& options) {
  if (!options.torch) return;
  for (const std::filesystem::path& file :
       {std::filesystem::path(options.python), std::filesystem::path(torch_script(options))})
    if (!std::filesystem::exists(file)) throw std::runtime_error(file.string() + " not found (or run with --no-torch)");
  if (options.torch_blas == "onednn" && !std::filesystem::exists(self_directory() / kBlasShim))
    throw std::runtime_error((self_directory() / kBlasShim).string() +
                             " not found: build the target mha_onednn_blas, or run with --torch-blas installed");
}

}  // namespace

int run_bench(const BenchOptions& options, const std::string& command) {
  if (options.torch_blas != "onednn" && options.torch_blas != "installed")
    throw std::invalid_argument("--torch-blas: expected onednn or installed, got " + options.torch_blas);
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
  print_roof_note();

  run_core(results, plan);
  run_scaling(results, plan);
  derive_causal(results);
  run_layout(results, plan);
  run_layer(results, plan, options);
  run_torch_blas_check(results, plan, options);
  run_big(results, plan);

  results.load_end = load_average();
  fmt::print("\nload average (1, 5, 15 min): {} at the start, {} at the end\n", results.load_start, results.load_end);
  results.targets = evaluate_targets(results);
  print_targets(results.targets);

  const std::filesystem::path json_path = out_dir / "bench.json", png_path = out_dir / "bench.png";
  {
    std::ofstream out(json_path);
    out << to_json(results).dump(2) << '\n';
    if (!out) throw std::runtime_error("cannot write " + json_path.string());
  }
  write_bench_plot(png_path, results, plan.big_threads);
  fmt::print("\nwrote {} and {}\n", json_path.string(), png_path.string());
  return 0;
}

}  // namespace mha_cli
