// `mha bench --torch-sdpa`: issue 34's benchmark, in one run.
//
//   speed and memory  q, k, v [1, h, N, d] (h 8, d 64), N from --sizes (default 512..8192), float32 and
//            bfloat16, causal and not, forward (no_grad) and forward+backward (the gradients of q, k, v):
//            mha = mha.torch.scaled_dot_product_attention(q, k, v, is_causal=...), the registered operator;
//            torch = torch 1.13's best by hand, softmax((q * scale) k^T + mask) v, its float32 products on
//            --torch-blas's library (default oneDNN's sgemm through libmha_onednn_blas.so: torch is built
//            with BLAS_INFO=generic, whose libblas.so.3 is netlib's reference BLAS here), its bfloat16
//            products on oneDNN (torch's mkldnn bf16 matmul). Times: one Python process per N and thread
//            count, both calls timed alternately (mha, torch, mha, ...) after a warm-up of each; medians.
//            Peak memory: a child forked per case and implementation from a process that has imported torch
//            and mha and run nothing; after the inputs are made, VmHWM reset (/proc/self/clear_refs), one
//            call, the new VmHWM less the resident set before it; twice, the second after malloc_trim(0)
//            (torch 1.13's CPU allocator has no statistics, and tracemalloc does not see its memory). The
//            table shows the second call's, what every call needs; bench-torch-sdpa.json also the first's,
//            which adds what a first call pages in once (library code, oneDNN's JIT). Rows where torch would
//            need more than --torch-memory-limit GiB are not run.
//   overhead [1, 8, 64, 64] float32 forward, not causal: the C++ kernel alone (mha::scaled_dot_product_attention
//            in this process, timed before and after the Python process), the pybind11 function on NumPy
//            arrays, the operator called directly and mha.torch.scaled_dot_product_attention; medians of
//            blocks of calls. The target: the function under 30 us per call above the C++ kernel.
//
// Legend: h heads, N = L = S, d head width.
#include "bench/bench_torch_sdpa.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/bench_machine.hpp"
#include "bench/bench_pair.hpp"
#include "bench/bench_process.hpp"
#include "bench/bench_runs.hpp"
#include "bench/bench_workloads.hpp"
#include "mha/mha.hpp"

namespace mha_cli::bench {
namespace {

using nlohmann::json;

constexpr std::int64_t kOverheadN = 64;     // L = S of the overhead rows
constexpr int kOverheadCalls = 200;         // calls per timed block (a block: ~20 ms at ~100 us a call)
constexpr int kOverheadBlocks = 15;         // blocks per figure (the C++ kernel: this many before, after)
constexpr double kOverheadTargetS = 30e-6;  // issue 34: under 30 us per call above the C++ kernel
constexpr int kDefaultRepeats = 3;          // --repeats 0: timed calls of each side per speed figure
constexpr const char* kDtypes[] = {"float32", "bfloat16"};
constexpr double kNotMeasured = -1;

// One shape's variant: the element type, the mask, the pass.
struct Case {
  std::string dtype;  // "float32", "bfloat16"
  bool causal = false;
  Pass pass = Pass::Forward;

  std::string spec() const { return fmt::format("{}:{}:{}", dtype, causal ? 1 : 0, pass_name(pass)); }
  bool matches(const json& line) const {
    return line.value("dtype", "") == dtype && line.value("causal", !causal) == causal &&
           line.value("pass", "") == pass_name(pass);
  }
};

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const char* dtype : kDtypes)
    for (const bool causal : {false, true})
      for (const Pass pass : {Pass::Forward, Pass::ForwardBackward}) cases.push_back({dtype, causal, pass});
  return cases;
}

struct Row {
  int threads = 0;
  std::int64_t n = 0;
  Case c;
  double mha_s = 0, torch_s = 0;          // medians; 0: not timed (speed_status says why)
  double mha_min_s = 0, torch_min_s = 0;  // the best calls: a check on the medians under a changing load
  std::string speed_status = "ok";
  double mha_bytes = kNotMeasured, torch_bytes = kNotMeasured;  // peak above the inputs
  std::string memory_status = "ok";
  json speed_line, memory_lines = json::array();  // what the Python side printed

  bool timed() const { return mha_s > 0 && torch_s > 0; }
  double speed_ratio() const { return torch_s / mha_s; }  // > 1: mha is faster
  double min_ratio() const { return torch_min_s / mha_min_s; }
  bool memory_measured() const { return mha_bytes >= 0 && torch_bytes >= 0; }
  double memory_ratio() const {  // > 1: mha needs less; infinite when mha touched no new page
    return mha_bytes > 0 ? torch_bytes / mha_bytes : std::numeric_limits<double>::infinity();
  }
};

// torch_sdpa.py in new processes, through TorchRunner (the environment that picks the BLAS, the JSON lines).
class SdpaPython {
 public:
  explicit SdpaPython(const BenchOptions& o) : options_(with_script(o)), runner_{options_, results_} {}
  SdpaPython(const SdpaPython&) = delete;
  SdpaPython& operator=(const SdpaPython&) = delete;

  std::vector<json> run(const std::string& mode, int threads, std::int64_t n, std::vector<std::string> extra,
                        std::string& error) const {
    std::vector<std::string> args = {"--mode", mode, "--mha-path", mha_python_dir(), "--n", std::to_string(n)};
    args.insert(args.end(), extra.begin(), extra.end());
    return runner_.run_lines(args, threads, options_.torch_blas, error);
  }
  const std::string& script() const { return options_.torch_script; }
  static std::string mha_python_dir() { return (self_directory() / "python").string(); }

 private:
  static BenchOptions with_script(BenchOptions o) {
    if (o.torch_script.empty()) o.torch_script = std::string(MHA_SOURCE_DIR) + "/apps/mha/bench/torch_sdpa.py";
    return o;
  }
  BenchOptions options_;
  BenchResults results_;  // TorchRunner records torch's version there; unused here
  TorchRunner runner_;
};

// torch's peak above the inputs, estimated: the [1, h, N, N] logits and weights (2 of them forward, about
// 5 with the backward's), plus the interpreter's slack.
double torch_need_bytes(std::int64_t n, const Case& c) {
  const double one = (c.dtype == "float32" ? 4.0 : 2.0) * kHeads * static_cast<double>(n) * static_cast<double>(n);
  return 0.5 * (1 << 30) + (c.pass == Pass::Forward ? 2.5 : 5.0) * one;
}

const json* find_line(const std::vector<json>& lines, const Case& c, const char* impl = nullptr) {
  for (const json& line : lines)
    if (c.matches(line) && (impl == nullptr || line.value("impl", "") == impl)) return &line;
  return nullptr;
}

// The speed of every case at one N and thread count, in one process.
void measure_speed(const SdpaPython& py, const BenchOptions& o, std::vector<Row>& rows) {
  std::string specs, error;
  for (const Row& r : rows) {
    if (!specs.empty()) specs += ',';
    specs += r.c.spec();
  }
  const int repeats = o.variants_repeats > 0 ? o.variants_repeats : kDefaultRepeats;
  const std::vector<json> lines = py.run("speed", rows.front().threads, rows.front().n,
                                         {"--cases", specs, "--repeats", std::to_string(repeats)}, error);
  for (Row& r : rows) {
    const json* line = find_line(lines, r.c);
    if (line == nullptr) {
      r.speed_status = error.empty() ? "no line for this case" : error;
      continue;
    }
    r.speed_line = *line;
    r.mha_s = (*line)["mha"]["median_s"].get<double>();
    r.torch_s = (*line)["torch"]["median_s"].get<double>();
    r.mha_min_s = (*line)["mha"]["min_s"].get<double>();
    r.torch_min_s = (*line)["torch"]["min_s"].get<double>();
  }
}

// The peak memory of every case and implementation at one N and thread count: one forked child each.
void measure_memory(const SdpaPython& py, const BenchOptions& o, std::vector<Row>& rows) {
  std::string specs, error;
  for (Row& r : rows) {
    if (!specs.empty()) specs += ',';
    specs += "mha:" + r.c.spec();
    const double need = torch_need_bytes(r.n, r.c);
    if (need > o.torch_memory_limit_gib * (1 << 30))
      r.memory_status = fmt::format("torch not run: would need ~{:.1f} GiB (--torch-memory-limit {:.0f})",
                                    need / (1 << 30), o.torch_memory_limit_gib);
    else specs += ",torch:" + r.c.spec();
  }
  const std::vector<json> lines = py.run("memory", rows.front().threads, rows.front().n, {"--cases", specs}, error);
  for (Row& r : rows) {
    for (const char* impl : {"mha", "torch"}) {
      const json* line = find_line(lines, r.c, impl);
      if (line == nullptr) continue;
      r.memory_lines.push_back(*line);
      if (line->contains("error")) {
        r.memory_status = fmt::format("{}: {}", impl, (*line)["error"].get<std::string>());
        continue;
      }
      (std::string(impl) == "mha" ? r.mha_bytes : r.torch_bytes) = (*line)["peak_above_inputs_bytes"].get<double>();
      if (!line->value("hwm_reset", false))  // /proc/self/clear_refs refused: the peak may predate the call
        r.memory_status = fmt::format("{}: VmHWM could not be reset, the figure is an upper bound", impl);
    }
    if (!error.empty() && r.memory_status == "ok" && !r.memory_measured()) r.memory_status = error;
  }
}

void print_rows_header(const BenchOptions& o) {
  fmt::print("\n== Speed and peak memory: q, k, v [1, {}, N, {}]; mha = mha.torch.scaled_dot_product_attention, torch "
             "= torch's softmax((q * scale) k^T + mask) v; times: medians of {} alternate calls after a warm-up of "
             "each, ms; memory: MiB above the inputs during a call, the second in a fresh (forked) process each, after "
             "malloc_trim (the first call's figures are in the JSON)\n",
             kHeads, kHeadWidth, o.variants_repeats > 0 ? o.variants_repeats : kDefaultRepeats);
  fmt::print("{:>4} {:>6} {:>8} {:>6} {:>8} | {:>10} {:>10} {:>10} {:>8} | {:>10} {:>10} {:>10}\n", "thr", "N", "dtype",
             "causal", "pass", "mha ms", "torch ms", "torch/mha", "of mins", "mha MiB", "torch MiB", "torch/mha");
}

void print_row(const Row& r) {
  std::string speed = r.timed() ? fmt::format("{:>10.3f} {:>10.3f} {:>9.2f}x {:>7.2f}x", 1e3 * r.mha_s, 1e3 * r.torch_s,
                                              r.speed_ratio(), r.min_ratio())
                                : fmt::format("{:>41}", "-");
  std::string memory = "-";
  if (r.memory_measured()) {
    const double ratio = r.memory_ratio();
    memory = fmt::format("{:>10.1f} {:>10.1f} {:>10}", r.mha_bytes / (1 << 20), r.torch_bytes / (1 << 20),
                         std::isfinite(ratio) ? fmt::format("{:.2f}x", ratio) : "n/a");
  } else if (r.mha_bytes >= 0) {
    memory = fmt::format("{:>10.1f} {:>10} {:>10}", r.mha_bytes / (1 << 20), "-", "-");
  }
  fmt::print("{:>4} {:>6} {:>8} {:>6} {:>8} | {} | {}\n", r.threads, r.n, r.c.dtype == "float32" ? "float32" : "bf16",
             r.c.causal ? "yes" : "no", pass_label(r.c.pass), speed, memory);
  if (r.speed_status != "ok") fmt::print("        speed: {}\n", r.speed_status);
  if (r.memory_status != "ok") fmt::print("        memory: {}\n", r.memory_status);
  flush_rows();
}

json row_json(const Row& r) {
  json j = {{"threads", r.threads},
            {"n", r.n},
            {"dtype", r.c.dtype},
            {"causal", r.c.causal},
            {"pass", pass_name(r.c.pass)},
            {"speed_status", r.speed_status},
            {"memory_status", r.memory_status},
            {"speed", r.speed_line},
            {"memory", r.memory_lines}};
  if (r.timed())
    j.update({{"mha_median_s", r.mha_s},
              {"torch_median_s", r.torch_s},
              {"torch_over_mha_time", r.speed_ratio()},
              {"torch_over_mha_time_of_mins", r.min_ratio()}});
  if (r.mha_bytes >= 0) j["mha_peak_bytes"] = r.mha_bytes;
  if (r.torch_bytes >= 0) j["torch_peak_bytes"] = r.torch_bytes;
  if (r.memory_measured() && std::isfinite(r.memory_ratio())) j["torch_over_mha_memory"] = r.memory_ratio();
  return j;
}

std::vector<Row> run_rows(const SdpaPython& py, const BenchOptions& o, json& report) {
  print_rows_header(o);
  std::vector<Row> all;
  for (const int threads : o.threads) {
    for (const std::int64_t n : o.sizes) {
      std::vector<Row> rows;
      for (const Case& c : all_cases()) {
        Row r;
        r.threads = threads;
        r.n = n;
        r.c = c;
        rows.push_back(r);
      }
      measure_speed(py, o, rows);
      measure_memory(py, o, rows);
      for (const Row& r : rows) {
        print_row(r);
        report["rows"].push_back(row_json(r));
        all.push_back(r);
      }
    }
  }
  return all;
}

// ---- the per-call overhead at [1, 8, 64, 64] ----------------------------------------------------------------

// Seconds per call of `blocks` blocks of kOverheadCalls calls each, after one block of warm-up.
std::vector<double> time_blocks(const std::function<void()>& call, int blocks) {
  using Clock = std::chrono::steady_clock;
  for (int i = 0; i < kOverheadCalls; ++i) call();
  std::vector<double> per_call;
  for (int b = 0; b < blocks; ++b) {
    const auto start = Clock::now();
    for (int i = 0; i < kOverheadCalls; ++i) call();
    per_call.push_back(std::chrono::duration<double>(Clock::now() - start).count() / kOverheadCalls);
  }
  return per_call;
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

constexpr const char* kOverheadPaths[] = {"pybind11", "operator", "function"};

// One thread count's overhead rows; the function's overhead over the kernel, or NaN when Python gave none.
double run_overhead_at(const SdpaPython& py, int threads, json& report) {
  mha::set_num_threads(threads);
  const mha::Shape shape{1, kHeads, kOverheadN, kHeadWidth};
  const mha::Tensor q = random_tensor(shape, 41), k = random_tensor(shape, 42), v = random_tensor(shape, 43);
  const auto kernel = [&] { (void)mha::scaled_dot_product_attention(q, k, v, mha::AttentionOptions{}); };
  std::vector<double> kernel_blocks = time_blocks(kernel, kOverheadBlocks);  // before the Python process
  std::string error;
  const std::vector<json> lines =
      py.run("overhead", threads, kOverheadN,
             {"--calls", std::to_string(kOverheadCalls), "--blocks", std::to_string(kOverheadBlocks)}, error);
  mha::set_num_threads(threads);
  const std::vector<double> after = time_blocks(kernel, kOverheadBlocks);
  kernel_blocks.insert(kernel_blocks.end(), after.begin(), after.end());
  const double kernel_s = median_of(kernel_blocks);
  json row = {{"threads", threads}, {"kernel_median_s", kernel_s}, {"kernel_blocks_s", kernel_blocks}};
  fmt::print("{:>4} | {:>10.1f}", threads, 1e6 * kernel_s);
  double function_over = std::numeric_limits<double>::quiet_NaN();
  if (lines.empty()) {
    fmt::print(" | {}\n", error);
    row["error"] = error;
  } else {
    const json& line = lines.front();
    for (const char* path : kOverheadPaths) fmt::print(" {:>10.1f}", 1e6 * line[path]["median_s"].get<double>());
    fmt::print(" |");
    for (const char* path : kOverheadPaths) {
      const double over = line[path]["median_s"].get<double>() - kernel_s;
      fmt::print(" {:>10.1f}", 1e6 * over);
      row[std::string(path) + "_over_kernel_s"] = over;
      if (std::string(path) == "function") function_over = over;
    }
    fmt::print("\n");
    row["python"] = line;
  }
  flush_rows();
  report["overhead"].push_back(row);
  return function_over;
}

std::vector<double> run_overhead(const SdpaPython& py, const BenchOptions& o, json& report) {
  fmt::print("\n== Per-call overhead: q, k, v [1, {}, {}, {}] float32, forward, not causal; medians of {} blocks of {} "
             "calls (the C++ kernel: {} before and {} after the Python process), us per call\n",
             kHeads, kOverheadN, kHeadWidth, kOverheadBlocks, kOverheadCalls, kOverheadBlocks, kOverheadBlocks);
  fmt::print("{:>4} | {:>10} {:>10} {:>10} {:>10} | {:>10} {:>10} {:>10}\n", "thr", "C++ kernel", "pybind11",
             "operator", "function", "pybind-C++", "op-C++", "func-C++");
  std::vector<double> function_over;
  for (const int threads : o.threads) function_over.push_back(run_overhead_at(py, threads, report));
  fmt::print("  pybind11: mha.scaled_dot_product_attention on NumPy arrays; operator: "
             "torch.ops.mha.scaled_dot_product_attention; function: mha.torch.scaled_dot_product_attention\n");
  return function_over;
}

// ---- the verdicts and the run -------------------------------------------------------------------------------

json verdict(const std::string& what, std::size_t rows, double worst, const std::string& worst_text,
             const std::string& goal, bool met) {
  fmt::print("  {}: {} rows, worst {} (target {}): {}\n", what, rows, worst_text, goal, met ? "met" : "NOT met");
  return {{"target", what}, {"rows", rows}, {"worst", worst}, {"goal", goal}, {"met", met}};
}

json judge(const std::vector<Row>& rows, const std::vector<double>& function_over) {
  fmt::print("\nTargets (issue 34; the speed and memory lines are the issue's comparison, read as \"mha at least as "
             "good as torch's best\"):\n");
  json t = json::array();
  // The largest measured overhead, negative when the function's median beat the kernel's (the two are timed
  // apart, so a few microseconds either way are noise); 0 when none was measured.
  double worst_over = -std::numeric_limits<double>::infinity();
  bool all_measured = !function_over.empty();
  for (const double over : function_over) {
    all_measured = all_measured && std::isfinite(over);
    if (std::isfinite(over)) worst_over = std::max(worst_over, over);
  }
  if (!std::isfinite(worst_over)) worst_over = 0;
  t.push_back(verdict("overhead of mha.torch.scaled_dot_product_attention over the C++ kernel, [1, 8, 64, 64]",
                      function_over.size(), worst_over, fmt::format("{:.1f} us", 1e6 * worst_over), "< 30 us",
                      all_measured && worst_over < kOverheadTargetS));
  for (const char* dtype : kDtypes) {
    double worst = std::numeric_limits<double>::infinity();
    std::size_t n = 0;
    for (const Row& r : rows)
      if (r.c.dtype == dtype && r.timed()) worst = std::min(worst, r.speed_ratio()), ++n;
    t.push_back(verdict(fmt::format("speed, {}: torch time over mha time", dtype), n, n ? worst : 0,
                        fmt::format("{:.2f}x", n ? worst : 0.0), ">= 1.00x", n > 0 && worst >= 1.0));
  }
  double worst = std::numeric_limits<double>::infinity();
  std::size_t n = 0;
  for (const Row& r : rows)
    if (r.memory_measured()) worst = std::min(worst, r.memory_ratio()), ++n;
  t.push_back(verdict("peak memory: torch's over mha's", n, n ? worst : 0, fmt::format("{:.2f}x", n ? worst : 0.0),
                      ">= 1.00x", n > 0 && worst >= 1.0));
  return t;
}

// torch's build and the libraries its process loads; refuses to go on without mha's operator library.
json torch_config(const SdpaPython& py, const BenchOptions& o) {
  std::string error;
  const std::vector<json> lines = py.run("config", o.threads.front(), kOverheadN, {}, error);
  if (lines.empty()) throw std::runtime_error(py.script() + " --mode config: " + error);
  const json& c = lines.front();
  if (!c.value("operators_loaded", false))
    throw std::runtime_error("mha's PyTorch operator library is not built beside " + SdpaPython::mha_python_dir() +
                             "/mha (build with libtorch-dev installed: CMake option MHA_BUILD_TORCH_OPS)");
  fmt::print("torch {} (Python {}), built with BLAS_INFO={}; float32 products: {}; loaded: {}; bfloat16 products: "
             "oneDNN (mkldnn {})\n",
             c.value("version", ""), c.value("python", ""), c.value("build_blas_info", ""), torch_label(o.torch_blas),
             c.value("blas_library", ""), c.value("mkldnn", false) ? "available" : "NOT available");
  return c;
}

json open_report(const BenchOptions& o, const std::string& command) {
  const MachineInfo m = describe_machine();
  json report = {{"command", command},
                 {"machine", cpu_name(m)},
                 {"logical_cpus", m.logical_cpus},
                 {"simd", m.simd},
                 {"onednn_version", m.onednn_version},
                 {"onednn_isa", m.onednn_isa},
                 {"date", m.date},
                 {"source_revision", source_revision()},
                 {"torch_blas", o.torch_blas},
                 {"load_start", load_average()},
                 {"rows", json::array()},
                 {"overhead", json::array()}};
  fmt::print("mha bench --torch-sdpa ({})\nmachine: {}, {} CPUs, {}{}; oneDNN {} ({}); source tree {}; load "
             "average {}\ncommand: {}\n",
             m.date, cpu_name(m), m.logical_cpus, m.simd, m.virtual_machine ? ", virtual" : "", m.onednn_version,
             m.onednn_isa, report["source_revision"].get<std::string>(), report["load_start"].get<std::string>(),
             command);
  return report;
}

}  // namespace

int run_bench_torch_sdpa(const BenchOptions& options, const std::string& command) {
  if (options.threads.empty() || options.sizes.empty())
    throw std::invalid_argument("--threads and --sizes must not be empty");
  if (const auto why = blas_unavailable(options.torch_blas))
    throw std::runtime_error("--torch-blas " + options.torch_blas + ": " + *why);
  const SdpaPython py(options);
  for (const std::string& file : {options.python, py.script()})
    if (!std::filesystem::exists(file)) throw std::runtime_error(file + " not found");
  json report = open_report(options, command);
  const double steal_start = steal_seconds();
  report["torch"] = torch_config(py, options);
  const std::vector<Row> rows = run_rows(py, options, report);
  const std::vector<double> function_over = run_overhead(py, options, report);
  report["targets"] = judge(rows, function_over);
  report["load_end"] = load_average();
  report["steal_seconds"] = steal_seconds() - steal_start;
  fmt::print("load average at the end: {}; CPU time taken by the hypervisor for others (steal) during the run: {:.1f} "
             "s\n",
             report["load_end"].get<std::string>(), report["steal_seconds"].get<double>());
  std::filesystem::create_directories(options.out_dir);
  const std::filesystem::path path = std::filesystem::path(options.out_dir) / "bench-torch-sdpa.json";
  std::ofstream out(path);
  out << report.dump(2) << "\n";
  if (!out) throw std::runtime_error("cannot write " + path.string());
  fmt::print("\nwrote {}\n", path.string());
  return 0;
}

}  // namespace mha_cli::bench
