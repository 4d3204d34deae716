// The decode kernel's prefetch level (src/decode/prefetch_level.hpp): chosen by the processor, forced by
// MHA_DECODE_PREFETCH. That either level gives the same results is checked by running the decode tests
// with each forced (tests/CMakeLists.txt: decode_prefetch_l1, decode_prefetch_l2).
#include "decode/prefetch_level.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>

namespace mha::detail {
namespace {

const CpuIdentity kZen4{true, 25}, kZen5{true, 26}, kXeon{false, 6}, kUnknown{};

TEST(DecodePrefetchLevel, FollowsWhatWasMeasuredOnEachProcessor) {
  EXPECT_EQ(choose_prefetch_level(kZen4, std::nullopt), PrefetchLevel::L2);  // 2.9-3.1x faster there
  EXPECT_EQ(choose_prefetch_level(kZen5, std::nullopt), PrefetchLevel::L1);  // 1.10-1.25x faster there
  EXPECT_EQ(choose_prefetch_level(kXeon, std::nullopt), PrefetchLevel::L1);
  EXPECT_EQ(choose_prefetch_level(kUnknown, std::nullopt), PrefetchLevel::L1);
  EXPECT_EQ(choose_prefetch_level(CpuIdentity{false, 25}, std::nullopt), PrefetchLevel::L1);  // not AMD
}

TEST(DecodePrefetchLevel, IsForcedByTheVariableAndIgnoresOtherValues) {
  for (const CpuIdentity& cpu : {kZen4, kZen5, kXeon}) {
    EXPECT_EQ(choose_prefetch_level(cpu, std::string("l1")), PrefetchLevel::L1);
    EXPECT_EQ(choose_prefetch_level(cpu, std::string("l2")), PrefetchLevel::L2);
    EXPECT_EQ(choose_prefetch_level(cpu, std::string("L3")), choose_prefetch_level(cpu, std::nullopt));
    EXPECT_EQ(choose_prefetch_level(cpu, std::string("")), choose_prefetch_level(cpu, std::nullopt));
  }
}

// This process's level: the one MHA_DECODE_PREFETCH forces (ctest decode_prefetch_l1 / _l2 set it), else the
// processor's choice, and the description says which.
TEST(DecodePrefetchLevel, ThisProcessFollowsTheVariable) {
  const char* value = std::getenv(kPrefetchLevelVariable);
  const std::string request = value ? value : "";
  const std::string description = decode_prefetch_description();
  if (request == "l1" || request == "l2") {
    EXPECT_EQ(decode_prefetch_level(), request == "l1" ? PrefetchLevel::L1 : PrefetchLevel::L2);
    EXPECT_NE(description.find("forced by MHA_DECODE_PREFETCH=" + request), std::string::npos) << description;
  } else {
    EXPECT_NE(description.find("chosen for"), std::string::npos) << description;
  }
  EXPECT_EQ(description.rfind(decode_prefetch_level() == PrefetchLevel::L1 ? "L1 (" : "L2 (", 0), 0u) << description;
}

}  // namespace
}  // namespace mha::detail
