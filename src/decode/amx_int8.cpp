// Decode over int8 pages on AMX tiles (amx_int8.hpp): the choice, the tile shapes, the digits and the
// products. The functions that touch tiles or AVX-512 carry their own target attribute (this file is
// compiled for the baseline ISA, so nothing else in it, nor any inline function it instantiates, may
// use instructions the machine lacks); they run only where int8_tiles() chose the tiles.
//
// Tile registers (palette 1), as TileConfig shapes them for heads of d_k = 64 H + tail:
//   0-3  int32 sums [16, 16]: four products at a time (four key tiles' logits, or four chunks of P V), so
//        that each product's latency hides behind the others'
//   4    [16, 64 bytes]: a key tile's 64 columns, or a group's weight digits [16, 64 keys]
//   5    [16, 64 bytes]: query digits for 64 columns [16 groups of 4 columns], or a value chunk [16 groups
//        of 4 keys, 16 columns x 4]
//   6, 7 a key tile's last d_k % 64 columns [16, tail] and their query digits [tail / 4, 64]
#include "decode/amx_int8.hpp"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace mha::detail::amx {

TileChoice choose_int8_tiles(const TileFacts& facts) {
  const std::string name = kDecodeAmxVariable;
  const bool off = facts.request == "off", on = facts.request == "on";
  const std::string why =
      facts.request && !off && !on ? "; " + name + "=\"" + *facts.request + "\" ignored: on or off" : "";
  if (off) return {false, "vectors (forced by " + name + "=off)"};
  if (!facts.cpu_has_amx_int8) return {false, "vectors (no AMX-INT8 on this CPU" + why + ")"};
  if (!facts.os_grants_tiles) return {false, "vectors (the OS does not grant the AMX tile state" + why + ")"};
  return {true, std::string("AMX tiles (") + (on ? "forced by " + name + "=on" : "the CPU has AMX-INT8" + why) + ")"};
}

namespace {

#if defined(__x86_64__)
bool cpu_has_amx_int8() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
  const bool avx512 = (ebx >> 16 & 1) && (ebx >> 17 & 1) && (ebx >> 30 & 1) && (ebx >> 31 & 1);  // F DQ BW VL
  return avx512 && (edx >> 24 & 1) && (edx >> 25 & 1);                                           // TILE INT8
}

// XCR0 enables the AVX-512 and tile states (bits 5-7, 17-18), and Linux lets this process use the tile
// data (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; granted once per process).
bool os_grants_tiles() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0 || !(ecx >> 27 & 1)) return false;  // OSXSAVE
  std::uint32_t xcr0_low = 0, xcr0_high = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  const std::uint32_t wanted = (7u << 5) | (3u << 17);
  if ((xcr0_low & wanted) != wanted) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}
#else
bool cpu_has_amx_int8() { return false; }
bool os_grants_tiles() { return false; }
#endif

}  // namespace

const TileChoice& int8_tiles() {
  static const TileChoice choice = [] {
    TileFacts facts;
    if (const char* value = std::getenv(kDecodeAmxVariable); value && *value) facts.request = value;
    facts.cpu_has_amx_int8 = cpu_has_amx_int8();
    facts.os_grants_tiles = facts.cpu_has_amx_int8 && facts.request != "off" && os_grants_tiles();
    return choose_int8_tiles(facts);
  }();
  return choice;
}

namespace {

constexpr std::int64_t round_up64(std::int64_t x) { return (x + 63) / 64 * 64; }
constexpr std::int64_t round_up4(std::int64_t x) { return (x + 3) / 4 * 4; }

std::int64_t groups_of(std::int64_t kv_heads, std::int64_t rows_per_head) {
  return kv_heads * ((rows_per_head + kGroupRows - 1) / kGroupRows);
}

}  // namespace

std::int64_t scratch_bytes(std::int64_t kv_heads, std::int64_t rows_per_head, std::int64_t d_k, std::int64_t d_v) {
  const std::int64_t groups = groups_of(kv_heads, rows_per_head);
  return groups * 16 * d_k + round_up64(groups * static_cast<std::int64_t>(sizeof(RowGroup))) + 64 * d_k +
         4 * 16 * 16 * 4 + 16 * 64 + 1024 * round_up4(d_v / 16);
}

Scratch carve_scratch(void* base, std::int64_t kv_heads, std::int64_t rows_per_head, std::int64_t d_k,
                      std::int64_t d_v) {
  const std::int64_t groups = groups_of(kv_heads, rows_per_head);
  auto* at = static_cast<std::int8_t*>(base);
  Scratch s;
  s.query_digits = at, at += groups * 16 * d_k;
  s.query_groups = reinterpret_cast<RowGroup*>(at),
  at += round_up64(groups * static_cast<std::int64_t>(sizeof(RowGroup)));
  s.keys = at, at += 64 * d_k;
  s.sums = reinterpret_cast<std::int32_t*>(at), at += 4 * 16 * 16 * 4;
  s.weights = reinterpret_cast<std::uint8_t*>(at), at += 16 * 64;
  s.values = at;  // [d_v / 16][16][64], and up to 3 chunks of zeros that accumulate_values multiplies too
  std::memset(s.values + 1024 * (d_v / 16), 0, static_cast<std::size_t>(1024 * (round_up4(d_v / 16) - d_v / 16)));
  return s;
}

void gather_key_tile(const std::int8_t* const* k_rows, std::int64_t n, std::int64_t d_k, std::int8_t* tile) {
  for (std::int64_t j = 0; j < kTileKeys; ++j) {
    if (j < n) std::memcpy(tile + j * d_k, k_rows[j], static_cast<std::size_t>(d_k));
    else std::memset(tile + j * d_k, 0, static_cast<std::size_t>(d_k));
  }
}

namespace {

// The power of two 2^e just above m > 0 (m < 2^e), as e; m must be finite.
int exponent_above(double m) { return std::ilogb(m) + 1; }

// Whether a row with largest magnitude m goes on the tiles (m = 0 does: it is all zeros; NaN does not).
bool representable(double m) { return m == 0.0 || (m >= 0x1p-60 && m <= 0x1p60); }

}  // namespace

#if defined(__x86_64__)

// GCC 12 warns that the intrinsics' own _mm512_undefined_* may be used uninitialized when they are
// inlined into a function of a wider target than the file's: a false positive of its headers.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define MHA_AMX_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq")))

namespace {

struct alignas(64) TileShapes {
  std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};
static_assert(sizeof(TileShapes) == 64);

// The compiler does not know what the tile instructions read: make every store before them visible.
inline void memory_barrier() { __asm__ volatile("" ::: "memory"); }

// The largest magnitude of row[0 .. n) (n a multiple of 16), or NaN where an element is NaN or infinite:
// what representable() judges a query or weight row by.
MHA_AMX_TARGET float largest_magnitude(const float* row, std::int64_t n) {
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __m512 infinity = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __m512 m = _mm512_setzero_ps();
  __mmask16 not_finite = 0;
  for (std::int64_t c = 0; c < n; c += 16) {
    const __m512 x = _mm512_and_ps(_mm512_loadu_ps(row + c), magnitude);
    not_finite |= _mm512_cmp_ps_mask(x, infinity, _CMP_NLT_UQ);  // Inf or NaN
    m = _mm512_max_ps(m, x);
  }
  return not_finite != 0 ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(m);
}

// Row r of a group, row[0 .. n), to be written as integers of `bits` bits: marks it tiled in `group` where
// representable() takes it and sets its unscale 2^(e - bits) (2^e > its largest magnitude); returns the
// factor 2^(bits - e) that makes its integers (exact: |x 2^(bits - e)| < 2^bits), or 0 where it writes no
// digits (a row of zeros, tiled; or one left to the vector kernel).
MHA_AMX_TARGET float tile_row_scale(const float* row, std::int64_t n, int r, int bits, RowGroup& group) {
  const float largest = largest_magnitude(row, n);
  if (!representable(largest)) return 0.0f;
  group.tiled |= 1u << r;
  if (largest == 0.0f) return 0.0f;
  const int e = exponent_above(largest);
  group.unscale[r] = std::ldexp(1.0f, e - bits);
  return std::ldexp(1.0f, bits - e);
}

}  // namespace

TileConfig::TileConfig(std::int64_t d_k) {
  const auto tail = static_cast<std::uint16_t>(d_k % 64);
  TileShapes shapes;
  for (int t = 0; t < 6; ++t) shapes.colsb[t] = 64, shapes.rows[t] = 16;
  if (tail > 0) {
    shapes.colsb[6] = tail, shapes.rows[6] = 16;
    shapes.colsb[7] = 64, shapes.rows[7] = static_cast<std::uint8_t>(tail / 4);
  }
  __asm__ volatile("ldtilecfg %0" ::"m"(shapes));  // _tile_loadconfig, which GCC 12 will not inline into a constructor
}

TileConfig::~TileConfig() { __asm__ volatile("tilerelease" ::); }  // _tile_release, likewise

MHA_AMX_TARGET RowGroup query_digits(const float* q, std::int64_t ld_q, int rows, std::int64_t d_k,
                                     std::int8_t* digits) {
  RowGroup group{{0.0f, 0.0f, 0.0f, 0.0f}, 0u};
  std::memset(digits, 0, static_cast<std::size_t>(16 * d_k));
  for (int r = 0; r < rows; ++r) {
    const float* row = q + r * ld_q;
    const float scale = tile_row_scale(row, d_k, r, 30, group);  // |q 2^(30-e)| < 2^30
    if (scale == 0.0f) continue;                                 // digits 0
    const __m512 up = _mm512_set1_ps(scale);
    for (std::int64_t c = 0; c < d_k; c += 16) {
      // Four signed base-256 digits, the lowest first: d = the low byte sign-extended, v = (v - d) / 256.
      __m512i v = _mm512_cvt_roundps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + c), up),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      for (int k = 0; k < 4; ++k) {
        const __m512i digit = _mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24);
        v = _mm512_srai_epi32(_mm512_sub_epi32(v, digit), 8);
        alignas(16) std::int32_t words[4];  // the digit of columns c + 4 i .. c + 4 i + 3, one word each
        _mm_store_si128(reinterpret_cast<__m128i*>(words), _mm512_cvtepi32_epi8(digit));
        for (int i = 0; i < 4; ++i) std::memcpy(digits + (c / 4 + i) * 64 + 4 * (4 * k + r), &words[i], 4);
      }
    }
  }
  return group;
}

// The four sums tiles 0-3 += A_i B: A_i (tile a) loaded from a_base(i), B in tile b; tile numbers are
// immediates, hence the macros.
#define MHA_AMX_PRODUCTS(dp, a, a_base, a_stride, b) \
  _tile_loadd(a, a_base(0), a_stride);               \
  dp(0, a, b);                                       \
  _tile_loadd(a, a_base(1), a_stride);               \
  dp(1, a, b);                                       \
  _tile_loadd(a, a_base(2), a_stride);               \
  dp(2, a, b);                                       \
  _tile_loadd(a, a_base(3), a_stride);               \
  dp(3, a, b)
#define MHA_AMX_ZERO_SUMS() \
  _tile_zero(0);            \
  _tile_zero(1);            \
  _tile_zero(2);            \
  _tile_zero(3)
#define MHA_AMX_STORE_SUMS(sums)     \
  _tile_stored(0, (sums), 64);       \
  _tile_stored(1, (sums) + 256, 64); \
  _tile_stored(2, (sums) + 512, 64); \
  _tile_stored(3, (sums) + 768, 64)

MHA_AMX_TARGET void key_block_dots(const std::int8_t* const* keys, std::int64_t stride, std::int64_t d_k,
                                   const std::int8_t* digits, const RowGroup& group, int rows, float* dots,
                                   std::int64_t ld_dots, std::int32_t* sums, LinesAhead* ahead) {
  memory_barrier();
  MHA_AMX_ZERO_SUMS();
  const std::int64_t whole = d_k / 64;
  for (std::int64_t h = 0; h < whole; ++h) {  // 64 columns of the keys and 16 groups of 4 of the digits
    _tile_loadd(5, digits + 1024 * h, 64);
#define MHA_KEYS(i) (keys[i] + 64 * h)
    MHA_AMX_PRODUCTS(_tile_dpbssd, 4, MHA_KEYS, stride, 5);
#undef MHA_KEYS
  }
  if (d_k % 64 != 0) {  // the last d_k % 64 columns: tiles 6 and 7 have their shapes
    _tile_loadd(7, digits + 1024 * whole, 64);
#define MHA_KEYS(i) (keys[i] + 64 * whole)
    MHA_AMX_PRODUCTS(_tile_dpbssd, 6, MHA_KEYS, stride, 7);
#undef MHA_KEYS
  }
  MHA_AMX_STORE_SUMS(sums);
  // sums [64 keys][16 columns], column 4 k + r: digit k of row r. Per key, the columns times 2^(8 k)
  // (exact), then per row (c0 + c2) + (c1 + c3) over the 128-bit blocks, four keys per vector:
  // by_key[q] lanes 4 i + r = key 4 q + i, row r. Then transposed to rows, 16 keys at a time: first
  // rows (r, r + 1) of keys 0-7 and 8-15 (pair), then split (halves).
  const __m512 powers = _mm512_set_ps(0x1p24f, 0x1p24f, 0x1p24f, 0x1p24f, 0x1p16f, 0x1p16f, 0x1p16f, 0x1p16f, 0x1p8f,
                                      0x1p8f, 0x1p8f, 0x1p8f, 1.0f, 1.0f, 1.0f, 1.0f);
  const __m512i pair[2] = {_mm512_set_epi32(29, 25, 21, 17, 13, 9, 5, 1, 28, 24, 20, 16, 12, 8, 4, 0),
                           _mm512_set_epi32(31, 27, 23, 19, 15, 11, 7, 3, 30, 26, 22, 18, 14, 10, 6, 2)};
  const __m512i halves[2] = {_mm512_set_epi32(23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0),
                             _mm512_set_epi32(31, 30, 29, 28, 27, 26, 25, 24, 15, 14, 13, 12, 11, 10, 9, 8)};
  for (int t = 0; t < 4; ++t) {
    if (ahead) ahead->issue_until(0.08 * (t + 1));
    __m512 by_key[4];
    for (int q = 0; q < 4; ++q) {
      __m512 f[4];
      for (int i = 0; i < 4; ++i)
        f[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(sums + 256 * t + 16 * (4 * q + i))), powers);
      const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(f[0], f[1], 0x44), _mm512_shuffle_f32x4(f[0], f[1], 0xEE));
      const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(f[2], f[3], 0x44), _mm512_shuffle_f32x4(f[2], f[3], 0xEE));
      by_key[q] = _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
    }
    for (int r = 0; r < rows; r += 2) {
      const __m512 low = _mm512_permutex2var_ps(by_key[0], pair[r / 2], by_key[1]);   // row r keys 0-7 | r+1 0-7
      const __m512 high = _mm512_permutex2var_ps(by_key[2], pair[r / 2], by_key[3]);  // the same for keys 8-15
      for (int k = 0; k < 2 && r + k < rows; ++k) {
        const __m512 row = _mm512_permutex2var_ps(low, halves[k], high);
        const bool tiled = (group.tiled >> (r + k) & 1) != 0;
        _mm512_storeu_ps(dots + (r + k) * ld_dots + 16 * t,
                         tiled ? _mm512_mul_ps(row, _mm512_set1_ps(group.unscale[r + k])) : _mm512_setzero_ps());
      }
    }
  }
}

MHA_AMX_TARGET void value_tiles(const std::int8_t* const* v_rows, std::int64_t kb, std::int64_t d_v,
                                std::int8_t* values, LinesAhead& ahead, double from, double to) {
  // Per 4 keys and 64 columns: each row's 32-bit words transposed 4 x 4 (block b of the row then holds
  // columns 4 b .. 4 b + 3, 16 + 4 b .., 32 + 4 b .., 48 + 4 b ..), then the bytes of the four rows
  // interleaved by two unpack rounds, which leaves columns 16 k .. 16 k + 15 in output k, key-minor.
  const __m512i transpose = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  for (std::int64_t g = 0; g < kBlockKeys / 4; ++g) {
    ahead.issue_until(from + (to - from) * static_cast<double>(g + 1) / (kBlockKeys / 4));
    for (std::int64_t c0 = 0; c0 < d_v; c0 += 64) {
      const std::int64_t width = d_v - c0 < 64 ? d_v - c0 : 64;
      const __mmask64 mask = width == 64 ? ~__mmask64{0} : (__mmask64{1} << width) - 1;
      __m512i r[4];
      for (int i = 0; i < 4; ++i) {
        const std::int64_t j = 4 * g + i;
        r[i] = j < kb ? _mm512_permutexvar_epi32(transpose, _mm512_maskz_loadu_epi8(mask, v_rows[j] + c0))
                      : _mm512_setzero_si512();
      }
      const __m512i a = _mm512_unpacklo_epi8(r[0], r[1]), b = _mm512_unpackhi_epi8(r[0], r[1]);
      const __m512i c = _mm512_unpacklo_epi8(r[2], r[3]), d = _mm512_unpackhi_epi8(r[2], r[3]);
      const __m512i out[4] = {_mm512_unpacklo_epi16(a, c), _mm512_unpackhi_epi16(a, c), _mm512_unpacklo_epi16(b, d),
                              _mm512_unpackhi_epi16(b, d)};
      for (std::int64_t k = 0; k < width / 16; ++k) _mm512_storeu_si512(values + (c0 / 16 + k) * 1024 + g * 64, out[k]);
    }
  }
}

MHA_AMX_TARGET RowGroup weight_digits(const float* p, std::int64_t ld_p, int rows, std::uint8_t* weights) {
  RowGroup group{{0.0f, 0.0f, 0.0f, 0.0f}, 0u};
  std::memset(weights, 0, 16 * 64);
  for (int r = 0; r < rows; ++r) {
    const float* row = p + r * ld_p;
    const float scale = tile_row_scale(row, kBlockKeys, r, 31, group);  // 0 <= p 2^(31-e) < 2^31
    if (scale == 0.0f) continue;                                        // digits 0
    const __m512 up = _mm512_set1_ps(scale);
    for (int q = 0; q < 4; ++q) {
      const __m512i v = _mm512_cvt_roundps_epu32(_mm512_mul_ps(_mm512_loadu_ps(row + 16 * q), up),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      for (int k = 0; k < 4; ++k)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(weights + (4 * k + r) * 64 + 16 * q),
                         _mm512_cvtepi32_epi8(_mm512_srli_epi32(v, 8 * k)));
    }
  }
  return group;
}

MHA_AMX_TARGET void accumulate_values(const std::uint8_t* weights, const RowGroup& group, int rows,
                                      const std::int8_t* values, std::int64_t d_v, float* acc, std::int64_t ld_acc,
                                      std::int32_t* sums, LinesAhead& ahead, double from, double to) {
  memory_barrier();
  _tile_loadd(4, weights, 64);
  const std::int64_t chunks = d_v / 16;
  const __m512 p8 = _mm512_set1_ps(0x1p8f), p16 = _mm512_set1_ps(0x1p16f);
  for (std::int64_t c0 = 0; c0 < chunks; c0 += 4) {  // four chunks of 16 columns (past d_v: not read)
    ahead.issue_until(from + (to - from) * static_cast<double>(std::min(c0 + 4, chunks)) / static_cast<double>(chunks));
    MHA_AMX_ZERO_SUMS();
    _tile_loadd(5, values + 1024 * c0, 64);  // sums c0 + i += the weight digits' products with chunk c0 + i
    _tile_dpbusd(0, 4, 5);
    _tile_loadd(5, values + 1024 * (c0 + 1), 64);
    _tile_dpbusd(1, 4, 5);
    _tile_loadd(5, values + 1024 * (c0 + 2), 64);
    _tile_dpbusd(2, 4, 5);
    _tile_loadd(5, values + 1024 * (c0 + 3), 64);
    _tile_dpbusd(3, 4, 5);
    MHA_AMX_STORE_SUMS(sums);
    for (std::int64_t c = c0; c < d_v / 16 && c < c0 + 4; ++c)
      for (int r = 0; r < rows; ++r) {
        if ((group.tiled >> r & 1) == 0 || group.unscale[r] == 0.0f) continue;
        const std::int32_t* chunk = sums + 256 * (c - c0);
        __m512 k[4];
        for (int i = 0; i < 4; ++i) k[i] = _mm512_cvtepi32_ps(_mm512_loadu_si512(chunk + 16 * (4 * i + r)));
        const __m512 s = _mm512_fmadd_ps(_mm512_fmadd_ps(k[3], p16, k[1]), p8, _mm512_fmadd_ps(k[2], p16, k[0]));
        float* out = acc + r * ld_acc + 16 * c;
        _mm512_storeu_ps(out, _mm512_fmadd_ps(s, _mm512_set1_ps(group.unscale[r]), _mm512_loadu_ps(out)));
      }
  }
}

#else  // not x86-64: int8_tiles() never chooses the tiles, so none of these runs

TileConfig::TileConfig(std::int64_t) {}
TileConfig::~TileConfig() {}
void key_block_dots(const std::int8_t* const*, std::int64_t, std::int64_t, const std::int8_t*, const RowGroup&, int,
                    float*, std::int64_t, std::int32_t*, LinesAhead*) {}
void value_tiles(const std::int8_t* const*, std::int64_t, std::int64_t, std::int8_t*, LinesAhead&, double, double) {}
RowGroup query_digits(const float*, std::int64_t, int, std::int64_t, std::int8_t*) { return {{}, 0u}; }
RowGroup weight_digits(const float*, std::int64_t, int, std::uint8_t*) { return {{}, 0u}; }
void accumulate_values(const std::uint8_t*, const RowGroup&, int, const std::int8_t*, std::int64_t, float*,
                       std::int64_t, std::int32_t*, LinesAhead&, double, double) {}

#endif

}  // namespace mha::detail::amx
