// transpose_bf16 (bf16_transpose.hpp): blocks of up to 32 x 32 16-bit elements by AVX-512BW shuffles, the edges'
// by masked loads and stores (compiled for that instruction set alone, a function attribute, called only where
// the CPU reports it); element by element elsewhere.
#include "attention/bf16_transpose.hpp"

#include <algorithm>
#include <cstdint>

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

bool has_avx512bw() {
  static const bool has = __builtin_cpu_supports("avx512bw");  // includes the OS's AVX-512 state
  return has;
}

// Row `column` of dst's block, its first rows elements (a mask), if the block has that column.
template <bool kWhole>
__attribute__((target("avx512f,avx512bw"))) inline void store_column(bfloat16* dst, std::int64_t ldd, std::int64_t nc,
                                                                     __mmask32 rows, std::int64_t column, __m512i x) {
  if (kWhole) _mm512_storeu_si512(dst + column * ldd, x);
  else if (column < nc) _mm512_mask_storeu_epi16(dst + column * ldd, rows, x);
}

// One block of up to 32 x 32: src rows a[0, nr) (nc elements each; the rest of the 32 x 32 read as zeros)
// to dst rows [0, nc) (nr elements each; nothing else written). kWhole: nr = nc = 32, without masks.
//   1. Each group of 8 rows is transposed inside every 128-bit lane (3 rounds of unpacks, 16-, 32- and
//      64-bit): v[g][j] lane L = column 8 L + j, rows 8 g .. 8 g + 7.
//   2. Column 8 L + j is lane L of v[0][j], v[1][j], v[2][j], v[3][j]: a 4 x 4 transpose of 128-bit lanes.
template <bool kWhole>
__attribute__((target("avx512f,avx512bw"))) void transpose_block(const bfloat16* src, std::int64_t lds, std::int64_t nr,
                                                                 std::int64_t nc, bfloat16* dst, std::int64_t ldd) {
  const __mmask32 columns = static_cast<__mmask32>((std::uint64_t{1} << nc) - 1);
  const __mmask32 rows = static_cast<__mmask32>((std::uint64_t{1} << nr) - 1);
  __m512i v[4][8];
  for (int g = 0; g < 4; ++g) {
    __m512i a[8], t[8], u[8];
    for (int i = 0; i < 8; ++i)
      a[i] = kWhole           ? _mm512_loadu_si512(src + (8 * g + i) * lds)
             : 8 * g + i < nr ? _mm512_maskz_loadu_epi16(columns, src + (8 * g + i) * lds)
                              : _mm512_setzero_si512();
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

}  // namespace

void transpose_bf16(const bfloat16* src, std::int64_t lds, std::int64_t rows, std::int64_t cols, bfloat16* dst,
                    std::int64_t ldd) {
#if defined(__x86_64__)
  if (has_avx512bw()) {
    for (std::int64_t r = 0; r < rows; r += kBlock)
      for (std::int64_t c = 0; c < cols; c += kBlock)
        if (r + kBlock <= rows && c + kBlock <= cols)
          transpose_block<true>(src + r * lds + c, lds, kBlock, kBlock, dst + c * ldd + r, ldd);
        else
          transpose_block<false>(src + r * lds + c, lds, std::min(kBlock, rows - r), std::min(kBlock, cols - c),
                                 dst + c * ldd + r, ldd);
    return;
  }
#endif
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
}

}  // namespace mha::detail
