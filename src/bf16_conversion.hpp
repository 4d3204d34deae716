// Spans of bfloat16 widened to float32 and of float32 rounded to bfloat16, in vectors of the best SIMD
// target of this machine: the conversions around the paths that compute bfloat16 in float32 (the
// attention kernels run in float32, attention/widening.cpp; the products on sgemm, gemm_bf16_widened.cpp)
// and Tensor::copy_of. Each gives exactly what mha::bfloat16's conversions give element by element:
// widening is exact, rounding is to nearest with ties to even (subnormals rounded, not flushed), NaN kept
// and made quiet.
#pragma once

#include <cstdint>

#include "mha/bfloat16.hpp"

namespace mha::detail {

// to[i] = from[i] widened exactly, for i in [0, n).
void widen_bfloat16(const bfloat16* from, std::int64_t n, float* to);

// to[i] = from[i] rounded to bfloat16, for i in [0, n).
void round_to_bfloat16(const float* from, std::int64_t n, bfloat16* to);

}  // namespace mha::detail
