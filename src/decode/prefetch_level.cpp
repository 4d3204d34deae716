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

PrefetchLevel decode_prefetch_level() {
  static const PrefetchLevel level = [] {
    const std::optional<std::string> request = prefetch_request();
    if (request && *request != "l1" && *request != "l2")
      std::fprintf(stderr, "mha: %s=\"%s\" is not l1 or l2: ignored (chosen by the processor)\n",
                   kPrefetchLevelVariable, request->c_str());
    return choose_prefetch_level(this_cpu(), request);
  }();
  return level;
}

std::string decode_prefetch_description() {
  const PrefetchLevel level = decode_prefetch_level();
  const std::optional<std::string> request = prefetch_request();
  const CpuIdentity cpu = this_cpu();
  const std::string why =
      request == "l1" || request == "l2"
          ? std::string("forced by ") + kPrefetchLevelVariable + "=" + *request
          : std::string("chosen for ") + (cpu.amd ? "AMD" : "this vendor's") + " family " + std::to_string(cpu.family);
  return level == PrefetchLevel::L1 ? "L1 (prefetcht0; " + why + ")" : "L2 (prefetcht2; " + why + ")";
}

}  // namespace mha::detail
