// The sgemm path of the bfloat16 products (gemm_bf16.cpp chooses it): the operands widened exactly to
// float32, sgemm's float32 accumulation, each result rounded once, as the matmul primitive's path rounds.
#pragma once

#include <cstdint>

#include "gemm.hpp"

namespace mha::detail {

// C (+)= alpha op(A) op(B) through sgemm on the calling thread, on its own widened copies of A and B:
// a tile of a kernel's parallel region.
void widened_tile(std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<bfloat16> A, GemmInput<bfloat16> B,
                  GemmOutput<float> C, float alpha);

// The whole product on the library's threads (gemm()'s blocks, thread-count independent), C float32 or
// bfloat16 (rounded once). M, N, K > 0.
template <class TC>
void gemm_widened(std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<bfloat16> A, GemmInput<bfloat16> B,
                  GemmOutput<TC> C, float alpha);

}  // namespace mha::detail
