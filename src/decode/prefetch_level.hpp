// Which cache level decode's prefetches of the block ahead ask for, chosen once per process.
//
// The kernel prefetches the next block's key and value rows while it computes the current one
// (decode_rows-inl.h). Into the L1 (prefetcht0) or into the L2 (prefetcht2): the faster one depends on
// the core, measured from caches far past the last-level cache (docs/PERFORMANCE.md, issue 33):
//   AMD Zen 4 (family 25): L2 2.9-3.1x faster for float32, 1.6-1.9x for bfloat16 (the L1's few miss
//                           buffers, each held until its line arrives, kept few lines in flight);
//   AMD Zen 5 (family 26): L1 1.14x faster for float32, 1.11x for bfloat16, 1.24x for int8 (medians);
//   Intel Xeons (family 6): L1 reached 66-68% of the read bandwidth; on the model-167 Xeon with AMX the two
//                           were equal (f32 95.8-96.9 ms against 95.7-96.9, int8 32.7 against 33.6-34.1, 1 x
//                           128k, 2026-12-06): bound elsewhere (docs/PERFORMANCE.md, issue 33).
// So L2 on AMD family 25 (Zen 3 shares it: not measured) and L1 everywhere else. MHA_DECODE_PREFETCH=l1|l2
// forces one (for measuring a new machine; the result is the same bits either way).
#pragma once

#include <optional>
#include <string>

namespace mha::detail {

enum class PrefetchLevel { L1, L2 };

inline constexpr const char* kPrefetchLevelVariable = "MHA_DECODE_PREFETCH";

// The processor, as far as the choice needs it.
struct CpuIdentity {
  bool amd = false;
  int family = 0;  // the display family (base + extended), e.g. 25 for Zen 3/4, 26 for Zen 5, 6 for Intel cores
};

// The level for `cpu` and MHA_DECODE_PREFETCH's value (nullopt: unset): "l1" or "l2" forces it; anything
// else is ignored (said once on stderr by decode_prefetch_level).
PrefetchLevel choose_prefetch_level(const CpuIdentity& cpu, const std::optional<std::string>& request);

// This process's level, decided at the first call (thread-safe; never throws).
PrefetchLevel decode_prefetch_level();

// That level and why, e.g. "L1 (prefetcht0; chosen for AMD family 26)" or "L2 (prefetcht2; forced by
// MHA_DECODE_PREFETCH=l2)": for benchmarks' reports.
std::string decode_prefetch_description();

}  // namespace mha::detail
