// Per-target helpers of the fused kernel's backward (flash_backward.cpp) for the rows its whole-block
// products leave out: keys and query rows holding NaN or Inf (nonfinite.hpp), whose exact terms are
// computed one by one, and zeroing the gradient rows of keys no query sees.
//
// Included once per SIMD target through Highway's foreach_target.h, after flash_tiles-inl.h.
#if defined(MHA_FLASH_BACKWARD_ROWS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_FLASH_BACKWARD_ROWS_INL_H_
#undef MHA_FLASH_BACKWARD_ROWS_INL_H_
#else
#define MHA_FLASH_BACKWARD_ROWS_INL_H_
#endif

#include <cmath>
#include <cstdint>

#include "attention/flash_tiles-inl.h"
#include "attention/params.hpp"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mha::detail::HWY_NAMESPACE {

// The probabilities of the listed keys below cols (columns of the tile s, row stride kBlockK), whose k rows hold
// NaN or Inf and were zeroed in the block copy: recomputed one by one from the real k row, so that a
// logit of -inf (an infinite component against q's sign) gives exactly 0, as the forward had it, and
// +inf or NaN gives NaN (soft-capping caps an infinite one; its slope, in cap_slope, is then 0).
// Forbidden entries stay 0.
template <class T>
void ExactProbabilitiesOfNonfiniteKeys(const AttentionInputs<T>& p, std::int64_t b, std::int64_t head, std::int64_t i0,
                                       std::int64_t rows, std::int64_t j0, std::int64_t cols, const std::int64_t* list,
                                       std::int64_t count, const float* lse, float* s, float* cap_slope) {
  for (std::int64_t n = 0; n < count; ++n) {
    if (list[n] >= cols) continue;  // past the tile's columns (a causal diagonal tile's hidden keys)
    const std::int64_t j = j0 + list[n];
    for (std::int64_t r = 0; r < rows; ++r) {
      const float added = p.added(b, head, i0 + r, j);
      float& prob = s[r * kBlockK + list[n]];
      if (p.forbidden(b, head, i0 + r, j) || lse[r] == kMinusInf) {
        prob = 0.0f;
        continue;
      }
      float dot = 0.0f;
      const std::int64_t kv = p.kv_head(head);
      for (std::int64_t e = 0; e < p.d_k; ++e) dot += float(p.q(b, head, i0 + r, e)) * float(p.k(b, kv, j, e));
      float logit = p.scale * dot;
      if (p.softcap > 0) {  // soft-capped as SoftcapTile caps the rest of the tile
        const float t = std::tanh(logit / p.softcap);
        logit = p.softcap * t;
        cap_slope[r * kBlockK + list[n]] = 1.0f - t * t;
      }
      prob = std::exp(logit + added - lse[r]);
    }
  }
}

// dX_j += alpha coef[r, j] x_r for the listed rows r of query block i0 (their non-finite x rows were
// zeroed in the block product), keys j0 + [0, cols), where coef (row stride kBlockK) is not 0.
template <class T>
void AddNonfiniteRows(const Strided4<const T>& x, std::int64_t b, std::int64_t head, std::int64_t i0,
                      const std::int64_t* list, std::int64_t count, const float* coef, float alpha, std::int64_t cols,
                      std::int64_t width, float* dx_block) {
  for (std::int64_t n = 0; n < count; ++n) {
    const std::int64_t r = list[n];
    for (std::int64_t c = 0; c < cols; ++c) {
      const float weight = coef[r * kBlockK + c];
      if (weight == 0.0f) continue;
      for (std::int64_t e = 0; e < width; ++e) dx_block[c * width + e] += alpha * weight * float(x(b, head, i0 + r, e));
    }
  }
}

// Zeroes rows [r0, r1) of x(b, head) [.., width].
template <class T>
void ZeroRows(const Strided4<T>& x, std::int64_t b, std::int64_t head, std::int64_t r0, std::int64_t r1,
              std::int64_t width) {
  for (std::int64_t r = r0; r < r1; ++r)
    for (std::int64_t e = 0; e < width; ++e) x(b, head, r, e) = T(0.0f);
}

}  // namespace mha::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard toggled per target
