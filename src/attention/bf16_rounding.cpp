// AVX512-BF16's conversion for the kernels' tiles (bf16_rounding.hpp): compiled for that instruction
// set alone (a function attribute), called only where the CPU reports it.
#include "attention/bf16_rounding.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace mha::detail {

#if defined(__x86_64__)

bool has_bf16_conversion() {
  static const bool has = __builtin_cpu_supports("avx512bf16");  // includes the OS's AVX-512 state
  return has;
}

__attribute__((target("avx512f,avx512bf16"))) void round_rows_with_bf16_conversion(const float* s, std::int64_t lds,
                                                                                   std::int64_t rows, std::int64_t n,
                                                                                   bfloat16* p, std::int64_t ldp) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < n; c += 16) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_loadu_ps(s + r * lds + c));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + r * ldp + c), reinterpret_cast<const __m256i&>(rounded));
    }
}

#else

bool has_bf16_conversion() { return false; }

void round_rows_with_bf16_conversion(const float*, std::int64_t, std::int64_t, std::int64_t, bfloat16*, std::int64_t) {}

#endif

}  // namespace mha::detail
