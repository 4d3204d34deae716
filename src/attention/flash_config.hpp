// Tile sizes of the fused (FlashAttention-2) kernel, in one place.
#pragma once

#include <cstdint>

namespace mha::detail::flash {

// Query rows per block. Each block keeps its scaled Q rows (64 x d_k), its output accumulator
// (64 x d_v) and one logits tile (64 x kBlockK) resident while it streams K/V blocks past them.
inline constexpr std::int64_t kBlockQ = 64;
// Keys per block. With d = 64 in float32: logits tile 32 KiB, K block 32 KiB, V block 32 KiB, so the
// working set (about 130 KiB with Q and the accumulator) stays in a core's L2 (512 KiB here).
inline constexpr std::int64_t kBlockK = 128;
// Row strides of the tiles are rounded up to this many floats (one 64-byte line, an AVX-512 vector),
// so every row starts aligned and whole vectors can be processed without a scalar tail.
inline constexpr std::int64_t kRowAlign = 16;

static_assert(kBlockK % kRowAlign == 0, "logits rows must hold whole vectors");

constexpr std::int64_t round_up(std::int64_t n, std::int64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

}  // namespace mha::detail::flash
