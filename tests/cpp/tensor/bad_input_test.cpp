// Bad input to Tensor (support/bad_input.hpp says what each case must do): a negative dimension, a
// reshape to another element count or to negative sizes, shapes whose element count or strides
// overflow 64 bits; and copy_of between bool and float, which the header does not
// clearly rule out.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "support/bad_input.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

Tensor T(Shape s, DType d = DType::Float32) { return Tensor(d, std::move(s)); }

std::vector<BadCase> bad_cases() {
  std::vector<BadCase> c;
  // ---- Tensor ----
  c.push_back({"tensor_reshaped_wrong_count", [] { (void)T({2, 3}).reshaped({4}); }, "shape"});
  c.push_back({"tensor_negative_dim", [] { (void)T({2, -1}); }, "shape|dim|-1"});
  c.push_back({"tensor_reshaped_negative_dims", [] { (void)T({6}).reshaped({-2, -3}); }, "shape"});
  // Sizes whose products overflow 64 bits: refused, never wrapped to 0 or a negative count. A zero size
  // does not make [0, 2^62, 2^62] acceptable (its strides overflow; NumPy refuses it too).
  constexpr std::int64_t k2_32 = std::int64_t{1} << 32, k2_62 = std::int64_t{1} << 62;
  c.push_back({"tensor_too_large_after_a_zero_dim", [] { (void)T({0, k2_62, k2_62}); }, "shape"});
  c.push_back({"tensor_more_than_2_60_elements", [] { (void)T({k2_32, k2_32}, DType::Bool); }, "shape"});
  c.push_back({"shape_numel_overflows", [] { (void)mha::shape_numel({k2_32, k2_32}); }, "shape"});
  c.push_back({"contiguous_strides_overflow", [] { (void)mha::contiguous_strides({2, k2_62, k2_62}); }, "shape"});
  c.push_back({"view_element_count_overflows",
               [] {
                 const float x = 0;
                 (void)mha::TensorView(&x, DType::Float32, {k2_32, k2_32}, {0, 0});  // a broadcast view
               },
               "shape"});
  return c;
}

class TensorBadInput : public ::testing::TestWithParam<BadCase> {};

TEST_P(TensorBadInput, ThrowsErrorNamingTheArgument) { expect_error_naming_the_argument(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, TensorBadInput, ::testing::ValuesIn(bad_cases()), bad_case_name);

TEST(Underspecified, CopyOfBetweenBoolAndFloat) {
  Tensor b = make_tensor(DType::Bool, {3}, {1, 0, 1});
  expect_error_if_thrown(
      [&] {
        Tensor f = Tensor::copy_of(b, DType::Float32);
        EXPECT_EQ(to_doubles(f), (std::vector<double>{1, 0, 1}));
      },
      "dtype|bool|float", "copy_of bool -> float32");
  Tensor f = make_tensor(DType::Float32, {3}, {0.0, 2.5, -1.0});
  expect_error_if_thrown(
      [&] {
        Tensor bb = Tensor::copy_of(f, DType::Bool);
        EXPECT_EQ(to_doubles(bb), (std::vector<double>{0, 1, 1}));
      },
      "dtype|bool|float", "copy_of float32 -> bool");
}

}  // namespace
}  // namespace mha_test
