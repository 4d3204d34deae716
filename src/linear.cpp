// Linear projections through oneDNN (float32) or plain loops (float64).
#include "linear.hpp"

#include <dnnl.hpp>

namespace mha::detail {

namespace {

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// Fills y [M, N] with the bias (or 0): the result of a product with K = 0.
template <class T>
void fill_bias(std::int64_t M, std::int64_t N, const T* bias, T* y, std::int64_t ldy) {
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < N; ++n) y[m * ldy + n] = bias ? bias[n] : T(0);
}

}  // namespace

template <>
void linear_forward<float>(const float* x, std::int64_t ldx, std::int64_t M, std::int64_t K, const float* w,
                           std::int64_t N, const float* bias, float* y, std::int64_t ldy) {
  if (M == 0 || N == 0) return;
  if (K == 0) return fill_bias(M, N, bias, y, ldy);
  using dt = dnnl::memory::data_type;
  dnnl::engine& engine = cpu_engine();
  // oneDNN computes dst [M, N] = src [M, K] * weights [K, N]; W^T is W read with strides {1, K}.
  const dnnl::memory::desc src_md({M, K}, dt::f32, dnnl::memory::dims{ldx, 1});
  const dnnl::memory::desc weights_md({K, N}, dt::f32, dnnl::memory::dims{1, K});
  const dnnl::memory::desc dst_md({M, N}, dt::f32, dnnl::memory::dims{ldy, 1});
  const dnnl::memory::desc bias_md = bias ? dnnl::memory::desc({1, N}, dt::f32, dnnl::memory::dims{N, 1})
                                          : dnnl::memory::desc();
  // oneDNN keeps created primitives in its own cache, so repeated shapes are not JIT-compiled again.
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src_md, weights_md, bias_md, dst_md), engine);
  dnnl::stream stream(engine);
  dnnl::memory src(src_md, engine, const_cast<float*>(x));
  dnnl::memory weights(weights_md, engine, const_cast<float*>(w));
  dnnl::memory dst(dst_md, engine, y);
  std::unordered_map<int, dnnl::memory> args{{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, weights}, {DNNL_ARG_DST, dst}};
  if (bias) args.emplace(DNNL_ARG_BIAS, dnnl::memory(bias_md, engine, const_cast<float*>(bias)));
  dnnl::matmul(pd).execute(stream, args);
  stream.wait();
}

template <>
void linear_forward<double>(const double* x, std::int64_t ldx, std::int64_t M, std::int64_t K, const double* w,
                            std::int64_t N, const double* bias, double* y, std::int64_t ldy) {
#pragma omp parallel for schedule(static)
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (std::int64_t c = 0; c < K; ++c) acc += x[m * ldx + c] * w[n * K + c];
      y[m * ldy + n] = acc + (bias ? bias[n] : 0.0);
    }
}

template <>
void gemm<float>(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, const float* A,
                 std::int64_t lda, const float* B, std::int64_t ldb, bool accumulate, float* C, std::int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (!accumulate) fill_bias<float>(M, N, nullptr, C, ldc);
    return;
  }
  dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, 1.0f, A, lda, B, ldb, accumulate ? 1.0f : 0.0f, C,
             ldc);
}

template <>
void gemm<double>(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, const double* A,
                  std::int64_t lda, const double* B, std::int64_t ldb, bool accumulate, double* C, std::int64_t ldc) {
#pragma omp parallel for schedule(static)
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (std::int64_t c = 0; c < K; ++c)
        acc += (trans_a ? A[c * lda + m] : A[m * lda + c]) * (trans_b ? B[n * ldb + c] : B[c * ldb + n]);
      C[m * ldc + n] = accumulate ? C[m * ldc + n] + acc : acc;
    }
}

template <class T>
void column_sums(const T* dy, std::int64_t ldy, std::int64_t M, std::int64_t N, T* bias_grad) {
  for (std::int64_t n = 0; n < N; ++n) bias_grad[n] = 0;
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < N; ++n) bias_grad[n] += dy[m * ldy + n];
}

template void column_sums<float>(const float*, std::int64_t, std::int64_t, std::int64_t, float*);
template void column_sums<double>(const double*, std::int64_t, std::int64_t, std::int64_t, double*);

}  // namespace mha::detail
