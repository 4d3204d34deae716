// Bad input to Tensor (support/bad_input.hpp says what each case must do): a negative dimension, a
// reshape to another element count or to negative sizes, shapes whose element count or strides
// overflow 64 bits; typed views that reach past their span, data_as<T>() with T not the dtype's
// element type; and copy_of between bool and float, which the header does not clearly rule out.
#include <gtest/gtest.h>

#include <cstdint>
#include <span>
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
  // Typed views: the shape (and strides) must stay inside the span.
  c.push_back({"typed_view_shape_beyond_span",
               [] {
                 const std::vector<float> x(5);
                 (void)mha::TensorView(x, {2, 3});
               },
               "shape|data holds 5"});
  c.push_back({"typed_view_strides_beyond_span",
               [] {
                 const std::vector<double> x(6);
                 (void)mha::TensorView(x, {2, 3}, {4, 1});  // reaches element 4 + 2 = 6, the 7th
               },
               "strides|data holds 6"});
  c.push_back({"typed_view_stride_offset_overflows",
               [] {
                 const std::vector<float> x(8);
                 (void)mha::TensorView(x, {3, 2}, {k2_62, 1});
               },
               "strides|overflow"});
  // data_as<T>() with T other than the dtype's element type.
  c.push_back({"view_data_as_wrong_type",
               [] {
                 const std::vector<double> x(4);
                 (void)mha::TensorView(x, {4}).data_as<float>();
               },
               "data_as|float64"});
  c.push_back({"tensor_data_as_wrong_type", [] { (void)T({2}, DType::Bool).data_as<double>(); }, "data_as|bool"});
  return c;
}

class TensorBadInput : public ::testing::TestWithParam<BadCase> {};

TEST_P(TensorBadInput, ThrowsErrorNamingTheArgument) { expect_error_naming_the_argument(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Cases, TensorBadInput, ::testing::ValuesIn(bad_cases()), bad_case_name);

TEST(TypedTensorView, DtypeFromTheElementTypeAndViewsWithinTheSpan) {
  const std::vector<float> f{1, 2, 3, 4, 5, 6, 7};
  const mha::TensorView v(f, {2, 3});  // the first 6 of 7 elements
  EXPECT_EQ(v.dtype(), DType::Float32);
  EXPECT_EQ(v.strides(), (Shape{3, 1}));
  EXPECT_EQ(v.data_as<float>()[5], 6.0f);
  const std::vector<double> d(7);
  EXPECT_EQ(mha::TensorView(d, {2, 3}, {4, 1}).dtype(), DType::Float64);  // reaches element 6: the last
  const bool b[3] = {true, false, true};
  const mha::TensorView bv(b, {3});
  EXPECT_EQ(bv.dtype(), DType::Bool);
  EXPECT_EQ(bv.data_as<std::uint8_t>()[2], 1);                              // bool elements may be read as bytes
  EXPECT_EQ(mha::TensorView(std::span<const float>(), {0, 4}).numel(), 0);  // empty span, no elements
  EXPECT_EQ(mha::TensorView(f, {100, 2}, {0, 1}).numel(), 200);             // broadcast rows: 2 elements reached
}

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
