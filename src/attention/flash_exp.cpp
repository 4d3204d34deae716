// flash_exp and flash_exp_bfloat16: the kernels' vector exps (one lane of each), dispatched like the kernel (see
// flash_exp.hpp).
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
  return hn::GetLane(ExpKeepNaN<ExpAccuracy::kFloat32>(d, hn::Set(d, x)));
}

float FlashExpBfloat16(float x) {
  const hn::CappedTag<float, 16> d;
  return hn::GetLane(ExpKeepNaN<ExpAccuracy::kBfloat16>(d, hn::Set(d, x)));
}

}  // namespace mha::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha::detail {

HWY_EXPORT(FlashExp);
HWY_EXPORT(FlashExpBfloat16);

float flash_exp(float x) { return HWY_DYNAMIC_DISPATCH(FlashExp)(x); }
float flash_exp_bfloat16(float x) { return HWY_DYNAMIC_DISPATCH(FlashExpBfloat16)(x); }

}  // namespace mha::detail
#endif  // HWY_ONCE
