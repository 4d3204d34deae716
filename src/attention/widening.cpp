// bfloat16 tensors to and from float32 for the kernels run in float32 (widening.hpp).
#include "attention/widening.hpp"

#include <cstdint>

#include "attention/params.hpp"
#include "bf16_conversion.hpp"
#include "parallel.hpp"

namespace mha::detail {

namespace {

// f(b, head, t, n) for each row (b, head, t) of a [B, h, T, d] tensor, n = (b h + head) T + t its index
// among the rows, on the library's threads (the layer's head views are strided [B, T, h, d] views, which
// Tensor::copy_of would walk element by element on one thread).
template <class F>
void for_each_row(const Shape& shape, F&& f) {
  const std::int64_t B = shape[0], h = shape[1], T = shape[2], rows = B * h * T;
  // A conversion moves an element in about the time a GEMM does 20 flops: parallel from ~0.1 ms of work.
  const SerialIfSmall serial_if_small(20.0 * static_cast<double>(rows * shape[3]));
#pragma omp parallel for schedule(static)
  for (std::int64_t n = 0; n < rows; ++n) f(n / (h * T), n / T % h, n % T, n);
}

}  // namespace

Tensor widened(const TensorView& x) {
  Tensor wide = Tensor::uninitialized(DType::Float32, x.shape());
  if (wide.numel() == 0) return wide;
  const bfloat16* base = x.data_as<bfloat16>();
  const std::int64_t d = x.size(3), column_stride = x.stride(3);
  float* to = wide.data_as<float>();
  for_each_row(x.shape(), [&](std::int64_t b, std::int64_t head, std::int64_t t, std::int64_t n) {
    const bfloat16* row = base + b * x.stride(0) + head * x.stride(1) + t * x.stride(2);
    if (column_stride == 1) widen_bfloat16(row, d, to + n * d);
    else
      for (std::int64_t c = 0; c < d; ++c) to[n * d + c] = row[c * column_stride];
  });
  return wide;
}

void round_into(const Tensor& src, const StridedOutput& dst) {
  if (src.numel() == 0) return;
  Strided4<bfloat16> out;
  out.data = static_cast<bfloat16*>(dst.data);
  for (int i = 0; i < 4; ++i) out.stride[i] = dst.strides[static_cast<std::size_t>(i)];
  const float* x = src.data_as<float>();
  const std::int64_t d = src.size(3);
  const bool adjacent = out.stride[3] == 1;
  for_each_row(src.shape(), [&](std::int64_t b, std::int64_t head, std::int64_t t, std::int64_t n) {
    if (adjacent) round_to_bfloat16(x + n * d, d, &out(b, head, t, 0));
    else
      for (std::int64_t c = 0; c < d; ++c) out(b, head, t, c) = x[n * d + c];
  });
}

}  // namespace mha::detail
