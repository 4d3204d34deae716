// A bfloat16 tile transposed: the first operand of the backward's dV += P^T dO and dK += dS^T Q, which
// oneDNN's AMX matmul runs 1.5-2.4x slower read transposed than plain (gemm_bf16.cpp's plain_copy).
// One thread, 256 x 256: 4.8 us with AVX-512 (Intel Xeon with AMX, 2026-12-06).
#pragma once

#include <cstdint>

#include "mha/bfloat16.hpp"

namespace mha::detail {

// dst[c * ldd + r] = src[r * lds + c] for r in [0, rows), c in [0, cols): blocks of 32 x 32 by AVX-512 shuffles
// where the CPU has AVX-512BW and AVX512-BF16 (every CPU with AMX, where it is used), else element by element.
// Reads nothing outside the source tile and writes nothing outside the transposed one; src and dst do not
// overlap.
void transpose_bf16(const bfloat16* src, std::int64_t lds, std::int64_t rows, std::int64_t cols, bfloat16* dst,
                    std::int64_t ldd);

// The row stride of a tile's transposed copy whose rows hold `rows` source rows: whole 32-element blocks
// (64 bytes, an AMX tile row). gemm_bf16.cpp's plain copies and the backward's P^T use it, so both hand
// oneDNN the same operand layout.
constexpr std::int64_t transposed_row_stride(std::int64_t rows) { return (rows + 31) / 32 * 32; }

// The same from a float32 tile, each element rounded to bfloat16 as round_rows_with_bf16_conversion rounds it
// (bf16_rounding.hpp: nearest even, subnormals flushed to zero, NaN quiet) on its way: the bits of rounding
// the rows first and transposing after, in one pass. The backward's P, which its products read only
// transposed where oneDNN runs on AMX.
void transpose_rounding_to_bf16(const float* src, std::int64_t lds, std::int64_t rows, std::int64_t cols, bfloat16* dst,
                                std::int64_t ldd);

}  // namespace mha::detail
