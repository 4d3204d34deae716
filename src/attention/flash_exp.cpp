// flash_exp: the kernel's vector exp, one lane of it, dispatched like the kernel (see flash_exp.hpp).
#include "attention/flash_exp.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/flash_exp.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "attention/online_softmax-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mha::detail::HWY_NAMESPACE {

float FlashExp(float x) {
  const hn::CappedTag<float, 16> d;  // the vector the kernel's rows use (online_softmax-inl.h)
  return hn::GetLane(ExpKeepNaN(d, hn::Set(d, x)));
}

}  // namespace mha::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha::detail {

HWY_EXPORT(FlashExp);

float flash_exp(float x) { return HWY_DYNAMIC_DISPATCH(FlashExp)(x); }

}  // namespace mha::detail
#endif  // HWY_ONCE
