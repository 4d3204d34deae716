// Per-target row operations of the fused kernel: the online softmax (Milakov & Gimelshein 2018, as
// used by FlashAttention-2) on rows of a logits tile, and row scaling of the output accumulator.
// Rows are padded to whole vectors by the caller; each row has a visible prefix (the keys the causal rule
// lets it see), past which it contributes exactly 0. NaN propagates: exp(NaN) is NaN (Highway's Exp
// alone returns 0 for NaN), so a NaN logit makes its row's sum, output and lse NaN, and an overflowing
// one (+inf, whose exp(inf - inf) is NaN) too: a row that depends on them becomes NaN, never a number.
//
// Included once per SIMD target by flash_forward.cpp, flash_backward.cpp and flash_exp.cpp through Highway's
// foreach_target.h.
#if defined(MHA_ONLINE_SOFTMAX_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_ONLINE_SOFTMAX_INL_H_
#undef MHA_ONLINE_SOFTMAX_INL_H_
#else
#define MHA_ONLINE_SOFTMAX_INL_H_
#endif

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "mha/bfloat16.hpp"

HWY_BEFORE_NAMESPACE();
namespace mha::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// AVX-512's vscalefps: e 2^floor(k) in one instruction, rounded once where the result is subnormal, 0 or
// infinity where it underflows or overflows, NaN where e or k is NaN. Where a target has it
// (MHA_EXP_SCALEF), the exps below finish with it for arguments of any size (ExpScaled): no range
// test on the way, where the integer add of n to the exponent bits holds for |x| < 87 only.
#undef MHA_EXP_SCALEF  // this file is read once per target
#if HWY_ARCH_X86 && HWY_TARGET <= HWY_AVX3
#define MHA_EXP_SCALEF 1
HWY_INLINE hn::Vec512<float> ScaleByPowerOfTwo(hn::Vec512<float> e, hn::Vec512<float> k) {
  return hn::Vec512<float>{_mm512_scalef_ps(e.raw, k.raw)};
}
// max(lo, x) and min(hi, x) lane by lane with a NaN x kept (x86's max and min return their second operand
// when either is NaN).
HWY_INLINE hn::Vec512<float> AtLeastKeepNaN(float lo, hn::Vec512<float> x) {
  return hn::Vec512<float>{_mm512_max_ps(_mm512_set1_ps(lo), x.raw)};
}
HWY_INLINE hn::Vec512<float> AtMostKeepNaN(float hi, hn::Vec512<float> x) {
  return hn::Vec512<float>{_mm512_min_ps(_mm512_set1_ps(hi), x.raw)};
}
#else
#define MHA_EXP_SCALEF 0
#endif

// 2^(j/16) for j = 0..15, each rounded to float32 (within 0.46 ULP).
alignas(64) inline constexpr float kExp2Sixteenths[16] = {
    0x1.000000p+0f, 0x1.0b5586p+0f, 0x1.172b84p+0f, 0x1.2387a6p+0f, 0x1.306fe0p+0f, 0x1.3dea64p+0f,
    0x1.4bfdaep+0f, 0x1.5ab07ep+0f, 0x1.6a09e6p+0f, 0x1.7a1148p+0f, 0x1.8ace54p+0f, 0x1.9c4918p+0f,
    0x1.ae89fap+0f, 0x1.c199bep+0f, 0x1.d5818ep+0f, 0x1.ea4afap+0f};

// exp(x) for |x| < 87 on 16-lane vectors with an FMA (ExpInRange's case on AVX-512): x = (16 m + j) ln2 / 16
// + r with |r| <= ln2 / 32, e^x = 2^m 2^(j/16) e^r; 2^(j/16) from a 16-entry table held in one register (a
// lane permute), e^r - 1 = r + r^2/2 + r^3/6 (truncation below 1e-8 relative), e^x = t + t (e^r - 1) in one
// FMA. n = 16 m + j comes from one FMA as in ExpInRange (x 16 / ln2 + 1.5 2^23, |n| < 2^11); ln2 / 16 in two
// parts, the first (ln2's first part / 16: a multiple of 2^-20) times n exact inside the FMA, so r is x - n
// ln2 / 16 to float precision. Within 1.1 ULP (the table's rounding, 0.46 at worst, plus the last FMA's;
// tests/cpp/attention/flash_exp_test.cpp). Seven FMAs a vector where the Taylor form takes ten: the softmax's
// exp pass is bound by the FMA pipes (docs/PERFORMANCE.md, issue 32). kAnyRange (where MHA_EXP_SCALEF):
// 2^m applied by vscalefps instead, for any x the callers have clamped (ExpScaled).
template <bool kAnyRange = false, class D, class V>
HWY_INLINE V ExpInRangeBySixteenths(D d, V x) {
  const hn::RebindToSigned<D> di;
  const auto round_to_int = hn::Set(d, 12582912.0f);                                // 1.5 2^23
  const auto shifted = hn::MulAdd(x, hn::Set(d, 23.0831206542234f), round_to_int);  // x 16 / ln2 + 1.5 2^23
  const auto nf = hn::Sub(shifted, round_to_int);                                   // n, exactly
  auto r = hn::MulAdd(nf, hn::Set(d, -0.693145751953125f / 16), x);
  r = hn::MulAdd(nf, hn::Set(d, -1.428606765330187e-6f / 16), r);
  const auto n = hn::BitCast(di, shifted);  // n in the low bits (two's complement), m = n >> 4 above them
  const auto t = hn::TableLookupLanes(hn::Load(d, kExp2Sixteenths), hn::IndicesFromVec(d, hn::And(n, hn::Set(di, 15))));
  const auto q = hn::MulAdd(hn::MulAdd(hn::Set(d, 1.0f / 6), r, hn::Set(d, 0.5f)), r, hn::Set(d, 1.0f));
  const auto e = hn::MulAdd(t, hn::Mul(q, r), t);  // 2^(j/16) e^r, in [0.97, 2)
#if MHA_EXP_SCALEF
  if constexpr (kAnyRange) return ScaleByPowerOfTwo(e, hn::Mul(nf, hn::Set(d, 1.0f / 16)));  // m = floor(n / 16)
#endif
  const auto two_to_m = hn::ShiftLeft<23>(hn::ShiftRight<4>(n));  // the constant's bits above n's: 0
  return hn::BitCast(d, hn::Add(hn::BitCast(di, e), two_to_m));   // m in [-126, 126]
}

// exp(x) for lanes with |x| < 87 (no overflow, no subnormal result), within 2 ULP. On 16-lane vectors with an
// FMA by ExpInRangeBySixteenths; otherwise x = n ln2 + r with n an integer
// and |r| <= ln2 / 2 (Cody & Waite: ln2 in two parts, so r is exact to float precision), e^r by its
// Taylor polynomial of degree 7 (truncation error below 6e-9 relative), and 2^n added to the
// exponent bits. n comes from one FMA, x / ln2 + 1.5 2^23 (|x / ln2| < 126): the sum's ulp is 1, so its
// rounding to nearest even is n, held in the low bits, whose shift left by 23 is n's (the constant's
// low 9 bits are 0). Three operations where a conversion to int32 (NearestInt) and its fix-up for
// out-of-range lanes took eight (measured in PERFORMANCE.md, issue 32). The FMA rounds the exact
// x / ln2, not its float product: the two differ only within an ulp of a half-integer, where either n
// leaves |r| <= ln2 / 2 + 1 ulp and the same accuracy. About 15 operations a vector against about 30
// for Highway's general Exp.
template <class D, class V>
HWY_INLINE V ExpInRange(D d, V x) {
#if HWY_NATIVE_FMA
  if constexpr (hn::MaxLanes(D()) == 16) return ExpInRangeBySixteenths(d, x);  // AVX-512: fewer FMAs
#endif
  const hn::RebindToSigned<D> di;
  const auto round_to_int = hn::Set(d, 12582912.0f);                                   // 1.5 2^23
  const auto shifted = hn::MulAdd(x, hn::Set(d, 1.44269504088896341f), round_to_int);  // x / ln2 + 1.5 2^23
  const auto nf = hn::Sub(shifted, round_to_int);                                      // n, exactly
  auto r = hn::MulAdd(nf, hn::Set(d, -0.693145751953125f), x);  // ln2 = 0.693145751953125 (exact in
  r = hn::MulAdd(nf, hn::Set(d, -1.428606765330187e-6f), r);    // 16 bits) + 1.4286e-6
  auto p = hn::Set(d, 1.0f / 5040);
  p = hn::MulAdd(p, r, hn::Set(d, 1.0f / 720));
  p = hn::MulAdd(p, r, hn::Set(d, 1.0f / 120));
  p = hn::MulAdd(p, r, hn::Set(d, 1.0f / 24));
  p = hn::MulAdd(p, r, hn::Set(d, 1.0f / 6));
  p = hn::MulAdd(p, r, hn::Set(d, 0.5f));
  p = hn::MulAdd(p, r, hn::Set(d, 1.0f));
  p = hn::MulAdd(p, r, hn::Set(d, 1.0f));  // e^r, in [0.7, 1.42]
  const auto two_to_n = hn::ShiftLeft<23>(hn::BitCast(di, shifted));
  return hn::BitCast(d, hn::Add(hn::BitCast(di, p), two_to_n));  // e^r 2^n, n in [-126, 126]
}

// How exactly the kernel's exp is evaluated: float32 (ExpInRange, within 2 ULP) for float32 kernels; to
// 4e-7 relative (ExpInRangeForBfloat16) for the bfloat16 kernel, whose probabilities are rounded to
// bfloat16 (2^-9 relative) before they enter a product, and whose lse stays within the float32 rule.
enum class ExpAccuracy { kFloat32, kBfloat16 };

// exp(x) for |x| < 87 to within 4e-7 relative (2e-7 for x > -20): x = n ln2 + r as in ExpInRange but
// with ln2 in one part where the target has an FMA (|n| <= 126 times float(ln2)'s error of 1.9e-9: r
// within 2.4e-7; in two parts, as there, where it has none), e^r =
// 1 + r q(r) with q of degree 4 fitted to the relative error over |r| <= ln2 / 2 (iteratively
// reweighted least squares in float64, coefficients rounded to float32: 9.5e-8), so exp(0) is 1
// exactly. Measured with float32 evaluation: 3.8e-7 at worst (x = -86.3), checked by
// tests/cpp/attention/flash_exp_test.cpp. Seven FMAs where ExpInRange takes ten: the exp is bound by
// the FMA pipes (docs/PERFORMANCE.md, issue 32). A polynomial of degree 4 (six FMAs, 3.1e-6) put the
// lse outside the float32 rule. kAnyRange as in ExpInRangeBySixteenths.
template <bool kAnyRange = false, class D, class V>
HWY_INLINE V ExpInRangeForBfloat16(D d, V x) {
  const hn::RebindToSigned<D> di;
  const auto round_to_int = hn::Set(d, 12582912.0f);                                   // 1.5 2^23
  const auto shifted = hn::MulAdd(x, hn::Set(d, 1.44269504088896341f), round_to_int);  // x / ln2 + 1.5 2^23
  const auto nf = hn::Sub(shifted, round_to_int);                                      // n, exactly
#if HWY_NATIVE_FMA
  const auto r = hn::MulAdd(nf, hn::Set(d, -0.693147182464599609375f), x);  // x - n ln2, rounded once
#else  // without an FMA the product rounds first: ln2 in two parts, the first product exact (ExpInRange)
  const auto r = hn::MulAdd(nf, hn::Set(d, -1.428606765330187e-6f), hn::MulAdd(nf, hn::Set(d, -0.693145751953125f), x));
#endif
  auto q = hn::Set(d, 0x1.0fa808p-7f);
  q = hn::MulAdd(q, r, hn::Set(d, 0x1.573a64p-5f));
  q = hn::MulAdd(q, r, hn::Set(d, 0x1.555a6cp-3f));
  q = hn::MulAdd(q, r, hn::Set(d, 0x1.fffdc6p-2f));
  q = hn::MulAdd(q, r, hn::Set(d, 0x1.fffff6p-1f));
  const auto p = hn::MulAdd(q, r, hn::Set(d, 1.0f));  // e^r, in [0.7, 1.42]
#if MHA_EXP_SCALEF
  if constexpr (kAnyRange) return ScaleByPowerOfTwo(p, nf);
#endif
  const auto two_to_n = hn::ShiftLeft<23>(hn::BitCast(di, shifted));
  return hn::BitCast(d, hn::Add(hn::BitCast(di, p), two_to_n));
}

// The accuracy of the kernel whose inputs are T.
template <class T>
inline constexpr ExpAccuracy kExpAccuracyOf =
    std::is_same_v<T, bfloat16> ? ExpAccuracy::kBfloat16 : ExpAccuracy::kFloat32;

template <ExpAccuracy kAccuracy, class D, class V>
HWY_INLINE V ExpInRangeTo(D d, V x) {
  if constexpr (kAccuracy == ExpAccuracy::kBfloat16) return ExpInRangeForBfloat16(d, x);
  else return ExpInRange(d, x);
}

#if MHA_EXP_SCALEF
// exp(x) on AVX-512 for every x, with no test on the way: x clamped to [-150, 100] (e^-150 is 0 in float32,
// e^100 infinity; x86's max and min keep a NaN x), the exp of kAccuracy finished by vscalefps, which rounds
// results below float32's normal range once to subnormals or 0 and makes those past it infinity. NaN stays
// NaN, -inf gives exactly 0. kClampAbove false skips the upper clamp where x <= 87 is known.
template <ExpAccuracy kAccuracy, bool kClampAbove = true>
HWY_INLINE hn::Vec512<float> ExpScaled(hn::Vec512<float> x) {
  const hn::Full512<float> d;
  x = AtLeastKeepNaN(-150.0f, x);
  if constexpr (kClampAbove) x = AtMostKeepNaN(100.0f, x);
  if constexpr (kAccuracy == ExpAccuracy::kBfloat16) return ExpInRangeForBfloat16</*kAnyRange=*/true>(d, x);
  else return ExpInRangeBySixteenths</*kAnyRange=*/true>(d, x);
}
#endif

// exp(x) lane by lane, NaN kept. On AVX-512 by ExpScaled; elsewhere lanes with |x| < 87 (the usual case:
// logits minus their row maximum) take ExpInRange, or ExpInRangeForBfloat16 for kAccuracy kBfloat16, and the
// others (a -inf from a mask, results that are subnormal or overflow, NaN) Highway's Exp, except that a NaN lane
// stays NaN (Exp clamps its argument and would return 0 for it). Each lane's value depends on that lane alone,
// never on its neighbours (which may be padding or another key's logit). -inf gives exactly 0.
template <ExpAccuracy kAccuracy = ExpAccuracy::kFloat32, class D, class V>
HWY_INLINE V ExpKeepNaN(D d, V x) {
#if MHA_EXP_SCALEF
  if constexpr (hn::MaxLanes(D()) == 16) return ExpScaled<kAccuracy>(x);
#endif
  const auto in_range = hn::Lt(hn::Abs(x), hn::Set(d, 87.0f));
  if (HWY_LIKELY(hn::AllTrue(d, in_range))) return ExpInRangeTo<kAccuracy>(d, x);
  const V fast = ExpInRangeTo<kAccuracy>(d, hn::IfThenElseZero(in_range, x));
  return hn::IfThenElse(in_range, fast, hn::IfThenElse(hn::IsNaN(x), x, hn::Exp(d, x)));
}

// The largest of row[0, visible) (row[visible, n) is ignored: keys the row may not see); n a multiple
// of the vector length. -inf for an all -inf (or empty) range. A row holding a NaN gives NaN or the
// largest of its other entries (the vector Max keeps either); either way its probabilities, their sum
// and so the row's output and lse become NaN (exp keeps the NaN), except when that maximum is -inf:
// then the row is scanned for a NaN, so that a row of NaN and -inf is not taken for an empty one.
HWY_INLINE float RowMax(const float* HWY_RESTRICT row, std::int64_t n, std::int64_t visible) {
  const hn::CappedTag<float, 16> d;  // rows are padded to 16 floats
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const auto minus_inf = hn::Set(d, -std::numeric_limits<float>::infinity());
  auto m = minus_inf;
  for (std::int64_t j = 0; j < n && j < visible; j += N) {
    auto x = hn::Load(d, row + j);
    if (j + N > visible) x = hn::IfThenElse(hn::FirstN(d, static_cast<std::size_t>(visible - j)), x, minus_inf);
    m = hn::Max(x, m);
  }
  const float row_max = hn::GetLane(hn::MaxOfLanes(d, m));
  if (row_max != -std::numeric_limits<float>::infinity()) return row_max;
  for (std::int64_t j = 0; j < n && j < visible; ++j)
    if (std::isnan(row[j])) return std::numeric_limits<float>::quiet_NaN();
  return row_max;
}

// row[j] = exp(row[j] - m) for j in [0, visible) and 0 for j in [visible, n), returning their sum, exp to
// kAccuracy (ExpKeepNaN; tested against std::exp through flash_exp.hpp); row[j] - m <= 0 here, and -inf
// (a forbidden key) gives exactly 0.
template <ExpAccuracy kAccuracy>
HWY_INLINE float ExpShiftedRowSum(float* HWY_RESTRICT row, std::int64_t n, std::int64_t visible, float m) {
  const hn::CappedTag<float, 16> d;  // rows are padded to 16 floats
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const auto vm = hn::Set(d, m);
  auto sum = hn::Zero(d);
  for (std::int64_t j = 0; j < n; j += N) {
    if (j >= visible) {
      hn::Store(hn::Zero(d), d, row + j);
      continue;
    }
    auto e = ExpKeepNaN<kAccuracy>(d, hn::Sub(hn::Load(d, row + j), vm));
    if (j + N > visible) e = hn::IfThenElseZero(hn::FirstN(d, static_cast<std::size_t>(visible - j)), e);
    hn::Store(e, d, row + j);
    sum = hn::Add(sum, e);
  }
  return hn::GetLane(hn::SumOfLanes(d, sum));
}

// What ExpRowSumWithinHeadroom did: the sum of the entries it exponentiated, and the first entry it left
// alone (n when it finished the row).
struct HeadroomPass {
  float sum;
  std::int64_t stopped_at;
};

// The one-pass form of ExpShiftedRowSum, against a reference m the row's logits may exceed by up to
// `headroom` (m a row's finite reference from earlier key blocks): row[j] = exp(row[j] - m) for j in
// [0, visible), 0 for j in [visible, n), and their sum, vector by vector, without a pass for the row's
// own max first. It stops at the first vector holding a visible row[j] - m > headroom (one that could
// overflow) and leaves that vector and the rest of the row as they were; the entries before it are then
// at most e^headroom. A NaN entry does not stop it (its exp is NaN, as in ExpShiftedRowSum).
template <ExpAccuracy kAccuracy>
HWY_INLINE HeadroomPass ExpRowSumWithinHeadroom(float* HWY_RESTRICT row, std::int64_t n, std::int64_t visible, float m,
                                                float headroom) {
  const hn::CappedTag<float, 16> d;  // rows are padded to 16 floats
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const auto vm = hn::Set(d, m), limit = hn::Set(d, headroom);
  auto sum = hn::Zero(d);
  std::int64_t j = 0;
  for (; j + N <= visible; j += N) {  // whole vectors of visible entries
    const auto x = hn::Sub(hn::Load(d, row + j), vm);
    hn::Vec<decltype(d)> e;
#if MHA_EXP_SCALEF
    // One test: past the headroom (a NaN is not); ExpScaled takes every x below it.
    if (!hn::AllFalse(d, hn::Gt(x, limit))) return {hn::GetLane(hn::SumOfLanes(d, sum)), j};
    e = ExpScaled<kAccuracy, /*kClampAbove=*/false>(x);
#else
    // One test for the usual case: within [-87, headroom], so neither stopping nor ExpKeepNaN's slow path.
    if (HWY_LIKELY(hn::AllTrue(d, hn::And(hn::Gt(x, hn::Set(d, -87.0f)), hn::Le(x, limit))))) {
      e = ExpInRangeTo<kAccuracy>(d, x);
    } else {
      if (!hn::AllFalse(d, hn::Gt(x, limit))) return {hn::GetLane(hn::SumOfLanes(d, sum)), j};
      e = ExpKeepNaN<kAccuracy>(d, x);
    }
#endif
    hn::Store(e, d, row + j);
    sum = hn::Add(sum, e);
  }
  if (j < visible) {  // a vector partly visible
    const auto seen = hn::FirstN(d, static_cast<std::size_t>(visible - j));
    const auto x = hn::Sub(hn::Load(d, row + j), vm);
    if (!hn::AllFalse(d, hn::And(seen, hn::Gt(x, limit)))) return {hn::GetLane(hn::SumOfLanes(d, sum)), j};
    const auto e = hn::IfThenElseZero(seen, ExpKeepNaN<kAccuracy>(d, x));
    hn::Store(e, d, row + j);
    sum = hn::Add(sum, e);
    j += N;
  }
  for (; j < n; j += N) hn::Store(hn::Zero(d), d, row + j);
  return {hn::GetLane(hn::SumOfLanes(d, sum)), n};
}

// row[j] = exp(row[j] - shift) for j in [0, visible) and 0 for j in [visible, n): probabilities from
// a known log-sum-exp.
template <ExpAccuracy kAccuracy>
HWY_INLINE void ExpShiftedRow(float* HWY_RESTRICT row, std::int64_t n, std::int64_t visible, float shift) {
  ExpShiftedRowSum<kAccuracy>(row, n, visible, shift);
}

// row[j] *= factor for j in [0, n); n a multiple of the vector length.
HWY_INLINE void ScaleRow(float* HWY_RESTRICT row, std::int64_t n, float factor) {
  const hn::CappedTag<float, 16> d;  // rows are padded to 16 floats
  const auto f = hn::Set(d, factor);
  for (std::int64_t j = 0; j < n; j += static_cast<std::int64_t>(hn::Lanes(d)))
    hn::Store(hn::Mul(hn::Load(d, row + j), f), d, row + j);
}

// The softmax backward on one row: dp[j] = p[j] * (dp[j] - D) for j in [0, n), where dp holds
// dL/dP and D = rowsum(dO * O) = sum_j p[j] dp[j]; the result is dL/dS (without the logit scale).
HWY_INLINE void SoftmaxBackwardRow(const float* HWY_RESTRICT p, float* HWY_RESTRICT dp, std::int64_t n, float D) {
  const hn::CappedTag<float, 16> d;  // rows are padded to 16 floats
  const auto vD = hn::Set(d, D);
  for (std::int64_t j = 0; j < n; j += static_cast<std::int64_t>(hn::Lanes(d)))
    hn::Store(hn::Mul(hn::Load(d, p + j), hn::Sub(hn::Load(d, dp + j), vD)), d, dp + j);
}

}  // namespace mha::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard toggled per target
