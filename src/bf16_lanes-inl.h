// float32 lanes to and from bfloat16: LoadWidened (lanes of float32 from float32 or bfloat16 memory: the decode
// kernel's rows, decode_rows-inl.h, which adds the quantized payloads; the quantizer of appended rows,
// quantize_rows.cpp; the conversions of bf16_conversion.cpp) and BfloatBits (float32 lanes rounded to
// bfloat16 as mha::bfloat16 rounds: bf16_conversion.cpp's round_to_bfloat16, which also rounds the fused
// kernel's P and dS where the CPU has no AVX512-BF16).
//
// Included once per SIMD target through Highway's foreach_target.h.
#if defined(MHA_BF16_LANES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_BF16_LANES_INL_H_
#undef MHA_BF16_LANES_INL_H_
#else
#define MHA_BF16_LANES_INL_H_
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

// The bits of each lane of x rounded to bfloat16 (to nearest, ties to even, as PyTorch and the
// AVX512-BF16 conversion round; Highway 1.0's DemoteTo truncates instead), in 16-bit lanes. A NaN
// stays NaN (made quiet).
template <class D, class V>
HWY_INLINE auto BfloatBits(D /* float lanes */, V x) {
  const hn::RebindToUnsigned<D> du;
  const hn::RebindToSigned<D> di;  // the bits fit 16: demoting from int32 keeps them
  const hn::Rebind<std::uint16_t, D> du16;
  const auto u = hn::BitCast(du, x);
  const auto lsb = hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1u));
  auto rounded = hn::ShiftRight<16>(hn::Add(u, hn::Add(hn::Set(du, 0x7fffu), lsb)));
  const auto quiet_nan = hn::Or(hn::ShiftRight<16>(u), hn::Set(du, 0x40u));
  rounded = hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(x)), quiet_nan, rounded);
  return hn::DemoteTo(du16, hn::BitCast(di, rounded));
}

}  // namespace mha::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard toggled per target
