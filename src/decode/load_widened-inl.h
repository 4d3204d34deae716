// Lanes of float32 from float32 or bfloat16 memory, for the decode kernel's rows (decode_rows-inl.h, which
// adds the quantized payloads) and the quantizer of appended rows (quantize_rows.cpp).
//
// Included once per SIMD target through Highway's foreach_target.h.
#if defined(MHA_DECODE_LOAD_WIDENED_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_DECODE_LOAD_WIDENED_INL_H_
#undef MHA_DECODE_LOAD_WIDENED_INL_H_
#else
#define MHA_DECODE_LOAD_WIDENED_INL_H_
#endif

#include <cstdint>

#include "hwy/highway.h"
#include "mha/bfloat16.hpp"

HWY_BEFORE_NAMESPACE();
namespace mha::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

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

}  // namespace mha::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard toggled per target
