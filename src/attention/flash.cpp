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
// The two products go through gemm_tile (oneDNN's sgemm on the calling thread, inside our OpenMP
// region); the row operations through Highway, dispatched once per call to the best SIMD target of the
// machine. Causal masking skips key blocks that lie entirely above the diagonal; key_lengths shortens
// the key range. Keys outside the range are never read; masked keys inside it get -inf logits
// (masks.hpp), and K/V rows of padded keys or holding NaN/Inf are zeroed in a copy of the block
// (nonfinite.hpp), so a NaN or Inf stored at a masked position cannot leak through the block products.
#include "attention/flash.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/flash.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <new>
#include <vector>

#include "attention/dropout.hpp"
#include "attention/flash_config.hpp"
#include "attention/masks.hpp"
#include "attention/nonfinite.hpp"
#include "attention/online_softmax-inl.h"
#include "gemm.hpp"
#include "hwy/aligned_allocator.h"
#include "hwy/highway.h"
#include "parallel.hpp"

HWY_BEFORE_NAMESPACE();
namespace mha::detail::HWY_NAMESPACE {

using flash::kBlockK;
using flash::kBlockQ;
using flash::kRowAlign;
using flash::round_up;

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// `count` floats of aligned scratch; std::bad_alloc when the memory is not there (never a null to
// write through).
hwy::AlignedFreeUniquePtr<float[]> AllocateFloats(std::int64_t count) {
  auto scratch = hwy::AllocateAligned<float>(static_cast<std::size_t>(count));
  if (!scratch) throw std::bad_alloc();
  return scratch;
}

// A row of weights of query i, keys [j0, j0 + cols), whose log-sum-exp is NaN: every entry is NaN after
// the exp, but a forbidden key's weight stays exactly 0 (a masked position is ignored, whatever the row).
void ZeroForbiddenEntries(const AttentionInputs<float>& p, std::int64_t b, std::int64_t head, std::int64_t i,
                          std::int64_t j0, std::int64_t cols, float* row) {
  for (std::int64_t c = 0; c < cols; ++c) {
    const bool forbidden_by_addition = p.additive_mask && p.additive_mask(b, head, i, j0 + c) == kMinusInf;
    if (!p.allowed(b, head, i, j0 + c) || forbidden_by_addition) row[c] = 0.0f;
  }
}

// S [rows, cols] (row stride kBlockK) = scale Q_rows K_blk^T. The scale goes in as sgemm's alpha in the
// forward and in both backward passes alike, so the backward's P = exp(S - lse) is normalised to float
// precision.
void ScaledLogits(const AttentionInputs<float>& p, const float* q_rows, std::int64_t rows, const float* k_block,
                  std::int64_t ldk, std::int64_t cols, float* s) {
  gemm_tile(rows, cols, p.d_k, plain(q_rows, p.q.stride[2]), transposed(k_block, ldk), overwrite(s, kBlockK), p.scale);
}

// Probabilities of a tile: s [rows, cols] (row stride kBlockK) holds scale * Q K^T; masks are applied
// and each row becomes P = exp(S - lse) (0 for a row that attended to nothing), padded with zeros.
void ProbabilitiesFromLse(const AttentionInputs<float>& p, std::int64_t b, std::int64_t head, std::int64_t i0,
                          std::int64_t rows, std::int64_t j0, std::int64_t cols, const float* lse, float* s) {
  const std::int64_t padded_cols = round_up(cols, kRowAlign);
  if (tile_needs_masks(p, i0, j0, cols)) apply_masks(p, b, head, i0, rows, j0, cols, s, kBlockK);
  for (std::int64_t r = 0; r < rows; ++r) {
    float* row = s + r * kBlockK;
    std::fill(row + cols, row + padded_cols, kMinusInf);
    if (lse[r] == kMinusInf) std::fill(row, row + padded_cols, 0.0f);
    else ExpShiftedRow(row, padded_cols, lse[r]);
    if (std::isnan(lse[r])) ZeroForbiddenEntries(p, b, head, i0 + r, j0, cols, row);
  }
}

// ---- forward --------------------------------------------------------------------------------------

// One thread's state for one block of query rows.
struct ForwardBlock {
  float* s;                 // [rows, kBlockK]: logits, then probabilities
  float* acc;               // [rows, ld_acc]: the unnormalised output
  float* kv_copy;           // [kBlockK, max(d_k, d_v)]: a K or V block made safe (nonfinite.hpp)
  float* m;                 // [rows]: running max, then the log-sum-exp
  float* l;                 // [rows]: running sum
  std::int64_t* nonfinite;  // [kBlockK]
  std::int64_t ld_acc;
};

// The online softmax over one logits tile (masks applied, cols <= kBlockK): P = exp(S - m') in place,
// l = a l + rowsum P, acc = a acc, m = m' with a = exp(m - m').
void OnlineSoftmaxTile(const ForwardBlock& w, std::int64_t rows, std::int64_t cols) {
  const std::int64_t padded_cols = round_up(cols, kRowAlign);
  for (std::int64_t r = 0; r < rows; ++r) {
    float* row = w.s + r * kBlockK;
    std::fill(row + cols, row + padded_cols, kMinusInf);
    const float row_max = RowMax(row, padded_cols);              // NaN when the row holds a NaN
    const bool nan = std::isnan(row_max) || std::isnan(w.m[r]);  // std::max would drop it
    const float m_new = nan ? std::numeric_limits<float>::quiet_NaN() : std::max(w.m[r], row_max);
    if (m_new == kMinusInf) {  // nothing allowed yet in this row
      std::fill(row, row + padded_cols, 0.0f);
      continue;
    }
    const float rescale = std::exp(w.m[r] - m_new);  // 0 when m was -inf
    w.l[r] = w.l[r] * rescale + ExpShiftedRowSum(row, padded_cols, m_new);
    ScaleRow(w.acc + r * w.ld_acc, w.ld_acc, rescale);
    w.m[r] = m_new;
  }
}

// acc += P V_blk for keys [j0, j0 + cols); rows of V holding NaN or Inf are added apart, only where
// their weight is not 0.
void AccumulateValues(const AttentionParams<float>& p, const ForwardBlock& w, std::int64_t b, std::int64_t head,
                      std::int64_t rows, std::int64_t j0, std::int64_t cols) {
  const SafeBlock v_block = safe_block(p, p.v, b, head, j0, cols, p.d_v, w.kv_copy, w.nonfinite);
  gemm_tile(rows, p.d_v, cols, plain(w.s, kBlockK), plain(v_block.data, v_block.ld), accumulate_into(w.acc, w.ld_acc));
  for (std::int64_t n = 0; n < v_block.nonfinite_count; ++n) {
    const std::int64_t c = w.nonfinite[n];
    for (std::int64_t r = 0; r < rows; ++r) {
      const float weight = w.s[r * kBlockK + c];
      if (weight == 0.0f) continue;
      for (std::int64_t e = 0; e < p.d_v; ++e) w.acc[r * w.ld_acc + e] += weight * p.v(b, head, j0 + c, e);
    }
  }
}

// out = acc / l; m becomes lse = m + log l. A row with no allowed key attends to nothing.
void FinishRows(const AttentionParams<float>& p, const ForwardBlock& w, std::int64_t b, std::int64_t head,
                std::int64_t i0, std::int64_t rows) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const bool empty = w.m[r] == kMinusInf;
    const float inv_l = empty ? 0.0f : 1.0f / w.l[r];
    for (std::int64_t c = 0; c < p.d_v; ++c) p.out(b, head, i0 + r, c) = empty ? 0.0f : w.acc[r * w.ld_acc + c] * inv_l;
    w.m[r] = empty ? kMinusInf : w.m[r] + std::log(w.l[r]);
    if (p.lse) p.lse[(b * p.h + head) * p.L + i0 + r] = w.m[r];
  }
}

// The weights of query rows [i0, i0 + rows), recomputed block by block from the log-sum-exp (in w.m),
// straight into the [B, h, L, S] output (already zero outside the key range).
void WriteWeights(const AttentionParams<float>& p, const ForwardBlock& w, std::int64_t b, std::int64_t head,
                  std::int64_t i0, std::int64_t rows, std::int64_t key_end) {
  for (std::int64_t j0 = 0; j0 < key_end; j0 += kBlockK) {
    const std::int64_t cols = std::min(kBlockK, key_end - j0);
    ScaledLogits(p, &p.q(b, head, i0, 0), rows, &p.k(b, head, j0, 0), p.k.stride[2], cols, w.s);
    ProbabilitiesFromLse(p, b, head, i0, rows, j0, cols, w.m, w.s);
    if (p.dropout_p > 0) apply_dropout(p, b, head, i0, rows, j0, cols, w.s, kBlockK);
    for (std::int64_t r = 0; r < rows; ++r)
      std::copy_n(w.s + r * kBlockK, cols, p.weights + ((b * p.h + head) * p.L + i0 + r) * p.S + j0);
  }
}

// The forward of query rows [i0, i0 + rows) of (b, head).
void ForwardQueryBlock(const AttentionParams<float>& p, const ForwardBlock& w, std::int64_t b, std::int64_t head,
                       std::int64_t i0, std::int64_t rows) {
  const float* q_rows = &p.q(b, head, i0, 0);  // [rows, d_k], row stride p.q.stride[2]
  std::fill(w.m, w.m + rows, kMinusInf);
  std::fill(w.l, w.l + rows, 0.0f);
  std::fill(w.acc, w.acc + rows * w.ld_acc, 0.0f);
  const std::int64_t key_end = key_range_end(p, b, i0, rows);
  for (std::int64_t j0 = 0; j0 < key_end; j0 += kBlockK) {
    const std::int64_t cols = std::min(kBlockK, key_end - j0);
    ScaledLogits(p, q_rows, rows, &p.k(b, head, j0, 0), p.k.stride[2], cols, w.s);
    if (tile_needs_masks(p, i0, j0, cols)) apply_masks(p, b, head, i0, rows, j0, cols, w.s, kBlockK);
    OnlineSoftmaxTile(w, rows, cols);
    if (p.dropout_p > 0) apply_dropout(p, b, head, i0, rows, j0, cols, w.s, kBlockK);
    AccumulateValues(p, w, b, head, rows, j0, cols);
  }
  FinishRows(p, w, b, head, i0, rows);
  if (p.weights) WriteWeights(p, w, b, head, i0, rows, key_end);
}

void FlashForward(const AttentionParams<float>& p) {
  const SerialIfSmall serial_if_small(2.0 * p.B * p.h * p.L * p.S * (p.d_k + p.d_v));
  const std::int64_t q_blocks = (p.L + kBlockQ - 1) / kBlockQ;
  const std::int64_t ld_acc = round_up(p.d_v, kRowAlign);
  // Per-thread workspace, allocated once per call: logits tile, accumulator, K/V block copy, m, l.
  // Sized to need: a block holds at most min(kBlockQ, L) query rows and min(kBlockK, S) keys.
  const std::int64_t max_rows = std::min(kBlockQ, p.L), max_cols = std::min(kBlockK, p.S);
  const std::int64_t s_size = max_rows * kBlockK, acc_size = max_rows * ld_acc;
  const std::int64_t kv_size = max_cols * std::max(p.d_k, p.d_v);
  const std::int64_t per_thread = s_size + acc_size + round_up(kv_size, kRowAlign) + 2 * kBlockQ;
  const auto workspace = AllocateFloats(omp_get_max_threads() * per_thread);
  std::vector<std::int64_t> nonfinite_lists(static_cast<std::size_t>(omp_get_max_threads() * kBlockK));

#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t item = 0; item < p.B * p.h * q_blocks; ++item) {
    const std::int64_t b = item / (p.h * q_blocks), head = (item / q_blocks) % p.h;
    const std::int64_t i0 = (item % q_blocks) * kBlockQ, rows = std::min(kBlockQ, p.L - i0);
    ForwardBlock w;
    w.s = workspace.get() + omp_get_thread_num() * per_thread;
    w.acc = w.s + s_size;
    w.kv_copy = w.acc + acc_size;
    w.m = w.kv_copy + round_up(kv_size, kRowAlign);
    w.l = w.m + kBlockQ;
    w.nonfinite = nonfinite_lists.data() + omp_get_thread_num() * kBlockK;
    w.ld_acc = ld_acc;
    ForwardQueryBlock(p, w, b, head, i0, rows);
  }
}

// ---- backward -------------------------------------------------------------------------------------
// The FlashAttention-2 backward, without atomics: one pass over key blocks writes dK and dV (each
// block by one thread), a second pass over query blocks writes dQ; both recompute P from the
// log-sum-exp. Compared with FlashAttention-2's single pass this recomputes Q K^T and dO V^T once
// more (7 products instead of 5) in exchange for a deterministic result and no shared writes.
//   D_i = dO_i . O_i
//   pass 1, key block j:   for each query block i:  S = scale Q_i K_j^T;  P = exp(S - lse_i)
//                          dV_j += dropout(P)^T dO_i;  dP = dO_i V_j^T;  dS = P (f dP - D_i)
//                          dK_j += scale dS^T Q_i
//   pass 2, query block i: for each key block j:  (S, P, dP, dS as above);  dQ_i += scale dS K_j

// dS = P * (f dP - D) for a tile: dp [rows, cols] holds dO V^T on entry and dS (without the logit
// scale) on exit; f is the dropout factor (1 without dropout).
void SoftmaxBackwardTile(const AttentionInputs<float>& p, std::int64_t b, std::int64_t head, std::int64_t i0,
                         std::int64_t rows, std::int64_t j0, std::int64_t cols, const float* s, const float* D,
                         float* dp) {
  if (p.dropout_p > 0) apply_dropout(p, b, head, i0, rows, j0, cols, dp, kBlockK);
  const std::int64_t padded_cols = round_up(cols, kRowAlign);
  for (std::int64_t r = 0; r < rows; ++r) {
    std::fill(dp + r * kBlockK + cols, dp + r * kBlockK + padded_cols, 0.0f);
    SoftmaxBackwardRow(s + r * kBlockK, dp + r * kBlockK, padded_cols, D[r]);
  }
}

// One thread's tiles and K/V block copies.
struct BackwardTiles {
  float *s, *dp, *pd, *k_copy, *v_copy;     // [kBlockQ, kBlockK] x 3, [kBlockK, max(d_k, d_v)] x 2
  std::int64_t *nonfinite_k, *nonfinite_v;  // [kBlockK] each
};

// The K and V blocks of keys j0.., safe for whole-block products (nonfinite.hpp).
struct KeyBlocks {
  SafeBlock k, v;
};

// What both backward passes share: the parameters, D = rowsum(dO * O) and the lse gathered
// contiguous ([B*h*L] each), and the per-thread workspace.
struct BackwardContext {
  const AttentionBackwardParams<float>& p;
  const float* D;
  const float* lse;
  float* workspace;
  std::int64_t per_thread, tile, kv_size;
  std::int64_t* nonfinite_lists;

  BackwardTiles tiles() const {
    const int thread = omp_get_thread_num();
    float* base = workspace + thread * per_thread;
    std::int64_t* lists = nonfinite_lists + thread * 2 * kBlockK;
    return {base, base + tile, base + 2 * tile, base + 3 * tile, base + 3 * tile + kv_size, lists, lists + kBlockK};
  }
  KeyBlocks key_blocks(const BackwardTiles& t, std::int64_t b, std::int64_t head, std::int64_t j0,
                       std::int64_t cols) const {
    return {safe_block(p, p.k, b, head, j0, cols, p.d_k, t.k_copy, t.nonfinite_k),
            safe_block(p, p.v, b, head, j0, cols, p.d_v, t.v_copy, t.nonfinite_v)};
  }
};

// S = scale Q_i K_j^T -> P (in t.s), and dP = dO_i V_j^T -> dS (in t.dp), for query rows i0.. and
// keys j0... A key whose k or v holds NaN or Inf gets dS = NaN in the rows that attend to it (P != 0),
// as the reference computes; rows that do not attend to it are untouched.
void TileGradients(const BackwardContext& ctx, const BackwardTiles& t, std::int64_t b, std::int64_t head,
                   std::int64_t i0, std::int64_t rows, std::int64_t j0, std::int64_t cols, const KeyBlocks& kv) {
  const AttentionBackwardParams<float>& p = ctx.p;
  const std::int64_t row0 = (b * p.h + head) * p.L + i0;
  ScaledLogits(p, &p.q(b, head, i0, 0), rows, kv.k.data, kv.k.ld, cols, t.s);
  ProbabilitiesFromLse(p, b, head, i0, rows, j0, cols, ctx.lse + row0, t.s);
  gemm_tile(rows, cols, p.d_v, plain(&p.dout(b, head, i0, 0), p.dout.stride[2]), transposed(kv.v.data, kv.v.ld),
            overwrite(t.dp, kBlockK));
  SoftmaxBackwardTile(p, b, head, i0, rows, j0, cols, t.s, ctx.D + row0, t.dp);
  for (auto [list, count] :
       {std::pair{t.nonfinite_k, kv.k.nonfinite_count}, std::pair{t.nonfinite_v, kv.v.nonfinite_count}})
    for (std::int64_t n = 0; n < count; ++n)
      for (std::int64_t r = 0; r < rows; ++r)
        if (t.s[r * kBlockK + list[n]] != 0.0f) t.dp[r * kBlockK + list[n]] = std::numeric_limits<float>::quiet_NaN();
}

// Pass 1: dK and dV of keys [j0, j0 + kBlockK) of (b, head), from every query block that sees them.
void KeyBlockGradients(const BackwardContext& ctx, std::int64_t b, std::int64_t head, std::int64_t j0) {
  const AttentionBackwardParams<float>& p = ctx.p;
  const std::int64_t key_end = p.key_lengths ? std::min(p.S, p.key_lengths[b]) : p.S;
  if (j0 >= key_end) return;  // only padding: no gradient
  const std::int64_t cols = std::min(kBlockK, key_end - j0);
  const BackwardTiles t = ctx.tiles();
  const KeyBlocks kv = ctx.key_blocks(t, b, head, j0, cols);
  // Causal: query i sees key j only when i >= j - (S - L); earlier query blocks see nothing here.
  const std::int64_t first_query = p.causal ? std::max<std::int64_t>(0, j0 - (p.S - p.L)) : 0;
  for (std::int64_t i0 = first_query / kBlockQ * kBlockQ; i0 < p.L; i0 += kBlockQ) {
    const std::int64_t rows = std::min(kBlockQ, p.L - i0);
    TileGradients(ctx, t, b, head, i0, rows, j0, cols, kv);
    const float* pd = t.s;  // dropout(P)
    if (p.dropout_p > 0) {
      for (std::int64_t r = 0; r < rows; ++r) std::copy_n(t.s + r * kBlockK, cols, t.pd + r * kBlockK);
      apply_dropout(p, b, head, i0, rows, j0, cols, t.pd, kBlockK);
      pd = t.pd;
    }
    // dV_j += dropout(P)^T dO_i;  dK_j += scale dS^T Q_i
    gemm_tile(cols, p.d_v, rows, transposed(pd, kBlockK), plain(&p.dout(b, head, i0, 0), p.dout.stride[2]),
              accumulate_into(&p.dv(b, head, j0, 0), p.dv.stride[2]));
    gemm_tile(cols, p.d_k, rows, transposed(t.dp, kBlockK), plain(&p.q(b, head, i0, 0), p.q.stride[2]),
              accumulate_into(&p.dk(b, head, j0, 0), p.dk.stride[2]), p.scale);
  }
}

// Pass 2: dQ of query rows [i0, i0 + rows) of (b, head), from every key block they see.
void QueryBlockGradients(const BackwardContext& ctx, std::int64_t b, std::int64_t head, std::int64_t i0,
                         std::int64_t rows) {
  const AttentionBackwardParams<float>& p = ctx.p;
  const BackwardTiles t = ctx.tiles();
  const std::int64_t key_end = key_range_end(p, b, i0, rows);
  for (std::int64_t j0 = 0; j0 < key_end; j0 += kBlockK) {
    const std::int64_t cols = std::min(kBlockK, key_end - j0);
    const KeyBlocks kv = ctx.key_blocks(t, b, head, j0, cols);
    TileGradients(ctx, t, b, head, i0, rows, j0, cols, kv);
    gemm_tile(rows, p.d_k, cols, plain(t.dp, kBlockK), plain(kv.k.data, kv.k.ld),
              accumulate_into(&p.dq(b, head, i0, 0), p.dq.stride[2]), p.scale);
  }
}

void FlashBackward(const AttentionBackwardParams<float>& p) {
  const SerialIfSmall serial_if_small(5.0 * p.B * p.h * p.L * p.S * (p.d_k + p.d_v));
  const std::int64_t q_blocks = (p.L + kBlockQ - 1) / kBlockQ, k_blocks = (p.S + kBlockK - 1) / kBlockK;
  // Sized to need: tiles of at most min(kBlockQ, L) rows (row stride kBlockK), K/V blocks of at most
  // min(kBlockK, S) keys.
  const std::int64_t max_rows = std::min(kBlockQ, p.L), max_cols = std::min(kBlockK, p.S);
  const std::int64_t tile = max_rows * kBlockK, kv_size = round_up(max_cols * std::max(p.d_k, p.d_v), kRowAlign);
  const std::int64_t per_thread = 3 * tile + 2 * kv_size;
  const auto workspace = AllocateFloats(omp_get_max_threads() * per_thread);
  const auto D_all = AllocateFloats(std::max<std::int64_t>(1, p.B * p.h * p.L));
  const auto lse_all = AllocateFloats(std::max<std::int64_t>(1, p.B * p.h * p.L));
  std::vector<std::int64_t> nonfinite_lists(static_cast<std::size_t>(omp_get_max_threads() * 2 * kBlockK));

#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < p.B * p.h * p.L; ++r) {  // D = rowsum(dO * O); lse gathered contiguous
    const std::int64_t b = r / (p.h * p.L), head = (r / p.L) % p.h, i = r % p.L;
    float D = 0.0f;
    for (std::int64_t c = 0; c < p.d_v; ++c) D += p.dout(b, head, i, c) * p.o(b, head, i, c);
    D_all[r] = D;
    lse_all[r] = p.lse_in(b, head, i, 0);
  }
  const BackwardContext ctx{p,          D_all.get(), lse_all.get(), workspace.get(),
                            per_thread, tile,        kv_size,       nonfinite_lists.data()};

#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t item = 0; item < p.B * p.h * k_blocks; ++item)  // pass 1: dK, dV
    KeyBlockGradients(ctx, item / (p.h * k_blocks), (item / k_blocks) % p.h, (item % k_blocks) * kBlockK);

#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t item = 0; item < p.B * p.h * q_blocks; ++item) {  // pass 2: dQ
    const std::int64_t i0 = (item % q_blocks) * kBlockQ;
    QueryBlockGradients(ctx, item / (p.h * q_blocks), (item / q_blocks) % p.h, i0, std::min(kBlockQ, p.L - i0));
  }
}

}  // namespace mha::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha::detail {

HWY_EXPORT(FlashForward);
HWY_EXPORT(FlashBackward);

void flash_attention_forward(const AttentionParams<float>& p) { HWY_DYNAMIC_DISPATCH(FlashForward)(p); }

void flash_attention_backward(const AttentionBackwardParams<float>& p) { HWY_DYNAMIC_DISPATCH(FlashBackward)(p); }

}  // namespace mha::detail
#endif  // HWY_ONCE
