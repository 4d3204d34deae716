// The fused kernel's float32 tiles (P, dS) rounded to bfloat16 with AVX512-BF16's own conversion
// (vcvtneps2bf16: one instruction a vector, where rounding by hand, bf16_conversion.hpp's round_to_bfloat16,
// takes about nine). Measured on a Zen 5, the hand rounding of P was about 5% of the bf16 forward.
//
// The instruction rounds to nearest even, as round_to_bfloat16 does, keeps infinities and makes NaN quiet, but
// flushes subnormal inputs (below 2^-126 in magnitude) to a zero of the same sign, where round_to_bfloat16
// rounds them to bfloat16 subnormals: a weight that small changes no result by more than 2^-126 times a
// value, and the bf16 products' path treats subnormals so already (attention.hpp).
#pragma once

#include <cstdint>

#include "mha/bfloat16.hpp"

namespace mha::detail {

// Whether this CPU has AVX512-BF16 (checked once); without it the kernels round by hand.
bool has_bf16_conversion();

// p[r * ldp + c] = s[r * lds + c] rounded to bfloat16 by vcvtneps2bf16, for rows [0, rows) and columns
// [0, n), n a multiple of 16. Only where has_bf16_conversion().
void round_rows_with_bf16_conversion(const float* s, std::int64_t lds, std::int64_t rows, std::int64_t n, bfloat16* p,
                                     std::int64_t ldp);

}  // namespace mha::detail
