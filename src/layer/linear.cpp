// Linear projections: the bias, then the product through the one GEMM entry.
#include "layer/linear.hpp"

#include <vector>

#include "dtype_dispatch.hpp"
#include "gemm.hpp"

namespace mha::detail {

template <class T>
void linear_forward(const T* x, std::int64_t ldx, std::int64_t M, std::int64_t K, const T* w, std::int64_t N,
                    const T* bias, T* y, std::int64_t ldy) {
  if (M == 0 || N == 0) return;
  for (std::int64_t m = 0; m < M; ++m)  // y = b (or 0), then y += x W^T
    for (std::int64_t n = 0; n < N; ++n) y[m * ldy + n] = bias ? bias[n] : T(0);
  if (K > 0) gemm<T>(M, N, K, plain(x, ldx), transposed(w, K), accumulate_into(y, ldy));
}

template <class T>
void column_sums(const T* dy, std::int64_t ldy, std::int64_t M, std::int64_t N, T* bias_grad) {
  std::vector<compute_t<T>> sums(static_cast<std::size_t>(N));  // bfloat16 sums in float32, rounded once
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t n = 0; n < N; ++n) sums[static_cast<std::size_t>(n)] += dy[m * ldy + n];
  for (std::int64_t n = 0; n < N; ++n) bias_grad[n] = T(sums[static_cast<std::size_t>(n)]);
}

template void linear_forward<float>(const float*, std::int64_t, std::int64_t, std::int64_t, const float*, std::int64_t,
                                    const float*, float*, std::int64_t);
template void linear_forward<double>(const double*, std::int64_t, std::int64_t, std::int64_t, const double*,
                                     std::int64_t, const double*, double*, std::int64_t);
template void linear_forward<bfloat16>(const bfloat16*, std::int64_t, std::int64_t, std::int64_t, const bfloat16*,
                                       std::int64_t, const bfloat16*, bfloat16*, std::int64_t);
template void column_sums<bfloat16>(const bfloat16*, std::int64_t, std::int64_t, std::int64_t, bfloat16*);
template void column_sums<float>(const float*, std::int64_t, std::int64_t, std::int64_t, float*);
template void column_sums<double>(const double*, std::int64_t, std::int64_t, std::int64_t, double*);

}  // namespace mha::detail
