// The prefetch level of the decode kernel (prefetch_level.hpp): the processor read once through CPUID.
#include "decode/prefetch_level.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

namespace mha::detail {

namespace {

CpuIdentity this_cpu() {
  CpuIdentity cpu;
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return cpu;
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4), std::memcpy(vendor + 4, &edx, 4), std::memcpy(vendor + 8, &ecx, 4);
  cpu.amd = std::strcmp(vendor, "AuthenticAMD") == 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return cpu;
  const int base = static_cast<int>((eax >> 8) & 0xf), extended = static_cast<int>((eax >> 20) & 0xff);
  cpu.family = base == 0xf ? base + extended : base;
#endif
  return cpu;
}

// MHA_DECODE_PREFETCH's value, nullopt when unset or empty.
std::optional<std::string> prefetch_request() {
  const char* value = std::getenv(kPrefetchLevelVariable);
  return value && *value ? std::optional<std::string>(value) : std::nullopt;
}

}  // namespace

PrefetchLevel choose_prefetch_level(const CpuIdentity& cpu, const std::optional<std::string>& request) {
  if (request == "l1") return PrefetchLevel::L1;
  if (request == "l2") return PrefetchLevel::L2;
  return cpu.amd && cpu.family == 25 ? PrefetchLevel::L2 : PrefetchLevel::L1;
}

namespace {

// The level of this process and why, decided once from the variable and the processor.
struct PrefetchChoice {
  PrefetchLevel level;
  std::string description;
};

const PrefetchChoice& prefetch_choice() {
  static const PrefetchChoice choice = [] {
    const std::optional<std::string> request = prefetch_request();
    const bool forced = request == "l1" || request == "l2";
    if (request && !forced)
      std::fprintf(stderr, "mha: %s=\"%s\" is not l1 or l2: ignored (chosen by the processor)\n",
                   kPrefetchLevelVariable, request->c_str());
    const CpuIdentity cpu = this_cpu();
    const PrefetchLevel level = choose_prefetch_level(cpu, request);
    const std::string why = forced ? std::string("forced by ") + kPrefetchLevelVariable + "=" + *request
                                   : std::string("chosen for ") + (cpu.amd ? "AMD" : "this vendor's") + " family " +
                                         std::to_string(cpu.family);
    return PrefetchChoice{level, (level == PrefetchLevel::L1 ? "L1 (prefetcht0; " : "L2 (prefetcht2; ") + why + ")"};
  }();
  return choice;
}

}  // namespace

PrefetchLevel decode_prefetch_level() { return prefetch_choice().level; }

std::string decode_prefetch_description() { return prefetch_choice().description; }

}  // namespace mha::detail
