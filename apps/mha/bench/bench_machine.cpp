// Reads the machine's description from /proc and uname, and the versions of what we run.
#include "bench/bench_machine.hpp"

#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <fstream>
#include <sstream>

#include <fmt/core.h>
#include <oneapi/dnnl/dnnl.h>

#include <stdexcept>

#include "bench/bench_process.hpp"

namespace mha_cli::bench {
namespace {

#if defined(__clang__)
constexpr const char* kCompiler = "clang++";
#else
constexpr const char* kCompiler = "g++";
#endif

// The value of the first "key<spaces/tabs>: value" line of a /proc file, or "".
std::string proc_field(const std::string& file, const std::string& key) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) != 0) continue;
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    if (line.find_first_not_of(" \t", key.size()) != colon) continue;  // a longer key with this prefix
    const auto start = line.find_first_not_of(' ', colon + 1);
    return start == std::string::npos ? "" : line.substr(start);
  }
  return "";
}

bool has_flag(const std::string& flags, const std::string& flag) {
  std::istringstream words(flags);
  std::string word;
  while (words >> word) {
    if (word == flag) return true;
  }
  return false;
}

std::string onednn_isa_name(dnnl_cpu_isa_t isa) {
  switch (isa) {
    case dnnl_cpu_isa_sse41: return "sse41";
    case dnnl_cpu_isa_avx: return "avx";
    case dnnl_cpu_isa_avx2: return "avx2";
    case dnnl_cpu_isa_avx2_vnni: return "avx2_vnni";
    case dnnl_cpu_isa_avx512_core: return "avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni: return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16: return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx: return "avx512_core_amx";
    default: return fmt::format("isa {:#x}", static_cast<unsigned>(isa));
  }
}

std::string local_date() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  char buffer[64];
  std::strftime(buffer, sizeof buffer, "%Y-%m-%dT%H:%M:%S%z", &local);
  return buffer;
}

// The clock of the core this runs on, in GHz: chains of dependent integer adds (one a cycle on every x86
// core) timed, the best of five (about 0.1 s in all). Register to register: Intel's Golden Cove and later
// fold chains of adds of an immediate in the renamer (about 6 a cycle on a Sapphire Rapids Xeon), which a
// register the compiler cannot see through avoids. 0 off x86.
double measure_clock_ghz() {
#if defined(__x86_64__)
  constexpr std::int64_t kIterations = 5'000'000, kAddsPerIteration = 8;
  std::uint64_t one = 1;
  asm volatile("" : "+r"(one));  // a value known only at run time
  double best = 0;
  for (int round = 0; round < 5; ++round) {
    std::uint64_t x = 0;
    const auto start = std::chrono::steady_clock::now();
    for (std::int64_t i = 0; i < kIterations; ++i)
      asm volatile("add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
                   "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0"
                   : "+r"(x)
                   : "r"(one));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, static_cast<double>(kIterations * kAddsPerIteration) / seconds * 1e-9);
  }
  return best;
#else
  return 0;
#endif
}

}  // namespace

MachineInfo describe_machine() {
  MachineInfo m;
  m.cpu_model = proc_field("/proc/cpuinfo", "model name");
  m.cpu_family_model = fmt::format("family {} model {}", proc_field("/proc/cpuinfo", "cpu family"),
                                   proc_field("/proc/cpuinfo", "model"));
  const std::string mhz = proc_field("/proc/cpuinfo", "cpu MHz");
  m.cpu_mhz = mhz.empty() ? 0.0 : std::stod(mhz);
  m.measured_ghz = measure_clock_ghz();
  m.logical_cpus = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
  const std::string flags = proc_field("/proc/cpuinfo", "flags");
  m.simd = has_flag(flags, "avx512f") ? "avx512f"
           : has_flag(flags, "avx2")  ? "avx2"
           : has_flag(flags, "avx")   ? "avx"
                                      : "sse";
  m.virtual_machine = has_flag(flags, "hypervisor");
  const std::string mem_kib = proc_field("/proc/meminfo", "MemTotal");  // "24684096 kB"
  m.memory_bytes = mem_kib.empty() ? 0 : std::stoll(mem_kib) * 1024;
  utsname uts{};
  if (uname(&uts) == 0) m.kernel = fmt::format("{} {}", uts.sysname, uts.release);
  m.date = local_date();
  m.mha_version = MHA_VERSION;
  const dnnl_version_t* v = dnnl_version();
  m.onednn_version = fmt::format("{}.{}.{}", v->major, v->minor, v->patch);
  m.onednn_isa = onednn_isa_name(dnnl_get_effective_cpu_isa());
  m.compiler = fmt::format("{} {}", kCompiler, __VERSION__);
  return m;
}

std::string cpu_name(const MachineInfo& m) {
  if (m.measured_ghz <= 0) return fmt::format("{} ({})", m.cpu_model, m.cpu_family_model);
  return fmt::format("{} ({}, runs at {:.2f} GHz)", m.cpu_model, m.cpu_family_model, m.measured_ghz);
}

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  in >> one >> five >> fifteen;
  return fmt::format("{} {} {}", one, five, fifteen);
}

double steal_seconds() {
  std::ifstream in("/proc/stat");
  std::string cpu;
  double ticks[8] = {};  // user nice system idle iowait irq softirq steal
  if (!(in >> cpu) || cpu != "cpu") return 0;
  for (double& t : ticks)
    if (!(in >> t)) return 0;
  return ticks[7] / static_cast<double>(sysconf(_SC_CLK_TCK));
}

std::string source_revision() {
  try {
    const ProcessResult git =
        run_process({"/usr/bin/git", "-C", MHA_SOURCE_DIR, "describe", "--always", "--dirty"}, {}, 10);
    if (git.exit_code == 0) return git.out.substr(0, git.out.find_last_not_of("\n ") + 1);
  } catch (const std::runtime_error&) {
  }
  return "unknown";
}

}  // namespace mha_cli::bench
