// Running a child process with a time limit and capturing its output: how `mha bench` runs each
// memory-measured shape (itself through /proc/self/exe, or PyTorch through Python) on its own.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace mha_cli::bench {

struct ProcessResult {
  int exit_code = -1;      // the exit status, or -1 when killed by a signal
  bool timed_out = false;  // killed (SIGKILL) at the time limit
  std::string out;         // everything written on stdout
  std::string err;         // everything written on stderr
};

// Runs argv[0] (a path, not looked up in PATH) with argv, the current environment plus `extra_env`
// ("NAME=value" entries, which win over the current ones). Throws std::runtime_error when the
// process cannot be started.
ProcessResult run_process(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env,
                          double timeout_s);

// What to execute to run this very program again: "/proc/self/exe". The kernel resolves it to the
// running binary even after the file was replaced or deleted (a rebuild during a long benchmark
// would otherwise run a different program, or none).
inline constexpr const char* kSelfExecutable = "/proc/self/exe";

// The directory the running executable was started from (where libmha_onednn_blas.so is built).
std::filesystem::path self_directory();

}  // namespace mha_cli::bench
