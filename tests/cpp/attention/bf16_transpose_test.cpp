// transpose_bf16 (src/attention/bf16_transpose.hpp), which the bfloat16 backward's products read P and dS
// through: every element lands at its transposed place, for sizes on and off the 32 x 32 blocks, with row
// strides wider than the tile; nothing outside the transposed tile is written.
#include "attention/bf16_transpose.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

namespace mha::detail {
namespace {

// A bfloat16 whose bits say where it came from: row r, column c of the source (r, c < 256).
bfloat16 tagged(std::int64_t r, std::int64_t c) {
  return bfloat16::from_bits(static_cast<std::uint16_t>((r << 8) | c));
}

void check_transpose(std::int64_t rows, std::int64_t cols, std::int64_t lds, std::int64_t ldd) {
  std::vector<bfloat16> src(static_cast<std::size_t>(std::max<std::int64_t>(1, rows * lds)));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < lds; ++c) src[static_cast<std::size_t>(r * lds + c)] = tagged(r, c);
  const bfloat16 untouched = bfloat16::from_bits(0xffff);  // a NaN no source element has (rows < 255)
  std::vector<bfloat16> dst(static_cast<std::size_t>(std::max<std::int64_t>(1, cols * ldd + 7)), untouched);
  transpose_bf16(src.data(), lds, rows, cols, dst.data(), ldd);
  for (std::int64_t c = 0; c < cols; ++c)
    for (std::int64_t r = 0; r < ldd; ++r) {
      const std::uint16_t got = dst[static_cast<std::size_t>(c * ldd + r)].bits;
      const std::uint16_t want = r < rows ? tagged(r, c).bits : untouched.bits;
      ASSERT_EQ(got, want) << "rows " << rows << " cols " << cols << " lds " << lds << " ldd " << ldd << " at (" << c
                           << ", " << r << ")";
    }
  for (std::size_t i = static_cast<std::size_t>(cols * ldd); i < dst.size(); ++i)
    ASSERT_EQ(dst[i].bits, untouched.bits) << "written past the tile";
}

TEST(Bfloat16Transpose, PutsEveryElementAtItsTransposedPlace) {
  for (const std::int64_t rows : {0, 1, 2, 31, 32, 33, 63, 64, 65, 96, 200, 254})
    for (const std::int64_t cols : {0, 1, 17, 31, 32, 33, 64, 100, 128, 255, 256})
      check_transpose(rows, cols, cols + (cols % 3), rows + 5);
}

TEST(Bfloat16Transpose, RandomSizesAndStrides) {
  std::mt19937_64 rng(32);
  std::uniform_int_distribution<std::int64_t> size(0, 254), extra(0, 40);
  for (int i = 0; i < 60; ++i) {
    const std::int64_t rows = size(rng), cols = std::min<std::int64_t>(256, size(rng) + 1);
    check_transpose(rows, cols, std::min<std::int64_t>(256, cols + extra(rng)), rows + extra(rng));
  }
}

}  // namespace
}  // namespace mha::detail
