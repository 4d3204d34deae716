// bfloat16 <-> float32 spans in vectors (bf16_conversion.hpp): whole vectors by bf16_lanes-inl.h's
// LoadWidened and BfloatBits, the elements past the last whole vector by mha::bfloat16 itself.
#include "bf16_conversion.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "bf16_conversion.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "bf16_lanes-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mha::detail::HWY_NAMESPACE {

void WidenBfloat16(const bfloat16* HWY_RESTRICT from, std::int64_t n, float* HWY_RESTRICT to) {
  const hn::ScalableTag<float> d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  std::int64_t i = 0;
  for (; i + N <= n; i += N) hn::StoreU(LoadWidened(d, from + i), d, to + i);
  for (; i < n; ++i) to[i] = from[i];
}

void RoundToBfloat16(const float* HWY_RESTRICT from, std::int64_t n, bfloat16* HWY_RESTRICT to) {
  const hn::ScalableTag<float> d;
  const hn::Rebind<std::uint16_t, decltype(d)> du16;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  std::int64_t i = 0;
  for (; i + N <= n; i += N)
    hn::StoreU(BfloatBits(d, hn::LoadU(d, from + i)), du16, reinterpret_cast<std::uint16_t*>(to + i));
  for (; i < n; ++i) to[i] = from[i];
}

}  // namespace mha::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha::detail {

HWY_EXPORT(WidenBfloat16);
HWY_EXPORT(RoundToBfloat16);

void widen_bfloat16(const bfloat16* from, std::int64_t n, float* to) {
  HWY_DYNAMIC_DISPATCH(WidenBfloat16)(from, n, to);
}

void round_to_bfloat16(const float* from, std::int64_t n, bfloat16* to) {
  HWY_DYNAMIC_DISPATCH(RoundToBfloat16)(from, n, to);
}

}  // namespace mha::detail
#endif  // HWY_ONCE
