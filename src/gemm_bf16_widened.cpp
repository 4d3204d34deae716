// The bfloat16 products' sgemm path (gemm_bf16_widened.hpp): bfloat16 operands widened exactly to
// float32 (the bits shifted up), then sgemm.
#include "gemm_bf16_widened.hpp"

#include <omp.h>

#include <algorithm>
#include <memory>
#include <type_traits>

#include "bf16_conversion.hpp"
#include "gemm_blocks.hpp"
#include "parallel.hpp"

namespace mha::detail {

namespace {

// Elements below which a whole product's operand is widened on the calling thread alone (~0.05 ms).
constexpr std::int64_t kMinParallelWidening = 1 << 17;

// Scratch of float32 that grows and is never zero-filled (every element read is written first): a
// std::vector's resize zero-filled whatever the last, smaller operand had not used, on every tile
// (the forward's operands alternate between 8K and 32K elements).
class WideningBuffer {
 public:
  float* reserve(std::int64_t count) {
    if (count > capacity_) {
      data_ = std::make_unique_for_overwrite<float[]>(static_cast<std::size_t>(count));
      capacity_ = count;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<float[]> data_;
  std::int64_t capacity_ = 0;
};

// Stored rows [r0, r1) of X (stored_cols each) widened into wide (row stride stored_cols): the bits
// shifted up.
void widen_rows(GemmInput<bfloat16> X, std::int64_t stored_cols, std::int64_t r0, std::int64_t r1,
                float* __restrict wide) {
  for (std::int64_t r = r0; r < r1; ++r) widen_bfloat16(X.data + r * X.ld, stored_cols, wide + r * stored_cols);
}

// The stored matrix of a bfloat16 operand, op(X) [rows, cols], widened into `out` (row stride: the
// stored width), as a float32 operand of the same orientation; on the library's threads when
// `in_parallel` (a whole product's operand, outside any parallel region); a tile's operands, inside a
// kernel's region, on the calling thread.
GemmInput<float> widened(std::int64_t rows, std::int64_t cols, GemmInput<bfloat16> X, WideningBuffer& out,
                         bool in_parallel = false) {
  const std::int64_t stored_rows = X.transposed ? cols : rows, stored_cols = X.transposed ? rows : cols;
  float* wide = out.reserve(stored_rows * stored_cols);
  if (in_parallel && stored_rows * stored_cols >= kMinParallelWidening) {
    const int threads = omp_get_max_threads();
#pragma omp parallel for schedule(static)
    for (int t = 0; t < threads; ++t)
      widen_rows(X, stored_cols, stored_rows * t / threads, stored_rows * (t + 1) / threads, wide);
  } else {
    widen_rows(X, stored_cols, 0, stored_rows, wide);
  }
  return {wide, std::max<std::int64_t>(stored_cols, 1), X.transposed};
}

}  // namespace

void widened_tile(std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<bfloat16> A, GemmInput<bfloat16> B,
                  GemmOutput<float> C, float alpha) {
  thread_local WideningBuffer a, b;
  gemm_tile(M, N, K, widened(M, K, A, a), widened(K, N, B, b), C, alpha);
}

// The whole product through sgemm on widened operands, on the library's threads in the blocks of the
// other path (gemm_blocks.hpp: thread-count independent): B widened once, each block widening its rows
// of A into its thread's scratch and, for a bfloat16 C, computing a float32 block rounded once (the old C
// added in float32 first when accumulating). Per block, so that no widened copy of A or C the size of
// the whole product is made: made whole on every call, their fresh pages cost more than the widening
// itself (measured on a Zen 5, the bfloat16 layer's training step at N 4096 with the path forced: about
// a tenth of its time in page faults and the serial widening).
template <class TC>
void gemm_widened(std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<bfloat16> A, GemmInput<bfloat16> B,
                  GemmOutput<TC> C, float alpha) {
  const SerialIfSmall serial_if_small(2.0 * M * N * K);
  WideningBuffer b;
  const GemmInput<float> B32 = widened(K, N, B, b, true);
  for_each_block(M, N, A, B32, C, [&](std::int64_t rows, std::int64_t cols, auto A_rows, auto B_columns, auto C_block) {
    thread_local WideningBuffer a, c;
    const GemmInput<float> A32 = widened(rows, K, A_rows, a);
    if constexpr (std::is_same_v<TC, float>) {
      gemm_tile(rows, cols, K, A32, B_columns, C_block, alpha);
    } else {
      float* block = c.reserve(rows * cols);
      for (std::int64_t m = 0; m < rows && C.accumulate; ++m)
        widen_bfloat16(C_block.data + m * C.ld, cols, block + m * cols);
      gemm_tile(rows, cols, K, A32, B_columns, GemmOutput<float>{block, cols, C.accumulate}, alpha);
      for (std::int64_t m = 0; m < rows; ++m) round_to_bfloat16(block + m * cols, cols, C_block.data + m * C.ld);
    }
    return dnnl_success;
  });
}

template void gemm_widened<float>(std::int64_t, std::int64_t, std::int64_t, GemmInput<bfloat16>, GemmInput<bfloat16>,
                                  GemmOutput<float>, float);
template void gemm_widened<bfloat16>(std::int64_t, std::int64_t, std::int64_t, GemmInput<bfloat16>, GemmInput<bfloat16>,
                                     GemmOutput<bfloat16>, float);

}  // namespace mha::detail
