// A test fixture that runs each of its tests once per SIMD target compiled in and supported by this CPU
// (e.g. AVX3, AVX2, SSE4, SSSE3 and scalar on an AVX-512 machine), so that the code of targets the
// dispatch would not pick here (one without FMA, one with narrower vectors) is checked too:
//
//   class MyEveryTarget : public mha_test::EveryTarget {};
//   MHA_INSTANTIATE_EVERY_TARGET(MyEveryTarget);
//   TEST_P(MyEveryTarget, Something) { ... }   // HWY_DYNAMIC_DISPATCH reaches GetParam()'s target
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "hwy/targets.h"

namespace mha_test {

class EveryTarget : public ::testing::TestWithParam<std::int64_t> {
 protected:
  void SetUp() override { hwy::SetSupportedTargetsForTest(GetParam()); }
  void TearDown() override { hwy::SetSupportedTargetsForTest(0); }
};

inline std::string target_test_name(const ::testing::TestParamInfo<std::int64_t>& info) {
  return hwy::TargetName(info.param);
}

}  // namespace mha_test

#define MHA_INSTANTIATE_EVERY_TARGET(Fixture)                                                          \
  INSTANTIATE_TEST_SUITE_P(Targets, Fixture, ::testing::ValuesIn(hwy::SupportedAndGeneratedTargets()), \
                           mha_test::target_test_name)
