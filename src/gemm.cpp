// Matrix products: oneDNN's sgemm for float32 (called from exactly one place, sgemm_on_this_thread),
// plain loops for float64. See gemm.hpp for the conventions.
#include "gemm.hpp"

#include <oneapi/dnnl/dnnl.h>

#include <algorithm>

#include "parallel.hpp"

namespace mha::detail {

namespace {

// oneDNN's sgemm; inside one of our OpenMP regions (or with one thread allowed) it runs on the
// calling thread.
void sgemm_on_this_thread(const GemmArgs<float>& g) {
  dnnl_sgemm(g.trans_a ? 'T' : 'N', g.trans_b ? 'T' : 'N', g.M, g.N, g.K, g.alpha, g.A, g.lda, g.B, g.ldb,
             g.accumulate ? 1.0f : 0.0f, g.C, g.ldc);
}

// C = 0 for a product with nothing to sum (K = 0), unless accumulating.
template <class T>
void clear_unless_accumulating(const GemmArgs<T>& g) {
  if (g.accumulate) return;
  for (std::int64_t m = 0; m < g.M; ++m) std::fill_n(g.C + m * g.ldc, g.N, T(0));
}

}  // namespace

template <>
void gemm<float>(const GemmArgs<float>& g) {
  if (g.M == 0 || g.N == 0) return;
  if (g.K == 0) return clear_unless_accumulating(g);
  const std::int64_t blocks = (g.M + kGemmRowsPerBlock - 1) / kGemmRowsPerBlock;
  const SerialIfSmall serial_if_small(2.0 * g.M * g.N * g.K);
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t block = 0; block < blocks; ++block) {
    GemmArgs<float> rows = g;  // rows [m0, m0 + M) of C, whole
    const std::int64_t m0 = block * kGemmRowsPerBlock;
    rows.M = std::min(kGemmRowsPerBlock, g.M - m0);
    rows.A = g.trans_a ? g.A + m0 : g.A + m0 * g.lda;  // rows of A' = columns of A when transposed
    rows.C = g.C + m0 * g.ldc;
    sgemm_on_this_thread(rows);
  }
}

template <>
void gemm<double>(const GemmArgs<double>& g) {
  const SerialIfSmall serial_if_small(2.0 * g.M * g.N * g.K);
#pragma omp parallel for schedule(static)
  for (std::int64_t m = 0; m < g.M; ++m)
    for (std::int64_t n = 0; n < g.N; ++n) {
      double acc = 0;
      for (std::int64_t c = 0; c < g.K; ++c)
        acc += (g.trans_a ? g.A[c * g.lda + m] : g.A[m * g.lda + c]) *
               (g.trans_b ? g.B[n * g.ldb + c] : g.B[c * g.ldb + n]);
      double& out = g.C[m * g.ldc + n];
      out = g.accumulate ? out + g.alpha * acc : g.alpha * acc;
    }
}

void gemm_tile(const GemmArgs<float>& args) { sgemm_on_this_thread(args); }

}  // namespace mha::detail
