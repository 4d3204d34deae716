// The fused attention kernel's backward: FlashAttention-2 (Dao 2023) on the CPU, float32 or bfloat16,
// recomputing P from the forward's log-sum-exp block by block (no L x S matrix), without atomics (see
// below). Products through gemm_tile, row operations through Highway (flash_tiles-inl.h,
// online_softmax-inl.h); NaN and Inf in Q, K, V or dO reach exactly the gradients that depend on them
// (nonfinite.hpp), and a forbidden key's gradients stay exactly 0. For bfloat16 inputs the five
// products take bfloat16 operands (Q, K, V, dO as given; P and dS rounded to bfloat16, as
// FlashAttention does) with float32 accumulation; P, dP, dS, D, dK, dV and dQ are float32 until dK, dV
// and dQ are rounded once into the outputs.
#include "attention/flash.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/flash_backward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention/bf16_transpose.hpp"
#include "attention/dropout.hpp"
#include "attention/flash_backward_context.hpp"
#include "attention/flash_backward_rows-inl.h"
#include "attention/flash_tiles-inl.h"
#include "attention/masks.hpp"
#include "attention/nonfinite.hpp"
#include "attention/query_block.hpp"
#include "hwy/highway.h"
#include "parallel.hpp"

HWY_BEFORE_NAMESPACE();
namespace mha::detail::HWY_NAMESPACE {

// ---- backward -------------------------------------------------------------------------------------
// The FlashAttention-2 backward, without atomics and deterministic: five products per tile, in one
// pass over key blocks. Each work item is one group of key blocks of one (b, key/value head); it owns
// their dK and dV, summed over the query heads that read that key/value head (all g = h / h_kv of
// them, in order, while the K/V block is in cache: grouped-query attention reads each block once per
// group), and adds its share of each query head's dQ into a dQ of its own (float32 inputs, group 0: the output itself;
// otherwise a float32 scratch copy), summed into the output after the pass in the order of the groups. The groups are a
// function of the shape only (dq_groups), so the result is the same for every thread count.
//   D_i = dO_i . O_i
//   key block j:  for each query block i that sees it:  S = scale Q_i K_j^T;  P = exp(S - lse_i)
//                 dV_j += dropout(P)^T dO_i;  dP = dO_i V_j^T;  dS = P (f dP - D_i)
//                 dK_j += scale dS^T Q_i;  dQ_i(group of j) += scale dS K_j
//   dQ_i = sum over the groups, in order

// Where SoftmaxBackwardTile writes the bfloat16 copies of P and dS (BackwardTiles' pd_rounded, ds_rounded);
// p null where P is rounded as it is transposed, later (BackwardContext::writes_transposed_p).
struct RoundedTiles {
  bfloat16 *p, *ds;  // [rows, kBlockK] each
};

// dS = P * (f dP - D) for a tile: dp [rows, cols] holds dO V^T on entry and dS (without the logit
// scale) on exit; f is the dropout factor (1 without dropout). In a row whose D is not finite (its dO
// or its output holds NaN or Inf) P * (...) is NaN even where P is 0, so a forbidden key's dS is set
// back to exactly 0 there: no gradient reaches a key the row does not attend to. With `rounded` (the
// tile's P and dS final once a row is done: RoundsRowByRow), each row's P and dS are rounded to
// bfloat16 into rounded->p and rounded->ds as it is done, still in the L1, where the caller would
// otherwise round both tiles after, reading them back from the L2. With `lse` (the rows' log-sum-exp), s holds
// the tile's masked logits on entry, and each row becomes P (ProbabilityRow) just before its dS, while in the
// L1: one pass over the tile fewer than ProbabilitiesFromLse before the dP product; without, s holds P.
template <class T>
void SoftmaxBackwardTile(const AttentionInputs<T>& p, std::int64_t b, std::int64_t head, std::int64_t i0,
                         std::int64_t rows, std::int64_t j0, std::int64_t cols, float* s, const float* lse,
                         const float* D, float* dp, const RoundedTiles* rounded) {
  if (p.dropout_p > 0) apply_dropout(p, b, head, i0, rows, j0, cols, dp, kBlockK);
  const std::int64_t padded_cols = round_up(cols, kRowAlign);
  for (std::int64_t r = 0; r < rows; ++r) {
    if (lse) ProbabilityRow(p, b, head, i0 + r, j0, cols, lse[r], s + r * kBlockK);
    std::fill(dp + r * kBlockK + cols, dp + r * kBlockK + padded_cols, 0.0f);
    SoftmaxBackwardRow(s + r * kBlockK, dp + r * kBlockK, padded_cols, D[r]);
    if (!std::isfinite(D[r])) ZeroForbiddenEntries(p, b, head, i0 + r, j0, cols, dp + r * kBlockK);
    if (rounded) {
      if (rounded->p) RoundRowsToBfloat16(s + r * kBlockK, kBlockK, 1, padded_cols, rounded->p + r * kBlockK, kBlockK);
      RoundRowsToBfloat16(dp + r * kBlockK, kBlockK, 1, padded_cols, rounded->ds + r * kBlockK, kBlockK);
    }
  }
}

// S = scale Q_i K_j^T -> P (in t.s), and dP = dO_i V_j^T -> dS (in t.dp), for query rows i0.. and
// keys j0... A key whose k holds NaN or Inf gets its exact P (0 for a -inf logit, else NaN); one whose
// v does gets dS = NaN in the rows that attend to it (P != 0). Rows that do not attend to it are
// untouched.
template <class T>
void TileGradients(const BackwardContext<T>& ctx, const BackwardTiles<T>& t, std::int64_t b, std::int64_t head,
                   std::int64_t i0, std::int64_t rows, std::int64_t j0, std::int64_t cols, const KeyBlocks<T>& kv) {
  const AttentionBackwardParams<T>& p = ctx.p;
  const std::int64_t row0 = (b * p.h + head) * p.L + i0;
  ScaledLogits(p, t.q_head + i0 * p.d_k, p.d_k, rows, kv.k.data, kv.k.ld, cols, t.s);
  if (p.softcap > 0) SoftcapTile(t.s, rows, cols, p.softcap, t.cap_slope);
  // P row by row in SoftmaxBackwardTile, unless a key's exact probabilities need the whole tile's first.
  const bool p_by_row = kv.k.nonfinite_count == 0;
  if (p_by_row) {
    if (needs_data_masks(p)) apply_masks(p, b, head, i0, rows, j0, cols, t.s, kBlockK);
  } else {
    ProbabilitiesFromLse(p, b, head, i0, rows, j0, cols, ctx.lse + row0, t.s);
    ExactProbabilitiesOfNonfiniteKeys(p, b, head, i0, rows, j0, cols, t.nonfinite_k, kv.k.nonfinite_count,
                                      ctx.lse + row0, t.s, t.cap_slope);
  }
  gemm_tile(rows, cols, p.d_v, plain(t.do_head + i0 * p.d_v, p.d_v), transposed(kv.v.data, kv.v.ld),
            overwrite(t.dp, kBlockK));
  const RoundedTiles rounded{ctx.writes_transposed_p ? nullptr : t.pd_rounded, t.ds_rounded};
  SoftmaxBackwardTile(p, b, head, i0, rows, j0, cols, t.s, p_by_row ? ctx.lse + row0 : nullptr, ctx.D + row0, t.dp,
                      RoundsRowByRow(ctx, kv) ? &rounded : nullptr);
  if (p.softcap > 0)  // dS times d cap / d logit, where dS is not 0 (a NaN slope must not reach a forbidden key)
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c)
        if (t.dp[r * kBlockK + c] != 0.0f) t.dp[r * kBlockK + c] *= t.cap_slope[r * kBlockK + c];
  for (std::int64_t n = 0; n < kv.v.nonfinite_count; ++n)  // dP = dO v^T of a zeroed v row was 0
    for (std::int64_t r = 0; r < rows && t.nonfinite_v[n] < cols; ++r)
      if (t.s[r * kBlockK + t.nonfinite_v[n]] != 0.0f)
        t.dp[r * kBlockK + t.nonfinite_v[n]] = std::numeric_limits<float>::quiet_NaN();
}

// dQ_i += scale dS K_j for the query rows i0.. of one tile, into the work item's dQ. The k rows holding
// NaN or Inf were zeroed in the product: their exact terms scale dS k_j are added for every allowed
// (i, j), as the reference adds them (0 * Inf is NaN there too).
template <class T>
void AddQueryGradients(const BackwardContext<T>& ctx, const BackwardTiles<T>& t, std::int64_t b, std::int64_t head,
                       std::int64_t i0, std::int64_t rows, std::int64_t j0, std::int64_t cols, const KeyBlocks<T>& kv,
                       const DqTarget& dq) {
  const AttentionBackwardParams<T>& p = ctx.p;
  gemm_tile(rows, p.d_k, cols, tile_operand<T>(t.dp, t.ds_rounded), plain(kv.k.data, kv.k.ld),
            accumulate_into(dq.data + i0 * dq.ld, dq.ld), p.scale);
  for (std::int64_t n = 0; n < kv.k.nonfinite_count; ++n) {
    if (t.nonfinite_k[n] >= cols) continue;  // past the tile's columns: no row of it sees the key
    const std::int64_t j = j0 + t.nonfinite_k[n];
    for (std::int64_t r = 0; r < rows; ++r) {
      const bool forbidden = p.forbidden(b, head, i0 + r, j);
      if (forbidden || ctx.lse[(b * p.h + head) * p.L + i0 + r] == kMinusInf) continue;
      const float ds = p.scale * t.dp[r * kBlockK + t.nonfinite_k[n]];
      const T* k_row = &p.k(b, p.kv_head(head), j, 0);
      for (std::int64_t e = 0; e < p.d_k; ++e) dq.data[(i0 + r) * dq.ld + e] += ds * float(k_row[e * p.k.stride[3]]);
    }
  }
}

// dV's first operand: dropout(P) [rows, seen] (pd, float32) read transposed, in the products' type: P^T
// rounded to bfloat16 as it is transposed into t.pd_rounded where ctx.writes_transposed_p, else the tile (or
// its rounded copy) read transposed by gemm_tile.
template <class T>
auto dropout_p_transposed(const BackwardContext<T>& ctx, const BackwardTiles<T>& t, const float* pd, std::int64_t rows,
                          std::int64_t seen) {
  if constexpr (BackwardContext<T>::kRounds) {
    if (ctx.writes_transposed_p) {
      const std::int64_t ld = transposed_row_stride(rows);  // as gemm_tile's own plain copy (gemm_bf16.cpp)
      transpose_rounding_to_bf16(pd, kBlockK, rows, seen, t.pd_rounded, ld);
      return plain(static_cast<const bfloat16*>(t.pd_rounded), ld);
    }
  }
  return transposed_tile<T>(pd, t.pd_rounded);
}

// The five products of one tile (query rows [i0, i0 + rows) of `head`, keys [j0, j0 + seen)): dV_j and dK_j of
// the key block (the first tile of the block overwrites them), and dQ_i's share into dq.
template <class T>
void TileAllGradients(const BackwardContext<T>& ctx, BackwardTiles<T>& t, std::int64_t b, std::int64_t head,
                      std::int64_t i0, std::int64_t rows, std::int64_t j0, std::int64_t seen, bool first,
                      const KeyBlocks<T>& kv, const std::uint8_t* query_flags, const DqTarget& dq) {
  const AttentionBackwardParams<T>& p = ctx.p;
  TileGradients(ctx, t, b, head, i0, rows, j0, seen, kv);
  const float* pd = t.s;  // dropout(P)
  if (p.dropout_p > 0) {
    for (std::int64_t r = 0; r < rows; ++r) std::copy_n(t.s + r * kBlockK, seen, t.pd + r * kBlockK);
    apply_dropout(p, b, head, i0, rows, j0, seen, t.pd, kBlockK);
    pd = t.pd;
  }
  // dV_j += dropout(P)^T dO_i;  dK_j += scale dS^T Q_i (the first tile overwrites), through copies of
  // dO_i and Q_i whose non-finite rows are zeroed and added apart where their coefficient is not 0
  // (nonfinite.hpp).
  const SafeBlock<T> dout_rows =
      safe_query_rows(t.do_head, p.d_v, i0, rows, p.d_v, query_flags, kDoutRow, t.do_copy, t.nonfinite_do);
  const SafeBlock<T> q_rows =
      safe_query_rows(t.q_head, p.d_k, i0, rows, p.d_k, query_flags, kQueryRow, t.q_copy, t.nonfinite_q);
  if (BackwardContext<T>::kRounds && !RoundsRowByRow(ctx, kv)) {  // the tiles' bfloat16 copies for the products
    if (!ctx.writes_transposed_p)
      RoundRowsToBfloat16(pd, kBlockK, rows, round_up(seen, kRowAlign), t.pd_rounded, kBlockK);
    RoundRowsToBfloat16(t.dp, kBlockK, rows, round_up(seen, kRowAlign), t.ds_rounded, kBlockK);
  }
  gemm_tile(seen, p.d_v, rows, dropout_p_transposed(ctx, t, pd, rows, seen), plain(dout_rows.data, dout_rows.ld),
            first ? overwrite(t.dv_block, p.d_v) : accumulate_into(t.dv_block, p.d_v));
  gemm_tile(seen, p.d_k, rows, transposed_tile<T>(t.dp, t.ds_rounded), plain(q_rows.data, q_rows.ld),
            first ? overwrite(t.dk_block, p.d_k) : accumulate_into(t.dk_block, p.d_k), p.scale);
  AddNonfiniteRows(p.dout, b, head, i0, t.nonfinite_do, dout_rows.nonfinite_count, pd, 1.0f, seen, p.d_v, t.dv_block);
  AddNonfiniteRows(p.q, b, head, i0, t.nonfinite_q, q_rows.nonfinite_count, t.dp, p.scale, seen, p.d_k, t.dk_block);
  AddQueryGradients(ctx, t, b, head, i0, rows, j0, seen, kv, dq);
}

// dK and dV of keys [j0, j0 + kBlockK) of (b, key/value head kv), and their share of dQ, from every
// query block of the group's query heads (head kv g + m, whose dQ goes to dq[m]) that sees them.
template <class T>
void KeyBlockGradients(const BackwardContext<T>& ctx, BackwardTiles<T>& t, std::int64_t b, std::int64_t kv,
                       std::int64_t j0, const DqTarget* dq) {
  const AttentionBackwardParams<T>& p = ctx.p;
  const std::int64_t key_end = p.key_lengths ? std::min(p.S, p.key_lengths[b]) : p.S;
  const std::int64_t cols = std::clamp<std::int64_t>(key_end - j0, 0, kBlockK);
  // Causal (or a window's right bound): query i sees key j only when i >= j - right - query_shift;
  // earlier query blocks see nothing here. A window's left bound: only when i <= j + left - query_shift.
  const std::int64_t right = right_extent(p), left = p.window_left;
  const std::int64_t first_query = right >= 0 ? std::max<std::int64_t>(0, j0 - right - p.query_shift) : 0;
  const std::int64_t block_q = ctx.block_q, first_block = first_query / block_q * block_q;
  const std::int64_t query_end = left >= 0 ? std::clamp<std::int64_t>(j0 + cols + left - p.query_shift, 0, p.L) : p.L;
  // Keys past key_end (padding) and keys no query sees get exactly 0 (first_query >= L: the block lies
  // right of every query's reach, as a key chunk after the query chunk does with causal).
  if (cols == 0 || first_block >= query_end || first_query >= p.L) {
    const std::int64_t end = std::min(p.S, j0 + kBlockK);
    ZeroRows(p.dk, b, kv, j0, end, p.d_k), ZeroRows(p.dv, b, kv, j0, end, p.d_v);
    return;
  }
  if (cols < std::min(kBlockK, p.S - j0)) {  // the block straddles key_end
    const std::int64_t end = std::min(p.S, j0 + kBlockK);
    ZeroRows(p.dk, b, kv, j0 + cols, end, p.d_k), ZeroRows(p.dv, b, kv, j0 + cols, end, p.d_v);
  }
  const KeyBlocks<T> kv_blocks = ctx.key_blocks(t, b, kv, j0, cols);
  bool started = false;  // whether a tile has written dK and dV yet (the first overwrites)
  for (std::int64_t m = 0, head = kv * p.group(); m < p.group(); ++m, ++head) {
    ctx.use_query_head(t, b, head);
    const std::uint8_t* query_flags = ctx.query_flags + (b * p.h + head) * p.L;
    for (std::int64_t block = first_block; block < query_end; block += block_q) {
      for (const RowBand band : tile_row_bands(p, block, std::min(block_q, p.L - block), j0, cols)) {
        // A diagonal tile in the forward's bands (masks.hpp), each a tile of its own here. Causal: a
        // band's products shrink to the keys its last (most-seeing) row sees; the rest get nothing from it.
        if (band.empty()) continue;
        const std::int64_t i0 = block + band.first, rows = band.rows, seen = band.cols;
        const bool first = !started;
        started = true;
        if (first && seen < cols) {  // rows [seen, cols) of dK and dV are not overwritten below: start at 0
          std::fill(t.dv_block + seen * p.d_v, t.dv_block + cols * p.d_v, 0.0f);
          std::fill(t.dk_block + seen * p.d_k, t.dk_block + cols * p.d_k, 0.0f);
        }
        TileAllGradients(ctx, t, b, head, i0, rows, j0, seen, first, kv_blocks, query_flags, dq[m]);
      }
    }
  }
  for (std::int64_t c = 0; c < cols; ++c) {  // the block's dK and dV, accumulated adjacent, to the outputs
    for (std::int64_t e = 0; e < p.d_k; ++e) p.dk(b, kv, j0 + c, e) = T(t.dk_block[c * p.d_k + e]);
    for (std::int64_t e = 0; e < p.d_v; ++e) p.dv(b, kv, j0 + c, e) = T(t.dv_block[c * p.d_v + e]);
  }
}

// How many groups the key blocks of one (b, head) are dealt into, each a work item with a dQ of its
// own: enough items for the threads of a typical machine when B * h is small, few enough that the
// extra dQ copies stay small. A function of the shape only, never of the thread count, so that the
// order in which dQ is summed, and so the result, is the same for every thread count.
template <class T>
std::int64_t dq_groups(const AttentionBackwardParams<T>& p, std::int64_t k_blocks) {
  constexpr std::int64_t kTargetItems = 8, kMaxGroups = 8;
  const std::int64_t wanted = (kTargetItems + p.B * p.h_kv - 1) / (p.B * p.h_kv);
  return std::clamp<std::int64_t>(wanted, 1, std::min(kMaxGroups, std::max<std::int64_t>(1, k_blocks)));
}

// D = rowsum(dO * O) and the lse, gathered contiguous [B*h*L]; the non-finite flags of q, dO, k, v.
template <class T>
void GatherRowData(const AttentionBackwardParams<T>& p, float* D_all, float* lse_all, std::uint8_t* query_flags,
                   std::uint8_t* key_flags) {
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < p.B * p.h * p.L; ++r) {
    const std::int64_t b = r / (p.h * p.L), head = (r / p.L) % p.h, i = r % p.L;
    float D = 0.0f;
    for (std::int64_t c = 0; c < p.d_v; ++c) D += float(p.dout(b, head, i, c)) * float(p.o(b, head, i, c));
    D_all[r] = D;
    lse_all[r] = p.lse_in(b, head, i, 0);
  }
  FlagNonfiniteRows(p.q, p.B, p.h, p.L, p.d_k, kQueryRow, query_flags);
  FlagNonfiniteRows(p.dout, p.B, p.h, p.L, p.d_v, kDoutRow, query_flags);
  FlagNonfiniteRows(p.k, p.B, p.h_kv, p.S, p.d_k, kKeyRow, key_flags);
  FlagNonfiniteRows(p.v, p.B, p.h_kv, p.S, p.d_v, kValueRow, key_flags);
}

// The rows of one thread's dQ of query head `head` (the m-th of its key/value head's group) and where
// group 0 writes: for float32 inputs the output itself when its rows are adjacent (else t.dq_head's
// m-th part, copied out at the end); for bfloat16 inputs always float32 rows (dq_float's part of the
// group), rounded once when the groups are summed.
template <class T>
DqTarget dq_target(const AttentionBackwardParams<T>& p, const BackwardTiles<T>& t, float* dq_float, std::int64_t b,
                   std::int64_t head, std::int64_t group, bool in_place) {
  const std::int64_t bh = b * p.h + head, m = head % p.group();
  if constexpr (std::is_same_v<T, float>) {
    if (in_place) return {p.dq.pointer(b, head, 0, 0), p.d_k};
    if (group == 0) return {t.dq_head + m * p.L * p.d_k, p.d_k};
    return {dq_float + ((group - 1) * p.B * p.h + bh) * p.L * p.d_k, p.d_k};
  } else {
    return {dq_float + (group * p.B * p.h + bh) * p.L * p.d_k, p.d_k};
  }
}

template <class T>
void FlashBackward(const AttentionBackwardParams<T>& p) {
  constexpr bool kFloat = std::is_same_v<T, float>;
  const SerialIfSmall serial_if_small(5.0 * p.B * p.h * p.L * p.S * (p.d_k + p.d_v));
  const std::int64_t k_blocks = (p.S + kBlockK - 1) / kBlockK, groups = dq_groups(p, k_blocks);
  const int threads = omp_get_max_threads();
  // Sized to need: tiles of at most min(block_q, L) rows (row stride kBlockK), K/V blocks of at most
  // min(kBlockK, S) keys.
  const std::int64_t block_q = query_block_rows(), max_rows = std::min(block_q, p.L), max_cols = std::min(kBlockK, p.S);
  const std::int64_t tile = max_rows * kBlockK, kv_size = round_up(max_cols * std::max(p.d_k, p.d_v), kRowAlign);
  const std::int64_t q_size = round_up(max_rows * std::max(p.d_k, p.d_v), kRowAlign);
  const std::int64_t head_copy_size =
      (p.q.stride[2] != p.d_k ? p.L * p.d_k : 0) + (p.dout.stride[2] != p.d_v ? p.L * p.d_v : 0);
  const std::int64_t dq_head_size =
      kFloat && p.dq.stride[2] != p.d_k ? round_up(p.group() * p.L * p.d_k, kRowAlign) : 0;
  const std::int64_t rows_all = std::max<std::int64_t>(1, p.B * p.h * p.L);
  const auto D_all = AllocateFloats(rows_all), lse_all = AllocateFloats(rows_all);
  // dQ in float32 [groups', B, h, L, d_k]: groups 1.. for float32 inputs (group 0 adds into the output
  // or t.dq_head), every group for bfloat16 inputs.
  const std::int64_t float_groups = kFloat ? groups - 1 : groups;
  const auto dq_float = AllocateFloats(std::max<std::int64_t>(1, float_groups * p.B * p.h * p.L * p.d_k));
  std::vector<std::uint8_t> query_flags(static_cast<std::size_t>(p.B * p.h * p.L));
  std::vector<std::uint8_t> key_flags(static_cast<std::size_t>(p.B * p.h_kv * p.S));
  std::vector<std::int64_t> nonfinite_lists(static_cast<std::size_t>(threads * BackwardContext<T>::kListsPerThread));
  GatherRowData(p, D_all.get(), lse_all.get(), query_flags.data(), key_flags.data());
  BackwardContext<T> ctx{
      p,       D_all.get(), lse_all.get(),  query_flags.data(), key_flags.data(),      nullptr, nullptr, nullptr, tile,
      kv_size, q_size,      head_copy_size, dq_head_size,       nonfinite_lists.data()};
  const auto floats = AllocateFloats(threads * ctx.floats_per_thread());
  const auto elements = Allocate<T>(threads * ctx.elements_per_thread());
  const auto rounded = Allocate<bfloat16>(std::max<std::int64_t>(1, threads * ctx.rounded_per_thread()));
  ctx.floats = floats.get(), ctx.elements = elements.get(), ctx.rounded = rounded.get();

#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t item = 0; item < p.B * p.h_kv * groups; ++item) {
    const std::int64_t b_kv = item / groups, b = b_kv / p.h_kv, kv = b_kv % p.h_kv, group = item % groups;
    BackwardTiles<T> t = ctx.tiles();
    const bool dq_in_place = group == 0 && p.dq.stride[2] == p.d_k;
    std::vector<DqTarget> dq;  // [g]: the dQ of each query head of the group
    for (std::int64_t head = kv * p.group(); head < (kv + 1) * p.group(); ++head) {
      dq.push_back(dq_target(p, t, dq_float.get(), b, head, group, dq_in_place));
      std::fill_n(dq.back().data, p.L * p.d_k, 0.0f);
    }
    for (std::int64_t block = group; block < k_blocks; block += groups)  // dealt round-robin: balances causal
      KeyBlockGradients(ctx, t, b, kv, block * kBlockK, dq.data());
    if constexpr (kFloat) {
      for (std::int64_t m = 0; group == 0 && !dq_in_place && m < p.group(); ++m)
        for (std::int64_t i = 0; i < p.L; ++i)
          for (std::int64_t e = 0; e < p.d_k; ++e) p.dq(b, kv * p.group() + m, i, e) = dq[m].data[i * p.d_k + e];
    }
  }
  if (kFloat && groups == 1) return;
#pragma omp parallel for schedule(static)
  for (std::int64_t r = 0; r < p.B * p.h * p.L; ++r) {  // dQ = the groups' shares, summed in order
    const std::int64_t b = r / (p.h * p.L), head = (r / p.L) % p.h, i = r % p.L;
    for (std::int64_t e = 0; e < p.d_k; ++e) {
      float sum = kFloat ? float(p.dq(b, head, i, e)) : 0.0f;
      for (std::int64_t g = 0; g < float_groups; ++g) sum += dq_float[(g * p.B * p.h * p.L + r) * p.d_k + e];
      p.dq(b, head, i, e) = T(sum);
    }
  }
}

void FlashBackwardFloat(const AttentionBackwardParams<float>& p) { FlashBackward(p); }
void FlashBackwardBfloat16(const AttentionBackwardParams<bfloat16>& p) { FlashBackward(p); }

}  // namespace mha::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha::detail {

HWY_EXPORT(FlashBackwardFloat);
HWY_EXPORT(FlashBackwardBfloat16);

void flash_attention_backward(const AttentionBackwardParams<float>& p) { HWY_DYNAMIC_DISPATCH(FlashBackwardFloat)(p); }
void flash_attention_backward(const AttentionBackwardParams<bfloat16>& p) {
  HWY_DYNAMIC_DISPATCH(FlashBackwardBfloat16)(p);
}

}  // namespace mha::detail
#endif  // HWY_ONCE
