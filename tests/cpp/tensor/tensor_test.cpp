// Tensor and TensorView (include/mha/tensor.hpp): shapes, strides, alignment, zero initialisation,
// copies with dtype conversion from strided and broadcast views, reshaping, undefined and empty tensors.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "support/test_util.hpp"

namespace mha_test {
namespace {

TEST(DType, SizesAndNames) {
  EXPECT_EQ(mha::dtype_size(DType::Float32), 4u);
  EXPECT_EQ(mha::dtype_size(DType::Float64), 8u);
  EXPECT_EQ(mha::dtype_size(DType::Bool), 1u);
  EXPECT_STREQ(mha::dtype_name(DType::Float32), "float32");
  EXPECT_STREQ(mha::dtype_name(DType::Float64), "float64");
  EXPECT_STREQ(mha::dtype_name(DType::Bool), "bool");
  static_assert(mha::dtype_of<float>() == DType::Float32);
  static_assert(mha::dtype_of<double>() == DType::Float64);
  static_assert(mha::dtype_of<bool>() == DType::Bool);
}

TEST(Shape, StrNumelAndContiguousStrides) {
  EXPECT_EQ(mha::shape_str({2, 3, 4}), "[2, 3, 4]");
  EXPECT_EQ(mha::shape_str({7}), "[7]");
  EXPECT_EQ(mha::shape_numel({2, 3, 4}), 24);
  EXPECT_EQ(mha::shape_numel({}), 1);
  EXPECT_EQ(mha::shape_numel({5, 0, 3}), 0);
  EXPECT_EQ(mha::contiguous_strides({2, 3, 4}), (Shape{12, 4, 1}));
  EXPECT_EQ(mha::contiguous_strides({5}), (Shape{1}));
  EXPECT_EQ(mha::contiguous_strides({}), (Shape{}));
  EXPECT_EQ(mha::contiguous_strides({3, 1, 5, 2}), (Shape{10, 10, 2, 1}));
}

// Shapes of awkward sizes, each allocated in every dtype.
struct TensorShapeCase {
  const char* name;
  Shape shape;
};

void PrintTo(const TensorShapeCase& c, std::ostream* os) { *os << c.name; }

class TensorAlloc : public ::testing::TestWithParam<std::tuple<TensorShapeCase, DType>> {};

TEST_P(TensorAlloc, ShapeStridesAlignmentAndZeroInit) {
  const auto& [c, dtype] = GetParam();
  // Allocate a few in a row so that an allocator that happens to align the first one is not enough.
  std::vector<Tensor> tensors;
  for (int i = 0; i < 4; ++i) tensors.emplace_back(dtype, c.shape);
  for (const Tensor& t : tensors) {
    EXPECT_TRUE(t.defined());
    EXPECT_EQ(t.dtype(), dtype);
    EXPECT_EQ(t.shape(), c.shape);
    EXPECT_EQ(t.rank(), static_cast<std::int64_t>(c.shape.size()));
    for (std::size_t d = 0; d < c.shape.size(); ++d) EXPECT_EQ(t.size(static_cast<std::int64_t>(d)), c.shape[d]);
    EXPECT_EQ(t.numel(), mha::shape_numel(c.shape));
    EXPECT_EQ(t.nbytes(), static_cast<std::size_t>(mha::shape_numel(c.shape)) * mha::dtype_size(dtype));
    EXPECT_EQ(t.strides(), mha::contiguous_strides(c.shape));
    ASSERT_NE(t.data(), nullptr);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data()) % 64, 0u) << "not 64-byte aligned";
    const auto* bytes = static_cast<const unsigned char*>(t.data());
    std::size_t nonzero = 0;
    for (std::size_t i = 0; i < t.nbytes(); ++i) nonzero += bytes[i] != 0;
    EXPECT_EQ(nonzero, 0u) << "not zero-initialised";

    const TensorView v = t.view();
    EXPECT_EQ(v.data(), t.data());
    EXPECT_EQ(v.dtype(), dtype);
    EXPECT_EQ(v.shape(), c.shape);
    EXPECT_EQ(v.strides(), mha::contiguous_strides(c.shape));
    EXPECT_TRUE(v.is_contiguous());
    EXPECT_EQ(v.numel(), t.numel());
  }
}

const TensorShapeCase kShapes[] = {
    {"scalar", {}},
    {"n1", {1}},
    {"n3", {3}},
    {"n17", {17}},
    {"7x5", {7, 5}},
    {"1x1x1", {1, 1, 1}},
    {"2x3x5x13", {2, 3, 5, 13}},
    {"65x3", {65, 3}},
};

INSTANTIATE_TEST_SUITE_P(Shapes, TensorAlloc,
                         ::testing::Combine(::testing::ValuesIn(kShapes),
                                            ::testing::Values(DType::Float32, DType::Float64, DType::Bool)),
                         [](const ::testing::TestParamInfo<TensorAlloc::ParamType>& info) {
                           return std::string(std::get<0>(info.param).name) + "_" + short_name(std::get<1>(info.param));
                         });

TEST(Tensor, DefaultIsUndefined) {
  Tensor t;
  EXPECT_FALSE(t.defined());
  EXPECT_EQ(t.data(), nullptr);
}

TEST(Tensor, EmptyTensorsAreDefined) {
  for (const Shape& s : {Shape{0}, Shape{2, 0, 3}, Shape{0, 4}}) {
    SCOPED_TRACE(mha::shape_str(s));
    Tensor t(DType::Float32, s);
    EXPECT_TRUE(t.defined());
    EXPECT_EQ(t.numel(), 0);
    EXPECT_EQ(t.nbytes(), 0u);
    EXPECT_EQ(t.shape(), s);
    EXPECT_EQ(t.view().numel(), 0);
    Tensor c = t.clone();
    EXPECT_TRUE(c.defined());
    EXPECT_EQ(c.shape(), s);
    Tensor d = Tensor::copy_of(t.view(), DType::Float64);
    EXPECT_TRUE(d.defined());
    EXPECT_EQ(d.dtype(), DType::Float64);
    EXPECT_EQ(d.shape(), s);
  }
}

TEST(Tensor, MoveKeepsStorage) {
  Tensor a = make_tensor(DType::Float32, {2, 2}, {1, 2, 3, 4});
  const void* p = a.data();
  Tensor b = std::move(a);
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(to_doubles(b), (std::vector<double>{1, 2, 3, 4}));
}

TEST(Tensor, CloneIsDeepAndEqual) {
  Rng rng(1);
  Tensor a = random_tensor(DType::Float64, {3, 5}, rng);
  Tensor b = a.clone();
  EXPECT_NE(a.data(), b.data());
  EXPECT_TRUE(bitwise_equal(a, b));
  a.data_as<double>()[0] = 42.0;
  EXPECT_NE(b.data_as<double>()[0], 42.0);
}

TEST(TensorView, AccessorsOnCallerMemory) {
  std::vector<float> mem(24);
  for (std::size_t i = 0; i < mem.size(); ++i) mem[i] = static_cast<float>(i);
  TensorView c(mem.data(), DType::Float32, {2, 3, 4});
  EXPECT_EQ(c.data_as<float>(), mem.data());
  EXPECT_EQ(c.rank(), 3);
  EXPECT_EQ(c.size(1), 3);
  EXPECT_EQ(c.strides(), (Shape{12, 4, 1}));
  EXPECT_EQ(c.stride(0), 12);
  EXPECT_EQ(c.numel(), 24);
  EXPECT_TRUE(c.is_contiguous());

  TensorView t(mem.data(), DType::Float32, {4, 6}, {1, 4});  // transpose of a [6, 4] matrix
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(t.strides(), (Shape{1, 4}));
  TensorView bcast(mem.data(), DType::Float32, {3, 4}, {0, 1});
  EXPECT_FALSE(bcast.is_contiguous());
}

TEST(Tensor, CopyOfConvertsFloat32ToFloat64Exactly) {
  std::vector<float> mem = {0.1f, -2.5f, 3.0e-30f, 1.0e30f, -0.0f, 7.0f};
  TensorView v(mem.data(), DType::Float32, {2, 3});
  Tensor d = Tensor::copy_of(v, DType::Float64);
  EXPECT_EQ(d.dtype(), DType::Float64);
  EXPECT_EQ(d.shape(), (Shape{2, 3}));
  for (std::size_t i = 0; i < mem.size(); ++i) EXPECT_EQ(d.data_as<double>()[i], static_cast<double>(mem[i])) << i;
  EXPECT_TRUE(std::signbit(d.data_as<double>()[4]));
}

TEST(Tensor, CopyOfConvertsFloat64ToFloat32ByRounding) {
  std::vector<double> mem = {0.1, 1.0 / 3.0, -1e-3, 12345.678901, 1e300 * 0.0, -7.0};
  TensorView v(mem.data(), DType::Float64, {6});
  Tensor f = Tensor::copy_of(v, DType::Float32);
  EXPECT_EQ(f.dtype(), DType::Float32);
  for (std::size_t i = 0; i < mem.size(); ++i) EXPECT_EQ(f.data_as<float>()[i], static_cast<float>(mem[i])) << i;
}

TEST(Tensor, CopyOfDefaultKeepsDtypeAndIsContiguous) {
  std::vector<double> mem = {1, 2, 3, 4, 5, 6};
  TensorView v(mem.data(), DType::Float64, {2, 3});
  Tensor c = Tensor::copy_of(v);
  EXPECT_EQ(c.dtype(), DType::Float64);
  EXPECT_NE(c.data(), static_cast<const void*>(mem.data()));
  EXPECT_EQ(to_doubles(c), (std::vector<double>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(c.data()) % 64, 0u);
}

// A transposed and a padded (row stride larger than the row) view copy to the logical C order.
TEST(Tensor, CopyOfStridedViews) {
  std::vector<double> mem(6 * 4);
  for (std::size_t i = 0; i < mem.size(); ++i) mem[i] = static_cast<double>(i);
  // mem as [6, 4]; its transpose [4, 6] has element (i, j) = mem[j * 4 + i].
  TensorView t(mem.data(), DType::Float64, {4, 6}, {1, 4});
  Tensor c = Tensor::copy_of(t, DType::Float32);
  ASSERT_EQ(c.shape(), (Shape{4, 6}));
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 6; ++j) EXPECT_EQ(c.data_as<float>()[i * 6 + j], static_cast<float>(j * 4 + i));

  // The first 3 columns of each row: a [6, 3] view with row stride 4.
  TensorView p(mem.data(), DType::Float64, {6, 3}, {4, 1});
  EXPECT_FALSE(p.is_contiguous());
  Tensor pc = Tensor::copy_of(p);
  for (int i = 0; i < 6; ++i)
    for (int j = 0; j < 3; ++j) EXPECT_EQ(pc.data_as<double>()[i * 3 + j], static_cast<double>(i * 4 + j));

  // A 3-D view with a permuted middle: storage [2, 3, 4] viewed as [2, 4, 3].
  TensorView perm(mem.data(), DType::Float64, {2, 4, 3}, {12, 1, 4});
  Tensor permc = Tensor::copy_of(perm);
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 4; ++b)
      for (int d = 0; d < 3; ++d)
        EXPECT_EQ(permc.data_as<double>()[(a * 4 + b) * 3 + d], static_cast<double>(a * 12 + d * 4 + b));
}

TEST(Tensor, CopyOfBroadcastViewMaterialisesRepeats) {
  std::vector<float> row = {1.5f, -2.0f, 3.25f, 4.0f};
  TensorView b(row.data(), DType::Float32, {3, 4}, {0, 1});  // the row repeated 3 times
  Tensor c = Tensor::copy_of(b, DType::Float64);
  ASSERT_EQ(c.shape(), (Shape{3, 4}));
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; ++j) EXPECT_EQ(c.data_as<double>()[i * 4 + j], static_cast<double>(row[j]));

  double one = 9.0;
  TensorView all(&one, DType::Float64, {2, 5}, {0, 0});  // a scalar broadcast to [2, 5]
  Tensor ac = Tensor::copy_of(all);
  EXPECT_EQ(to_doubles(ac), std::vector<double>(10, 9.0));
}

TEST(Tensor, CopyOfBoolStaysBool) {
  std::vector<std::uint8_t> mem = {0, 1, 0, 7, 1, 0};     // nonzero = true
  TensorView v(mem.data(), DType::Bool, {3, 2}, {1, 3});  // transposed
  Tensor c = Tensor::copy_of(v);
  EXPECT_EQ(c.dtype(), DType::Bool);
  ASSERT_EQ(c.shape(), (Shape{3, 2}));
  // Logical (i, j) = mem[i + 3 * j]: rows (0, 7), (1, 1), (0, 0).
  const std::vector<double> expected = {0, 1, 1, 1, 0, 0};
  EXPECT_EQ(to_doubles(c), expected);
}

TEST(Tensor, ReshapedKeepsStorageAndValues) {
  Tensor a = make_tensor(DType::Float64, {2, 6}, {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11});
  const void* p = a.data();
  Tensor b = std::move(a).reshaped({3, 2, 2});
  EXPECT_EQ(b.shape(), (Shape{3, 2, 2}));
  EXPECT_EQ(b.strides(), (Shape{4, 2, 1}));
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(to_doubles(b), (std::vector<double>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}));
  Tensor c = std::move(b).reshaped({12});
  EXPECT_EQ(c.shape(), (Shape{12}));
  EXPECT_EQ(c.data(), p);
  Tensor e(DType::Float32, {0, 3});
  Tensor f = std::move(e).reshaped({3, 0});
  EXPECT_TRUE(f.defined());
  EXPECT_EQ(f.shape(), (Shape{3, 0}));
}

TEST(Tensor, WritesThroughDataAreSeenByViews) {
  Tensor t(DType::Float32, {2, 2});
  t.data_as<float>()[3] = 5.0f;
  TensorView v = t;  // implicit conversion
  EXPECT_EQ(v.data_as<float>()[3], 5.0f);
  EXPECT_EQ(to_doubles(v), (std::vector<double>{0, 0, 0, 5}));
}

}  // namespace
}  // namespace mha_test
