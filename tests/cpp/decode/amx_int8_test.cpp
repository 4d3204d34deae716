// The AMX tiles of int8 decode (src/decode/amx_int8.hpp): the choice from faked facts and which calls take
// them, and, where this machine runs them, each piece against arithmetic written here: the query digits
// rebuild the row rounded at 30 bits, the logits are the exact integer dots scaled back, the value layout
// is the tiles' pairing, and P V adds the exact integer sums of the weights rounded at 31 bits. Rows the
// tiles cannot represent are left to the vector kernel, and said so. That decode over int8 pages agrees
// with the float64 reference whichever path runs is checked by the decode suites, run twice
// (tests/CMakeLists.txt: decode_amx_off forces the vectors).
#include "decode/amx_int8.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "decode/decode_driver.hpp"
#include "decode/decode_params.hpp"

namespace mha::detail::amx {
namespace {

TEST(AmxInt8Choice, TilesWhereTheCpuHasThemAndTheOsGrantsThem) {
  EXPECT_TRUE(choose_int8_tiles({true, true, std::nullopt}).tiles);
  EXPECT_FALSE(choose_int8_tiles({false, false, std::nullopt}).tiles);
  EXPECT_FALSE(choose_int8_tiles({true, false, std::nullopt}).tiles);
  EXPECT_EQ(choose_int8_tiles({true, true, std::nullopt}).description, "AMX tiles (the CPU has AMX-INT8)");
  EXPECT_EQ(choose_int8_tiles({false, false, std::nullopt}).description, "vectors (no AMX-INT8 on this CPU)");
  EXPECT_EQ(choose_int8_tiles({true, false, std::nullopt}).description,
            "vectors (the OS does not grant the AMX tile state)");
}

TEST(AmxInt8Choice, OffForcesVectorsOnForcesNothingTheMachineLacks) {
  EXPECT_FALSE(choose_int8_tiles({true, true, "off"}).tiles);
  EXPECT_EQ(choose_int8_tiles({true, true, "off"}).description, "vectors (forced by MHA_DECODE_AMX=off)");
  EXPECT_TRUE(choose_int8_tiles({true, true, "on"}).tiles);
  EXPECT_EQ(choose_int8_tiles({true, true, "on"}).description, "AMX tiles (forced by MHA_DECODE_AMX=on)");
  EXPECT_FALSE(choose_int8_tiles({false, false, "on"}).tiles);
  const TileChoice odd = choose_int8_tiles({true, true, "yes"});
  EXPECT_TRUE(odd.tiles);
  EXPECT_NE(odd.description.find("MHA_DECODE_AMX=\"yes\" ignored"), std::string::npos) << odd.description;
}

TEST(AmxInt8Choice, TakesHeadsOfSixteensAndGroupsOfTwoOrMoreRows) {
  EXPECT_TRUE(takes(128, 128, 2));
  EXPECT_TRUE(takes(16, 48, 4));
  EXPECT_TRUE(takes(64, 64, 9));
  EXPECT_FALSE(takes(128, 128, 1));  // one query row per kv head (h = h_kv, one query): the vectors were faster
  EXPECT_FALSE(takes(120, 128, 4));
  EXPECT_FALSE(takes(128, 72, 4));
  EXPECT_FALSE(takes(0, 16, 4));
}

// Where the tiles run, decode gives them scratch (and so runs them) for int8 pages of widths they take
// and two or more query rows per kv head's group (g x Lq), in either mode (the per-head mode's items hold
// one row of the group: it follows the group, so the two modes agree bitwise); none for one row, other
// widths or other storage.
TEST(AmxInt8Choice, DecodeRunsTheTilesOnlyWhereTheyTakeTheCallsShape) {
  DecodeParams<std::int8_t, float> p;
  p.h = 32, p.h_kv = 8, p.q_len = 1, p.d_k = 128, p.d_v = 64;
  const bool tiles = int8_tiles().tiles;
  EXPECT_EQ(decode::tile_scratch_bytes(p, 8, 4) > 0, tiles);  // group-packed: 8 kv heads x 4 rows
  EXPECT_EQ(decode::tile_scratch_bytes(p, 1, 1) > 0, tiles);  // per head: one row of a group of 4
  p.h = p.h_kv = 8;                                           // plain multi-head attention, one query
  EXPECT_EQ(decode::tile_scratch_bytes(p, 8, 1), 0);
  EXPECT_EQ(decode::tile_scratch_bytes(p, 1, 1), 0);
  p.q_len = 2;  // two new queries: two rows per kv head
  EXPECT_EQ(decode::tile_scratch_bytes(p, 8, 2) > 0, tiles);
  p.d_v = 72;
  EXPECT_EQ(decode::tile_scratch_bytes(p, 8, 2), 0);
  DecodeParams<float, float> f;
  f.h = 32, f.h_kv = 8, f.q_len = 1, f.d_k = 128, f.d_v = 64;
  EXPECT_EQ(decode::tile_scratch_bytes(f, 8, 4), 0);
}

TEST(AmxInt8Choice, ThisProcessFollowsTheVariable) {
  const char* value = std::getenv(kDecodeAmxVariable);
  if (value && std::string(value) == "off") {
    EXPECT_FALSE(int8_tiles().tiles);
  }
  EXPECT_FALSE(int8_tiles().description.empty());
}

#define MHA_SKIP_WITHOUT_TILES() \
  if (!int8_tiles().tiles) GTEST_SKIP() << "int8 decode runs on vectors here: " << int8_tiles().description

// 2^e, the smallest power of two above m > 0.
int exponent_above(double m) {
  int e = -200;
  while (std::ldexp(1.0, e) <= m) ++e;
  return e;
}

double round_half_even(double v) {
  const double below = std::floor(v), rest = v - below;
  return rest > 0.5 || (rest == 0.5 && std::fmod(below, 2.0) != 0.0) ? below + 1.0 : below;
}

// The integer a tiled query row's column stands for, rebuilt from its digits (column 4 k + r of dim group c / 4).
std::int64_t rebuilt(const std::vector<std::int8_t>& digits, int r, std::int64_t c) {
  std::int64_t v = 0;
  for (int k = 3; k >= 0; --k) v = v * 256 + digits[(c / 4) * 64 + 4 * (4 * k + r) + c % 4];
  return v;
}

TEST(AmxInt8Tiles, QueryDigitsRebuildTheRowRoundedAt30Bits) {
  MHA_SKIP_WITHOUT_TILES();
  std::mt19937 gen(7);
  std::uniform_real_distribution<float> u(-1, 1);
  for (const std::int64_t d_k : {16, 48, 64, 80, 128, 144})
    for (int scale = -70; scale <= 70; scale += 7) {
      const int rows = 1 + (scale + 70) % 4;
      std::vector<float> q(static_cast<std::size_t>(rows * d_k));
      for (float& x : q) x = std::ldexp(u(gen), scale);
      q[0] = 0.0f;                                                          // a zero in a row
      if (rows > 1) q[d_k + 1] = std::numeric_limits<float>::denorm_min();  // a subnormal
      std::vector<std::int8_t> digits(static_cast<std::size_t>(16 * d_k), 99);
      const RowGroup group = query_digits(q.data(), d_k, rows, d_k, digits.data());
      for (int r = 0; r < rows; ++r) {
        double m = 0;
        for (std::int64_t c = 0; c < d_k; ++c) m = std::max(m, std::fabs(double(q[r * d_k + c])));
        const bool expected = m >= 0x1p-60 && m <= 0x1p60;
        ASSERT_EQ((group.tiled >> r & 1) != 0, expected) << "max " << m;
        if (!expected) continue;
        const int e = exponent_above(m);
        ASSERT_EQ(group.unscale[r], std::ldexp(1.0f, e - 30));
        for (std::int64_t c = 0; c < d_k; ++c)
          ASSERT_EQ(rebuilt(digits, r, c), round_half_even(std::ldexp(double(q[r * d_k + c]), 30 - e)))
              << "d_k " << d_k << " row " << r << " column " << c;
      }
      for (int r = rows; r < 4; ++r)
        for (std::int64_t c = 0; c < d_k; ++c) ASSERT_EQ(rebuilt(digits, r, c), 0) << "a row past `rows`";
    }
}

TEST(AmxInt8Tiles, RowsOutOfReachAreLeftToTheVectors) {
  MHA_SKIP_WITHOUT_TILES();
  const std::int64_t d_k = 32;
  const float cases[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(), 0x1p61f,
                         0x1p-61f, 0.0f};
  for (const float x : cases) {
    std::vector<float> q(4 * d_k, 0.25f);
    for (std::int64_t c = 0; c < d_k; ++c) q[d_k + c] = c == 3 ? x : (x == 0x1p-61f || x == 0.0f ? 0.0f : 0.25f);
    std::vector<std::int8_t> digits(static_cast<std::size_t>(16 * d_k));
    const RowGroup group = query_digits(q.data(), d_k, 4, d_k, digits.data());
    const bool zero_row = x == 0.0f;
    EXPECT_EQ(group.tiled, zero_row ? 0xFu : 0xDu) << x;  // row 1 is out of reach, unless all zero
    for (std::int64_t c = 0; c < d_k; ++c) ASSERT_EQ(rebuilt(digits, 1, c), 0);
  }
}

// Random int8 rows, back to back with `stride` bytes between row starts.
std::vector<std::int8_t> random_rows(std::mt19937& gen, std::int64_t rows, std::int64_t stride) {
  std::uniform_int_distribution<int> u(-127, 127);
  std::vector<std::int8_t> v(static_cast<std::size_t>(rows * stride));
  for (auto& x : v) x = static_cast<std::int8_t>(u(gen));
  return v;
}

TEST(AmxInt8Tiles, LogitsAreTheExactIntegerDotsScaledBack) {
  MHA_SKIP_WITHOUT_TILES();
  std::mt19937 gen(11);
  std::uniform_real_distribution<float> u(-1, 1);
  for (const std::int64_t d_k : {16, 48, 64, 80, 128, 144})
    for (const int rows : {1, 2, 3, 4}) {
      const std::int64_t stride = d_k + 16 * (rows % 2);  // rows of a page, or with a gap between them
      const std::vector<std::int8_t> keys = random_rows(gen, 64, stride);
      std::vector<float> q(static_cast<std::size_t>(rows * d_k));
      for (float& x : q) x = std::ldexp(u(gen), rows * 3 - 5);
      const TileConfig config(d_k);
      std::vector<std::int8_t> digits(static_cast<std::size_t>(16 * d_k));
      const RowGroup group = query_digits(q.data(), d_k, rows, d_k, digits.data());
      ASSERT_EQ(group.tiled, (1u << rows) - 1);
      const std::int8_t* tiles[4] = {keys.data(), keys.data() + 16 * stride, keys.data() + 32 * stride,
                                     keys.data() + 48 * stride};
      std::vector<float> dots(static_cast<std::size_t>(rows * 64), -1.0f);
      std::vector<std::int32_t> sums(4 * 256);
      key_block_dots(tiles, stride, d_k, digits.data(), group, rows, dots.data(), 64, sums.data(), nullptr);
      for (int r = 0; r < rows; ++r)
        for (std::int64_t j = 0; j < 64; ++j) {
          std::int64_t exact = 0, magnitude = 0;
          for (std::int64_t c = 0; c < d_k; ++c) {
            const std::int64_t term = rebuilt(digits, r, c) * keys[static_cast<std::size_t>(j * stride + c)];
            exact += term, magnitude += std::abs(term);
          }
          const double want = double(exact) * group.unscale[r];  // exact in double (|exact| < 2^53)
          ASSERT_LE(std::fabs(double(dots[r * 64 + j]) - want), 0x1p-22 * double(magnitude) * group.unscale[r])
              << "d_k " << d_k << " row " << r << " key " << j;
        }
    }
}

TEST(AmxInt8Tiles, ValueTilesPairFourKeysPerWordAndZeroPastTheBlock) {
  MHA_SKIP_WITHOUT_TILES();
  std::mt19937 gen(13);
  for (const std::int64_t d_v : {16, 48, 64, 80, 128, 144})
    for (const std::int64_t kb : {1, 5, 63, 64}) {
      const std::vector<std::int8_t> v = random_rows(gen, kb, d_v);
      std::vector<const std::int8_t*> rows(static_cast<std::size_t>(kb));
      for (std::int64_t j = 0; j < kb; ++j) rows[j] = v.data() + (kb - 1 - j) * d_v;  // any order of rows
      std::vector<std::int8_t> tiles(static_cast<std::size_t>(1024 * ((d_v / 16 + 3) / 4 * 4)), 99);
      LinesAhead none;
      value_tiles(rows.data(), kb, d_v, tiles.data(), none, 0.0, 0.0);
      for (std::int64_t c = 0; c < d_v / 16; ++c)
        for (std::int64_t g = 0; g < 16; ++g)
          for (std::int64_t n = 0; n < 16; ++n)
            for (std::int64_t i = 0; i < 4; ++i) {
              const std::int64_t j = 4 * g + i;
              ASSERT_EQ(tiles[c * 1024 + g * 64 + 4 * n + i], j < kb ? rows[j][16 * c + n] : 0)
                  << "d_v " << d_v << " kb " << kb << " chunk " << c << " key " << j << " column " << n;
            }
    }
}

TEST(AmxInt8Tiles, ValuesAddTheExactIntegerSumsOfWeightsRoundedAt31Bits) {
  MHA_SKIP_WITHOUT_TILES();
  std::mt19937 gen(17);
  std::uniform_real_distribution<float> u(0, 1);
  for (const std::int64_t d_v : {16, 48, 64, 80, 128, 144})
    for (const int rows : {1, 2, 3, 4}) {
      const std::int64_t kb = 64 - 13 * (rows - 1);
      const std::vector<std::int8_t> v = random_rows(gen, kb, d_v);
      std::vector<const std::int8_t*> value_rows(static_cast<std::size_t>(kb));
      for (std::int64_t j = 0; j < kb; ++j) value_rows[j] = v.data() + j * d_v;
      std::vector<float> p(static_cast<std::size_t>(rows * 64), 0.0f);  // zeros past kb
      for (int r = 0; r < rows; ++r)
        for (std::int64_t j = 0; j < kb; ++j) p[r * 64 + j] = j % 7 == r ? 0.0f : std::ldexp(u(gen), 8 * r - 20);
      if (rows == 4)
        for (std::int64_t j = 0; j < 64; ++j) p[3 * 64 + j] = 0.0f;  // a row without weight: tiled, adds nothing
      std::vector<float> acc(static_cast<std::size_t>(rows * d_v)), before;
      for (float& x : acc) x = u(gen) - 0.5f;
      before = acc;
      const TileConfig config(16);
      std::vector<std::uint8_t> weights(16 * 64);
      std::vector<std::int8_t> tiles(static_cast<std::size_t>(1024 * ((d_v / 16 + 3) / 4 * 4)));
      std::vector<std::int32_t> sums(4 * 256);
      LinesAhead none;
      value_tiles(value_rows.data(), kb, d_v, tiles.data(), none, 0.0, 0.0);
      const RowGroup group = weight_digits(p.data(), 64, rows, weights.data());
      ASSERT_EQ(group.tiled, (1u << rows) - 1);
      accumulate_values(weights.data(), group, rows, tiles.data(), d_v, acc.data(), d_v, sums.data(), none, 0.0, 1.0);
      for (int r = 0; r < rows; ++r) {
        double m = 0;
        for (std::int64_t j = 0; j < 64; ++j) m = std::max(m, double(p[r * 64 + j]));
        const int e = m > 0 ? exponent_above(m) : 0;
        for (std::int64_t c = 0; c < d_v; ++c) {
          const double a = before[r * d_v + c];
          if (m == 0) {
            ASSERT_EQ(acc[r * d_v + c], float(a)) << "a row without weight adds nothing";
            continue;
          }
          std::int64_t exact = 0, magnitude = 0;
          for (std::int64_t j = 0; j < kb; ++j) {
            const auto w = static_cast<std::int64_t>(round_half_even(std::ldexp(double(p[r * 64 + j]), 31 - e)));
            exact += w * v[j * d_v + c], magnitude += std::abs(w * v[j * d_v + c]);
          }
          const double want = a + std::ldexp(double(exact), e - 31);
          const double bound = 0x1p-22 * (std::fabs(a) + std::ldexp(double(magnitude), e - 31));
          ASSERT_LE(std::fabs(double(acc[r * d_v + c]) - want), bound)
              << "d_v " << d_v << " row " << r << " column " << c;
        }
      }
    }
}

TEST(AmxInt8Tiles, WeightRowsOutOfReachAreLeftToTheVectors) {
  MHA_SKIP_WITHOUT_TILES();
  const float cases[] = {std::numeric_limits<float>::quiet_NaN(), 0x1p61f, 0x1p-61f};
  for (const float x : cases) {
    std::vector<float> p(4 * 64, 0.5f);
    for (std::int64_t j = 0; j < 64; ++j) p[2 * 64 + j] = x == 0x1p-61f ? x : (j == 9 ? x : 0.5f);
    std::vector<std::uint8_t> weights(16 * 64, 7);
    const RowGroup group = weight_digits(p.data(), 64, 4, weights.data());
    EXPECT_EQ(group.tiled, 0xBu) << x;  // row 2 is not
    for (int k = 0; k < 4; ++k)
      for (std::int64_t j = 0; j < 64; ++j) ASSERT_EQ(weights[(4 * k + 2) * 64 + j], 0) << "its digits are 0";
  }
}

}  // namespace
}  // namespace mha::detail::amx
