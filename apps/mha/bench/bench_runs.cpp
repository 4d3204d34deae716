// Per-shape processes: the arguments, the environment that picks PyTorch's BLAS, and reading the JSON
// lines they print.
//
// Legend: B batch, h heads, N = L = S, E = d_model.
#include "bench/bench_runs.hpp"

#include <cstdlib>
#include <filesystem>
#include <sstream>

#include <fmt/core.h>

namespace mha_cli::bench {
namespace {

std::string trimmed(const std::string& s) { return s.substr(0, s.find_last_not_of("\n ") + 1); }

// What Debian's libblas.so.3 resolves to (through /etc/alternatives), for the label.
std::string installed_blas_path() {
  std::error_code error;
  const auto path = std::filesystem::canonical("/usr/lib/x86_64-linux-gnu/libblas.so.3", error);
  return error ? "libblas.so.3" : "libblas.so.3 -> " + path.string();
}

// The environment that puts PyTorch's sgemm_ on `blas` at `threads`.
std::vector<std::string> blas_environment(const std::string& blas, int threads) {
  if (blas == "onednn") return {"LD_PRELOAD=" + (self_directory() / kBlasShim).string()};
  if (blas == "openblas") {
    const char* old = std::getenv("LD_LIBRARY_PATH");
    return {fmt::format("LD_LIBRARY_PATH={}{}{}", kOpenBlasDir, old && *old ? ":" : "", old ? old : ""),
            fmt::format("OPENBLAS_NUM_THREADS={}", threads)};  // its own threads, not OpenMP's
  }
  return {};
}

}  // namespace

std::vector<std::string> policy_args(const RepeatPolicy& p) {
  return {"--warmup",   std::to_string(p.warmup),       "--min-reps", std::to_string(p.min_reps),
          "--max-reps", std::to_string(p.max_reps),     "--min-time", fmt::format("{}", p.min_time_s),
          "--max-time", fmt::format("{}", p.max_time_s)};
}

std::vector<nlohmann::json> json_lines(const ProcessResult& process, double timeout_s, std::string& error) {
  std::vector<nlohmann::json> lines;
  std::istringstream out(process.out);
  for (std::string line; std::getline(out, line);) {
    if (trimmed(line).empty()) continue;
    try {
      lines.push_back(nlohmann::json::parse(line));
    } catch (const nlohmann::json::exception& e) {
      error = fmt::format("failed: unreadable output ({}): {}", e.what(), line);
    }
  }
  if (process.timed_out) {
    error = fmt::format("timed out after {:.0f} s", timeout_s);
  } else if (process.exit_code != 0) {
    const std::string err = trimmed(process.err);
    error = fmt::format("failed (exit {}): {}", process.exit_code, err.substr(err.find_last_of('\n') + 1));
  } else if (lines.empty() && error.empty()) {
    error = "failed: no output";
  }
  return lines;
}

namespace {

// The last JSON line of a per-shape process; `flops` per call gives its rate.
ProcessRun parse_run(const ProcessResult& process, double timeout_s, double flops, nlohmann::json* raw) {
  ProcessRun run;
  std::string error;
  const std::vector<nlohmann::json> lines = json_lines(process, timeout_s, error);
  if (!error.empty() || lines.empty()) {
    run.status = error.empty() ? "failed: no output" : error;
    return run;
  }
  const nlohmann::json& j = lines.back();
  try {
    run.timing = {j.at("min_s").get<double>(), j.at("median_s").get<double>(), j.at("reps").get<int>()};
    run.baseline_rss_bytes = j.at("baseline_rss_bytes").get<std::int64_t>();
    run.peak_rss_first_bytes = j.at("peak_rss_first_bytes").get<std::int64_t>();
    run.peak_rss_bytes = j.at("peak_rss_bytes").get<std::int64_t>();
    run.gflops = flops / run.timing.min_s * 1e-9;
    if (raw) *raw = j;
  } catch (const nlohmann::json::exception& e) {
    run.status = fmt::format("failed: unreadable output ({}): {}", e.what(), j.dump());
  }
  return run;
}

}  // namespace

ProcessRun run_ours(const std::string& impl, std::int64_t n, bool causal, int threads, Pass pass,
                    const RepeatPolicy& policy, double flops, const std::string& dtype) {
  std::vector<std::string> argv = {
      kSelfExecutable,   "bench-one",     "--impl",           impl,        "--n",
      std::to_string(n), "--causal",      causal ? "1" : "0", "--threads", std::to_string(threads),
      "--pass",          pass_name(pass), "--dtype",          dtype};
  for (std::string& a : policy_args(policy)) argv.push_back(std::move(a));
  return parse_run(run_process(argv, {}, kOwnTimeoutS), kOwnTimeoutS, flops, nullptr);
}

std::string torch_label(const std::string& blas) {
  if (blas == "onednn") return "PyTorch 1.13 with its sgemm_ calls sent to oneDNN (LD_PRELOAD libmha_onednn_blas.so)";
  if (blas == "openblas")
    return fmt::format("PyTorch 1.13 on OpenBLAS (libopenblas0-pthread, LD_LIBRARY_PATH={})", kOpenBlasDir);
  return "PyTorch 1.13 on Debian's default BLAS (" + installed_blas_path() + ")";
}

std::optional<std::string> blas_unavailable(const std::string& blas) {
  if (blas == "onednn" && !std::filesystem::exists(self_directory() / kBlasShim))
    return (self_directory() / kBlasShim).string() + " not found: build the target mha_onednn_blas";
  if (blas == "openblas" && !std::filesystem::exists(std::filesystem::path(kOpenBlasDir) / "libblas.so.3"))
    return fmt::format("not measured: OpenBLAS is not installed ({}/libblas.so.3 is missing); the bench installs "
                       "nothing: install it with `apt-get install libopenblas0-pthread` and run again",
                       kOpenBlasDir);
  return std::nullopt;
}

// PyTorch materialises the [B*h, N, N] logits and weights. Peak RSS measured at N = 1024..4096
// (B 1, h 8, 2 threads) was the interpreter and torch (~0.25 GiB) plus about this many float32
// [B*h, N, N] tensors: 1.1-1.6 forward (no mask: the fused eval path), 2.3-2.5 forward with the causal
// mask, 3.3-4.6 forward + backward. The estimate takes the upper ends.
double torch_memory_estimate_bytes(std::int64_t batch_heads, std::int64_t n, bool causal, Pass pass) {
  const double tensors = pass == Pass::ForwardBackward ? 4.0 : causal ? 2.5 : 1.6;
  const double one = 4.0 * static_cast<double>(batch_heads) * static_cast<double>(n) * static_cast<double>(n);
  return 0.3 * (1 << 30) + tensors * one;
}

std::string torch_script(const BenchOptions& options) {
  if (!options.torch_script.empty()) return options.torch_script;
  return std::string(MHA_SOURCE_DIR) + "/apps/mha/bench/torch_mha.py";
}

std::vector<nlohmann::json> TorchRunner::run_lines(std::vector<std::string> args, int threads, const std::string& blas,
                                                   std::string& error) const {
  std::vector<std::string> argv = {options.python, torch_script(options), "--threads", std::to_string(threads)};
  for (std::string& a : args) argv.push_back(std::move(a));
  const ProcessResult process = run_process(argv, blas_environment(blas, threads), options.torch_timeout_s);
  std::vector<nlohmann::json> lines = json_lines(process, options.torch_timeout_s, error);
  if (!lines.empty()) {
    results.torch_version = lines.back().value("version", "");
    results.python_version = lines.back().value("python", "");
  }
  return lines;
}

ProcessRun TorchRunner::run(std::int64_t n, bool causal, int threads, Pass pass, const std::string& blas,
                            const RepeatPolicy& policy, double flops) const {
  ProcessRun run;
  const double need = torch_memory_estimate_bytes(kHeads, n, causal, pass);
  if (need > options.torch_memory_limit_gib * (1 << 30)) {
    run.status = fmt::format("skipped: would need ~{:.1f} GiB (limit {:.0f} GiB; --torch-memory-limit)",
                             need / (1 << 30), options.torch_memory_limit_gib);
    return run;
  }
  std::vector<std::string> args = {"--n",     std::to_string(n),     "--causal",  causal ? "1" : "0",
                                   "--pass",  pass_name(pass),       "--d-model", std::to_string(kDModel),
                                   "--heads", std::to_string(kHeads)};
  for (std::string& a : policy_args(policy)) args.push_back(std::move(a));
  std::vector<std::string> argv = {options.python, torch_script(options), "--threads", std::to_string(threads)};
  for (std::string& a : args) argv.push_back(std::move(a));
  nlohmann::json raw;
  run = parse_run(run_process(argv, blas_environment(blas, threads), options.torch_timeout_s), options.torch_timeout_s,
                  flops, &raw);
  if (run.ok()) {
    results.torch_version = raw.value("version", "");
    results.python_version = raw.value("python", "");
    run.blas_library = raw.value("blas_library", "");
  }
  return run;
}

}  // namespace mha_cli::bench
