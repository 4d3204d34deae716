// tile_row_bands (src/attention/masks.hpp): the bands a diagonal logits tile is computed in. For every tile
// shape, position and right bound: the bands cover the tile's rows once, in order; each is as wide as its
// last row sees (and so as wide as any of its rows sees); neighbours differ in width (else they would be
// one band); at most kMaxRowBands; a tile no row of which sees less than the last is one band. And the
// shapes chosen: 64-row bands on a 256-row diagonal, two halves on a 128-row one, a tile under 32 rows
// whole.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "attention/masks.hpp"

namespace mha::detail {
namespace {

AttentionInputs<float> causal_inputs(std::int64_t query_shift, std::int64_t window_right, bool causal) {
  AttentionInputs<float> p;
  p.query_shift = query_shift;
  p.window_right = window_right;
  p.causal = causal;
  return p;
}

// What row i of the tile sees, written here: keys j0 + c with c < cols and j0 + c <= i + shift + right.
std::int64_t sees(std::int64_t i, std::int64_t shift, std::int64_t right, std::int64_t j0, std::int64_t cols) {
  if (right < 0) return cols;
  return std::clamp<std::int64_t>(i + shift + right - j0 + 1, 0, cols);
}

void check_bands(const AttentionInputs<float>& p, std::int64_t right, std::int64_t i0, std::int64_t rows,
                 std::int64_t j0, std::int64_t cols) {
  SCOPED_TRACE(::testing::Message() << "i0 " << i0 << " rows " << rows << " j0 " << j0 << " cols " << cols << " shift "
                                    << p.query_shift << " right " << right);
  const auto bands = tile_row_bands(p, i0, rows, j0, cols);
  std::int64_t covered = 0, used = 0, previous_cols = -1;
  for (const RowBand& band : bands) {
    if (band.rows == 0) continue;
    ++used;
    ASSERT_EQ(band.first, covered) << "bands in order, without gaps or overlaps";
    covered += band.rows;
    const std::int64_t last = i0 + band.first + band.rows - 1;
    ASSERT_EQ(band.cols, sees(last, p.query_shift, right, j0, cols)) << "as wide as its last row sees";
    for (std::int64_t r = band.first; r < band.first + band.rows; ++r)
      ASSERT_LE(sees(i0 + r, p.query_shift, right, j0, cols), band.cols);
    ASSERT_NE(band.cols, previous_cols) << "neighbours as wide are one band";
    previous_cols = band.cols;
  }
  ASSERT_EQ(covered, rows);
  ASSERT_LE(used, static_cast<std::int64_t>(kMaxRowBands));
  if (sees(i0, p.query_shift, right, j0, cols) == sees(i0 + rows - 1, p.query_shift, right, j0, cols)) {
    ASSERT_EQ(used, 1) << "no row sees less than the last: one band";
  }
}

TEST(RowBands, CoverTheTileAndFollowTheDiagonalOnRandomTiles) {
  std::mt19937_64 rng(64);
  std::uniform_int_distribution<std::int64_t> size(1, 256), position(0, 600), shift(-300, 300), right(-1, 40);
  for (int n = 0; n < 3000; ++n) {
    const std::int64_t window_right = right(rng);
    const bool causal = rng() % 2 == 0;
    const AttentionInputs<float> p = causal_inputs(shift(rng), window_right, causal);
    check_bands(p, right_extent(p), position(rng), size(rng), position(rng), size(rng));
  }
}

TEST(RowBands, TheChosenHeights) {
  const AttentionInputs<float> p = causal_inputs(0, -1, true);
  const auto tall = tile_row_bands(p, 0, 256, 0, 256);  // a diagonal tile of a 256-row query block
  for (std::int64_t k = 0; k < 4; ++k) {
    EXPECT_EQ(tall[static_cast<std::size_t>(k)].first, 64 * k);
    EXPECT_EQ(tall[static_cast<std::size_t>(k)].rows, 64);
    EXPECT_EQ(tall[static_cast<std::size_t>(k)].cols, 64 * (k + 1));
  }
  const auto short_tile = tile_row_bands(p, 128, 128, 128, 256);  // a 128-row block's diagonal, keys beyond it
  EXPECT_EQ(short_tile[0].rows, 64);
  EXPECT_EQ(short_tile[0].cols, 64);
  EXPECT_EQ(short_tile[1].rows, 64);
  EXPECT_EQ(short_tile[1].cols, 128);
  EXPECT_EQ(short_tile[2].rows, 0);
  const auto small = tile_row_bands(p, 0, 31, 0, 31);  // under 32 rows: whole
  EXPECT_EQ(small[0].rows, 31);
  EXPECT_EQ(small[0].cols, 31);
  EXPECT_EQ(small[1].rows, 0);
}

}  // namespace
}  // namespace mha::detail
