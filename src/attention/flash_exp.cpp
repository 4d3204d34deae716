// flash_exp, flash_exp_bfloat16 and flash_round_by_hand: the kernels' vector exps (one lane of each) and their bfloat16
// rounding by hand, dispatched like the kernel (see flash_exp.hpp).
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

void FlashRoundByHand(const float* x, std::int64_t n, bfloat16* out) { RoundRowByHand(x, n, out); }

}  // namespace mha::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha::detail {

HWY_EXPORT(FlashExp);
HWY_EXPORT(FlashExpBfloat16);
HWY_EXPORT(FlashRoundByHand);

float flash_exp(float x) { return HWY_DYNAMIC_DISPATCH(FlashExp)(x); }
float flash_exp_bfloat16(float x) { return HWY_DYNAMIC_DISPATCH(FlashExpBfloat16)(x); }

void flash_round_by_hand(const float* x, std::int64_t n, bfloat16* out) {
  HWY_DYNAMIC_DISPATCH(FlashRoundByHand)(x, n, out);
}

}  // namespace mha::detail
#endif  // HWY_ONCE
