// Tile sizes of the fused (FlashAttention-2) kernel, in one place.
#pragma once

#include <cstdint>

namespace mha::detail::flash {

// Query rows per block. Each block reads its Q rows (128 x d_k), its output accumulator
// (128 x d_v) and one logits tile (128 x kBlockK) resident while it streams K/V blocks past them;
// taller blocks reuse each K/V block for more rows (measured: 128 x 256 beat 64 x 128 by about 5
// points of the GEMM roof forward and backward at N = 2048..4096, d = 64, on this machine).
inline constexpr std::int64_t kBlockQ = 128;
// Keys per block. With d = 64 in float32: logits tile 128 KiB, K and V blocks 64 KiB each, Q block
// and accumulator 32 KiB each: about 320 KiB, inside a core's 512 KiB L2 here.
inline constexpr std::int64_t kBlockK = 256;
// Row strides of the tiles are rounded up to this many floats (one 64-byte line, an AVX-512 vector),
// so every row starts aligned and whole vectors can be processed without a scalar tail.
inline constexpr std::int64_t kRowAlign = 16;

static_assert(kBlockK % kRowAlign == 0, "logits rows must hold whole vectors");

constexpr std::int64_t round_up(std::int64_t n, std::int64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

}  // namespace mha::detail::flash
