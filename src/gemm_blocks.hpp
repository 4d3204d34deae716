// How gemm() shares a product among threads, for every dtype: C is cut into blocks of
// gemm_rows_per_block(M) rows and gemm_column_blocks(M, N) parts of the columns (gemm.hpp), each
// computed whole (its full K reduction) by one thread, so the result does not depend on the number of
// threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include <oneapi/dnnl/dnnl_types.h>

#include "gemm.hpp"

namespace mha::detail {

// Calls product(rows, cols, A_rows, B_columns, C_block) for every block of C in the threads' parallel
// region, where A_rows are the block's rows of op(A), B_columns its columns of op(B) and C_block the
// block of C; product returns oneDNN's status. A and B may differ in type (the bfloat16 product's sgemm
// path passes B already widened and widens each block's rows of A itself). Returns the status of a failed block, if any
// (an exception cannot leave the region).
template <class TA, class TB, class TC, class Product>
dnnl_status_t for_each_block(std::int64_t M, std::int64_t N, GemmInput<TA> A, GemmInput<TB> B, GemmOutput<TC> C,
                             Product product) {
  const std::int64_t rows_per_block = gemm_rows_per_block(M);
  const std::int64_t row_blocks = (M + rows_per_block - 1) / rows_per_block;
  const std::int64_t column_blocks = gemm_column_blocks(M, N);
  std::atomic<int> failure{dnnl_success};
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t block = 0; block < row_blocks * column_blocks; ++block) {  // C [m0.., n0..], whole K
    const std::int64_t m0 = block / column_blocks * rows_per_block, rows = std::min(rows_per_block, M - m0);
    const std::int64_t part = block % column_blocks;  // columns [n0, n1), multiples of 16 but the last
    const std::int64_t n0 = N * part / column_blocks / 16 * 16;
    const std::int64_t n1 = part + 1 == column_blocks ? N : N * (part + 1) / column_blocks / 16 * 16;
    GemmInput<TA> A_rows = A;  // rows of op(A): columns of A when transposed
    A_rows.data += A.transposed ? m0 : m0 * A.ld;
    GemmInput<TB> B_columns = B;  // columns of op(B): rows of B when transposed
    B_columns.data += B.transposed ? n0 * B.ld : n0;
    const GemmOutput<TC> C_block{C.data + m0 * C.ld + n0, C.ld, C.accumulate};
    const dnnl_status_t status = product(rows, n1 - n0, A_rows, B_columns, C_block);
    if (status != dnnl_success) failure = status;
  }
  return static_cast<dnnl_status_t>(failure.load());
}

}  // namespace mha::detail
