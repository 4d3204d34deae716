// The parts both passes of the fused kernel (flash_forward.cpp, flash_backward.cpp) share, per SIMD
// target: scratch allocation, the scaled logits of a tile, and probabilities recomputed from the
// log-sum-exp.
//
// Included once per SIMD target through Highway's foreach_target.h.
#if defined(MHA_FLASH_TILES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_FLASH_TILES_INL_H_
#undef MHA_FLASH_TILES_INL_H_
#else
#define MHA_FLASH_TILES_INL_H_
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <new>
#include <type_traits>

#include "attention/bf16_rounding.hpp"
#include "attention/flash_config.hpp"
#include "attention/masks.hpp"
#include "attention/online_softmax-inl.h"
#include "attention/params.hpp"
#include "bf16_conversion.hpp"
#include "gemm.hpp"
#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mha::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using flash::kBlockK;
using flash::kRowAlign;
using flash::round_up;

inline constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// `count` elements of aligned scratch; std::bad_alloc when the memory is not there (never a null to
// write through).
template <class E>
hwy::AlignedFreeUniquePtr<E[]> Allocate(std::int64_t count) {
  auto scratch = hwy::AllocateAligned<E>(static_cast<std::size_t>(count));
  if (!scratch) throw std::bad_alloc();
  return scratch;
}
inline hwy::AlignedFreeUniquePtr<float[]> AllocateFloats(std::int64_t count) { return Allocate<float>(count); }

// Sets the forbidden entries of a tile row of query i, keys [j0, j0 + cols), back to exactly 0: for a
// row of weights whose log-sum-exp is NaN (every entry is NaN after the exp) and for a row of dS whose
// D is not finite. A masked position is ignored, whatever the row holds.
template <class T>
void ZeroForbiddenEntries(const AttentionInputs<T>& p, std::int64_t b, std::int64_t head, std::int64_t i,
                          std::int64_t j0, std::int64_t cols, float* row) {
  for (std::int64_t c = 0; c < cols; ++c) {
    if (p.forbidden(b, head, i, j0 + c)) row[c] = 0.0f;
  }
}

// S [rows, cols] (row stride kBlockK, float32) = scale Q_rows K_blk^T, from float32 or bfloat16 rows
// (float32 accumulation). The scale goes in as the product's alpha in the forward and in both backward
// passes alike, so the backward's P = exp(S - lse) is normalised to float precision.
template <class T>
void ScaledLogits(const AttentionInputs<T>& p, const T* q_rows, std::int64_t ldq, std::int64_t rows, const T* k_block,
                  std::int64_t ldk, std::int64_t cols, float* s) {
  gemm_tile(rows, cols, p.d_k, plain(q_rows, ldq), transposed(k_block, ldk), overwrite(s, kBlockK), p.scale);
}

// Logit soft-capping of a tile, before masks: s [rows, cols] (row stride kBlockK) becomes
// cap tanh(s / cap); with `slope` (a tile like s), slope = 1 - tanh^2(s / cap), the derivative the backward
// multiplies dS by. Whole vectors, so the padding past cols (never read as a result) is capped too.
inline void SoftcapTile(float* HWY_RESTRICT s, std::int64_t rows, std::int64_t cols, float cap,
                        float* HWY_RESTRICT slope) {
  const hn::ScalableTag<float> d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d)), padded = round_up(cols, kRowAlign);
  const auto vcap = hn::Set(d, cap), inv_cap = hn::Set(d, 1.0f / cap), one = hn::Set(d, 1.0f);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < padded; c += N) {
      const auto t = hn::Tanh(d, hn::Mul(hn::Load(d, s + r * kBlockK + c), inv_cap));
      hn::Store(hn::Mul(vcap, t), d, s + r * kBlockK + c);
      if (slope) hn::Store(hn::NegMulAdd(t, t, one), d, slope + r * kBlockK + c);
    }
}

// One row of ProbabilitiesFromLse, its masks applied: row [cols] (query row i of the tile at keys j0..)
// becomes P = exp(S - lse) (0 for a row that attended to nothing), padded with zeros to a whole vector.
template <class T>
HWY_INLINE void ProbabilityRow(const AttentionInputs<T>& p, std::int64_t b, std::int64_t head, std::int64_t i,
                               std::int64_t j0, std::int64_t cols, float lse, float* HWY_RESTRICT row) {
  const std::int64_t visible = lse == kMinusInf ? 0 : causal_visible(p, i, j0, cols);
  ExpShiftedRow<kExpAccuracyOf<T>>(row, round_up(cols, kRowAlign), visible, lse);
  if (std::isnan(lse)) ZeroForbiddenEntries(p, b, head, i, j0, cols, row);
}

// Probabilities of a tile: s [rows, cols] (row stride kBlockK) holds scale * Q K^T (soft-capped); masks are applied
// and each row becomes P (ProbabilityRow).
template <class T>
void ProbabilitiesFromLse(const AttentionInputs<T>& p, std::int64_t b, std::int64_t head, std::int64_t i0,
                          std::int64_t rows, std::int64_t j0, std::int64_t cols, const float* lse, float* s) {
  if (needs_data_masks(p)) apply_masks(p, b, head, i0, rows, j0, cols, s, kBlockK);
  for (std::int64_t r = 0; r < rows; ++r) ProbabilityRow(p, b, head, i0 + r, j0, cols, lse[r], s + r * kBlockK);
}

// Whether row[0, n) holds only finite floats.
HWY_INLINE bool RowIsFinite(const float* HWY_RESTRICT row, std::int64_t n) {
  const hn::ScalableTag<float> d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  std::int64_t e = 0;
  for (; e + N <= n; e += N)
    if (!hn::AllTrue(d, hn::IsFinite(hn::LoadU(d, row + e)))) return false;
  for (; e < n; ++e)
    if (!std::isfinite(row[e])) return false;
  return true;
}

// Whether row[0, n) holds only finite bfloat16 values (exponent bits not all ones), a vector of them at a
// time (the element loop it replaces took about 1% of a bfloat16 forward).
HWY_INLINE bool RowIsFinite(const bfloat16* HWY_RESTRICT row, std::int64_t n) {
  const hn::ScalableTag<std::uint16_t> d;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  const std::uint16_t* bits = reinterpret_cast<const std::uint16_t*>(row);
  const auto exponent = hn::Set(d, std::uint16_t{0x7f80});
  std::int64_t e = 0;
  for (; e + N <= n; e += N)
    if (!hn::AllFalse(d, hn::Eq(hn::And(hn::LoadU(d, bits + e), exponent), exponent))) return false;
  for (; e < n; ++e)
    if ((bits[e] & 0x7f80) == 0x7f80) return false;
  return true;
}

// p[r * ldp + c] = s[r * lds + c] rounded to bfloat16 for rows [0, rows) and columns [0, n), n a
// multiple of 16: a float32 tile as the bfloat16 operand of a product. By AVX512-BF16's conversion where
// the CPU has it (bf16_rounding.hpp: subnormals flushed to zero), else by hand (bf16_conversion.hpp).
inline void RoundRowsToBfloat16(const float* HWY_RESTRICT s, std::int64_t lds, std::int64_t rows, std::int64_t n,
                                bfloat16* HWY_RESTRICT p, std::int64_t ldp) {
  if (has_bf16_conversion()) return round_rows_with_bf16_conversion(s, lds, rows, n, p, ldp);
  for (std::int64_t r = 0; r < rows; ++r) round_to_bfloat16(s + r * lds, n, p + r * ldp);
}

// A float32 tile (row stride kBlockK) as a product's operand: the tile itself for float32 inputs, its
// bfloat16 copy (RoundRowsToBfloat16, by the caller) for bfloat16 inputs.
template <class T>
auto tile_operand(const float* tile, const bfloat16* rounded) {
  if constexpr (std::is_same_v<T, bfloat16>) return plain(rounded, kBlockK);
  else return plain(tile, kBlockK);
}
template <class T>
auto transposed_tile(const float* tile, const bfloat16* rounded) {
  if constexpr (std::is_same_v<T, bfloat16>) return transposed(rounded, kBlockK);
  else return transposed(tile, kBlockK);
}

// flags[(b * h + head) * rows + r] |= bit for each row r of x [B, h, rows, width] (unit inner stride)
// that holds NaN or Inf: one pass over x, so that the tiles only read a byte per row (nonfinite.hpp).
template <class E>
void FlagNonfiniteRows(const Strided4<const E>& x, std::int64_t B, std::int64_t h, std::int64_t rows,
                       std::int64_t width, std::uint8_t bit, std::uint8_t* flags) {
#pragma omp parallel for schedule(static)
  for (std::int64_t n = 0; n < B * h * rows; ++n) {
    const std::int64_t b = n / (h * rows), head = (n / rows) % h, r = n % rows;
    if (!RowIsFinite(&x(b, head, r, 0), width)) flags[n] |= bit;
  }
}

}  // namespace mha::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard toggled per target
