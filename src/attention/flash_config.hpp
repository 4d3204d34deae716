// Tile sizes of the fused (FlashAttention-2) kernel, in one place.
#pragma once

#include <cstdint>

namespace mha::detail::flash {

// Query rows per block: one of two heights, chosen once per process by the size of a core's L2
// (query_block.hpp). Each block reads its Q rows (rows x d_k), its output accumulator (rows x d_v) and
// one logits tile (rows x kBlockK) resident while it streams K/V blocks past them; taller blocks reuse
// each K/V block for more rows (measured: 128 x 256 beat 64 x 128 by about 5 points of the GEMM roof
// forward and backward at N = 2048..4096, d = 64, on a Zen 3; 256 x 256 beat 128 x 256 by 5-8% on a
// Xeon with 2 MiB of L2 per core).
inline constexpr std::int64_t kBlockQShort = 128;
inline constexpr std::int64_t kBlockQTall = 256;
// Keys per block. With d = 64 in float32 and 128 rows: logits tile 128 KiB, K and V blocks 64 KiB each,
// Q block and accumulator 32 KiB each: about 320 KiB, inside a Zen 3 core's 512 KiB L2.
inline constexpr std::int64_t kBlockK = 256;
// bfloat16 uses the same tiles. They suit the matrix units: AMX tiles are 16 rows x 64 bytes (32 bf16),
// and 128 or 256 query rows x 256 keys are whole multiples of both; AVX512-BF16 works on 16 floats / 32 bf16 per
// register. Measured on the Zen 5 (AVX512-BF16, oneDNN's brg:avx512_core_bf16), one thread, the two
// forward products QK^T [rows, keys, K = 64] and PV [rows, 64, K = keys] per shape, in GFLOP/s, with a
// build running beside them (so compare within the row only): 128 x 256: 212 / 212; 256 x 256: 225 / 222;
// 128 x 512: 227 / 203; 256 x 512: 176 / 218; 64 x 256: 185 / 162. No shape was clearly faster, so the
// float32 tiles were kept (the bf16 forward's tile products reach 361-417 GFLOP/s when run alone on a
// quiet machine: docs/PERFORMANCE.md). With AMX (the Xeon above) 256 rows ran the products 1.17x faster.
//
// Row strides of the tiles are rounded up to this many floats (one 64-byte line, an AVX-512 vector),
// so every row starts aligned and whole vectors can be processed without a scalar tail.
inline constexpr std::int64_t kRowAlign = 16;

static_assert(kBlockK % kRowAlign == 0, "logits rows must hold whole vectors");

constexpr std::int64_t round_up(std::int64_t n, std::int64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

}  // namespace mha::detail::flash
