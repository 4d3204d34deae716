// The one entry for matrix products: every product of the library (projections, their gradients, the
// fused kernel's tiles) and of the example Transformer goes through here. float32 runs oneDNN's sgemm
// (the only call of it in the tree); float64, the verification dtype that oneDNN's CPU matmul does
// not support, runs plain loops; bfloat16 (gemm_bf16.cpp) runs oneDNN's matmul primitive (AMX or
// AVX512-BF16) or sgemm over float32 copies of the operands, whichever this process found faster at
// first use (bf16_path.hpp), always accumulating in float32. A new dtype's product is added here.
//
// A product is C [M, N] = alpha op(A) op(B), or C += alpha op(A) op(B), with op(A) [M, K] and
// op(B) [K, N]. Every matrix is row-major with its own row stride in elements (ld), so an operand or
// the result may be a block or a column slice of a wider matrix:
//   gemm<float>(M, N, K, plain(x, ldx), transposed(w, K), overwrite(y, ldy));   // y = x W^T
#pragma once

#include <cstdint>
#include <string>

#include "bf16_path.hpp"
#include "mha/bfloat16.hpp"

namespace mha::detail {

// A matrix a product reads: X [rows, cols] at `data`, rows `ld` elements apart; op(X) is X, or X^T
// when `transposed`.
template <class T>
struct GemmInput {
  const T* data;
  std::int64_t ld;
  bool transposed;
};

template <class T>
GemmInput<T> plain(const T* x, std::int64_t ld) {
  return {x, ld, false};
}
template <class T>
GemmInput<T> transposed(const T* x, std::int64_t ld) {
  return {x, ld, true};
}

// Where a product writes: C [M, N] at `data`, rows `ld` elements apart, overwritten or added to.
template <class T>
struct GemmOutput {
  T* data;
  std::int64_t ld;
  bool accumulate;
};

template <class T>
GemmOutput<T> overwrite(T* c, std::int64_t ld) {
  return {c, ld, false};
}
template <class T>
GemmOutput<T> accumulate_into(T* c, std::int64_t ld) {
  return {c, ld, true};
}

// Rows of C per work item of gemm(). Each block of C rows is computed whole (its full K reduction) by
// one thread, so the result does not depend on the number of threads: oneDNN's own threading may
// split K and sum the parts in an order that does (measured: the layer's out differed in 546 of
// 19,200 elements between 1 and 2 threads). Every call packs its B operand again, so larger blocks
// run faster: one thread, N = K = 512, measured on a Zen 5 (AVX-512): 174-185 GFLOP/s in blocks of
// 128 rows, 191-197 in 256, 197-203 in 512. gemm_rows_per_block picks, from M alone, the largest
// power of two from kGemmRowsPerBlock to kGemmMaxRowsPerBlock that still leaves two blocks or more.
inline constexpr std::int64_t kGemmRowsPerBlock = 128;
inline constexpr std::int64_t kGemmMaxRowsPerBlock = 512;

constexpr std::int64_t gemm_rows_per_block(std::int64_t M) {
  std::int64_t rows = kGemmRowsPerBlock;
  while (rows < kGemmMaxRowsPerBlock && 4 * rows <= M) rows *= 2;
  return rows;
}

// A product with few row blocks would leave threads idle (M = B*L = 128: the projections of short
// batches, which PyTorch runs on every thread). Its columns are then split too, in 2, 4, ... parts
// (a power of two, so that two threads get equal shares) of at least kGemmMinColsPerBlock columns
// (multiples of 16 but the last), until there are kGemmMinWorkItems work items or N allows no more.
// Like the rows, the split depends on the sizes alone. Measured on a Zen 5 (AVX-512), the layer's
// forward at B = 8, N = 16 (128 rows), 2 threads: E = 512 1.38 -> 0.89 ms, E = 256 0.39 -> 0.25 ms
// (one thread: 1.3-1.6 ms and 0.38-0.45 ms).
inline constexpr std::int64_t kGemmMinWorkItems = 4;
inline constexpr std::int64_t kGemmMinColsPerBlock = 128;

constexpr std::int64_t gemm_column_blocks(std::int64_t M, std::int64_t N) {
  const std::int64_t rows = gemm_rows_per_block(M), row_blocks = (M + rows - 1) / rows;
  std::int64_t blocks = 1;
  while (blocks * row_blocks < kGemmMinWorkItems && 2 * blocks * kGemmMinColsPerBlock <= N) blocks *= 2;
  return blocks;
}

// A product with a single row block and a single column block (M <= kGemmRowsPerBlock and
// N < 2 kGemmMinColsPerBlock: the weight gradients dW = dY^T X of narrow layers, K = B*L rows) would
// run on one thread; it is split instead into K / 512 parts of K (at most 4), computed in parallel
// into separate buffers and summed in a fixed order. The split depends on M, N and K only, never on
// the thread count, so results stay bitwise thread-independent.
inline constexpr std::int64_t kGemmMinRowsPerKChunk = 512;
inline constexpr std::int64_t kGemmMaxKChunks = 4;

// A whole product on the library's threads: blocks of gemm_rows_per_block(M) rows (and
// gemm_column_blocks(M, N) parts of the columns) of C shared among them
// (on the calling thread alone when the product is small, see parallel.hpp). K = 0 gives C = 0 (or
// leaves C as it is when accumulating). Results are bitwise independent of the thread count. Throws
// mha::Error (an internal error) if oneDNN refuses the product, e.g. for a row stride below the rows'
// width.
template <class T>
void gemm(std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<T> A, GemmInput<T> B, GemmOutput<T> C, T alpha = 1);

// One tile of a kernel, on the calling thread only (for use inside the kernel's own parallel region).
// A product oneDNN refuses is an internal assertion: it prints the product's arguments and aborts.
void gemm_tile(std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<float> A, GemmInput<float> B,
               GemmOutput<float> C, float alpha = 1);

// bfloat16 operands, float32 accumulation (gemm_bf16.cpp). gemm<bfloat16> rounds each product's C to
// bfloat16 once (when accumulating, the old C is added in float32 before that rounding); these
// overloads keep C in float32, as the kernels' tiles and sums of several products need. Where oneDNN's
// matmul is its AMX kernel, gemm_tile copies a transposed A plain first (faster there: gemm_bf16.cpp).
void gemm(std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<bfloat16> A, GemmInput<bfloat16> B,
          GemmOutput<float> C, float alpha = 1);
void gemm_tile(std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<bfloat16> A, GemmInput<bfloat16> B,
               GemmOutput<float> C, float alpha = 1);

// Whether that gemm_tile copies a transposed A plain before its product (oneDNN's AMX matmul): a caller that
// makes A itself can then write it transposed in the first place.
bool gemm_tile_copies_transposed_bf16();

// The path that runs this process's bfloat16 products (those of M N K >= 65536 multiply-adds; smaller
// ones always run on sgemm, gemm_bf16.cpp says why), decided once, at the first call of either function
// below or the first such product: MHA_BF16_GEMM=onednn|sgemm forces one; otherwise, where oneDNN has a
// native bf16 matmul, both are timed on the fused kernels' tiles on one thread (bf16_path.hpp; a few ms
// of products, after making what they need: gemm_bf16.cpp's kMeasuredRounds).
Bf16Path bf16_gemm_path();

// That path and why, e.g. "oneDNN matmul brg:avx512_core_amx_bf16 (chosen: 1370 vs sgemm's 275 GFLOP/s,
// measured at first use)", "sgemm over widened operands (forced by MHA_BF16_GEMM=sgemm)", or "sgemm
// over widened operands (no bf16 instructions; oneDNN's bf16 matmul here: ...)".
std::string bf16_gemm_implementation();

}  // namespace mha::detail
