// How many query rows the fused kernels' blocks hold (flash_forward.cpp, flash_backward.cpp), chosen once
// per process from the size of a core's L2.
//
// A block keeps its Q rows, its output accumulator and a [rows, kBlockK] float32 logits tile resident while
// K/V blocks stream past (the backward three such tiles); taller blocks read each K/V block for more rows
// and give the products taller, faster shapes, as long as the tiles stay in the L2. Measured
// (docs/PERFORMANCE.md):
//   AMD Zen 3 (512 KiB L2): 128 x 256 beat 64 x 128 by ~5 points of the GEMM roof, float32, d 64;
//   AMD Zen 5 (1 MiB L2): bf16 tile products 128 / 256 rows within the machine's noise (212 / 225 GFLOP/s);
//   Intel Xeon with AMX (family 6 model 167, 2 MiB L2), 256 rows against 128 (2026-12-06): bf16 tile
//     products 1.17x, bf16 layer forward 1.08x, training step 1.05-1.07x, float32 layer forward 1.05x.
// 256 rows' backward tiles are 768 KiB (three of 256 x 256 floats): over the Zen 3's L2, most of the
// Zen 5's. So 256 rows where a core has at least 2 MiB of L2, else 128 (unknown: 128).
// MHA_QUERY_BLOCK=128|256 forces one (for measuring and for the tests, which run the kernels' suites with
// each). The height changes the order of the backward's sums over query blocks (dK, dV) and the shapes of
// the products, so results differ in their last bits between heights; each is deterministic.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace mha::detail {

inline constexpr const char* kQueryBlockVariable = "MHA_QUERY_BLOCK";

// The L2 a core needs before blocks are 256 rows tall.
inline constexpr std::int64_t kTallBlockMinL2Bytes = std::int64_t{2} << 20;

// The height for a core with `l2_bytes` of L2 (0: unknown) and MHA_QUERY_BLOCK's value (nullopt: unset):
// "128" or "256" forces it; anything else is ignored (said once on stderr by query_block_rows).
std::int64_t choose_query_block_rows(std::int64_t l2_bytes, const std::optional<std::string>& request);

// This process's height, decided at the first call (thread-safe; never throws).
std::int64_t query_block_rows();

// That height and why, e.g. "256 query rows (chosen for a 2048 KiB L2 per core)" or "128 query rows
// (forced by MHA_QUERY_BLOCK=128)": for benchmarks' reports.
std::string query_block_description();

}  // namespace mha::detail
