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
#include "decode/decode_params.hpp"
#include "decode/split_kv.hpp"
#include "hwy/cache_control.h"
#include "hwy/highway.h"
#include "mha/bfloat16.hpp"

HWY_BEFORE_NAMESPACE();
namespace mha::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using decode::kKeyBlock;

// N float lanes from p: float32 loaded, bfloat16 widened exactly (its bits are a float's upper half).
template <class D>
HWY_INLINE hn::Vec<D> LoadWidened(D d, const float* HWY_RESTRICT p) {
  return hn::LoadU(d, p);
}
template <class D>
HWY_INLINE hn::Vec<D> LoadWidened(D d, const bfloat16* HWY_RESTRICT p) {
  const hn::RebindToUnsigned<D> du;
  const hn::Rebind<std::uint16_t, D> du16;
  const auto bits = hn::PromoteTo(du, hn::LoadU(du16, reinterpret_cast<const std::uint16_t*>(p)));
  return hn::BitCast(d, hn::ShiftLeft<16>(bits));
}

// int8 widened exactly.
template <class D>
HWY_INLINE hn::Vec<D> LoadWidened(D d, const std::int8_t* HWY_RESTRICT p) {
  const hn::RebindToSigned<D> di;
  const hn::Rebind<std::int8_t, D> di8;
  return hn::ConvertTo(d, hn::PromoteTo(di, hn::LoadU(di8, p)));
}
// float8 e4m3 (no infinities; S.1111.111 is NaN) widened exactly: a normal value (exponent field e > 0)
// becomes the float with exponent e - 7 and the same 3 mantissa bits; a subnormal is m 2^-9.
template <class D>
HWY_INLINE hn::Vec<D> LoadWidened(D d, const Float8E4M3* HWY_RESTRICT p) {
  const hn::RebindToSigned<D> di;
  const hn::Rebind<std::uint8_t, D> du8;
  const auto bits = hn::BitCast(di, hn::PromoteTo(hn::RebindToUnsigned<D>(), hn::LoadU(du8, &p->bits)));
  const auto magnitude_bits = hn::And(bits, hn::Set(di, 0x7F));  // e m: exponent and mantissa
  const auto normal = hn::BitCast(d, hn::Add(hn::ShiftLeft<20>(magnitude_bits), hn::Set(di, 120 << 23)));
  const auto subnormal = hn::Mul(hn::ConvertTo(d, magnitude_bits), hn::Set(d, 1.0f / 512.0f));
  auto magnitude = hn::IfThenElse(hn::RebindMask(d, hn::Lt(magnitude_bits, hn::Set(di, 8))), subnormal, normal);
  magnitude = hn::IfThenElse(hn::RebindMask(d, hn::Eq(magnitude_bits, hn::Set(di, 0x7F))),
                             hn::Set(d, std::numeric_limits<float>::quiet_NaN()), magnitude);
  const auto sign = hn::ShiftLeft<24>(hn::And(bits, hn::Set(di, 0x80)));
  return hn::BitCast(d, hn::Or(hn::BitCast(di, magnitude), sign));
}

// The lane sums of a0..a3 into out[0..3], four at once: per 128-bit block, two interleaving adds leave
// [sum a0, sum a1, sum a2, sum a3] of the block's lanes, and the blocks are added in order. Every row goes
// through the same tree whichever slot it has, so its sum does not depend on its neighbours (a tile of
// one row passes zeros for the others).
#if HWY_TARGET == HWY_SCALAR  // one lane: nothing to interleave
template <class D, class V>
HWY_INLINE void SumOfLanes4(D /* one lane */, V a0, V a1, V a2, V a3, float* out) {
  out[0] = hn::GetLane(a0), out[1] = hn::GetLane(a1), out[2] = hn::GetLane(a2), out[3] = hn::GetLane(a3);
}
#else
template <class D, class V>
HWY_INLINE void SumOfLanes4(D d, V a0, V a1, V a2, V a3, float* out) {
  const hn::Repartition<double, D> dd;  // pairs of floats moved as one 64-bit lane
  const V s01 = hn::Add(hn::InterleaveLower(d, a0, a1), hn::InterleaveUpper(d, a0, a1));
  const V s23 = hn::Add(hn::InterleaveLower(d, a2, a3), hn::InterleaveUpper(d, a2, a3));
  const auto x = hn::BitCast(dd, s01), y = hn::BitCast(dd, s23);
  const V sums = hn::Add(hn::BitCast(d, hn::InterleaveLower(dd, x, y)), hn::BitCast(d, hn::InterleaveUpper(dd, x, y)));
  HWY_ALIGN float lanes[hn::MaxLanes(d)];
  hn::Store(sums, d, lanes);
  const std::size_t N = hn::Lanes(d);
  for (std::size_t r = 0; r < 4; ++r) {
    out[r] = lanes[r];
    for (std::size_t block = 4; block < N; block += 4) out[r] += lanes[block + r];
  }
}
#endif

// The dot products of one key row k [d_k] with query rows q [rows, ld_q] (rows <= 4, a tile): each
// row's vector sum over whole vectors, reduced, plus its scalar tail; the same for any tile size.
template <int kRows, class T>
HWY_INLINE void DotTile(const float* HWY_RESTRICT q, std::int64_t ld_q, const T* HWY_RESTRICT k, std::int64_t d_k,
                        float* dots) {
  const hn::ScalableTag<float> d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d)), whole = d_k - d_k % N;
  auto a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
  for (std::int64_t c = 0; c < whole; c += N) {
    const auto kv = LoadWidened(d, k + c);
    a0 = hn::MulAdd(hn::Load(d, q + c), kv, a0);
    if constexpr (kRows > 1) a1 = hn::MulAdd(hn::Load(d, q + ld_q + c), kv, a1);
    if constexpr (kRows > 2) a2 = hn::MulAdd(hn::Load(d, q + 2 * ld_q + c), kv, a2);
    if constexpr (kRows > 3) a3 = hn::MulAdd(hn::Load(d, q + 3 * ld_q + c), kv, a3);
  }
  float sums[4];
  SumOfLanes4(d, a0, a1, a2, a3, sums);
  for (int r = 0; r < kRows; ++r) {
    float tail = 0.0f;
    for (std::int64_t c = whole; c < d_k; ++c) tail += q[r * ld_q + c] * static_cast<float>(k[c]);
    dots[r] = sums[r] + tail;
  }
}

// Asks for the `bytes` of `row` to be brought into the cache.
HWY_INLINE void PrefetchRow(const void* row, std::int64_t bytes) {
  for (std::int64_t b = 0; b < bytes; b += 64) hwy::Prefetch(static_cast<const char*>(row) + b);
}

// The rows of the block read next, prefetched one key row and one value row per key of the current block.
template <class T>
struct RowsAhead {
  const T* const* k = nullptr;
  const T* const* v = nullptr;
  std::int64_t count = 0;  // 0: nothing ahead
  std::int64_t k_bytes = 0, v_bytes = 0;
};

// s [R, kKeyBlock] = scale q k_j for keys j < kb (quantized rows: scale key_scales[j] q k_j), -inf where
// a row may not see key j (j >= visible[r]) and in the padding up to kKeyBlock. Meanwhile prefetches the
// rows ahead.
template <class T>
void BlockLogits(const float* HWY_RESTRICT q, std::int64_t ld_q, std::int64_t R, const T* const* k_rows,
                 std::int64_t kb, std::int64_t d_k, float scale, const float* key_scales, const std::int64_t* visible,
                 const RowsAhead<T>& ahead, float* HWY_RESTRICT s) {
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  float dots[4];
  for (std::int64_t j = 0; j < kb; ++j) {
    if (j < ahead.count) {
      PrefetchRow(ahead.k[j], ahead.k_bytes);
      PrefetchRow(ahead.v[j], ahead.v_bytes);
    }
    const float scale_j = key_scales ? scale * key_scales[j] : scale;
    std::int64_t r = 0;
    for (; r + 4 <= R; r += 4) {
      DotTile<4>(q + r * ld_q, ld_q, k_rows[j], d_k, dots);
      for (int t = 0; t < 4; ++t) s[(r + t) * kKeyBlock + j] = j < visible[r + t] ? dots[t] * scale_j : kMinusInf;
    }
    for (; r < R; ++r) {
      DotTile<1>(q + r * ld_q, ld_q, k_rows[j], d_k, dots);
      s[r * kKeyBlock + j] = j < visible[r] ? dots[0] * scale_j : kMinusInf;
    }
  }
  for (std::int64_t r = 0; r < R; ++r)
    for (std::int64_t j = kb; j < kKeyBlock; ++j) s[r * kKeyBlock + j] = kMinusInf;
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
// reach a result).
inline void ScaleWeightsByValueScales(float* HWY_RESTRICT p, std::int64_t R, std::int64_t kb,
                                      const float* value_scales) {
  for (std::int64_t r = 0; r < R; ++r)
    for (std::int64_t j = 0; j < kb; ++j)
      if (p[r * kKeyBlock + j] != 0.0f) p[r * kKeyBlock + j] *= value_scales[j];
}

// acc [rows, ld_acc] (rows <= 4) += P V over the keys of a block, columns [c, c + N): each row's sum
// runs over the keys in order; a weight of exactly 0 adds nothing (its value is not read, so a NaN
// there cannot reach the row). all_weighted[j]: no row of the item has weight 0 at key j; when every
// key of the block is so (`block_weighted`, the usual case), the loop runs without a test per key.
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

// acc [R, ld_acc] += P [R, kKeyBlock] V_block [kb, d_v]: whole vectors of columns by tiles of 4 rows,
// then the columns past the last whole vector one by one.
template <class T>
void BlockAccumulate(const float* HWY_RESTRICT p, std::int64_t R, const T* const* v_rows, std::int64_t kb,
                     std::int64_t d_v, const std::uint8_t* all_weighted, float* HWY_RESTRICT acc, std::int64_t ld_acc) {
  const hn::ScalableTag<float> d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d)), whole = d_v - d_v % N;
  bool block_weighted = true;
  for (std::int64_t j = 0; j < kb; ++j) block_weighted = block_weighted && all_weighted[j] != 0;
  for (std::int64_t c = 0; c < whole; c += N) {
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
        if (weight != 0.0f) sum += weight * static_cast<float>(v_rows[j][c]);
      }
      acc[r * ld_acc + c] = sum;
    }
}

}  // namespace mha::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard toggled per target
