// The fused kernels' query block height (src/attention/query_block.hpp): chosen by the L2's size, forced
// by MHA_QUERY_BLOCK. That either height gives results within the rules is checked by running the kernels'
// suites with each forced (tests/CMakeLists.txt: flash_query_block_128, flash_query_block_256).
#include "attention/query_block.hpp"

#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>

#include "attention/flash_config.hpp"

namespace mha::detail {
namespace {

constexpr std::int64_t kKiB = 1024, kMiB = 1024 * kKiB;

TEST(QueryBlockRows, FollowTheL2OfEachMachineMeasured) {
  EXPECT_EQ(choose_query_block_rows(512 * kKiB, std::nullopt), 128);  // Zen 3
  EXPECT_EQ(choose_query_block_rows(1 * kMiB, std::nullopt), 128);    // Zen 5
  EXPECT_EQ(choose_query_block_rows(2 * kMiB, std::nullopt), 256);    // the Xeons drawn (family 6 models 167, 207)
  EXPECT_EQ(choose_query_block_rows(2 * kMiB - 1, std::nullopt), 128);
  EXPECT_EQ(choose_query_block_rows(0, std::nullopt), 128);  // unknown
}

TEST(QueryBlockRows, AreForcedByTheVariableAndIgnoreOtherValues) {
  for (const std::int64_t l2 : {std::int64_t{0}, 512 * kKiB, 2 * kMiB}) {
    EXPECT_EQ(choose_query_block_rows(l2, std::string("128")), 128);
    EXPECT_EQ(choose_query_block_rows(l2, std::string("256")), 256);
    for (const char* other : {"", "64", "512", "tall", "256 "})
      EXPECT_EQ(choose_query_block_rows(l2, std::string(other)), choose_query_block_rows(l2, std::nullopt)) << other;
  }
}

TEST(QueryBlockRows, AreOneOfTheTwoHeightsTheWorkspacesAreSizedFor) {
  static_assert(flash::kBlockQShort % flash::kRowAlign == 0 && flash::kBlockQTall % flash::kRowAlign == 0);
  const std::int64_t rows = query_block_rows();
  EXPECT_TRUE(rows == flash::kBlockQShort || rows == flash::kBlockQTall) << rows;
}

// This process's height: the one MHA_QUERY_BLOCK forces (ctest flash_query_block_* set it), else the L2's
// choice, and the description says which.
TEST(QueryBlockRows, ThisProcessFollowsTheVariable) {
  const char* value = std::getenv(kQueryBlockVariable);
  const std::string request = value ? value : "";
  const std::string description = query_block_description();
  if (request == "128" || request == "256") {
    EXPECT_EQ(query_block_rows(), std::stoll(request));
    EXPECT_NE(description.find("forced by MHA_QUERY_BLOCK=" + request), std::string::npos) << description;
  } else {
    EXPECT_NE(description.find("chosen for"), std::string::npos) << description;
  }
  EXPECT_EQ(description.rfind(std::to_string(query_block_rows()) + " query rows (", 0), 0u) << description;
}

}  // namespace
}  // namespace mha::detail
