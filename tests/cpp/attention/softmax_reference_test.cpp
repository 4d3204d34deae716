// The fused forward's softmax reference (flash_forward.cpp, OnlineSoftmaxTile): after a row's first key
// block the kernel exponentiates each tile against the row's running reference m in one pass, and moves m
// only when a logit exceeds it by more than the headroom (8). support/rising_logits.hpp makes that happen
// where it can go wrong: logits rising block after block past the headroom (the pass stops inside a tile
// and the entries already done are rescaled), a rise within it (m stays, probabilities above 1), causal
// rows whose visible prefix ends inside the rising vector, and, here, a NaN or +inf logit first appearing
// in a later block. Float32 forward and backward against the float64 reference by the sweeps' rule
// (kernel_compare.hpp); bfloat16 in attention/bfloat16_test.cpp (RisingLogits).
//
// Legend: B batch, h heads, L queries, S keys, d_k query/key width, d_v value width.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "support/kernel_compare.hpp"
#include "support/rising_logits.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

class SoftmaxReference : public ::testing::TestWithParam<bool> {};
INSTANTIATE_TEST_SUITE_P(Causal, SoftmaxReference, ::testing::Bool());

TEST_P(SoftmaxReference, RisingLogitsWithinTheRule) {
  const KernelCase c = rising_logits_case(GetParam());
  CaseData d = make_case_data(c);
  put_rising_logits(c, d);
  const KernelRun ref64 = run_kernel(c, d, DType::Float64, mha::Kernel::Reference, false);
  double largest = 0;  // the case must move the reference by far more than the headroom
  for (double x : ref64.lse) largest = std::max(largest, std::fabs(x));
  ASSERT_GT(largest, 30.0);
  expect_fused_within_the_rule(c, d);
}

// A NaN or +inf logit first seen in a later key block (past a finite reference) makes exactly its own
// row NaN (out and lse), as in the reference kernel; the other rows agree with the reference kernel's. Query row 7 of
// head 1 and key 600 get entries of 1e30 in columns 2 and 3 (0 there in every other row and key): their
// product overflows to +inf, or to inf - inf = NaN, for that row and key alone.
TEST(SoftmaxReferenceNonFinite, LaterBlockNaNAndInfReachOnlyTheirRow) {
  for (const bool nan_logit : {true, false}) {
    KernelCase c = rising_logits_case(false);
    c.need_weights = false;
    CaseData d = make_case_data(c);
    put_rising_logits(c, d);
    for (std::int64_t row = 0; row < c.h * c.L; ++row)
      for (std::int64_t e : {2, 3}) d.q[static_cast<std::size_t>(row * c.d_k + e)] = 0.0;
    for (std::int64_t key = 0; key < c.h * c.S; ++key)
      for (std::int64_t e : {2, 3}) d.k[static_cast<std::size_t>(key * c.d_k + e)] = 0.0;
    const std::int64_t bad_row = 1 * c.L + 7, bad_key = 1 * c.S + 600;
    d.q[static_cast<std::size_t>(bad_row * c.d_k + 2)] = d.q[static_cast<std::size_t>(bad_row * c.d_k + 3)] = 1e30;
    d.k[static_cast<std::size_t>(bad_key * c.d_k + 2)] = 1e30;
    d.k[static_cast<std::size_t>(bad_key * c.d_k + 3)] = nan_logit ? -1e30 : 0.0;
    const KernelRun fused = run_kernel(c, d, DType::Float32, mha::Kernel::Flash, false);
    const KernelRun ref32 = run_kernel(c, d, DType::Float32, mha::Kernel::Reference, false);
    for (std::int64_t row = 0; row < c.h * c.L; ++row) {
      const bool bad = row == bad_row;
      const auto r = static_cast<std::size_t>(row);
      EXPECT_EQ(std::isnan(fused.lse[r]), bad) << "lse, row " << row << (nan_logit ? ", NaN" : ", +inf");
      EXPECT_EQ(std::isnan(ref32.lse[r]), bad) << "reference lse, row " << row;
      if (!bad) {
        EXPECT_NEAR(fused.lse[r], ref32.lse[r], 1e-4 * std::max(1.0, std::fabs(ref32.lse[r]))) << "row " << row;
      }
      for (std::int64_t e = 0; e < c.d_v; ++e) {
        const auto at = static_cast<std::size_t>(row * c.d_v + e);
        EXPECT_EQ(std::isnan(fused.out[at]), bad) << "out, row " << row << (nan_logit ? ", NaN" : ", +inf");
        if (!bad) {
          EXPECT_NEAR(fused.out[at], ref32.out[at], 1e-5) << "row " << row;
        }
      }
    }
  }
}

}  // namespace
}  // namespace mha_test
