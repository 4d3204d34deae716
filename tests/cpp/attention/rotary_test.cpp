// Rotary position embeddings (mha/rotary.hpp, src/attention/rotary.hpp):
//   (a) apply_rotary and its backward against a plain double loop written here from the formula, for both
//       pairings, partial rotary_dim, absent, [L] and [B, L] positions (int64 and int32), three dtypes;
//   (b) rotate_in_place on q kept as [B, L, h, d] inside a wider buffer (a packed [B, L, 3 h d] qkv row)
//       gives the bits apply_rotary gives on the transposed [B, h, L, d] view, and touches nothing else;
//   (c) bad arguments are refused naming them.
// The Python tests (tests/python/test_rotary.py) cover large positions, strides, NaN and hypothesis.
//
// Legend: B batch, h heads, L positions, d head width, r rotary_dim.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "attention/rotary.hpp"
#include "support/bad_input.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

using mha::PositionsView;
using mha::RotaryOptions;

constexpr std::int64_t B = 2, H = 3, L = 5, D = 10;

// y[b, head, l, :] for x: [B, h, L, d] (C order, doubles): the pairs rotated by
// theta_i = position(b, l) * base^(-2i / r), by -theta_i when inverse. pos: [B, L].
std::vector<double> naive_rotary(const std::vector<double>& x, const std::vector<std::int64_t>& pos, std::int64_t r,
                                 double base, bool interleaved, bool inverse) {
  std::vector<double> y = x;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t head = 0; head < H; ++head)
      for (std::int64_t l = 0; l < L; ++l) {
        const std::size_t row = static_cast<std::size_t>(((b * H + head) * L + l) * D);
        for (std::int64_t i = 0; i < r / 2; ++i) {
          const double theta = static_cast<double>(pos[static_cast<std::size_t>(b * L + l)]) *
                               std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(r));
          const double c = std::cos(theta), s = inverse ? -std::sin(theta) : std::sin(theta);
          const std::size_t ia = row + static_cast<std::size_t>(interleaved ? 2 * i : i);
          const std::size_t ib = row + static_cast<std::size_t>(interleaved ? 2 * i + 1 : i + r / 2);
          y[ia] = x[ia] * c - x[ib] * s;
          y[ib] = x[ib] * c + x[ia] * s;
        }
      }
  return y;
}

struct RotaryCase {
  DType dtype;
  std::int64_t rotary_dim;  // 0: d
  bool interleaved;
  int positions;  // 0 absent, 1 [L] int64, 2 [B, L] int64, 3 [B, L] int32
};

std::string rotary_case_str(const RotaryCase& c) {
  static const char* kPositions[] = {"default", "shared", "rows", "rows_int32"};
  return std::string(mha::dtype_name(c.dtype)) + "_r" + std::to_string(c.rotary_dim) +
         (c.interleaved ? "_interleaved_" : "_neox_") + kPositions[c.positions];
}
std::string rotary_case_name(const ::testing::TestParamInfo<RotaryCase>& info) { return rotary_case_str(info.param); }
void PrintTo(const RotaryCase& c, std::ostream* os) { *os << rotary_case_str(c); }

class RotaryVsLoop : public ::testing::TestWithParam<RotaryCase> {};

TEST_P(RotaryVsLoop, ForwardAndBackwardMatchTheDoubleLoop) {
  const RotaryCase c = GetParam();
  Rng rng(31 + static_cast<std::uint64_t>(c.positions));
  const Tensor x = random_tensor(c.dtype, {B, H, L, D}, rng, -2.0, 2.0);
  const std::vector<double> x64 = to_doubles(x);
  const std::vector<std::int64_t> shared = {0, 7, 3, 4096, 99'999};
  const std::vector<std::int64_t> rows = {1, 2, 3, 4, 5, 0, 0, 1, 2, 500'000};
  const std::vector<std::int32_t> rows32(rows.begin(), rows.end());
  std::optional<PositionsView> positions;
  std::vector<std::int64_t> pos(B * L);  // [B, L] for the loop
  for (std::int64_t i = 0; i < B * L; ++i) pos[static_cast<std::size_t>(i)] = i % L;
  if (c.positions == 1) positions.emplace(std::span<const std::int64_t>(shared), Shape{L});
  if (c.positions == 2) positions.emplace(std::span<const std::int64_t>(rows), Shape{B, L});
  if (c.positions == 3) positions.emplace(std::span<const std::int32_t>(rows32), Shape{B, L});
  for (std::int64_t i = 0; i < B * L && c.positions != 0; ++i)
    pos[static_cast<std::size_t>(i)] =
        c.positions == 1 ? shared[static_cast<std::size_t>(i % L)] : rows[static_cast<std::size_t>(i)];
  const RotaryOptions options{.base = 10000.0, .rotary_dim = c.rotary_dim, .interleaved = c.interleaved};
  const std::int64_t r = c.rotary_dim == 0 ? D : c.rotary_dim;

  for (const bool inverse : {false, true}) {
    const Tensor y =
        inverse ? mha::apply_rotary_backward(x, positions, options) : mha::apply_rotary(x, positions, options);
    ASSERT_EQ(y.dtype(), c.dtype);
    ASSERT_EQ(y.shape(), (Shape{B, H, L, D}));
    const std::vector<double> got = to_doubles(y);
    const std::vector<double> want = naive_rotary(x64, pos, r, options.base, c.interleaved, inverse);
    for (std::size_t k = 0; k < got.size(); ++k) {
      // Rounding of the pair's products (|x| <= 2): float32 a few units of 2^-24 of 4; float64 an angle of
      // 5e5 known to ~1e-10; bfloat16 its own rounding (2^-8 relative) on top of float32's.
      const double tol = c.dtype == DType::Float64   ? 1e-9
                         : c.dtype == DType::Float32 ? 16 * std::ldexp(1.0, -24) * 4
                                                     : std::ldexp(std::fabs(want[k]), -8) + 4e-6;
      ASSERT_NEAR(got[k], want[k], tol) << "element " << k << (inverse ? " (backward)" : " (forward)");
    }
  }
}

std::vector<RotaryCase> rotary_cases() {
  std::vector<RotaryCase> cases;
  for (const DType dtype : {DType::Float64, DType::Float32, DType::BFloat16})
    for (const std::int64_t r : {0, 4, 2})
      for (const bool interleaved : {false, true})
        for (const int positions : {0, 1, 2, 3}) cases.push_back({dtype, r, interleaved, positions});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Rotary, RotaryVsLoop, ::testing::ValuesIn(rotary_cases()), rotary_case_name);

// ---- (b) rotate_in_place on the layer's layout ----------------------------------------------------------------

template <class T>
void check_in_place_on_packed_rows(bool interleaved, std::int64_t rotary_dim) {
  // qkv: [B, L, 3 h d + 3] (q, k, v of each position side by side, then padding); q = qkv[:, :, :h d] seen as
  // [B, L, h, d], i.e. (b, head, l, c) at b * L W + l * W + head * d + c.
  constexpr std::int64_t W = 3 * H * D + 3;
  const DType dtype = mha::dtype_of<T>();
  Rng rng(77);
  const Tensor qkv = random_tensor(dtype, {B, L, W}, rng);
  const TensorView q_view(qkv.data(), dtype, {B, H, L, D}, {L * W, D, W, 1});  // [B, h, L, d], transposed strides
  const std::vector<std::int64_t> rows = {9, 8, 7, 6, 5, 100, 200, 300, 400, 123'456};
  const PositionsView positions(std::span<const std::int64_t>(rows), {B, L});
  const RotaryOptions options{.base = 500000.0, .rotary_dim = rotary_dim, .interleaved = interleaved};
  const Tensor want = mha::apply_rotary(q_view, positions, options);

  Tensor rotated = qkv.clone();
  const std::int64_t strides[4] = {L * W, D, W, 1};
  const auto table =
      mha::detail::make_rotary_table<mha::detail::compute_t<T>>(&positions, B, L, rotary_dim ? rotary_dim : D, options);
  mha::detail::rotate_in_place(rotated.data_as<T>(), strides, B, H, L, D, table, false);

  const std::vector<double> before = to_doubles(qkv), after = to_doubles(rotated), q_want = to_doubles(want);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t l = 0; l < L; ++l)
      for (std::int64_t w = 0; w < W; ++w) {
        const std::size_t k = static_cast<std::size_t>((b * L + l) * W + w);
        if (w >= H * D) {
          ASSERT_EQ(after[k], before[k]) << "outside q, b " << b << " l " << l << " w " << w;
          continue;
        }
        const std::int64_t head = w / D, c = w % D;
        ASSERT_EQ(after[k], q_want[static_cast<std::size_t>(((b * H + head) * L + l) * D + c)])
            << "b " << b << " head " << head << " l " << l << " c " << c;
      }

  // And back: the inverse rotation in place returns to the input within rounding.
  mha::detail::rotate_in_place(rotated.data_as<T>(), strides, B, H, L, D, table, true);
  const std::vector<double> round_trip = to_doubles(rotated);
  const double tol = dtype == DType::Float64 ? 1e-12 : dtype == DType::Float32 ? 1e-6 : 2e-2;
  for (std::size_t k = 0; k < round_trip.size(); ++k) ASSERT_NEAR(round_trip[k], before[k], tol) << k;
}

TEST(RotaryInPlace, PackedRowsFloat32) {
  check_in_place_on_packed_rows<float>(false, 0);
  check_in_place_on_packed_rows<float>(true, 4);
}
TEST(RotaryInPlace, PackedRowsFloat64) {
  check_in_place_on_packed_rows<double>(true, 0);
  check_in_place_on_packed_rows<double>(false, 6);
}
TEST(RotaryInPlace, PackedRowsBfloat16) {
  check_in_place_on_packed_rows<mha::bfloat16>(false, 0);
  check_in_place_on_packed_rows<mha::bfloat16>(true, 2);
}

// ---- (c) bad arguments ------------------------------------------------------------------------------------

Tensor T4(Shape s, DType d = DType::Float32) { return Tensor(d, std::move(s)); }
const std::vector<std::int64_t> kFive = {0, 1, 2, 3, 4};
const std::vector<std::int64_t> kNegative = {0, 1, -2, 3, 4};

std::vector<BadCase> rotary_bad_cases() {
  const double nan = std::nan("");
  std::vector<BadCase> c;
  c.push_back({"x_rank3", [] { (void)mha::apply_rotary(T4({H, L, D})); }, "^x\\b"});
  c.push_back({"x_bool", [] { (void)mha::apply_rotary(T4({B, H, L, D}, DType::Bool)); }, "^x\\b"});
  c.push_back({"dy_rank5", [] { (void)mha::apply_rotary_backward(T4({1, B, H, L, D})); }, "^dy\\b"});
  c.push_back({"rotary_dim_odd",
               [] {
                 (void)mha::apply_rotary(T4({B, H, L, D}), {}, {.rotary_dim = 3});
               },
               "^rotary_dim\\b"});
  c.push_back({"rotary_dim_above_d",
               [] {
                 (void)mha::apply_rotary(T4({B, H, L, D}), {}, {.rotary_dim = 12});
               },
               "^rotary_dim\\b"});
  c.push_back({"rotary_dim_negative",
               [] {
                 (void)mha::apply_rotary(T4({B, H, L, D}), {}, {.rotary_dim = -2});
               },
               "^rotary_dim\\b"});
  c.push_back({"rotary_dim_default_odd_d", [] { (void)mha::apply_rotary(T4({B, H, L, 7})); }, "^rotary_dim\\b"});
  c.push_back({"base_zero", [] { (void)mha::apply_rotary(T4({B, H, L, D}), {}, {.base = 0.0}); }, "^base\\b"});
  c.push_back({"base_nan", [nan] { (void)mha::apply_rotary(T4({B, H, L, D}), {}, {.base = nan}); }, "^base\\b"});
  c.push_back({"base_inf", [] { (void)mha::apply_rotary(T4({B, H, L, D}), {}, {.base = kInf}); }, "^base\\b"});
  c.push_back({"positions_shape",
               [] {
                 (void)mha::apply_rotary(T4({B, H, L + 1, D}), PositionsView(std::span(kFive), {L}));
               },
               "^positions\\b"});
  c.push_back({"positions_rows",
               [] {
                 (void)mha::apply_rotary(T4({B + 1, H, 1, D}), PositionsView(std::span(kFive), {B + 3, 1}));
               },
               "^positions\\b"});
  c.push_back({"positions_negative",
               [] {
                 (void)mha::apply_rotary(T4({B, H, L, D}), PositionsView(std::span(kNegative), {L}));
               },
               "^positions\\b"});
  c.push_back({"positions_too_few", [] { (void)PositionsView(std::span(kFive), {2, 3}); }, "^positions\\b"});
  c.push_back({"positions_stride_rank", [] { (void)PositionsView(kFive.data(), {5}, {1, 1}); }, "^positions\\b"});
  c.push_back({"positions_negative_stride", [] { (void)PositionsView(kFive.data(), {5}, {-1}); }, "^positions\\b"});
  return c;
}

class RotaryBadInput : public ::testing::TestWithParam<BadCase> {};
TEST_P(RotaryBadInput, NamesTheArgument) { expect_error_naming_the_argument(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Rotary, RotaryBadInput, ::testing::ValuesIn(rotary_bad_cases()), bad_case_name);

}  // namespace
}  // namespace mha_test
