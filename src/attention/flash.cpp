// The fused attention kernel: FlashAttention-2 (Dao 2023, "FlashAttention-2: Faster Attention with
// Better Parallelism and Work Partitioning") on the CPU, float32, never holding an L x S matrix.
//
// Forward, for one (b, head, block of kBlockQ query rows):
//   m = -inf, l = 0, acc = 0                                   per row; acc [rows, d_v]
//   for each block of kBlockK keys:
//     S = scale Q_blk K_blk^T (+ masks)                        [rows, cols]
//     m' = max(m, rowmax S);  P = exp(S - m');  a = exp(m - m')
//     l = a l + rowsum P;  acc = a acc + dropout(P) V_blk;  m = m'
//   out = acc / l;  lse = m + log l                            (a row with no allowed key: 0, -inf)
// The two products go through oneDNN's sgemm (single-threaded inside our OpenMP region); the row
// operations through Highway, dispatched once per call to the best SIMD target of the machine.
// Causal masking skips key blocks that lie entirely above the diagonal; key_lengths shortens the key
// range. Keys outside the range are never read; masked keys inside it get -inf logits, and K/V rows
// of padded keys or holding NaN/Inf are zeroed in a copy of the block (see safe_block), so a NaN or
// Inf stored at a masked position cannot leak through the block products.
#include "attention/flash.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/flash.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <oneapi/dnnl/dnnl.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention/dropout.hpp"
#include "attention/flash_config.hpp"
#include "attention/online_softmax-inl.h"
#include "parallel.hpp"
#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"

#ifndef MHA_FLASH_SHARED_ONCE
#define MHA_FLASH_SHARED_ONCE
namespace mha::detail::flash {

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// Row-major product C [M, N] (=|+=) alpha A' B', A' = A [M, K] or A^T (A [K, M]), B' = B [K, N] or
// B^T (B [N, K]). Called inside our OpenMP region, oneDNN runs it on the calling thread.
inline void sgemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
                  const float* A, std::int64_t lda, const float* B, std::int64_t ldb, bool accumulate, float* C,
                  std::int64_t ldc) {
  dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, accumulate ? 1.0f : 0.0f, C,
             ldc);
}

// The key range [0, end) that query rows [i0, i0 + rows) of batch b may attend to at all.
inline std::int64_t key_range_end(const AttentionParams<float>& p, std::int64_t b, std::int64_t i0,
                                  std::int64_t rows) {
  std::int64_t end = p.S;
  if (p.key_lengths) end = std::min(end, p.key_lengths[b]);
  if (p.causal) end = std::min(end, std::max<std::int64_t>(0, i0 + rows + p.S - p.L));  // last row sees j <= i + S - L
  return end;
}

// Whether a tile needs per-element masking (beyond the key range already cut by key_range_end).
inline bool tile_needs_masks(const AttentionParams<float>& p, std::int64_t i0, std::int64_t j0, std::int64_t cols) {
  if (p.key_padding || p.bool_mask || p.additive_mask) return true;
  return p.causal && j0 + cols - 1 > i0 + p.S - p.L;  // the first row of the tile does not see every key
}

// Applies the masks to a logits tile s [rows, cols] (row stride ld): forbidden -> -inf, additive added.
inline void apply_masks(const AttentionParams<float>& p, std::int64_t b, std::int64_t head, std::int64_t i0,
                        std::int64_t rows, std::int64_t j0, std::int64_t cols, float* s, std::int64_t ld) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      float& x = s[r * ld + c];
      const float added = p.additive_mask ? p.additive_mask(b, head, i0 + r, j0 + c) : 0.0f;
      x = (!p.allowed(b, head, i0 + r, j0 + c) || added == kMinusInf) ? kMinusInf : x + added;
    }
}

// P [rows, cols] (row stride ld) times the dropout factors of rows i0.., keys j0..
inline void apply_dropout(const AttentionParams<float>& p, std::int64_t b, std::int64_t head, std::int64_t i0,
                          std::int64_t rows, std::int64_t j0, std::int64_t cols, float* s, std::int64_t ld) {
  const float keep_scale = 1.0f / (1.0f - p.dropout_p);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      float& x = s[r * ld + c];
      x = dropout_uniform(p.dropout_seed, b, head, i0 + r, j0 + c) < p.dropout_p ? 0.0f : x * keep_scale;
    }
}

// A K or V block [cols, width] (unit inner stride) made safe for products over the whole block: rows
// of padded keys, and rows holding NaN or Inf, are zeroed in a copy (`scratch`, row stride width);
// without such rows the block is used in place. The non-finite rows (keys that some query may
// still attend to) are listed in `nonfinite` so the caller can add their exact contribution to the
// rows that do attend to them: a NaN or Inf then reaches exactly the outputs that depend on it.
struct SafeBlock {
  const float* data;
  std::int64_t ld;
  std::int64_t nonfinite_count;  // entries of the caller's list
};

inline SafeBlock safe_block(const AttentionParams<float>& p, const Strided4<const float>& x, std::int64_t b,
                            std::int64_t head, std::int64_t j0, std::int64_t cols, std::int64_t width, float* scratch,
                            std::int64_t* nonfinite) {
  const float* block = &x(b, head, j0, 0);
  const std::int64_t ld = x.stride[2];
  std::int64_t count = 0;
  bool any_padding = false;
  for (std::int64_t c = 0; c < cols; ++c) {
    if (p.key_padding && p.key_padding(b, head, 0, j0 + c)) {
      any_padding = true;
      continue;
    }
    for (std::int64_t e = 0; e < width; ++e)
      if (!std::isfinite(block[c * ld + e])) {
        nonfinite[count++] = c;
        break;
      }
  }
  if (!any_padding && count == 0) return {block, ld, 0};
  for (std::int64_t c = 0, next = 0; c < cols; ++c) {
    bool zero = p.key_padding && p.key_padding(b, head, 0, j0 + c);
    if (next < count && nonfinite[next] == c) zero = true, ++next;
    for (std::int64_t e = 0; e < width; ++e) scratch[c * width + e] = zero ? 0.0f : block[c * ld + e];
  }
  return {scratch, width, count};
}

}  // namespace mha::detail::flash
#endif  // MHA_FLASH_SHARED_ONCE

HWY_BEFORE_NAMESPACE();
namespace mha::detail::HWY_NAMESPACE {

using flash::kBlockK;
using flash::kBlockQ;
using flash::kMinusInf;
using flash::kRowAlign;
using flash::round_up;
using detail::SerialIfSmall;

// Probabilities of a tile: s [rows, cols] (row stride kBlockK) holds scale * Q K^T; masks are applied
// and each row becomes P = exp(S - lse) (0 for a row that attended to nothing), padded with zeros.
void ProbabilitiesFromLse(const AttentionParams<float>& p, std::int64_t b, std::int64_t head, std::int64_t i0,
                          std::int64_t rows, std::int64_t j0, std::int64_t cols, const float* lse, float* s) {
  const std::int64_t padded_cols = round_up(cols, kRowAlign);
  if (flash::tile_needs_masks(p, i0, j0, cols)) flash::apply_masks(p, b, head, i0, rows, j0, cols, s, kBlockK);
  for (std::int64_t r = 0; r < rows; ++r) {
    float* row = s + r * kBlockK;
    std::fill(row + cols, row + padded_cols, kMinusInf);
    if (lse[r] == kMinusInf) std::fill(row, row + padded_cols, 0.0f);
    else ExpShiftedRow(row, padded_cols, lse[r]);
  }
}

void FlashForward(const AttentionParams<float>& p) {
  const SerialIfSmall serial_if_small(2.0 * p.B * p.h * p.L * p.S * (p.d_k + p.d_v));
  const std::int64_t q_blocks = (p.L + kBlockQ - 1) / kBlockQ;
  const std::int64_t ld_acc = round_up(p.d_v, kRowAlign);
  // Per-thread workspace, allocated once per call: logits tile, accumulator, V block copy, m, l.
  const std::int64_t s_size = kBlockQ * kBlockK, acc_size = kBlockQ * ld_acc;
  const std::int64_t kv_size = kBlockK * std::max(p.d_k, p.d_v);
  const std::int64_t per_thread = s_size + acc_size + round_up(kv_size, kRowAlign) + 2 * kBlockQ;
  auto workspace = hwy::AllocateAligned<float>(static_cast<std::size_t>(omp_get_max_threads() * per_thread));
  std::vector<std::int64_t> nonfinite_lists(static_cast<std::size_t>(omp_get_max_threads() * kBlockK));

#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t item = 0; item < p.B * p.h * q_blocks; ++item) {
    const std::int64_t b = item / (p.h * q_blocks), head = (item / q_blocks) % p.h;
    const std::int64_t i0 = (item % q_blocks) * kBlockQ, rows = std::min(kBlockQ, p.L - i0);
    std::int64_t* nonfinite = nonfinite_lists.data() + omp_get_thread_num() * kBlockK;  // [kBlockK]
    float* s = workspace.get() + omp_get_thread_num() * per_thread;    // [rows, kBlockK]
    float* acc = s + s_size;                                            // [rows, ld_acc]
    float* kv_copy = acc + acc_size;                                    // [kBlockK, d_v]
    float* m = kv_copy + round_up(kv_size, kRowAlign);                  // [rows]
    float* l = m + kBlockQ;                                             // [rows]

    const float* q_rows = &p.q(b, head, i0, 0);  // [rows, d_k], row stride p.q.stride[2]
    for (std::int64_t r = 0; r < rows; ++r) {
      m[r] = kMinusInf;
      l[r] = 0.0f;
    }
    std::fill(acc, acc + rows * ld_acc, 0.0f);

    const std::int64_t key_end = flash::key_range_end(p, b, i0, rows);
    for (std::int64_t j0 = 0; j0 < key_end; j0 += kBlockK) {
      const std::int64_t cols = std::min(kBlockK, key_end - j0), padded_cols = round_up(cols, kRowAlign);
      // S = scale Q_blk K_blk^T (the scale as sgemm's alpha: the backward recomputes S the same way,
      // so its P = exp(S - lse) is normalised to float precision)
      flash::sgemm(false, true, rows, cols, p.d_k, p.scale, q_rows, p.q.stride[2], &p.k(b, head, j0, 0), p.k.stride[2],
                     false, s, kBlockK);
      if (flash::tile_needs_masks(p, i0, j0, cols)) flash::apply_masks(p, b, head, i0, rows, j0, cols, s, kBlockK);
      // Online softmax: P = exp(S - m'), l = a l + rowsum P, acc = a acc.
      for (std::int64_t r = 0; r < rows; ++r) {
        float* row = s + r * kBlockK;
        std::fill(row + cols, row + padded_cols, kMinusInf);
        const float m_new = std::max(m[r], RowMax(row, padded_cols));
        if (m_new == kMinusInf) {  // nothing allowed yet in this row
          std::fill(row, row + padded_cols, 0.0f);
          continue;
        }
        const float rescale = std::exp(m[r] - m_new);  // 0 when m was -inf
        l[r] = l[r] * rescale + ExpShiftedRowSum(row, padded_cols, m_new);
        ScaleRow(acc + r * ld_acc, ld_acc, rescale);
        m[r] = m_new;
      }
      if (p.dropout_p > 0) flash::apply_dropout(p, b, head, i0, rows, j0, cols, s, kBlockK);
      // acc += P V_blk; rows of V holding NaN or Inf are added apart, only where their weight is not 0.
      const flash::SafeBlock v_block = flash::safe_block(p, p.v, b, head, j0, cols, p.d_v, kv_copy, nonfinite);
      flash::sgemm(false, false, rows, p.d_v, cols, 1.0f, s, kBlockK, v_block.data, v_block.ld, true, acc, ld_acc);
      for (std::int64_t n = 0; n < v_block.nonfinite_count; ++n) {
        const std::int64_t c = nonfinite[n];
        for (std::int64_t r = 0; r < rows; ++r) {
          const float weight = s[r * kBlockK + c];
          if (weight == 0.0f) continue;
          for (std::int64_t e = 0; e < p.d_v; ++e) acc[r * ld_acc + e] += weight * p.v(b, head, j0 + c, e);
        }
      }
    }

    // out = acc / l; lse = m + log l. A row with no allowed key attends to nothing.
    for (std::int64_t r = 0; r < rows; ++r) {
      const bool empty = m[r] == kMinusInf;
      const float inv_l = empty ? 0.0f : 1.0f / l[r];
      for (std::int64_t c = 0; c < p.d_v; ++c) p.out(b, head, i0 + r, c) = empty ? 0.0f : acc[r * ld_acc + c] * inv_l;
      m[r] = empty ? kMinusInf : m[r] + std::log(l[r]);  // m now holds the log-sum-exp
      if (p.lse) p.lse[(b * p.h + head) * p.L + i0 + r] = m[r];
    }

    // The weights, if asked for: recomputed block by block from the log-sum-exp, straight into the
    // [B, h, L, S] output (already zero outside the key range).
    if (p.weights) {
      for (std::int64_t j0 = 0; j0 < key_end; j0 += kBlockK) {
        const std::int64_t cols = std::min(kBlockK, key_end - j0);
        flash::sgemm(false, true, rows, cols, p.d_k, p.scale, q_rows, p.q.stride[2], &p.k(b, head, j0, 0), p.k.stride[2],
                     false, s, kBlockK);
        ProbabilitiesFromLse(p, b, head, i0, rows, j0, cols, m, s);  // m holds the log-sum-exp
        if (p.dropout_p > 0) flash::apply_dropout(p, b, head, i0, rows, j0, cols, s, kBlockK);
        for (std::int64_t r = 0; r < rows; ++r)
          std::copy_n(s + r * kBlockK, cols, p.weights + ((b * p.h + head) * p.L + i0 + r) * p.S + j0);
      }
    }
  }
}

// dS = P * (f dP - D) for a tile: dp [rows, cols] holds dO V^T on entry and dS (without the logit
// scale) on exit; f is the dropout factor (1 without dropout).
void SoftmaxBackwardTile(const AttentionParams<float>& p, std::int64_t b, std::int64_t head, std::int64_t i0,
                         std::int64_t rows, std::int64_t j0, std::int64_t cols, const float* s, const float* D,
                         float* dp) {
  if (p.dropout_p > 0) flash::apply_dropout(p, b, head, i0, rows, j0, cols, dp, kBlockK);
  const std::int64_t padded_cols = round_up(cols, kRowAlign);
  for (std::int64_t r = 0; r < rows; ++r) {
    std::fill(dp + r * kBlockK + cols, dp + r * kBlockK + padded_cols, 0.0f);
    SoftmaxBackwardRow(s + r * kBlockK, dp + r * kBlockK, padded_cols, D[r]);
  }
}

// The FlashAttention-2 backward, without atomics: one pass over key blocks writes dK and dV (each
// block by one thread), a second pass over query blocks writes dQ; both recompute P from the
// log-sum-exp. Compared with FlashAttention-2's single pass this recomputes Q K^T and dO V^T once
// more (7 products instead of 5) in exchange for a deterministic result and no shared writes.
//   D_i = dO_i . O_i
//   pass 1, key block j:   for each query block i:  S = scale Q_i K_j^T;  P = exp(S - lse_i)
//                          dV_j += dropout(P)^T dO_i;  dP = dO_i V_j^T;  dS = P (f dP - D_i)
//                          dK_j += scale dS^T Q_i
//   pass 2, query block i: for each key block j:  (S, P, dP, dS as above);  dQ_i += scale dS K_j
void FlashBackward(const AttentionBackwardParams<float>& p) {
  const SerialIfSmall serial_if_small(5.0 * p.B * p.h * p.L * p.S * (p.d_k + p.d_v));
  const std::int64_t q_blocks = (p.L + kBlockQ - 1) / kBlockQ, k_blocks = (p.S + kBlockK - 1) / kBlockK;
  const std::int64_t tile = kBlockQ * kBlockK, kv_size = round_up(kBlockK * std::max(p.d_k, p.d_v), kRowAlign);
  const std::int64_t per_thread = 3 * tile + 2 * kv_size;
  auto workspace = hwy::AllocateAligned<float>(static_cast<std::size_t>(omp_get_max_threads() * per_thread));
  auto D_all = hwy::AllocateAligned<float>(static_cast<std::size_t>(std::max<std::int64_t>(1, p.B * p.h * p.L)));
  auto lse_all = hwy::AllocateAligned<float>(static_cast<std::size_t>(std::max<std::int64_t>(1, p.B * p.h * p.L)));

#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < p.B * p.h * p.L; ++r) {  // D = rowsum(dO * O); lse gathered contiguous
    const std::int64_t b = r / (p.h * p.L), head = (r / p.L) % p.h, i = r % p.L;
    float D = 0.0f;
    for (std::int64_t c = 0; c < p.d_v; ++c) D += p.dout(b, head, i, c) * p.o(b, head, i, c);
    D_all[r] = D;
    lse_all[r] = p.lse_in(b, head, i, 0);
  }

  std::vector<std::int64_t> nonfinite_lists(static_cast<std::size_t>(omp_get_max_threads() * 2 * kBlockK));

  struct Tiles {
    float *s, *dp, *pd, *k_copy, *v_copy;
    std::int64_t *nonfinite_k, *nonfinite_v;  // [kBlockK] each
  };
  auto tiles = [&] {
    const int thread = omp_get_thread_num();
    float* base = workspace.get() + thread * per_thread;
    std::int64_t* lists = nonfinite_lists.data() + thread * 2 * kBlockK;
    return Tiles{base, base + tile, base + 2 * tile, base + 3 * tile, base + 3 * tile + kv_size, lists,
                 lists + kBlockK};
  };
  // The K and V blocks of keys j0.., safe for whole-block products (see safe_block).
  struct KeyBlocks {
    flash::SafeBlock k, v;
  };
  auto key_blocks = [&](const Tiles& t, std::int64_t b, std::int64_t head, std::int64_t j0, std::int64_t cols) {
    return KeyBlocks{flash::safe_block(p, p.k, b, head, j0, cols, p.d_k, t.k_copy, t.nonfinite_k),
                     flash::safe_block(p, p.v, b, head, j0, cols, p.d_v, t.v_copy, t.nonfinite_v)};
  };
  // S = scale Q_i K_j^T -> P, and dP = dO_i V_j^T -> dS, for query rows i0.. and keys j0..
  // A key whose k or v holds NaN or Inf gets dS = NaN in the rows that attend to it (P != 0), as the
  // reference computes; rows that do not attend to it are untouched.
  auto tile_gradients = [&](const Tiles& t, std::int64_t b, std::int64_t head, std::int64_t i0, std::int64_t rows,
                            std::int64_t j0, std::int64_t cols, const KeyBlocks& kv) {
    const std::int64_t row0 = (b * p.h + head) * p.L + i0;
    flash::sgemm(false, true, rows, cols, p.d_k, p.scale, &p.q(b, head, i0, 0), p.q.stride[2], kv.k.data, kv.k.ld,
                 false, t.s, kBlockK);
    ProbabilitiesFromLse(p, b, head, i0, rows, j0, cols, lse_all.get() + row0, t.s);
    flash::sgemm(false, true, rows, cols, p.d_v, 1.0f, &p.dout(b, head, i0, 0), p.dout.stride[2], kv.v.data, kv.v.ld,
                 false, t.dp, kBlockK);
    SoftmaxBackwardTile(p, b, head, i0, rows, j0, cols, t.s, D_all.get() + row0, t.dp);
    for (auto [list, count] : {std::pair{t.nonfinite_k, kv.k.nonfinite_count}, std::pair{t.nonfinite_v, kv.v.nonfinite_count}})
      for (std::int64_t n = 0; n < count; ++n)
        for (std::int64_t r = 0; r < rows; ++r)
          if (t.s[r * kBlockK + list[n]] != 0.0f) t.dp[r * kBlockK + list[n]] = std::numeric_limits<float>::quiet_NaN();
  };

  // Pass 1: dK, dV, one key block per work item.
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t item = 0; item < p.B * p.h * k_blocks; ++item) {
    const std::int64_t b = item / (p.h * k_blocks), head = (item / k_blocks) % p.h;
    const std::int64_t key_end = p.key_lengths ? std::min(p.S, p.key_lengths[b]) : p.S;
    const std::int64_t j0 = (item % k_blocks) * kBlockK;
    if (j0 >= key_end) continue;  // only padding: no gradient
    const std::int64_t cols = std::min(kBlockK, key_end - j0);
    const Tiles t = tiles();
    const KeyBlocks kv = key_blocks(t, b, head, j0, cols);
    // Causal: query i sees key j only when i >= j - (S - L); earlier query blocks see nothing here.
    const std::int64_t first_query = p.causal ? std::max<std::int64_t>(0, j0 - (p.S - p.L)) : 0;
    for (std::int64_t i0 = first_query / kBlockQ * kBlockQ; i0 < p.L; i0 += kBlockQ) {
      const std::int64_t rows = std::min(kBlockQ, p.L - i0);
      tile_gradients(t, b, head, i0, rows, j0, cols, kv);
      const float* pd = t.s;  // dropout(P)
      if (p.dropout_p > 0) {
        for (std::int64_t r = 0; r < rows; ++r) std::copy_n(t.s + r * kBlockK, cols, t.pd + r * kBlockK);
        flash::apply_dropout(p, b, head, i0, rows, j0, cols, t.pd, kBlockK);
        pd = t.pd;
      }
      // dV_j += dropout(P)^T dO_i;  dK_j += scale dS^T Q_i
      flash::sgemm(true, false, cols, p.d_v, rows, 1.0f, pd, kBlockK, &p.dout(b, head, i0, 0), p.dout.stride[2], true,
                   &p.dv(b, head, j0, 0), p.dv.stride[2]);
      flash::sgemm(true, false, cols, p.d_k, rows, p.scale, t.dp, kBlockK, &p.q(b, head, i0, 0), p.q.stride[2], true,
                   &p.dk(b, head, j0, 0), p.dk.stride[2]);
    }
  }

  // Pass 2: dQ, one query block per work item.
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t item = 0; item < p.B * p.h * q_blocks; ++item) {
    const std::int64_t b = item / (p.h * q_blocks), head = (item / q_blocks) % p.h;
    const std::int64_t i0 = (item % q_blocks) * kBlockQ, rows = std::min(kBlockQ, p.L - i0);
    const Tiles t = tiles();
    const std::int64_t key_end = flash::key_range_end(p, b, i0, rows);
    for (std::int64_t j0 = 0; j0 < key_end; j0 += kBlockK) {
      const std::int64_t cols = std::min(kBlockK, key_end - j0);
      const KeyBlocks kv = key_blocks(t, b, head, j0, cols);
      tile_gradients(t, b, head, i0, rows, j0, cols, kv);
      flash::sgemm(false, false, rows, p.d_k, cols, p.scale, t.dp, kBlockK, kv.k.data, kv.k.ld, true,
                   &p.dq(b, head, i0, 0), p.dq.stride[2]);
    }
  }
}

float FlashExp(float x) { return ExpOne(x); }

}  // namespace mha::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha::detail {

HWY_EXPORT(FlashForward);
HWY_EXPORT(FlashExp);
HWY_EXPORT(FlashBackward);

void flash_attention_backward(const AttentionBackwardParams<float>& p) { HWY_DYNAMIC_DISPATCH(FlashBackward)(p); }

void flash_attention_forward(const AttentionParams<float>& p) { HWY_DYNAMIC_DISPATCH(FlashForward)(p); }

float flash_exp(float x) { return HWY_DYNAMIC_DISPATCH(FlashExp)(x); }

}  // namespace mha::detail
#endif  // HWY_ONCE
