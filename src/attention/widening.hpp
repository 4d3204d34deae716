// bfloat16 attention computed in float32 (attention_core.cpp: the reference kernel, and the fused one
// where the bfloat16 products run on sgemm): its [B, h, T, d] tensors widened exactly to float32, and
// the float32 results rounded back to bfloat16 once, row by row on the library's threads.
#pragma once

#include "attention/attention_core.hpp"
#include "mha/tensor.hpp"

namespace mha::detail {

// x (bfloat16 [B, h, T, d], any strides) widened exactly into a contiguous float32 tensor.
Tensor widened(const TensorView& x);

// dst [B, h, T, d] (bfloat16, strided) = src (float32, contiguous, same shape) rounded to bfloat16.
void round_into(const Tensor& src, const StridedOutput& dst);

}  // namespace mha::detail
