// libmha_onednn_blas.so: the BLAS routine sgemm_ on oneDNN's dnnl_sgemm, for `mha bench` to preload
// into PyTorch.
//
// Why: Debian's python3-torch 1.13 does its float32 products (nn.Linear, bmm) through the Fortran
// BLAS symbol sgemm_ from libblas.so.3, and on a machine where that alternative is netlib's reference
// BLAS (no OpenBLAS, BLIS or MKL installed) they run at a few GFLOP/s on one thread. Comparing with
// that would measure the BLAS, not attention. Preloaded (LD_PRELOAD), this sgemm_ takes precedence,
// so PyTorch's products run on the same oneDNN sgemm as our roof and our kernels, with PyTorch's own
// thread count (both use libgomp, so torch.set_num_threads sets what oneDNN sees).
//
// BLAS is column-major and oneDNN's sgemm row-major: a column-major C [m, n] is the row-major C^T,
// and C^T = op(B)^T op(A)^T, so the operands swap places and keep their transposition flags.
#include <oneapi/dnnl/dnnl.h>

#include <cstdio>
#include <cstdlib>

namespace {

char transposition(const char* flag) { return (*flag == 'N' || *flag == 'n') ? 'N' : 'T'; }  // 'C' = 'T' for reals

}  // namespace

// C [m, n] = alpha op(A) op(B) + beta C, column-major, as the reference BLAS defines it. (gfortran's
// hidden string-length arguments after ldc are not read.)
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) {
  if (*m == 0 || *n == 0) return;
  if (*k == 0) {  // C = beta C (with beta 0, C is not read, as in the reference BLAS)
    for (int j = 0; j < *n; ++j)
      for (int i = 0; i < *m; ++i) c[j * *ldc + i] = *beta == 0.0f ? 0.0f : *beta * c[j * *ldc + i];
    return;
  }
  const dnnl_status_t status =
      dnnl_sgemm(transposition(transb), transposition(transa), *n, *m, *k, *alpha, b, *ldb, a, *lda, *beta, c, *ldc);
  if (status != dnnl_success) {
    std::fprintf(stderr, "libmha_onednn_blas: dnnl_sgemm failed (status %d) for m %d n %d k %d\n",
                 static_cast<int>(status), *m, *n, *k);
    std::abort();
  }
}
