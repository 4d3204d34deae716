// The one entry for matrix products: every product of the library (projections, their gradients, the
// fused kernel's tiles) and of the example Transformer goes through here. float32 runs oneDNN's sgemm
// (the only call of it in the tree); float64, the verification dtype that oneDNN's CPU matmul does
// not support, runs plain loops. A new dtype's product is added here.
//
// Every product is C [M, N] = alpha A' B' (+ C when accumulate), row-major, where
//   A' = A [M, K], or A^T for A [K, M] when trans_a;   B' = B [K, N], or B^T for B [N, K] when trans_b;
// lda, ldb, ldc are row strides in elements (C may be a column slice of a wider matrix).
#pragma once

#include <cstdint>

namespace mha::detail {

// The arguments of one product, named (the BLAS argument list, with its order kept).
template <class T>
struct GemmArgs {
  bool trans_a = false, trans_b = false;
  std::int64_t M = 0, N = 0, K = 0;
  T alpha = 1;
  const T* A = nullptr;
  std::int64_t lda = 0;
  const T* B = nullptr;
  std::int64_t ldb = 0;
  bool accumulate = false;  // C += ... instead of C = ...
  T* C = nullptr;
  std::int64_t ldc = 0;
};

// Rows of C per work item of gemm(). Each block of C rows is computed whole (its full K reduction) by
// one thread, so the result does not depend on the number of threads: oneDNN's own threading may
// split K and sum the parts in an order that does (measured: the layer's out differed in 546 of
// 19,200 elements between 1 and 2 threads). 128 rows keep each call large enough to run at the
// GEMM's full rate.
inline constexpr std::int64_t kGemmRowsPerBlock = 128;

// A whole product on the library's threads: blocks of kGemmRowsPerBlock rows of C shared among them
// (on the calling thread alone when the product is small, see parallel.hpp). K = 0 gives C = 0
// (or leaves C as it is when accumulating). Results are bitwise independent of the thread count.
template <class T>
void gemm(const GemmArgs<T>& args);

// One tile of a kernel, on the calling thread only (for use inside the kernel's own parallel region).
void gemm_tile(const GemmArgs<float>& args);

}  // namespace mha::detail
