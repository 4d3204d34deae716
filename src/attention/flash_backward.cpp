// The fused attention kernel's backward: FlashAttention-2 (Dao 2023) on the CPU, float32, recomputing
// P from the forward's log-sum-exp block by block (no L x S matrix), without atomics (see below).
// Products through gemm_tile, row operations through Highway (flash_tiles-inl.h,
// online_softmax-inl.h); NaN and Inf in Q, K, V or dO reach exactly the gradients that depend on them
// (nonfinite.hpp), and a forbidden key's gradients stay exactly 0.
#include "attention/flash.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/flash_backward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention/dropout.hpp"
#include "attention/flash_tiles-inl.h"
#include "attention/masks.hpp"
#include "attention/nonfinite.hpp"
#include "hwy/highway.h"
#include "parallel.hpp"

HWY_BEFORE_NAMESPACE();
namespace mha::detail::HWY_NAMESPACE {

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
// scale) on exit; f is the dropout factor (1 without dropout). In a row whose D is not finite (its dO
// or its output holds NaN or Inf) P * (...) is NaN even where P is 0, so a forbidden key's dS is set
// back to exactly 0 there: no gradient reaches a key the row does not attend to.
void SoftmaxBackwardTile(const AttentionInputs<float>& p, std::int64_t b, std::int64_t head, std::int64_t i0,
                         std::int64_t rows, std::int64_t j0, std::int64_t cols, const float* s, const float* D,
                         float* dp) {
  if (p.dropout_p > 0) apply_dropout(p, b, head, i0, rows, j0, cols, dp, kBlockK);
  const std::int64_t padded_cols = round_up(cols, kRowAlign);
  for (std::int64_t r = 0; r < rows; ++r) {
    std::fill(dp + r * kBlockK + cols, dp + r * kBlockK + padded_cols, 0.0f);
    SoftmaxBackwardRow(s + r * kBlockK, dp + r * kBlockK, padded_cols, D[r]);
    if (!std::isfinite(D[r])) ZeroForbiddenEntries(p, b, head, i0 + r, j0, cols, dp + r * kBlockK);
  }
}

// One thread's tiles and block copies.
struct BackwardTiles {
  float *s, *dp, *pd;                         // [kBlockQ, kBlockK] each
  float *k_copy, *v_copy, *q_copy, *do_copy;  // [kBlockK, max(d_k, d_v)] x 2, [kBlockQ, max(d_k, d_v)] x 2
  std::int64_t *nonfinite_k, *nonfinite_v;    // [kBlockK] each
  std::int64_t *nonfinite_q, *nonfinite_do;   // [kBlockQ] each
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
  std::int64_t per_thread, tile, kv_size, q_size;
  std::int64_t* nonfinite_lists;  // kListsPerThread per thread

  static constexpr std::int64_t kListsPerThread = 2 * kBlockK + 2 * kBlockQ;

  BackwardTiles tiles() const {
    const int thread = omp_get_thread_num();
    float* base = workspace + thread * per_thread;
    float* copies = base + 3 * tile;
    std::int64_t* lists = nonfinite_lists + thread * kListsPerThread;
    return {base,
            base + tile,
            base + 2 * tile,
            copies,
            copies + kv_size,
            copies + 2 * kv_size,
            copies + 2 * kv_size + q_size,
            lists,
            lists + kBlockK,
            lists + 2 * kBlockK,
            lists + 2 * kBlockK + kBlockQ};
  }
  KeyBlocks key_blocks(const BackwardTiles& t, std::int64_t b, std::int64_t head, std::int64_t j0,
                       std::int64_t cols) const {
    return {safe_block(p, p.k, b, head, j0, cols, p.d_k, t.k_copy, t.nonfinite_k),
            safe_block(p, p.v, b, head, j0, cols, p.d_v, t.v_copy, t.nonfinite_v)};
  }
};

// The probabilities of the listed keys (columns of the tile s, row stride kBlockK), whose k rows hold
// NaN or Inf and were zeroed in the block copy: recomputed one by one from the real k row, so that a
// logit of -inf (an infinite component against q's sign) gives exactly 0, as the forward had it, and
// +inf or NaN gives NaN. Forbidden entries stay 0.
void ExactProbabilitiesOfNonfiniteKeys(const AttentionInputs<float>& p, std::int64_t b, std::int64_t head,
                                       std::int64_t i0, std::int64_t rows, std::int64_t j0, const std::int64_t* list,
                                       std::int64_t count, const float* lse, float* s) {
  for (std::int64_t n = 0; n < count; ++n) {
    const std::int64_t j = j0 + list[n];
    for (std::int64_t r = 0; r < rows; ++r) {
      const float added = p.added(b, head, i0 + r, j);
      float& prob = s[r * kBlockK + list[n]];
      if (p.forbidden(b, head, i0 + r, j) || lse[r] == kMinusInf) {
        prob = 0.0f;
        continue;
      }
      float dot = 0.0f;
      for (std::int64_t e = 0; e < p.d_k; ++e) dot += p.q(b, head, i0 + r, e) * p.k(b, head, j, e);
      prob = std::exp(p.scale * dot + added - lse[r]);
    }
  }
}

// S = scale Q_i K_j^T -> P (in t.s), and dP = dO_i V_j^T -> dS (in t.dp), for query rows i0.. and
// keys j0... A key whose k holds NaN or Inf gets its exact P (0 for a -inf logit, else NaN); one whose
// v does gets dS = NaN in the rows that attend to it (P != 0). Rows that do not attend to it are
// untouched.
void TileGradients(const BackwardContext& ctx, const BackwardTiles& t, std::int64_t b, std::int64_t head,
                   std::int64_t i0, std::int64_t rows, std::int64_t j0, std::int64_t cols, const KeyBlocks& kv) {
  const AttentionBackwardParams<float>& p = ctx.p;
  const std::int64_t row0 = (b * p.h + head) * p.L + i0;
  ScaledLogits(p, &p.q(b, head, i0, 0), rows, kv.k.data, kv.k.ld, cols, t.s);
  ProbabilitiesFromLse(p, b, head, i0, rows, j0, cols, ctx.lse + row0, t.s);
  ExactProbabilitiesOfNonfiniteKeys(p, b, head, i0, rows, j0, t.nonfinite_k, kv.k.nonfinite_count, ctx.lse + row0, t.s);
  gemm_tile(rows, cols, p.d_v, plain(&p.dout(b, head, i0, 0), p.dout.stride[2]), transposed(kv.v.data, kv.v.ld),
            overwrite(t.dp, kBlockK));
  SoftmaxBackwardTile(p, b, head, i0, rows, j0, cols, t.s, ctx.D + row0, t.dp);
  for (std::int64_t n = 0; n < kv.v.nonfinite_count; ++n)  // dP = dO v^T of a zeroed v row was 0
    for (std::int64_t r = 0; r < rows; ++r)
      if (t.s[r * kBlockK + t.nonfinite_v[n]] != 0.0f)
        t.dp[r * kBlockK + t.nonfinite_v[n]] = std::numeric_limits<float>::quiet_NaN();
}

// dX_j += alpha coef[r, j] x_r for the listed rows r of query block i0 (their non-finite x rows were
// zeroed in the block product), keys j0 + [0, cols), where coef (row stride kBlockK) is not 0.
void AddNonfiniteRows(const Strided4<const float>& x, std::int64_t b, std::int64_t head, std::int64_t i0,
                      const std::int64_t* list, std::int64_t count, const float* coef, float alpha, std::int64_t cols,
                      std::int64_t width, const Strided4<float>& dx, std::int64_t j0) {
  for (std::int64_t n = 0; n < count; ++n) {
    const std::int64_t r = list[n];
    for (std::int64_t c = 0; c < cols; ++c) {
      const float weight = coef[r * kBlockK + c];
      if (weight == 0.0f) continue;
      for (std::int64_t e = 0; e < width; ++e) dx(b, head, j0 + c, e) += alpha * weight * x(b, head, i0 + r, e);
    }
  }
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
    // dV_j += dropout(P)^T dO_i;  dK_j += scale dS^T Q_i, through copies of dO_i and Q_i whose
    // non-finite rows are zeroed and added apart where their coefficient is not 0 (nonfinite.hpp).
    const SafeBlock dout_rows = safe_query_rows(p.dout, b, head, i0, rows, p.d_v, t.do_copy, t.nonfinite_do);
    const SafeBlock q_rows = safe_query_rows(p.q, b, head, i0, rows, p.d_k, t.q_copy, t.nonfinite_q);
    gemm_tile(cols, p.d_v, rows, transposed(pd, kBlockK), plain(dout_rows.data, dout_rows.ld),
              accumulate_into(&p.dv(b, head, j0, 0), p.dv.stride[2]));
    gemm_tile(cols, p.d_k, rows, transposed(t.dp, kBlockK), plain(q_rows.data, q_rows.ld),
              accumulate_into(&p.dk(b, head, j0, 0), p.dk.stride[2]), p.scale);
    AddNonfiniteRows(p.dout, b, head, i0, t.nonfinite_do, dout_rows.nonfinite_count, pd, 1.0f, cols, p.d_v, p.dv, j0);
    AddNonfiniteRows(p.q, b, head, i0, t.nonfinite_q, q_rows.nonfinite_count, t.dp, p.scale, cols, p.d_k, p.dk, j0);
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
    // The k rows holding NaN or Inf were zeroed in the product: their exact terms scale dS k_j, for
    // every allowed (i, j), as the reference adds them (0 * Inf is NaN there too).
    for (std::int64_t n = 0; n < kv.k.nonfinite_count; ++n) {
      const std::int64_t j = j0 + t.nonfinite_k[n];
      for (std::int64_t r = 0; r < rows; ++r) {
        const bool forbidden = p.forbidden(b, head, i0 + r, j);
        if (forbidden || ctx.lse[(b * p.h + head) * p.L + i0 + r] == kMinusInf) continue;
        const float ds = p.scale * t.dp[r * kBlockK + t.nonfinite_k[n]];
        for (std::int64_t e = 0; e < p.d_k; ++e) p.dq(b, head, i0 + r, e) += ds * p.k(b, head, j, e);
      }
    }
  }
}

void FlashBackward(const AttentionBackwardParams<float>& p) {
  const SerialIfSmall serial_if_small(5.0 * p.B * p.h * p.L * p.S * (p.d_k + p.d_v));
  const std::int64_t q_blocks = (p.L + kBlockQ - 1) / kBlockQ, k_blocks = (p.S + kBlockK - 1) / kBlockK;
  // Sized to need: tiles of at most min(kBlockQ, L) rows (row stride kBlockK), K/V blocks of at most
  // min(kBlockK, S) keys.
  const std::int64_t max_rows = std::min(kBlockQ, p.L), max_cols = std::min(kBlockK, p.S);
  const std::int64_t tile = max_rows * kBlockK, kv_size = round_up(max_cols * std::max(p.d_k, p.d_v), kRowAlign);
  const std::int64_t q_size = round_up(max_rows * std::max(p.d_k, p.d_v), kRowAlign);
  const std::int64_t per_thread = 3 * tile + 2 * kv_size + 2 * q_size;
  const auto workspace = AllocateFloats(omp_get_max_threads() * per_thread);
  const auto D_all = AllocateFloats(std::max<std::int64_t>(1, p.B * p.h * p.L));
  const auto lse_all = AllocateFloats(std::max<std::int64_t>(1, p.B * p.h * p.L));
  std::vector<std::int64_t> nonfinite_lists(
      static_cast<std::size_t>(omp_get_max_threads() * BackwardContext::kListsPerThread));

#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < p.B * p.h * p.L; ++r) {  // D = rowsum(dO * O); lse gathered contiguous
    const std::int64_t b = r / (p.h * p.L), head = (r / p.L) % p.h, i = r % p.L;
    float D = 0.0f;
    for (std::int64_t c = 0; c < p.d_v; ++c) D += p.dout(b, head, i, c) * p.o(b, head, i, c);
    D_all[r] = D;
    lse_all[r] = p.lse_in(b, head, i, 0);
  }
  const BackwardContext ctx{p,    D_all.get(), lse_all.get(), workspace.get(),       per_thread,
                            tile, kv_size,     q_size,        nonfinite_lists.data()};

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

HWY_EXPORT(FlashBackward);

void flash_attention_backward(const AttentionBackwardParams<float>& p) { HWY_DYNAMIC_DISPATCH(FlashBackward)(p); }

}  // namespace mha::detail
#endif  // HWY_ONCE
