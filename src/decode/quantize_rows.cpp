// Rows quantized in vectors (quantize_rows.hpp): per row, max |x| and whether every element is finite
// in float32 vectors (float32 and bfloat16 hold nothing beyond float32's range, and max |x| of them is
// exact in float32), the scale by quantize.hpp's rule, then each payload from x / s in float64 lanes:
//   int8:  round to nearest even, clamp to +-127
//   e4m3:  a = |y|, E = max(exponent of a, -6), r = round(a 2^(3-E)) to nearest even,
//          pattern = sign | min((E + 6) 8 + r, 0x7E)          (as e4m3_from_double, a = 0 giving 0)
// and the scalar rule for the elements past the last whole vector.
//
// Legend: d a row's width, N the float64 lanes of a vector.
#include "decode/quantize_rows.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "decode/quantize_rows.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <cmath>
#include <limits>

#include "bf16_lanes-inl.h"  // LoadWidened
#include "decode/quantize.hpp"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mha::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// max |x_c| of x [d] as a double, or NaN when an element is NaN or +-Inf (row_max_abs's result).
template <class T>
double MaxAbs(const T* HWY_RESTRICT x, std::int64_t d) {
  const hn::ScalableTag<float> df;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(df)), whole = d - d % N;
  auto max_abs = hn::Zero(df);
  auto finite = hn::Eq(max_abs, max_abs);  // all true
  for (std::int64_t c = 0; c < whole; c += N) {
    const auto v = LoadWidened(df, x + c);
    max_abs = hn::Max(max_abs, hn::Abs(v));
    finite = hn::And(finite, hn::IsFinite(v));
  }
  const double tail = row_max_abs(x + whole, d - whole, 1);
  if (!hn::AllTrue(df, finite) || std::isnan(tail)) return std::numeric_limits<double>::quiet_NaN();
  return std::max(static_cast<double>(hn::GetLane(hn::MaxOfLanes(df, max_abs))), tail);
}

// The payloads of N elements from y = x / s (float64 lanes).
template <class D>
HWY_INLINE void StoreInt8Payloads(D d, hn::Vec<D> y, std::int8_t* HWY_RESTRICT q) {
  const hn::RebindToSigned<D> di;
  const hn::RebindToUnsigned<D> du;
  const hn::Rebind<std::uint8_t, D> du8;
  const auto r = hn::Min(hn::Max(hn::Round(y), hn::Set(d, -kInt8PayloadMax)), hn::Set(d, kInt8PayloadMax));
  hn::StoreU(hn::TruncateTo(du8, hn::BitCast(du, hn::ConvertTo(di, r))), du8, reinterpret_cast<std::uint8_t*>(q));
}
template <class D>
HWY_INLINE void StoreE4M3Payloads(D d, hn::Vec<D> y, std::uint8_t* HWY_RESTRICT q) {
  const hn::RebindToSigned<D> di;
  const hn::RebindToUnsigned<D> du;
  const hn::Rebind<std::uint8_t, D> du8;
  const auto a = hn::Abs(y);
  // E = max(floor(log2 a), -6) from the exponent field (a = 0 reads -1023, so E = -6 and r = 0).
  const auto biased = hn::BitCast(di, hn::ShiftRight<52>(hn::BitCast(du, a)));
  const auto E = hn::Max(hn::Sub(biased, hn::Set(di, 1023)), hn::Set(di, -6));
  const auto two_to_3_minus_E = hn::BitCast(d, hn::ShiftLeft<52>(hn::Sub(hn::Set(di, 1023 + 3), E)));
  const auto r = hn::ConvertTo(di, hn::Round(hn::Mul(a, two_to_3_minus_E)));  // exact: a power of two
  const auto magnitude = hn::Min(hn::Add(hn::ShiftLeft<3>(hn::Add(E, hn::Set(di, 6))), r),
                                 hn::Set(di, static_cast<std::int64_t>(kE4M3MaxBits)));
  const auto sign = hn::BitCast(di, hn::ShiftLeft<7>(hn::ShiftRight<63>(hn::BitCast(du, y))));  // -0 too
  hn::StoreU(hn::TruncateTo(du8, hn::BitCast(du, hn::Or(magnitude, sign))), du8, q);
}

// quantize_row (quantize.hpp) for a contiguous row, the payloads in vectors.
template <bool kE4M3, class T, class Payload>
float QuantizeRow(const T* HWY_RESTRICT x, std::int64_t d, Payload* HWY_RESTRICT q) {
  const double payload_max = kE4M3 ? kE4M3PayloadMax : kInt8PayloadMax;
  const double max_abs = MaxAbs(x, d);
  if (!(max_abs > 0.0)) {
    std::fill_n(q, d, Payload{0});
    return max_abs == 0.0 ? 0.0f : std::numeric_limits<float>::quiet_NaN();
  }
  const float s = quantization_scale(max_abs, payload_max);
  const hn::ScalableTag<double> dd;
  const hn::Rebind<float, decltype(dd)> df;  // N floats, promoted
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(dd)), whole = d - d % N;
  const auto vs = hn::Set(dd, static_cast<double>(s));
  for (std::int64_t c = 0; c < whole; c += N) {
    const auto y = hn::Div(hn::PromoteTo(dd, LoadWidened(df, x + c)), vs);
    if constexpr (kE4M3) StoreE4M3Payloads(dd, y, q + c);
    else StoreInt8Payloads(dd, y, q + c);
  }
  for (std::int64_t c = whole; c < d; ++c) {
    const double y = static_cast<double>(x[c]) / static_cast<double>(s);
    if constexpr (kE4M3) q[c] = e4m3_from_double(y);
    else q[c] = int8_from_double(y);
  }
  return s;
}

float QuantizeInt8Float(const float* x, std::int64_t d, std::int8_t* q) { return QuantizeRow<false>(x, d, q); }
float QuantizeInt8Bfloat16(const bfloat16* x, std::int64_t d, std::int8_t* q) { return QuantizeRow<false>(x, d, q); }
float QuantizeE4M3Float(const float* x, std::int64_t d, std::uint8_t* q) { return QuantizeRow<true>(x, d, q); }
float QuantizeE4M3Bfloat16(const bfloat16* x, std::int64_t d, std::uint8_t* q) { return QuantizeRow<true>(x, d, q); }

}  // namespace mha::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha::detail {

HWY_EXPORT(QuantizeInt8Float);
HWY_EXPORT(QuantizeInt8Bfloat16);
HWY_EXPORT(QuantizeE4M3Float);
HWY_EXPORT(QuantizeE4M3Bfloat16);

float quantize_int8_row_vectors(const float* x, std::int64_t d, std::int8_t* q) {
  return HWY_DYNAMIC_DISPATCH(QuantizeInt8Float)(x, d, q);
}
float quantize_int8_row_vectors(const bfloat16* x, std::int64_t d, std::int8_t* q) {
  return HWY_DYNAMIC_DISPATCH(QuantizeInt8Bfloat16)(x, d, q);
}
float quantize_e4m3_row_vectors(const float* x, std::int64_t d, std::uint8_t* q) {
  return HWY_DYNAMIC_DISPATCH(QuantizeE4M3Float)(x, d, q);
}
float quantize_e4m3_row_vectors(const bfloat16* x, std::int64_t d, std::uint8_t* q) {
  return HWY_DYNAMIC_DISPATCH(QuantizeE4M3Bfloat16)(x, d, q);
}

}  // namespace mha::detail
#endif  // HWY_ONCE
