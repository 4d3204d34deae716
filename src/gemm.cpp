// Matrix products: oneDNN's sgemm for float32 (called from exactly one place, sgemm_on_this_thread),
// plain loops for float64. See gemm.hpp for the conventions.
#include "gemm.hpp"

#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "gemm_blocks.hpp"
#include "mha/error.hpp"
#include "parallel.hpp"

namespace mha::detail {

namespace {

// oneDNN's sgemm; inside one of our OpenMP regions (or with one thread allowed) it runs on the
// calling thread. Returns oneDNN's status: it refuses, leaving C untouched, a leading dimension below
// the row width it reads (callers pass operands whose rows it can read; attention_core.cpp copies
// inputs whose rows overlap).
dnnl_status_t sgemm_on_this_thread(std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<float> A,
                                   GemmInput<float> B, GemmOutput<float> C, float alpha) {
  return dnnl_sgemm(A.transposed ? 'T' : 'N', B.transposed ? 'T' : 'N', M, N, K, alpha, A.data, A.ld, B.data, B.ld,
                    C.accumulate ? 1.0f : 0.0f, C.data, C.ld);
}

std::string describe_failure(dnnl_status_t status, std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<float> A,
                             GemmInput<float> B, GemmOutput<float> C) {
  return "internal error: oneDNN's sgemm failed (status " + std::to_string(static_cast<int>(status)) + ") for M " +
         std::to_string(M) + ", N " + std::to_string(N) + ", K " + std::to_string(K) + ", lda " + std::to_string(A.ld) +
         (A.transposed ? " (A^T)" : "") + ", ldb " + std::to_string(B.ld) + (B.transposed ? " (B^T)" : "") + ", ldc " +
         std::to_string(C.ld);
}

// The parts of K a product of one row block is split into (1: none), from its sizes alone.
std::int64_t k_chunks(std::int64_t M, std::int64_t N, std::int64_t K) {
  if (M > kGemmRowsPerBlock || gemm_column_blocks(M, N) > 1) return 1;
  return std::clamp<std::int64_t>(K / kGemmMinRowsPerKChunk, 1, kGemmMaxKChunks);
}

// Columns [k0, k1) of op(A) and rows [k0, k1) of op(B).
GemmInput<float> a_columns(GemmInput<float> A, std::int64_t k0) {
  A.data += A.transposed ? k0 * A.ld : k0;
  return A;
}
GemmInput<float> b_rows(GemmInput<float> B, std::int64_t k0) {
  B.data += B.transposed ? k0 : k0 * B.ld;
  return B;
}

// C (+)= alpha op(A) op(B) for M <= kGemmRowsPerBlock in `chunks` parts of K, one work item each:
// part 0 into C, part c > 0 into partial[c - 1]; then C += partial[0] + ... in that order, so the
// result depends on the sizes only, not on which thread ran which part.
dnnl_status_t gemm_split_k(std::int64_t M, std::int64_t N, std::int64_t K, std::int64_t chunks, GemmInput<float> A,
                           GemmInput<float> B, GemmOutput<float> C, float alpha) {
  // [chunks - 1, M, N], kept for the next product: at most 3 x 128 x N floats per calling thread (1.5 MiB
  // for N = 1024), never returned to the system before the thread ends.
  thread_local std::vector<float> partial;
  partial.resize(static_cast<std::size_t>((chunks - 1) * M * N));
  float* const parts = partial.data();  // the calling thread's buffer, named in the region by pointer
  std::atomic<int> failure{dnnl_success};
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::int64_t k0 = K * c / chunks, k1 = K * (c + 1) / chunks;
    const GemmOutput<float> out = c == 0 ? C : overwrite(parts + (c - 1) * M * N, N);
    const dnnl_status_t status = sgemm_on_this_thread(M, N, k1 - k0, a_columns(A, k0), b_rows(B, k0), out, alpha);
    if (status != dnnl_success) failure = status;
  }
  for (std::int64_t c = 1; c < chunks; ++c)
    for (std::int64_t m = 0; m < M; ++m) {
      const float* p = parts + ((c - 1) * M + m) * N;
      float* row = C.data + m * C.ld;
      for (std::int64_t n = 0; n < N; ++n) row[n] += p[n];
    }
  return static_cast<dnnl_status_t>(failure.load());
}

}  // namespace

template <>
void gemm<float>(std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<float> A, GemmInput<float> B,
                 GemmOutput<float> C, float alpha) {
  if (M == 0 || N == 0) return;
  if (K == 0) {  // nothing to sum: C = 0, unless accumulating
    if (!C.accumulate)
      for (std::int64_t m = 0; m < M; ++m) std::fill_n(C.data + m * C.ld, N, 0.0f);
    return;
  }
  const SerialIfSmall serial_if_small(2.0 * M * N * K);
  if (const std::int64_t chunks = k_chunks(M, N, K); chunks > 1) {
    const dnnl_status_t status = gemm_split_k(M, N, K, chunks, A, B, C, alpha);
    if (status != dnnl_success) throw Error(describe_failure(status, M, N, K, A, B, C));
    return;
  }
  const dnnl_status_t status = for_each_block(
      M, N, A, B, C, [&](std::int64_t rows, std::int64_t cols, auto A_rows, auto B_columns, auto C_block) {
        return sgemm_on_this_thread(rows, cols, K, A_rows, B_columns, C_block, alpha);
      });
  if (status != dnnl_success) throw Error(describe_failure(status, M, N, K, A, B, C));
}

template <>
void gemm<double>(std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<double> A, GemmInput<double> B,
                  GemmOutput<double> C, double alpha) {
  const SerialIfSmall serial_if_small(2.0 * M * N * K);
#pragma omp parallel for schedule(static)
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < N; ++n) {
      double sum = 0;
      for (std::int64_t k = 0; k < K; ++k)
        sum += (A.transposed ? A.data[k * A.ld + m] : A.data[m * A.ld + k]) *
               (B.transposed ? B.data[n * B.ld + k] : B.data[k * B.ld + n]);
      double& c = C.data[m * C.ld + n];
      c = C.accumulate ? c + alpha * sum : alpha * sum;
    }
}

void gemm_tile(std::int64_t M, std::int64_t N, std::int64_t K, GemmInput<float> A, GemmInput<float> B,
               GemmOutput<float> C, float alpha) {
  const dnnl_status_t status = sgemm_on_this_thread(M, N, K, A, B, C, alpha);
  if (status == dnnl_success) return;
  // Inside a kernel's parallel region nothing can be thrown: a failed tile is a broken internal
  // invariant (the boundary gives kernels only operands the product accepts), so stop loudly rather
  // than return what the untouched tile held.
  std::fprintf(stderr, "mha: %s\n", describe_failure(status, M, N, K, A, B, C).c_str());
  std::abort();
}

}  // namespace mha::detail
