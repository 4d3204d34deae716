// The shapes `mha bench` times in processes of their own: ours (`mha bench-one`, `mha bench-grid`)
// and PyTorch's (torch_mha.py), with the BLAS PyTorch's float32 products run on.
//
// Legend: B batch, h heads, N = L = S, E = d_model.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench.hpp"
#include "bench/bench_measure.hpp"
#include "bench/bench_process.hpp"
#include "bench/bench_results.hpp"
#include "bench/bench_workloads.hpp"

namespace mha_cli::bench {

inline constexpr std::int64_t kHeads = 8;                          // h of the core and layer tables
inline constexpr std::int64_t kDModel = 512;                       // E
inline constexpr std::int64_t kHeadWidth = kDModel / kHeads;       // d = 64
inline constexpr double kOwnTimeoutS = 3600;                       // our own processes: the --big ones take minutes
inline constexpr const char* kBlasShim = "libmha_onednn_blas.so";  // built beside this program
// Debian's libopenblas0-pthread puts its libblas.so.3 here (and registers it as an alternative of
// libblas.so.3, which the bench does not rely on: LD_LIBRARY_PATH on this directory selects it).
inline constexpr const char* kOpenBlasDir = "/usr/lib/x86_64-linux-gnu/openblas-pthread";

// The arguments that pass `policy` to a child (`mha bench-one`, `mha bench-grid`, torch_mha.py).
std::vector<std::string> policy_args(const RepeatPolicy& policy);

// The child's JSON lines: every non-empty line of stdout that parses; `error` gets why a line did
// not, or why the process gave none (timed out, exit status and its last line of stderr).
std::vector<nlohmann::json> json_lines(const ProcessResult& process, double timeout_s, std::string& error);

// `mha bench-one` in a new process of this program: one shape, its time and peak RSS.
ProcessRun run_ours(const std::string& impl, std::int64_t n, bool causal, int threads, Pass pass,
                    const RepeatPolicy& policy, double flops, const std::string& dtype = "float32");

// "onednn", "installed", "openblas": a line saying what PyTorch's products run on.
std::string torch_label(const std::string& blas);

// Why PyTorch cannot run on `blas` here (the library is missing, with how to get it), or nothing.
std::optional<std::string> blas_unavailable(const std::string& blas);

// torch_mha.py in new Python processes, on the BLAS named as in BenchOptions::torch_blas.
struct TorchRunner {
  const BenchOptions& options;
  BenchResults& results;

  // One shape of the E = 512, h = 8 layer: its time and peak RSS. Skipped (status) when estimated to
  // need more memory than --torch-memory-limit.
  ProcessRun run(std::int64_t n, bool causal, int threads, Pass pass, const std::string& blas,
                 const RepeatPolicy& policy, double flops) const;

  // Any arguments, on `blas` at `threads`: the JSON lines the process printed (see json_lines).
  std::vector<nlohmann::json> run_lines(std::vector<std::string> args, int threads, const std::string& blas,
                                        std::string& error) const;
};

// torch_mha.py: --torch-script, or the source tree's.
std::string torch_script(const BenchOptions& options);

// PyTorch's estimated peak memory on self-attention with `batch_heads` = B * h heads of N x N weights.
double torch_memory_estimate_bytes(std::int64_t batch_heads, std::int64_t n, bool causal, Pass pass);

}  // namespace mha_cli::bench
