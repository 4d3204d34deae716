// Per-target row operations of the decode kernel (decode_kernel.cpp), float32 arithmetic on float32,
// bfloat16, int8 or float8 e4m3 keys and values (widened in registers; a quantized row's scale is
// applied once to its logit and once to its weight, never to a dequantized copy): the logits of a block
// of keys for the R query rows of a work item, the online softmax over them, and acc += P V for the
// block.
//
// Every row is computed alone, in the same order whichever rows share its tile, so a row's result does
// not depend on how many rows the item holds (group-packed and per-head items agree bitwise).
//
// Legend: R rows of a work item, kb keys in a block (<= kKeyBlock), d_k, d_v, ld row strides.
//
// Included once per SIMD target through Highway's foreach_target.h.
#if defined(MHA_DECODE_ROWS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_DECODE_ROWS_INL_H_
#undef MHA_DECODE_ROWS_INL_H_
#else
#define MHA_DECODE_ROWS_INL_H_
#endif

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "attention/online_softmax-inl.h"  // ExpKeepNaN
#include "attention/online_softmax.hpp"
#include "bf16_lanes-inl.h"
#include "decode/decode_driver.hpp"  // for_each_page_run
#include "decode/decode_params.hpp"
#include "decode/prefetch_rows-inl.h"
#include "decode/split_kv.hpp"
#include "hwy/highway.h"
#include "mha/bfloat16.hpp"

HWY_BEFORE_NAMESPACE();
namespace mha::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using decode::kKeyBlock;

// LoadWidened for float32 and bfloat16 rows: bf16_lanes-inl.h. int8 widened exactly.
template <class D>
HWY_INLINE hn::Vec<D> LoadWidened(D d, const std::int8_t* HWY_RESTRICT p) {
  const hn::RebindToSigned<D> di;
  const hn::Rebind<std::int8_t, D> di8;
  return hn::ConvertTo(d, hn::PromoteTo(di, hn::LoadU(di8, p)));
}
// float8 e4m3 widened exactly, as its value times 2^-8 (kWidenedUnit: the key and value scales carry the
// 2^8, so logit and weight come out bitwise as with the value itself; a power of two commutes with every
// rounding). The bits s e m, sign-extended to 16 bits and shifted left by 7, placed as the float16
// s 0 e m 0000000: a normal e4m3 becomes a normal float16 with exponent e - 15, a subnormal m 2^-9 the
// float16 subnormal m 2^-17, which converts exactly to float32 (the F16C conversion reads float16
// subnormals whatever the DAZ flag). Four instructions a vector, as int8's two. The NaN pattern
// S.1111.111 is never stored (quantize.hpp: finite rows saturate at 448; a row that is not finite is
// stored as zeros with a NaN scale, which the scale carries into its logit and weight).
//
// E4M3AsFloat16 places the bits as float16 (all but the conversion), for any number of lanes (di16's).
template <class DI16>
HWY_INLINE auto E4M3AsFloat16(DI16 di16, const Float8E4M3* HWY_RESTRICT p) {
  const hn::Rebind<std::int8_t, DI16> di8;
  const hn::Repartition<hwy::float16_t, DI16> df16;
  const auto wide = hn::PromoteTo(di16, hn::LoadU(di8, reinterpret_cast<const std::int8_t*>(&p->bits)));
  return hn::BitCast(df16, hn::And(hn::ShiftLeft<7>(wide), hn::Set(di16, static_cast<std::int16_t>(0xBF80))));
}
template <class D>
HWY_INLINE hn::Vec<D> LoadWidened(D d, const Float8E4M3* HWY_RESTRICT p) {
  return hn::PromoteTo(d, E4M3AsFloat16(hn::Rebind<std::int16_t, D>(), p));
}

// Two vectors of float lanes from 2N elements, p [0, N) and p [N, 2N): LoadWidened twice, but for float8
// e4m3, whose 2N payloads are sign-extended, shifted and masked as one vector of int16 (three
// instructions for both halves instead of six), then converted half by half. The same lanes as
// LoadWidened's.
template <class D, class T>
HWY_INLINE void LoadWidenedPair(D d, const T* HWY_RESTRICT p, hn::Vec<D>& low, hn::Vec<D>& high) {
  low = LoadWidened(d, p);
  high = LoadWidened(d, p + hn::Lanes(d));
}
#if HWY_TARGET != HWY_SCALAR && HWY_TARGET != HWY_EMU128
template <class D>
HWY_INLINE void LoadWidenedPair(D d, const Float8E4M3* HWY_RESTRICT p, hn::Vec<D>& low, hn::Vec<D>& high) {
  const hn::Repartition<std::int16_t, D> di16;            // 2N lanes
  const hn::Half<hn::Repartition<hwy::float16_t, D>> dh;  // N lanes
  const auto half = E4M3AsFloat16(di16, p);
  low = hn::PromoteTo(d, hn::LowerHalf(dh, half));
  high = hn::PromoteTo(d, hn::UpperHalf(dh, half));
}
#endif

// What one lane of LoadWidened holds for an element x, for the scalar tails: x itself but for float8
// e4m3, x times 2^-8 (exact: the smallest e4m3, 2^-9, becomes 2^-17).
template <class T>
inline constexpr float kWidenedUnit = std::is_same_v<T, Float8E4M3> ? 256.0f : 1.0f;
template <class T>
HWY_INLINE float WidenedScalar(T x) {
  return static_cast<float>(x) * (1.0f / kWidenedUnit<T>);
}

// Register tiles: rows of queries (or of weights) x keys (or value columns) whose products are all
// independent accumulators, so that no FMA waits on the one before it. Wide enough to hide the FMA's
// latency, small enough for the registers: 32 vector registers with AVX-512, 16 below.
inline constexpr int kTileRows = HWY_TARGET <= HWY_AVX3 ? 4 : 2;  // query rows of a logits or P V tile
inline constexpr int kTileKeys = 4;                               // keys of a logits tile
inline constexpr int kTileCols = 4;                               // vectors of value columns of a P V tile

// The lane sums of the accumulators a [kRows x 4] (row r, key j at a[4 r + j]) into dots [kRows, ld_dots]:
// per 128-bit block, two interleaving adds leave [sum a_r0, sum a_r1, sum a_r2, sum a_r3] of the
// block's lanes ((l0 + l2) + (l1 + l3)), and the blocks are added in order. Every (row, key) goes
// through the same tree whichever tile holds it, so its sum does not depend on its neighbours.
#if HWY_TARGET == HWY_SCALAR  // one lane: nothing to interleave
template <int kRows, class D, class V>
HWY_INLINE void ReduceDots(D /* one lane */, const V* a, float* HWY_RESTRICT dots, std::int64_t ld_dots) {
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < 4; ++j) dots[r * ld_dots + j] = hn::GetLane(a[4 * r + j]);
}
#else
template <int kRows, class D, class V>
HWY_INLINE void ReduceDots(D d, const V* a, float* HWY_RESTRICT dots, std::int64_t ld_dots) {
  const hn::Repartition<double, D> dd;  // pairs of floats moved as one 64-bit lane
  const hn::Full128<float> d4;
  const std::size_t N = hn::Lanes(d);
  HWY_ALIGN float lanes[hn::MaxLanes(d)];
  for (int r = 0; r < kRows; ++r) {
    const V* t = a + 4 * r;
    const V s01 = hn::Add(hn::InterleaveLower(d, t[0], t[1]), hn::InterleaveUpper(d, t[0], t[1]));
    const V s23 = hn::Add(hn::InterleaveLower(d, t[2], t[3]), hn::InterleaveUpper(d, t[2], t[3]));
    const auto x = hn::BitCast(dd, s01), y = hn::BitCast(dd, s23);
    hn::Store(hn::Add(hn::BitCast(d, hn::InterleaveLower(dd, x, y)), hn::BitCast(d, hn::InterleaveUpper(dd, x, y))), d,
              lanes);
    auto sum = hn::Load(d4, lanes);
    for (std::size_t block = 4; block < N; block += 4) sum = hn::Add(sum, hn::Load(d4, lanes + block));
    hn::StoreU(sum, d4, dots + r * ld_dots);
  }
}
#endif

// dots [kRows, ld_dots] (4 columns) = q_r . k_j for query rows q [kRows, ld_q] and the 4 key rows k[j]
// [d_k]: each (row, key) a vector sum over whole vectors, reduced (ReduceDots), plus its scalar tail.
template <int kRows, class T>
HWY_INLINE void DotTile(const float* HWY_RESTRICT q, std::int64_t ld_q, const T* const* k, std::int64_t d_k,
                        float* HWY_RESTRICT dots, std::int64_t ld_dots) {
  const hn::ScalableTag<float> d;
  using V = hn::Vec<decltype(d)>;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d)), whole = d_k - d_k % N;
  V a[4 * kRows];
  for (int i = 0; i < 4 * kRows; ++i) a[i] = hn::Zero(d);
  // a[4 r + j] += q_r [c0, c0 + N) * the four keys' widened lanes there.
  const auto multiply_add = [&](std::int64_t c0, V k0, V k1, V k2, V k3) HWY_ATTR {
    for (int r = 0; r < kRows; ++r) {
      const V qr = hn::Load(d, q + r * ld_q + c0);
      a[4 * r] = hn::MulAdd(qr, k0, a[4 * r]);
      a[4 * r + 1] = hn::MulAdd(qr, k1, a[4 * r + 1]);
      a[4 * r + 2] = hn::MulAdd(qr, k2, a[4 * r + 2]);
      a[4 * r + 3] = hn::MulAdd(qr, k3, a[4 * r + 3]);
    }
  };
  std::int64_t c = 0;
  constexpr bool kPairs = std::is_same_v<T, Float8E4M3>;  // widened two vectors at a time (LoadWidenedPair)
  for (; kPairs && c + 2 * N <= whole; c += 2 * N) {      // the same multiply-adds, in the same order
    V k0[2], k1[2], k2[2], k3[2];
    LoadWidenedPair(d, k[0] + c, k0[0], k0[1]);
    LoadWidenedPair(d, k[1] + c, k1[0], k1[1]);
    LoadWidenedPair(d, k[2] + c, k2[0], k2[1]);
    LoadWidenedPair(d, k[3] + c, k3[0], k3[1]);
    for (int h = 0; h < 2; ++h) multiply_add(c + h * N, k0[h], k1[h], k2[h], k3[h]);
  }
  for (; c < whole; c += N)
    multiply_add(c, LoadWidened(d, k[0] + c), LoadWidened(d, k[1] + c), LoadWidened(d, k[2] + c),
                 LoadWidened(d, k[3] + c));
  ReduceDots<kRows>(d, a, dots, ld_dots);
  if (whole == d_k) return;
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < 4; ++j) {
      float tail = 0.0f;
      for (std::int64_t c = whole; c < d_k; ++c) tail += q[r * ld_q + c] * WidenedScalar(k[j][c]);
      dots[r * ld_dots + j] += tail;
    }
}

// Quantized pages: the scales of positions [t0, t0 + kb) of kv head `head` of sequence s as the kernel
// applies them, logit_scales[j] = scale (kWidenedUnit key_scale_j) and value_scales[j] = kWidenedUnit
// value_scale_j (the rows are widened as x / kWidenedUnit); past kb, scale and 0. A page's run of rows
// is copied by whole vectors (a page of 16 rows in one with AVX-512), then element by element.
template <class T>
HWY_INLINE void GatherBlockScales(const DecodeParams<T, float>& p, std::int64_t s, std::int64_t head, std::int64_t t0,
                                  std::int64_t kb, float* HWY_RESTRICT logit_scales, float* HWY_RESTRICT value_scales) {
  const hn::ScalableTag<float> d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const float unit = kWidenedUnit<T>;
  const auto vunit = hn::Set(d, unit), vscale = hn::Set(d, p.scale);
  decode::for_each_page_run(p, s, t0, kb, [&](std::size_t page, std::int64_t row, std::int64_t rows, std::int64_t j) {
    const float* k = p.k_scale_pages[page] + head * p.page_size + row;
    const float* v = p.v_scale_pages[page] + head * p.page_size + row;
    std::int64_t i = 0;
    for (; i + N <= rows; i += N) {
      hn::StoreU(hn::Mul(vscale, hn::Mul(vunit, hn::LoadU(d, k + i))), d, logit_scales + j + i);
      hn::StoreU(hn::Mul(vunit, hn::LoadU(d, v + i)), d, value_scales + j + i);
    }
    for (; i < rows; ++i) logit_scales[j + i] = p.scale * (unit * k[i]), value_scales[j + i] = unit * v[i];
  });
  for (std::int64_t j = kb; j < kKeyBlock; ++j) logit_scales[j] = p.scale, value_scales[j] = 0.0f;
}

// s [R, kKeyBlock] from the dots in its columns j < kb: times logit_scales[j], and -inf where a row may not
// see key j (j >= visible[r]) and in the padding (j >= kb, whose columns are not read: they may hold
// anything, numbers of an earlier block or memory never written).
inline void ScaleAndMaskLogits(float* HWY_RESTRICT s, std::int64_t R, const float* HWY_RESTRICT logit_scales,
                               const std::int64_t* visible, std::int64_t kb) {
  const hn::ScalableTag<float> d;
  const hn::RebindToSigned<decltype(d)> di;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const auto minus_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
  for (std::int64_t r = 0; r < R; ++r) {
    const auto limit = hn::Set(di, static_cast<std::int32_t>(std::clamp<std::int64_t>(visible[r], 0, kb)));
    float* row = s + r * kKeyBlock;
    for (std::int64_t j = 0; j < kKeyBlock; j += N) {
      const auto seen = hn::RebindMask(d, hn::Lt(hn::Iota(di, static_cast<std::int32_t>(j)), limit));
      const auto dots = hn::MaskedLoad(seen, d, row + j);
      hn::Store(hn::IfThenElse(seen, hn::Mul(dots, hn::Load(d, logit_scales + j)), minus_inf), d, row + j);
    }
  }
}

// s [R, kKeyBlock] = logit_scales[j] q k_j for keys j < kb (logit_scales: the scale, times the key row's
// own for quantized rows; GatherBlockScales), -inf where a row may not see key j (j >= visible[r]) and in
// the padding up to kKeyBlock. The dots by tiles of kTileRows rows x 4 keys (the keys past kb read key
// kb - 1 again; their logits become -inf), then scaled and masked row by row. Meanwhile prefetches the
// rows ahead.
template <class T>
void BlockLogits(const float* HWY_RESTRICT q, std::int64_t ld_q, std::int64_t R, const T* const* k_rows,
                 std::int64_t kb, std::int64_t d_k, const float* HWY_RESTRICT logit_scales, const std::int64_t* visible,
                 const RowsAhead<T>& ahead, float* HWY_RESTRICT s) {
  static_assert(kKeyBlock % kTileKeys == 0, "a block holds whole key tiles");
  for (std::int64_t j0 = 0; j0 < kb; j0 += kTileKeys) {
    const T* k[kTileKeys];
    for (std::int64_t j = 0; j < kTileKeys; ++j) k[j] = k_rows[std::min(j0 + j, kb - 1)];
    const std::int64_t ahead_here = std::min<std::int64_t>(kTileKeys, ahead.count - j0);  // may be <= 0
    PrefetchRowPairs(ahead.k + j0, ahead.v + j0, ahead_here, ahead.k_bytes, ahead.v_bytes, ahead.level);
    std::int64_t r = 0;
    for (; r + kTileRows <= R; r += kTileRows)
      DotTile<kTileRows>(q + r * ld_q, ld_q, k, d_k, s + r * kKeyBlock + j0, kKeyBlock);
    for (; r < R; ++r) DotTile<1>(q + r * ld_q, ld_q, k, d_k, s + r * kKeyBlock + j0, kKeyBlock);
  }
  if (ahead.count > kb)  // the rows ahead past this block's keys
    PrefetchRowPairs(ahead.k + kb, ahead.v + kb, ahead.count - kb, ahead.k_bytes, ahead.v_bytes, ahead.level);
  ScaleAndMaskLogits(s, R, logit_scales, visible, kb);
}

// The online softmax over one block: for each row, m' = max(m, max_j s_j) (NaN if any is NaN),
// s_j = exp(s_j - m') in place (0 for -inf), l = a l + sum_j s_j and acc = a acc with a = exp(m - m').
// A row that has seen only -inf so far keeps m = -inf, l = 0 and weights 0.
inline void BlockOnlineSoftmax(float* HWY_RESTRICT s, std::int64_t R, float* m, float* l, float* HWY_RESTRICT acc,
                               std::int64_t ld_acc) {
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  const hn::ScalableTag<float> d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  static_assert(kKeyBlock % 16 == 0, "logits rows must hold whole vectors");
  for (std::int64_t r = 0; r < R; ++r) {
    float* row = s + r * kKeyBlock;
    auto vmax = hn::Set(d, kMinusInf);
    auto nan = hn::Lt(vmax, vmax);  // all false
    for (std::int64_t j = 0; j < kKeyBlock; j += N) {
      const auto x = hn::Load(d, row + j);
      vmax = hn::Max(vmax, x);
      nan = hn::Or(nan, hn::IsNaN(x));
    }
    const float block_max =
        hn::AllFalse(d, nan) ? hn::GetLane(hn::MaxOfLanes(d, vmax)) : std::numeric_limits<float>::quiet_NaN();
    const OnlineSoftmaxStep<float> step = online_softmax_step(m[r], block_max);  // online_softmax.hpp's rule
    if (step.no_weight) {                                                        // nothing with weight yet
      for (std::int64_t j = 0; j < kKeyBlock; ++j) row[j] = 0.0f;
      continue;
    }
    const auto vm = hn::Set(d, step.m_new);
    auto sum = hn::Zero(d);
    for (std::int64_t j = 0; j < kKeyBlock; j += N) {
      const auto e = ExpKeepNaN(d, hn::Sub(hn::Load(d, row + j), vm));
      hn::Store(e, d, row + j);
      sum = hn::Add(sum, e);
    }
    l[r] = l[r] * step.rescale + hn::GetLane(hn::SumOfLanes(d, sum));
    if (step.rescale != 1.0f) ScaleRow(acc + r * ld_acc, ld_acc, step.rescale);
    m[r] = step.m_new;
  }
}

// Quantized values: each weight p_rj times its value row's scale, so that acc += p s_j q_j is the weight
// times the dequantized row. A weight of exactly 0 stays 0 (a NaN scale of a row no query weighs cannot
// reach a result). value_scales [kKeyBlock], finite past kb (whose weights are 0).
inline void ScaleWeightsByValueScales(float* HWY_RESTRICT p, std::int64_t R, const float* HWY_RESTRICT value_scales) {
  const hn::ScalableTag<float> d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  for (std::int64_t r = 0; r < R; ++r)
    for (std::int64_t j = 0; j < kKeyBlock; j += N) {
      const auto w = hn::Load(d, p + r * kKeyBlock + j);
      const auto scaled = hn::Mul(w, hn::LoadU(d, value_scales + j));
      hn::Store(hn::IfThenElse(hn::Eq(w, hn::Zero(d)), w, scaled), d, p + r * kKeyBlock + j);
    }
}

// Whether every row of p [R, kKeyBlock] has a nonzero weight at every key j < kb (the usual case, found
// with vectors); where not, all_weighted[j] = no row has weight exactly 0 at key j, for j < kb.
inline bool FlagWeightedKeys(const float* HWY_RESTRICT p, std::int64_t R, std::int64_t kb, std::uint8_t* all_weighted) {
  const hn::ScalableTag<float> d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  bool every = true;
  for (std::int64_t j = 0; j < kb && every; j += N) {
    const auto keys = hn::FirstN(d, static_cast<std::size_t>(kb - j));
    auto zero = hn::Eq(hn::Zero(d), hn::Set(d, 1.0f));  // all false
    for (std::int64_t r = 0; r < R; ++r) zero = hn::Or(zero, hn::Eq(hn::Load(d, p + r * kKeyBlock + j), hn::Zero(d)));
    every = hn::AllFalse(d, hn::And(zero, keys));
  }
  if (every) return true;
  for (std::int64_t j = 0; j < kb; ++j) {
    bool all = true;
    for (std::int64_t r = 0; r < R; ++r) all = all && p[r * kKeyBlock + j] != 0.0f;
    all_weighted[j] = all;
  }
  return false;
}

// acc [rows, ld_acc] (rows <= 4) += P V over the keys of a block, columns [c, c + N): each row's sum
// runs over the keys in order; a weight of exactly 0 adds nothing (its value is not read, so a NaN
// there cannot reach the row). When every key of the block has weight in every row (`block_weighted`,
// the usual case), the loop runs without a test per key; else all_weighted[j]: no row of the item has
// weight 0 at key j.
template <int kRows, class T>
HWY_INLINE void AccumulateTile(const float* HWY_RESTRICT p, const T* const* v_rows, std::int64_t kb,
                               const std::uint8_t* all_weighted, bool block_weighted, std::int64_t c,
                               float* HWY_RESTRICT acc, std::int64_t ld_acc) {
  const hn::ScalableTag<float> d;
  auto a0 = hn::Load(d, acc + c), a1 = a0, a2 = a0, a3 = a0;
  if constexpr (kRows > 1) a1 = hn::Load(d, acc + ld_acc + c);
  if constexpr (kRows > 2) a2 = hn::Load(d, acc + 2 * ld_acc + c);
  if constexpr (kRows > 3) a3 = hn::Load(d, acc + 3 * ld_acc + c);
  if (block_weighted) {
    for (std::int64_t j = 0; j < kb; ++j) {
      const auto v = LoadWidened(d, v_rows[j] + c);
      a0 = hn::MulAdd(hn::Set(d, p[j]), v, a0);
      if constexpr (kRows > 1) a1 = hn::MulAdd(hn::Set(d, p[kKeyBlock + j]), v, a1);
      if constexpr (kRows > 2) a2 = hn::MulAdd(hn::Set(d, p[2 * kKeyBlock + j]), v, a2);
      if constexpr (kRows > 3) a3 = hn::MulAdd(hn::Set(d, p[3 * kKeyBlock + j]), v, a3);
    }
  } else {
    for (std::int64_t j = 0; j < kb; ++j) {
      const float p0 = p[j];  // the rows past kRows are not read: they may lie past the logits
      const float p1 = kRows > 1 ? p[kKeyBlock + j] : 0.0f, p2 = kRows > 2 ? p[2 * kKeyBlock + j] : 0.0f,
                  p3 = kRows > 3 ? p[3 * kKeyBlock + j] : 0.0f;
      const bool all = all_weighted[j] != 0;
      if (!all && p0 == 0.0f && p1 == 0.0f && p2 == 0.0f && p3 == 0.0f) continue;
      const auto v = LoadWidened(d, v_rows[j] + c);
      if (all || p0 != 0.0f) a0 = hn::MulAdd(hn::Set(d, p0), v, a0);
      if constexpr (kRows > 1)
        if (all || p1 != 0.0f) a1 = hn::MulAdd(hn::Set(d, p1), v, a1);
      if constexpr (kRows > 2)
        if (all || p2 != 0.0f) a2 = hn::MulAdd(hn::Set(d, p2), v, a2);
      if constexpr (kRows > 3)
        if (all || p3 != 0.0f) a3 = hn::MulAdd(hn::Set(d, p3), v, a3);
    }
  }
  hn::Store(a0, d, acc + c);
  if constexpr (kRows > 1) hn::Store(a1, d, acc + ld_acc + c);
  if constexpr (kRows > 2) hn::Store(a2, d, acc + 2 * ld_acc + c);
  if constexpr (kRows > 3) hn::Store(a3, d, acc + 3 * ld_acc + c);
}

// acc [kRows, ld_acc] += P V over the keys of a block, columns [c, c + kCols N), for a block in which
// every key has weight in every row: kRows x kCols accumulators, each summed over the keys in order (as
// AccumulateTile sums it).
template <int kRows, int kCols, class T>
HWY_INLINE void AccumulateWeightedTile(const float* HWY_RESTRICT p, const T* const* v_rows, std::int64_t kb,
                                       std::int64_t c, float* HWY_RESTRICT acc, std::int64_t ld_acc) {
  const hn::ScalableTag<float> d;
  using V = hn::Vec<decltype(d)>;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  V a[kRows * kCols];
  for (int r = 0; r < kRows; ++r)
    for (int k = 0; k < kCols; ++k) a[r * kCols + k] = hn::Load(d, acc + r * ld_acc + c + k * N);
  for (std::int64_t j = 0; j < kb; ++j) {
    V v[kCols];
    static_assert(kCols % 2 == 0, "value vectors are widened in pairs");
    for (int k = 0; k < kCols; k += 2) LoadWidenedPair(d, v_rows[j] + c + k * N, v[k], v[k + 1]);
    for (int r = 0; r < kRows; ++r) {
      const V w = hn::Set(d, p[r * kKeyBlock + j]);
      for (int k = 0; k < kCols; ++k) a[r * kCols + k] = hn::MulAdd(w, v[k], a[r * kCols + k]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int k = 0; k < kCols; ++k) hn::Store(a[r * kCols + k], d, acc + r * ld_acc + c + k * N);
}

// acc [R, ld_acc] += P [R, kKeyBlock] V_block [kb, d_v]: whole vectors of columns, by tiles of kTileRows
// rows x kTileCols vectors when every key has weight in every row (`block_weighted`, the usual case),
// else by tiles of 4 rows x 1 vector that test each weight (all_weighted as FlagWeightedKeys leaves it);
// then the columns past the last whole vector one by one. Each acc element is summed over the keys in
// order whichever tile holds it.
template <class T>
void BlockAccumulate(const float* HWY_RESTRICT p, std::int64_t R, const T* const* v_rows, std::int64_t kb,
                     std::int64_t d_v, bool block_weighted, const std::uint8_t* all_weighted, float* HWY_RESTRICT acc,
                     std::int64_t ld_acc) {
  const hn::ScalableTag<float> d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d)), whole = d_v - d_v % N;
  std::int64_t c = 0;
  if (block_weighted) {
    const std::int64_t tiled = whole - whole % (kTileCols * N), tiled_rows = R - R % kTileRows;
    for (; c < tiled; c += kTileCols * N)
      for (std::int64_t r = 0; r < tiled_rows; r += kTileRows)
        AccumulateWeightedTile<kTileRows, kTileCols>(p + r * kKeyBlock, v_rows, kb, c, acc + r * ld_acc, ld_acc);
    for (std::int64_t r = tiled_rows; r < R; ++r)
      for (std::int64_t cr = 0; cr < tiled; cr += kTileCols * N)
        AccumulateWeightedTile<1, kTileCols>(p + r * kKeyBlock, v_rows, kb, cr, acc + r * ld_acc, ld_acc);
  }
  for (; c < whole; c += N) {
    std::int64_t r = 0;
    for (; r + 4 <= R; r += 4)
      AccumulateTile<4>(p + r * kKeyBlock, v_rows, kb, all_weighted, block_weighted, c, acc + r * ld_acc, ld_acc);
    for (; r < R; ++r)
      AccumulateTile<1>(p + r * kKeyBlock, v_rows, kb, all_weighted, block_weighted, c, acc + r * ld_acc, ld_acc);
  }
  for (std::int64_t r = 0; r < R; ++r)
    for (std::int64_t c = whole; c < d_v; ++c) {
      float sum = acc[r * ld_acc + c];
      for (std::int64_t j = 0; j < kb; ++j) {
        const float weight = p[r * kKeyBlock + j];
        if (weight != 0.0f) sum += weight * WidenedScalar(v_rows[j][c]);
      }
      acc[r * ld_acc + c] = sum;
    }
}

}  // namespace mha::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard toggled per target
