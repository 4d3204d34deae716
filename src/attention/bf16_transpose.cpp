// transpose_bf16 and transpose_rounding_to_bf16 (bf16_transpose.hpp): blocks of up to 32 x 32 16-bit elements by
// AVX-512BW shuffles, the edges' by masked loads and stores; a float32 source rounded to bfloat16 by AVX512-BF16's
// conversion as its rows are loaded (one network for both, compiled for AVX-512BW with AVX512-BF16, a function
// attribute, and called only where the CPU reports both); element by element elsewhere.
#include "attention/bf16_transpose.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention/bf16_rounding.hpp"

#if defined(__x86_64__)
// GCC 12's AVX-512 unpack intrinsics start from _mm512_undefined_*(), which -Wuninitialized reports as a use
// of an uninitialised value inside the header (GCC bug 105593); the values are all defined.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#endif

namespace mha::detail {
namespace {

#if defined(__x86_64__)

inline constexpr std::int64_t kBlock = 32;  // 32 x 32 elements: 32 registers of 32 bfloat16

// The instruction sets of the network below: AVX-512BW's shuffles and AVX512-BF16's conversion (every CPU
// with AVX512-BF16 seen so far has AVX-512BW: Cooper Lake, Sapphire Rapids and later, Zen 4 and Zen 5).
bool has_network() {
  static const bool has = __builtin_cpu_supports("avx512bw") && has_bf16_conversion();  // the OS's AVX-512 state too
  return has;
}

#define MHA_TRANSPOSE_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

// Row i of a block: its first nc elements as 32 bfloat16 (`columns`: nc ones), zeros past them; zeros for
// rows i >= nr. kWhole: nr = nc = 32.
template <bool kWhole>
MHA_TRANSPOSE_TARGET inline __m512i load_row(const bfloat16* src, std::int64_t lds, int i, std::int64_t nr,
                                             __mmask32 columns) {
  if (kWhole) return _mm512_loadu_si512(src + i * lds);
  return i < nr ? _mm512_maskz_loadu_epi16(columns, src + i * lds) : _mm512_setzero_si512();
}
// The same from float32, rounded to nearest even by vcvtne2ps2bf16 (round_rows_with_bf16_conversion's
// rounding: subnormals flushed to zero, NaN kept as a quiet NaN).
template <bool kWhole>
MHA_TRANSPOSE_TARGET inline __m512i load_row(const float* src, std::int64_t lds, int i, std::int64_t nr,
                                             __mmask32 columns) {
  if (!kWhole && i >= nr) return _mm512_setzero_si512();
  const float* row = src + i * lds;
  const __m512 lo = kWhole ? _mm512_loadu_ps(row) : _mm512_maskz_loadu_ps(static_cast<__mmask16>(columns), row);
  const __m512 hi =
      kWhole ? _mm512_loadu_ps(row + 16) : _mm512_maskz_loadu_ps(static_cast<__mmask16>(columns >> 16), row + 16);
  const __m512bh rounded = _mm512_cvtne2ps_pbh(hi, lo);  // elements 0-15 from lo, 16-31 from hi
  __m512i bits;
  std::memcpy(&bits, &rounded, sizeof bits);
  return bits;
}

// Row `column` of dst's block, its first rows elements (a mask), if the block has that column.
template <bool kWhole>
MHA_TRANSPOSE_TARGET inline void store_column(bfloat16* dst, std::int64_t ldd, std::int64_t nc, __mmask32 rows,
                                              std::int64_t column, __m512i x) {
  if (kWhole) _mm512_storeu_si512(dst + column * ldd, x);
  else if (column < nc) _mm512_mask_storeu_epi16(dst + column * ldd, rows, x);
}

// One block of up to 32 x 32: src rows a[0, nr) (nc elements each; the rest of the 32 x 32 read as zeros)
// to dst rows [0, nc) (nr elements each; nothing else written). kWhole: nr = nc = 32, without masks.
//   1. Each group of 8 rows is transposed inside every 128-bit lane (3 rounds of unpacks, 16-, 32- and
//      64-bit): v[g][j] lane L = column 8 L + j, rows 8 g .. 8 g + 7.
//   2. Column 8 L + j is lane L of v[0][j], v[1][j], v[2][j], v[3][j]: a 4 x 4 transpose of 128-bit lanes.
template <bool kWhole, class E>
MHA_TRANSPOSE_TARGET void transpose_block(const E* src, std::int64_t lds, std::int64_t nr, std::int64_t nc,
                                          bfloat16* dst, std::int64_t ldd) {
  const __mmask32 columns = static_cast<__mmask32>((std::uint64_t{1} << nc) - 1);
  const __mmask32 rows = static_cast<__mmask32>((std::uint64_t{1} << nr) - 1);
  __m512i v[4][8];
  for (int g = 0; g < 4; ++g) {
    __m512i a[8], t[8], u[8];
    for (int i = 0; i < 8; ++i) a[i] = load_row<kWhole>(src, lds, 8 * g + i, nr, columns);
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm512_unpacklo_epi16(a[2 * i], a[2 * i + 1]);      // columns 0-3 of rows 2i, 2i + 1
      t[2 * i + 1] = _mm512_unpackhi_epi16(a[2 * i], a[2 * i + 1]);  // columns 4-7
    }
    for (int h = 0; h < 2; ++h) {                                        // rows 0-3 (h 0) and 4-7 (h 1)
      u[4 * h] = _mm512_unpacklo_epi32(t[4 * h], t[4 * h + 2]);          // columns 0, 1
      u[4 * h + 1] = _mm512_unpackhi_epi32(t[4 * h], t[4 * h + 2]);      // columns 2, 3
      u[4 * h + 2] = _mm512_unpacklo_epi32(t[4 * h + 1], t[4 * h + 3]);  // columns 4, 5
      u[4 * h + 3] = _mm512_unpackhi_epi32(t[4 * h + 1], t[4 * h + 3]);  // columns 6, 7
    }
    for (int i = 0; i < 4; ++i) {
      v[g][2 * i] = _mm512_unpacklo_epi64(u[i], u[4 + i]);      // column 2i: rows 0-3, then 4-7
      v[g][2 * i + 1] = _mm512_unpackhi_epi64(u[i], u[4 + i]);  // column 2i + 1
    }
  }
  for (int j = 0; j < 8; ++j) {
    const __m512i x0 = _mm512_shuffle_i64x2(v[0][j], v[1][j], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i x1 = _mm512_shuffle_i64x2(v[0][j], v[1][j], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i x2 = _mm512_shuffle_i64x2(v[2][j], v[3][j], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i x3 = _mm512_shuffle_i64x2(v[2][j], v[3][j], _MM_SHUFFLE(3, 2, 3, 2));
    store_column<kWhole>(dst, ldd, nc, rows, j, _mm512_shuffle_i64x2(x0, x2, _MM_SHUFFLE(2, 0, 2, 0)));
    store_column<kWhole>(dst, ldd, nc, rows, 8 + j, _mm512_shuffle_i64x2(x0, x2, _MM_SHUFFLE(3, 1, 3, 1)));
    store_column<kWhole>(dst, ldd, nc, rows, 16 + j, _mm512_shuffle_i64x2(x1, x3, _MM_SHUFFLE(2, 0, 2, 0)));
    store_column<kWhole>(dst, ldd, nc, rows, 24 + j, _mm512_shuffle_i64x2(x1, x3, _MM_SHUFFLE(3, 1, 3, 1)));
  }
}

#endif

// The blocks of a rows x cols tile through the network, where the CPU has it.
template <class E>
bool transpose_by_blocks(const E* src, std::int64_t lds, std::int64_t rows, std::int64_t cols, bfloat16* dst,
                         std::int64_t ldd) {
#if defined(__x86_64__)
  if (!has_network()) return false;
  for (std::int64_t r = 0; r < rows; r += kBlock)
    for (std::int64_t c = 0; c < cols; c += kBlock)
      if (r + kBlock <= rows && c + kBlock <= cols)
        transpose_block<true>(src + r * lds + c, lds, kBlock, kBlock, dst + c * ldd + r, ldd);
      else
        transpose_block<false>(src + r * lds + c, lds, std::min(kBlock, rows - r), std::min(kBlock, cols - c),
                               dst + c * ldd + r, ldd);
  return true;
#else
  return false;
#endif
}

// vcvtneps2bf16's rounding of one float: bfloat16's own (nearest even, NaN quiet), but a subnormal input
// flushed to a zero of its sign first.
bfloat16 round_as_the_instruction(float x) {
  return bfloat16(std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x);
}

}  // namespace

void transpose_bf16(const bfloat16* src, std::int64_t lds, std::int64_t rows, std::int64_t cols, bfloat16* dst,
                    std::int64_t ldd) {
  if (transpose_by_blocks(src, lds, rows, cols, dst, ldd)) return;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
}

void transpose_rounding_to_bf16(const float* src, std::int64_t lds, std::int64_t rows, std::int64_t cols, bfloat16* dst,
                                std::int64_t ldd) {
  if (transpose_by_blocks(src, lds, rows, cols, dst, ldd)) return;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) dst[c * ldd + r] = round_as_the_instruction(src[r * lds + c]);
}

}  // namespace mha::detail
