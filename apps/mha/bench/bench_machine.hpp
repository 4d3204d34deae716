// The machine and software a benchmark ran on, for its report.
#pragma once

#include <cstdint>
#include <string>

namespace mha_cli::bench {

struct MachineInfo {
  std::string cpu_model;          // /proc/cpuinfo "model name"
  std::string cpu_family_model;   // "family 25 model 1" (the model name alone can be as vague as "AMD EPYC")
  double cpu_mhz = 0;             // /proc/cpuinfo "cpu MHz" of the first CPU
  double measured_ghz = 0;        // the clock a core ran at while describe_machine measured it; 0: not measured
  int logical_cpus = 0;           // online CPUs
  std::string simd;               // the widest of avx512f / avx2 / avx in the CPU flags
  bool virtual_machine = false;   // the "hypervisor" CPU flag
  std::int64_t memory_bytes = 0;  // /proc/meminfo MemTotal
  std::string kernel;             // uname -sr
  std::string date;               // local time, ISO 8601
  std::string mha_version;
  std::string onednn_version;  // the runtime library's, e.g. "2.6.3"
  std::string onednn_isa;      // the instruction set oneDNN's JIT uses on this machine
  std::string compiler;        // the compiler that built this program
};

MachineInfo describe_machine();

// The CPU as the reports name it: "AMD EPYC (family 26 model 2, runs at 3.38 GHz)". A virtual machine's
// "cpu MHz" is often the host's nominal clock (a Zen 5 here reads 2096 MHz and runs at 3.3-3.4 GHz), and
// the host may change the clock between runs, so the measured one is what figures compare against.
std::string cpu_name(const MachineInfo& m);

// /proc/loadavg's 1, 5 and 15 minute load averages, e.g. "0.52 0.61 0.70": how busy the machine was.
std::string load_average();
// CPU time the hypervisor gave to others while our virtual CPUs wanted to run ("steal" in /proc/stat,
// all CPUs together), in seconds since boot; 0 where it cannot be read.
double steal_seconds();

// The source tree's commit, "-dirty" when it has uncommitted changes, at the time of the run (git describe;
// "unknown" without git). The binary was built from the tree as it was at build time.
std::string source_revision();

}  // namespace mha_cli::bench
