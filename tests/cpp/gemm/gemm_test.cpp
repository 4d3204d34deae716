// The one GEMM entry (src/gemm.hpp) against a float64 product written out here: every transposition,
// accumulate or not, alpha, K = 0, row strides wider than the rows, sizes across the row blocks
// (gemm_rows_per_block), few row blocks with the columns split (gemm_column_blocks, every transposition),
// one row block with K split in parts (kGemmMinRowsPerKChunk); and the float32
// result bitwise independent of the thread count.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gemm.hpp"

namespace mha_test {
namespace {

using mha::detail::gemm;
using mha::detail::gemm_column_blocks;
using mha::detail::gemm_rows_per_block;
using mha::detail::kGemmMaxRowsPerBlock;
using mha::detail::kGemmMinColsPerBlock;
using mha::detail::kGemmMinRowsPerKChunk;
using mha::detail::kGemmMinWorkItems;
using mha::detail::kGemmRowsPerBlock;

struct GemmCase {
  bool trans_a, trans_b, accumulate;
  std::int64_t M, N, K;
  double alpha;
  std::int64_t pad;  // extra elements at the end of every row of A, B and C

  std::string name() const {
    return std::string(trans_a ? "At" : "A") + (trans_b ? "Bt" : "B") + (accumulate ? "_acc" : "") + "_M" +
           std::to_string(M) + "_N" + std::to_string(N) + "_K" + std::to_string(K) + (alpha != 1 ? "_alpha" : "") +
           (pad ? "_pad" : "");
  }
};

// Row-major operands with their row strides, as the product reads them.
template <class T>
struct Operands {
  std::int64_t lda, ldb, ldc;
  std::vector<T> A, B, C;
};

template <class T>
Operands<T> make_operands(const GemmCase& c, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  const std::int64_t a_rows = c.trans_a ? c.K : c.M, a_cols = c.trans_a ? c.M : c.K;
  const std::int64_t b_rows = c.trans_b ? c.N : c.K, b_cols = c.trans_b ? c.K : c.N;
  Operands<T> o{a_cols + c.pad, b_cols + c.pad, c.N + c.pad, {}, {}, {}};
  auto fill = [&](std::vector<T>& x, std::int64_t rows, std::int64_t ld) {
    x.resize(static_cast<std::size_t>(std::max<std::int64_t>(1, rows * ld)));
    for (T& e : x) e = static_cast<T>(u(rng));
  };
  fill(o.A, a_rows, o.lda);
  fill(o.B, b_rows, o.ldb);
  fill(o.C, c.M, o.ldc);
  return o;
}

// The product of the case on its operands, through the entry under test.
template <class T>
void run_gemm(const GemmCase& c, Operands<T>& o) {
  gemm<T>(c.M, c.N, c.K, {o.A.data(), o.lda, c.trans_a}, {o.B.data(), o.ldb, c.trans_b},
          {o.C.data(), o.ldc, c.accumulate}, static_cast<T>(c.alpha));
}

// C as the product defines it, in float64 from the same operands; also sum |alpha a b| per element.
template <class T>
void expected(const GemmCase& c, const Operands<T>& o, std::vector<double>& want, std::vector<double>& magnitude) {
  want.assign(static_cast<std::size_t>(c.M * c.N), 0.0);
  magnitude.assign(want.size(), 0.0);
  for (std::int64_t m = 0; m < c.M; ++m)
    for (std::int64_t n = 0; n < c.N; ++n) {
      double sum = 0, size = 0;
      for (std::int64_t k = 0; k < c.K; ++k) {
        const double a = c.trans_a ? o.A[k * o.lda + m] : o.A[m * o.lda + k];
        const double b = c.trans_b ? o.B[n * o.ldb + k] : o.B[k * o.ldb + n];
        sum += a * b;
        size += std::fabs(a * b);
      }
      const double before = c.accumulate ? static_cast<double>(o.C[m * o.ldc + n]) : 0.0;
      want[m * c.N + n] = before + c.alpha * sum;
      magnitude[m * c.N + n] = std::fabs(before) + std::fabs(c.alpha) * size;
    }
}

std::vector<GemmCase> cases() {
  std::vector<GemmCase> all;
  const std::int64_t rows[] = {1, 7, kGemmRowsPerBlock, kGemmRowsPerBlock + 1, 2 * kGemmRowsPerBlock + 45};
  for (int t = 0; t < 8; ++t)
    for (std::int64_t M : rows)
      all.push_back({(t & 1) != 0, (t & 2) != 0, (t & 4) != 0, M, 19, 33, t % 3 == 0 ? 0.5 : 1.0, t % 2 == 0 ? 3 : 0});
  all.push_back({false, true, false, 5, 4, 0, 1.0, 0});  // K = 0: C = 0
  all.push_back({true, false, true, 5, 4, 0, 1.0, 2});   // K = 0, accumulating: C unchanged
  all.push_back({false, false, false, 64, 64, 1, 1.0, 0});
  // Blocks of more rows (gemm_rows_per_block): 256 and 512, with a remainder.
  all.push_back({false, true, true, 4 * 256 - 3, 17, 29, 1.0, 1});
  all.push_back({true, false, false, 3 * kGemmMaxRowsPerBlock + 45, 9, 21, 0.5, 0});
  // Few row blocks, wide N: the columns split too (gemm_column_blocks), in parts of unequal width
  // (N not a multiple of 16 or of the parts), with every transposition.
  for (int t = 0; t < 4; ++t) {
    all.push_back({(t & 1) != 0, (t & 2) != 0, t == 3, 9, 4 * kGemmMinColsPerBlock + 45, 70, 1.0, t == 1 ? 5 : 0});
    all.push_back(
        {(t & 1) != 0, (t & 2) != 0, t == 0, kGemmRowsPerBlock + 3, 2 * kGemmMinColsPerBlock + 1, 40, 0.5, 0});
  }
  // One row block, long K: split into parts of K (kGemmMinRowsPerKChunk), as the weight gradients are.
  all.push_back({true, false, false, 24, 19, 2 * kGemmMinRowsPerKChunk + 37, 1.0, 0});
  all.push_back({true, false, true, 24, 19, 9 * kGemmMinRowsPerKChunk + 5, 0.5, 3});
  return all;
}

class GemmTest : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GemmTest, Float32WithinRoundingOfTheFloat64Product) {
  const GemmCase c = GetParam();
  Operands<float> o = make_operands<float>(c, 1);
  std::vector<double> want, magnitude;
  expected(c, o, want, magnitude);
  const std::vector<float> before = o.C;
  run_gemm(c, o);
  // float32 accumulation of K terms: within K + 2 units of float's epsilon of the terms' magnitude.
  const double eps = std::ldexp(1.0, -23) * static_cast<double>(c.K + 2);
  for (std::int64_t m = 0; m < c.M; ++m) {
    for (std::int64_t n = 0; n < c.N; ++n)
      ASSERT_NEAR(o.C[m * o.ldc + n], want[m * c.N + n], eps * magnitude[m * c.N + n] + 1e-30)
          << "C[" << m << ", " << n << "]";
    for (std::int64_t n = c.N; n < o.ldc; ++n)
      ASSERT_EQ(o.C[m * o.ldc + n], before[m * o.ldc + n]) << "padding written";
  }
}

TEST_P(GemmTest, Float64MatchesTheProductToDoublePrecision) {
  const GemmCase c = GetParam();
  Operands<double> o = make_operands<double>(c, 2);
  std::vector<double> want, magnitude;
  expected(c, o, want, magnitude);
  run_gemm(c, o);
  for (std::int64_t m = 0; m < c.M; ++m)
    for (std::int64_t n = 0; n < c.N; ++n)
      ASSERT_NEAR(o.C[m * o.ldc + n], want[m * c.N + n], 1e-14 * (c.K + 2) * magnitude[m * c.N + n] + 1e-300);
}

TEST(Gemm, RowsPerBlockGrowWithMAndKeepTwoBlocks) {
  EXPECT_EQ(gemm_rows_per_block(1), kGemmRowsPerBlock);
  EXPECT_EQ(gemm_rows_per_block(511), kGemmRowsPerBlock);
  EXPECT_EQ(gemm_rows_per_block(512), 2 * kGemmRowsPerBlock);
  EXPECT_EQ(gemm_rows_per_block(1 << 20), kGemmMaxRowsPerBlock);
  for (std::int64_t M = 4 * kGemmRowsPerBlock; M < 8 * kGemmMaxRowsPerBlock; M += 37)
    EXPECT_GE((M + gemm_rows_per_block(M) - 1) / gemm_rows_per_block(M), 2) << M;
}

TEST(Gemm, ColumnsSplitOnlyWhereRowBlocksAreFew) {
  EXPECT_EQ(gemm_column_blocks(128, 1536), kGemmMinWorkItems);  // the projections of B*L = 128 rows
  EXPECT_EQ(gemm_column_blocks(256, 1536), kGemmMinWorkItems / 2);
  EXPECT_EQ(gemm_column_blocks(128, 2 * kGemmMinColsPerBlock - 1), 1);  // too narrow: K split instead
  EXPECT_EQ(gemm_column_blocks(4 * kGemmMaxRowsPerBlock, 4096), 1);     // enough row blocks
  for (std::int64_t M : {1, 100, 300, 700})
    for (std::int64_t N = 1; N < 3000; N += 97)
      EXPECT_GE(N / gemm_column_blocks(M, N), kGemmMinColsPerBlock < N ? kGemmMinColsPerBlock - 16 : 0)
          << M << " " << N;
}

INSTANTIATE_TEST_SUITE_P(Configs, GemmTest, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<GemmCase>& info) { return info.param.name(); });

TEST(Gemm, Float32BitwiseIndependentOfTheThreadCount) {
  // Large enough to run in parallel (above parallel.hpp's threshold): several row blocks; and one row
  // block with wide N, its columns split (a projection of 128 rows); one row block with a long K, split
  // into parts of K (a weight gradient's shape), accumulating.
  for (const GemmCase& c : {GemmCase{false, true, false, 3 * kGemmRowsPerBlock + 5, 96, 200, 1.0, 0},
                            GemmCase{true, true, false, 2 * kGemmMaxRowsPerBlock + 45, 96, 200, 1.0, 0},
                            GemmCase{false, true, true, kGemmRowsPerBlock, 3 * 512 + 7, 512, 1.0, 0},
                            GemmCase{true, false, true, 64, 64, 4 * kGemmMinRowsPerKChunk + 3, 1.0, 0}}) {
    Operands<float> one = make_operands<float>(c, 3), two = one;
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    run_gemm(c, one);
    omp_set_num_threads(2);
    run_gemm(c, two);
    omp_set_num_threads(saved);
    EXPECT_EQ(one.C, two.C) << c.name();
  }
}

}  // namespace
}  // namespace mha_test
