// The fused attention kernel's forward: FlashAttention-2 (Dao 2023, "FlashAttention-2: Faster Attention with
// Better Parallelism and Work Partitioning") on the CPU, float32 or bfloat16, never holding an L x S matrix.
//
// Forward, for one (b, head, block of query rows):
//   m = -inf, l = 0, acc = 0                                   per row; acc [rows, d_v]
//   for each block of kBlockK keys:
//     S = scale Q_blk K_blk^T (+ masks)                        [rows, cols]
//     m' = max(m, rowmax S);  P = exp(S - m');  a = exp(m - m')
//     l = a l + rowsum P;  acc = a acc + dropout(P) V_blk;  m = m'
//   out = acc / l;  lse = m + log l                            (a row with no allowed key: 0, -inf)
// The two products go through gemm_tile (on the calling thread, inside our OpenMP region: oneDNN's
// sgemm for float32; for bfloat16 its matmul primitive, bfloat16 operands with float32 accumulation,
// P rounded to bfloat16 for the P V product as FlashAttention does); the online softmax, m, l and the
// accumulator are float32 for both. The row operations go through Highway, dispatched once per call
// to the best SIMD target of the machine. Causal masking skips key blocks that lie entirely above the diagonal;
// key_lengths shortens the key range. Grouped-query attention (h_kv < h key/value heads): a work item
// takes the query heads that share a key/value head (all g = h / h_kv of them, or a part when there are
// few items) through each K/V block in turn, so a block is read from memory once per group and its
// safe copy made once. Each head keeps its own tiles of query_block_rows() rows, the same as the
// backward's: stacking the group's rows into one taller product gave logits an ulp away from those the backward
// recomputes (the sweep caught P = exp(S - lse) off by that much), and decoding, where stacking pays, has a kernel of
// its own (src/decode). Keys outside the range are never read; masked keys inside it get -inf logits (masks.hpp), and
// K/V rows of padded keys or holding NaN/Inf are zeroed in a copy of the block (nonfinite.hpp), so a NaN or Inf stored
// at a masked position cannot leak through the block products.
#include "attention/flash.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "attention/flash_forward.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention/dropout.hpp"
#include "attention/flash_tiles-inl.h"
#include "attention/masks.hpp"
#include "attention/nonfinite.hpp"
#include "attention/online_softmax.hpp"
#include "attention/query_block.hpp"
#include "hwy/highway.h"
#include "parallel.hpp"
#include "prefetch_lines.hpp"

HWY_BEFORE_NAMESPACE();
namespace mha::detail::HWY_NAMESPACE {

// ---- forward --------------------------------------------------------------------------------------

// The K and V rows of the key block after the current one, asked for into the L2 a share at a time: the
// online softmax of a tile asks, each of its rows, for that row's share of the lines, so that they come
// while the tile's products run. At N = 16384 a head's K and V (8 MiB at d 64) no longer stay near, and
// oneDNN's sgemm reads each block as it packs it, waiting on every line (docs/PERFORMANCE.md, issue 32).
struct BlocksAhead {
  LineSpan spans[2];  // the K rows', the V rows' (no lines: nothing to ask for)

  // Asks for share r of `shares` of the lines.
  void prefetch_share(std::int64_t r, std::int64_t shares) const {
    for (const LineSpan& span : spans)
      for (std::int64_t line = span.lines * r / shares; line < span.lines * (r + 1) / shares; ++line)
        __builtin_prefetch(span.first + 64 * line, 0, 2);
  }
};

// One thread's state for one block of query rows of each head of its item; T is the inputs' type (float or
// bfloat16).
template <class T>
struct ForwardBlock {
  float* s;                 // [rows, kBlockK]: logits, then probabilities
  bfloat16* p_rounded;      // [rows, kBlockK]: the probabilities in bfloat16 (bfloat16 inputs only)
  float* acc;               // [heads, rows, ld_acc]: the unnormalised output of each head
  T* v_copy;                // [kBlockK, d_v]: a V block made safe (nonfinite.hpp)
  float* m;                 // [heads, rows]: running max, then the log-sum-exp
  float* l;                 // [heads, rows]: running sum
  T* q_copy;                // [heads, rows, d_k]: the Q rows, adjacent
  std::int64_t* nonfinite;  // [kBlockK]
  std::int64_t ld_acc;
  const std::uint8_t* key_flags;  // [S] of this (b, key/value head): kValueRow where v holds NaN or Inf
  const T* k_head;                // [S, d_k] of this (b, key/value head), adjacent rows (the caller's or a copy)
  const T* v_head;                // [S, d_v], likewise
  BlocksAhead ahead;              // the next key block's rows, asked for during a tile's softmax

  // The state of the n-th head of the item, of `rows` rows (the logits tile is shared).
  ForwardBlock head_state(std::int64_t n, std::int64_t rows) const {
    ForwardBlock part = *this;
    part.acc += n * rows * ld_acc, part.m += n * rows, part.l += n * rows;
    return part;
  }
  // The state of a head's rows from `first` on (a band of a tile: masks.hpp, tile_row_bands).
  ForwardBlock rows_from(std::int64_t first) const {
    ForwardBlock part = *this;
    part.s += first * kBlockK, part.p_rounded += first * kBlockK;
    part.acc += first * ld_acc, part.m += first, part.l += first;
    return part;
  }
};

// Whether the online softmax rounds each row of P to bfloat16 as it finishes it (the row still in the
// L1), for the P V product: bfloat16 inputs without dropout, which changes P after the softmax. Otherwise
// AccumulateValues rounds the whole tile after, a pass that reads it back from the L2 (a float32 tile of
// 128 or 256 rows x 256 keys, 128-256 KiB, is larger than an L1). The tile passes, this one and the backward's, were
// 6-7% of the bf16 training step with AMX (docs/PERFORMANCE.md, issue 32).
template <class T>
bool RoundsInSoftmax(const AttentionInputs<T>& p) {
  return std::is_same_v<T, bfloat16> && p.dropout_p == 0;
}

// How far a row's logits may exceed its reference m before the reference moves: P = exp(S - m) is then at
// most e^8 (about 3000), far from float32's overflow.
inline constexpr float kSoftmaxHeadroom = 8.0f;

// The online softmax of row r of a logits tile (entries [0, visible) allowed, padded to padded_cols): P =
// exp(S - m') in place, l = a l + rowsum P, acc = a acc, m = m' with a = exp(m - m'). m is the row's
// reference, not always its running max: a row that already has a finite m exponentiates the tile against
// it in one pass and keeps it while no logit exceeds it by more than kSoftmaxHeadroom (out = acc / l and lse
// = m + log l hold for any reference); only a row's first tile with weight, or one with a logit past the
// headroom, finds the max and moves m to it (the rule of online_softmax.hpp). Measured in
// docs/PERFORMANCE.md (issue 32): the max pass and its dependent reduction before every row's exps cost
// more than the exps' own vector work hides.
template <ExpAccuracy kAccuracy, class T>
void OnlineSoftmaxRow(const ForwardBlock<T>& w, std::int64_t r, std::int64_t visible, std::int64_t padded_cols) {
  float* row = w.s + r * kBlockK;
  // Entries [0, done) hold exp(S - m) (their sum in done_sum), the rest still S.
  std::int64_t done = 0;
  float done_sum = 0.0f;
  if (std::isfinite(w.m[r])) {
    const HeadroomPass pass = ExpRowSumWithinHeadroom<kAccuracy>(row, padded_cols, visible, w.m[r], kSoftmaxHeadroom);
    if (pass.stopped_at == padded_cols) {  // the usual case: m stays
      w.l[r] += pass.sum;
      return;
    }
    done = pass.stopped_at, done_sum = pass.sum;
  }
  // The max of the entries left (see RowMax for a row holding a NaN; those done are below it), then the
  // rule of online_softmax.hpp.
  const OnlineSoftmaxStep<float> step =
      online_softmax_step(w.m[r], RowMax(row + done, padded_cols - done, visible - done));
  if (step.no_weight) {  // nothing allowed yet in this row
    std::fill(row, row + padded_cols, 0.0f);
    return;
  }
  if (done > 0) ScaleRow(row, done, step.rescale);  // exp(S - m) exp(m - m') = exp(S - m')
  w.l[r] = (w.l[r] + done_sum) * step.rescale +
           ExpShiftedRowSum<kAccuracy>(row + done, padded_cols - done, visible - done, step.m_new);
  if (step.rescale != 1.0f) ScaleRow(w.acc + r * w.ld_acc, w.ld_acc, step.rescale);
  w.m[r] = step.m_new;
}

// The online softmax over one logits tile (data masks applied, cols <= kBlockK) of query rows i0..: each row
// by OnlineSoftmaxRow (0 past its causal prefix and in the padding), and its bfloat16 copy where
// RoundsInSoftmax.
template <class T>
void OnlineSoftmaxTile(const AttentionInputs<T>& p, const ForwardBlock<T>& w, std::int64_t i0, std::int64_t rows,
                       std::int64_t j0, std::int64_t cols) {
  const std::int64_t padded_cols = round_up(cols, kRowAlign);
  const bool round = RoundsInSoftmax(p);
  for (std::int64_t r = 0; r < rows; ++r) {
    w.ahead.prefetch_share(r, rows);
    OnlineSoftmaxRow<kExpAccuracyOf<T>>(w, r, causal_visible(p, i0 + r, j0, cols), padded_cols);
    if (round) RoundRowsToBfloat16(w.s + r * kBlockK, kBlockK, 1, padded_cols, w.p_rounded + r * kBlockK, kBlockK);
  }
}

// acc += P V_blk for keys [j0, j0 + cols) of key/value head kv, v_block their safe copy (P rounded to
// bfloat16 first for bfloat16 inputs); rows of V holding NaN or Inf are added apart, only where their
// weight is not 0.
template <class T>
void AccumulateValues(const AttentionParams<T>& p, const ForwardBlock<T>& w, const SafeBlock<T>& v_block,
                      std::int64_t b, std::int64_t kv, std::int64_t rows, std::int64_t j0, std::int64_t cols) {
  if (std::is_same_v<T, bfloat16> && !RoundsInSoftmax(p))  // (else rounded row by row)
    RoundRowsToBfloat16(w.s, kBlockK, rows, round_up(cols, kRowAlign), w.p_rounded, kBlockK);
  gemm_tile(rows, p.d_v, cols, tile_operand<T>(w.s, w.p_rounded), plain(v_block.data, v_block.ld),
            accumulate_into(w.acc, w.ld_acc));
  for (std::int64_t n = 0; n < v_block.nonfinite_count; ++n) {
    const std::int64_t c = w.nonfinite[n];
    if (c >= cols) continue;  // past a band's columns
    for (std::int64_t r = 0; r < rows; ++r) {
      const float weight = w.s[r * kBlockK + c];
      if (weight == 0.0f) continue;
      for (std::int64_t e = 0; e < p.d_v; ++e) w.acc[r * w.ld_acc + e] += weight * float(p.v(b, kv, j0 + c, e));
    }
  }
}

// out = acc / l; m becomes lse = m + log l, the head's sink folded in first (online_softmax.hpp). A row
// with no allowed key attends to nothing (output 0; lse -inf, or the sink); one whose allowed logits are
// all -inf gets NaN (0 / 0), as the reference, unless a sink gives the row weight.
template <class T>
void FinishRows(const AttentionParams<T>& p, const ForwardBlock<T>& w, std::int64_t b, std::int64_t head,
                std::int64_t i0, std::int64_t rows, std::int64_t key_end) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const bool no_key = w.m[r] == kMinusInf && !has_allowed_key(p, b, head, i0 + r, key_end);
    const float acc_scale = p.sinks ? fold_sink(w.m[r], w.l[r], p.sinks[head]) : 1.0f;
    bool empty = w.m[r] == kMinusInf;
    if (empty && !no_key) {                                                        // allowed keys, all at -inf: 0 / 0
      if (!p.partial_over_keys) w.m[r] = std::numeric_limits<float>::quiet_NaN();  // else lse -inf, out NaN
      empty = false;
    }
    const float inv_l = empty || no_key ? 0.0f : acc_scale / w.l[r];
    T* out_row = &p.out(b, head, i0 + r, 0);
    const float* acc_row = w.acc + r * w.ld_acc;
    if (p.out.stride[3] == 1)  // (vectorised)
      for (std::int64_t c = 0; c < p.d_v; ++c) out_row[c] = T(empty ? 0.0f : acc_row[c] * inv_l);
    else
      for (std::int64_t c = 0; c < p.d_v; ++c) out_row[c * p.out.stride[3]] = T(empty ? 0.0f : acc_row[c] * inv_l);
    w.m[r] = empty ? kMinusInf : w.m[r] + std::log(w.l[r]);  // with a sink, a row of no key: the sink
    if (p.lse) p.lse[(b * p.h + head) * p.L + i0 + r] = w.m[r];
  }
}

// The weights of query rows [i0, i0 + rows), recomputed block by block from the log-sum-exp (in w.m),
// straight into the [B, h, L, S] output (0 outside the key range).
template <class T>
void WriteWeights(const AttentionParams<T>& p, const ForwardBlock<T>& w, std::int64_t b, std::int64_t head,
                  std::int64_t i0, std::int64_t rows, std::int64_t key_end) {
  for (std::int64_t j0 = 0; j0 < key_end; j0 += kBlockK) {
    const std::int64_t cols = std::min(kBlockK, key_end - j0);
    for (const RowBand band : tile_row_bands(p, i0, rows, j0, cols)) {  // the forward's bands, so its logits
      const std::int64_t first = i0 + band.first, band_cols = band.cols;
      float* s = w.s + band.first * kBlockK;
      if (!band.empty()) {
        ScaledLogits(p, &p.q(b, head, first, 0), p.q.stride[2], band.rows, &p.k(b, p.kv_head(head), j0, 0),
                     p.k.stride[2], band_cols, s);
        if (p.softcap > 0) SoftcapTile(s, band.rows, band_cols, p.softcap, nullptr);
        ProbabilitiesFromLse(p, b, head, first, band.rows, j0, band_cols, w.m + band.first, s);
        if (p.dropout_p > 0) apply_dropout(p, b, head, first, band.rows, j0, band_cols, s, kBlockK);
      }
      for (std::int64_t r = 0; r < band.rows; ++r) {
        T* row = p.weights + ((b * p.h + head) * p.L + first + r) * p.S + j0;
        std::copy_n(s + r * kBlockK, band_cols, row);
        std::fill(row + band_cols, row + cols, T(0.0f));  // keys of the tile the band does not see
      }
    }
  }
  for (std::int64_t r = 0; r < rows; ++r) {
    T* row = p.weights + ((b * p.h + head) * p.L + i0 + r) * p.S;
    std::fill(row + key_end, row + p.S, T(0.0f));
  }
}

// One logits tile of one head: query rows [i0, i0 + rows) (q_rows, adjacent; state w) against keys [j0, j0 + cols)
// of key/value head kv (v_block their safe V rows): logits, soft-cap, masks, online softmax, dropout, P V.
template <class T>
void ForwardTile(const AttentionParams<T>& p, const ForwardBlock<T>& w, const T* q_rows, const SafeBlock<T>& v_block,
                 std::int64_t b, std::int64_t kv, std::int64_t head, std::int64_t i0, std::int64_t rows,
                 std::int64_t j0, std::int64_t cols) {
  ScaledLogits(p, q_rows, p.d_k, rows, w.k_head + j0 * p.d_k, p.d_k, cols, w.s);
  if (p.softcap > 0) SoftcapTile(w.s, rows, cols, p.softcap, nullptr);
  if (needs_data_masks(p)) apply_masks(p, b, head, i0, rows, j0, cols, w.s, kBlockK);
  OnlineSoftmaxTile(p, w, i0, rows, j0, cols);
  if (p.dropout_p > 0) apply_dropout(p, b, head, i0, rows, j0, cols, w.s, kBlockK);
  AccumulateValues(p, w, v_block, b, kv, rows, j0, cols);
}

// The forward of query rows [i0, i0 + rows) of query heads [head0, head0 + heads), which all read
// key/value head kv: each K/V block once, for every head in turn.
template <class T>
void ForwardQueryBlock(const AttentionParams<T>& p, const ForwardBlock<T>& w, std::int64_t b, std::int64_t kv,
                       std::int64_t head0, std::int64_t heads, std::int64_t i0, std::int64_t rows) {
  std::vector<const T*> q_rows(static_cast<std::size_t>(heads));  // [rows, d_k] of each head
  for (std::int64_t n = 0; n < heads; ++n)
    q_rows[static_cast<std::size_t>(n)] =
        adjacent_rows(&p.q(b, head0 + n, i0, 0), p.q.stride[2], rows, p.d_k, w.q_copy + n * rows * p.d_k);
  std::fill(w.m, w.m + heads * rows, kMinusInf);
  std::fill(w.l, w.l + heads * rows, 0.0f);
  std::fill(w.acc, w.acc + heads * rows * w.ld_acc, 0.0f);
  const std::int64_t key_end = key_range_end(p, b, i0, rows);
  for (std::int64_t j0 = key_block_begin(p, i0, kBlockK); j0 < key_end; j0 += kBlockK) {
    const std::int64_t cols = std::min(kBlockK, key_end - j0);
    const SafeBlock<T> v_block =
        safe_block(p, w.v_head, p.d_v, b, kv, j0, cols, p.d_v, w.key_flags, kValueRow, w.v_copy, w.nonfinite);
    ForwardBlock<T> tile_w = w;  // the first tile of the block asks for the next block's rows
    if (j0 + kBlockK < key_end) {
      const std::int64_t next_cols = std::min(kBlockK, key_end - j0 - kBlockK);
      tile_w.ahead.spans[0] = line_span(w.k_head + (j0 + kBlockK) * p.d_k, next_cols * p.d_k * std::int64_t{sizeof(T)});
      tile_w.ahead.spans[1] = line_span(w.v_head + (j0 + kBlockK) * p.d_v, next_cols * p.d_v * std::int64_t{sizeof(T)});
    }
    for (std::int64_t n = 0; n < heads; ++n) {
      for (const RowBand band : tile_row_bands(p, i0, rows, j0, cols)) {  // a diagonal tile in bands (masks.hpp)
        if (band.empty()) continue;
        ForwardTile(p, tile_w.head_state(n, rows).rows_from(band.first),
                    q_rows[static_cast<std::size_t>(n)] + band.first * p.d_k, v_block, b, kv, head0 + n,
                    i0 + band.first, band.rows, j0, band.cols);
        tile_w.ahead = {};
      }
    }
  }
  for (std::int64_t n = 0; n < heads; ++n) {
    FinishRows(p, w.head_state(n, rows), b, head0 + n, i0, rows, key_end);
    if (p.weights) WriteWeights(p, w.head_state(n, rows), b, head0 + n, i0, rows, key_end);
  }
}

// The K and V rows of one (b, key/value head), adjacent, for one thread: the caller's rows when they are (a
// [B, h, S, d] layout), else copies made when the thread starts on a head it did not copy last (the
// layer's [B, S, h, d] layout: its rows lie h d apart, which the products read much slower, and a
// copy per key block would be made once per query block; a copy per head serves all the thread's
// query blocks of that head, since the work items run through the heads in order).
template <class T>
class HeadCopies {
 public:
  HeadCopies(const AttentionParams<T>& p, int threads)
      : p_(p),
        copy_k_(p.k.stride[2] != p.d_k),
        copy_v_(p.v.stride[2] != p.d_v),
        per_thread_((copy_k_ ? p.S * p.d_k : 0) + (copy_v_ ? p.S * p.d_v : 0)),
        storage_(Allocate<T>(std::max<std::int64_t>(1, threads * per_thread_))),
        copied_(static_cast<std::size_t>(threads), -1) {}

  // Sets w.k_head and w.v_head for (b, key/value head) on thread `thread`.
  void use(ForwardBlock<T>& w, int thread, std::int64_t b, std::int64_t head) {
    T* k_copy = storage_.get() + thread * per_thread_;
    T* v_copy = k_copy + (copy_k_ ? p_.S * p_.d_k : 0);
    const bool fresh = copied_[static_cast<std::size_t>(thread)] != b * p_.h_kv + head;
    copied_[static_cast<std::size_t>(thread)] = b * p_.h_kv + head;
    w.k_head = copy_k_
                   ? (fresh ? adjacent_rows(p_.k.pointer(b, head, 0, 0), p_.k.stride[2], p_.S, p_.d_k, k_copy) : k_copy)
                   : p_.k.pointer(b, head, 0, 0);
    w.v_head = copy_v_
                   ? (fresh ? adjacent_rows(p_.v.pointer(b, head, 0, 0), p_.v.stride[2], p_.S, p_.d_v, v_copy) : v_copy)
                   : p_.v.pointer(b, head, 0, 0);
  }

 private:
  const AttentionParams<T>& p_;
  bool copy_k_, copy_v_;
  std::int64_t per_thread_;
  hwy::AlignedFreeUniquePtr<T[]> storage_;
  std::vector<std::int64_t> copied_;  // per thread: the b * h_kv + head its copies hold, -1 for none
};

// Query heads per work item: a key/value head's whole group, or an equal part of it when there would
// be fewer than 8 items (each head's result is the same whichever item computes it).
template <class T>
std::int64_t heads_per_item(const AttentionInputs<T>& p, std::int64_t q_blocks) {
  const std::int64_t g = p.group(), items = std::max<std::int64_t>(1, p.B * p.h_kv * q_blocks);
  std::int64_t parts = std::clamp<std::int64_t>((8 + items - 1) / items, 1, g);
  while (g % parts != 0) ++parts;
  return g / parts;
}

template <class T>
void FlashForward(const AttentionParams<T>& p) {
  const SerialIfSmall serial_if_small(2.0 * p.B * p.h * p.L * p.S * (p.d_k + p.d_v));
  const std::int64_t block_q = query_block_rows(), q_blocks = (p.L + block_q - 1) / block_q;
  const std::int64_t heads = heads_per_item(p, q_blocks), parts = p.group() / heads;
  const std::int64_t ld_acc = round_up(p.d_v, kRowAlign);
  const int threads = omp_get_max_threads();
  // Per-thread workspace, allocated once per call: logits tile, accumulators, m, l (float32); V block and
  // Q copies (of T), the rounded probabilities (bfloat16 inputs). Sized to need: a block holds at most
  // min(block_q, L) query rows of each of its heads and min(kBlockK, S) keys.
  const std::int64_t max_rows = std::min(block_q, p.L), max_cols = std::min(kBlockK, p.S);
  const std::int64_t s_size = max_rows * kBlockK, acc_size = heads * max_rows * ld_acc;
  const std::int64_t floats_per_thread = s_size + acc_size + round_up(2 * heads * max_rows, kRowAlign);
  const std::int64_t v_size = round_up(max_cols * p.d_v, kRowAlign);
  const std::int64_t elements_per_thread = v_size + round_up(heads * max_rows * p.d_k, kRowAlign);
  const std::int64_t rounded_per_thread = std::is_same_v<T, bfloat16> ? s_size : 0;
  const auto floats = AllocateFloats(std::max<std::int64_t>(1, threads * floats_per_thread));
  const auto elements = Allocate<T>(std::max<std::int64_t>(1, threads * elements_per_thread));
  const auto rounded = Allocate<bfloat16>(std::max<std::int64_t>(1, threads * rounded_per_thread));
  std::vector<std::int64_t> nonfinite_lists(static_cast<std::size_t>(threads * kBlockK));
  std::vector<std::uint8_t> key_flags(static_cast<std::size_t>(p.B * p.h_kv * p.S));  // [B, h_kv, S]
  FlagNonfiniteRows(p.v, p.B, p.h_kv, p.S, p.d_v, kValueRow, key_flags.data());
  HeadCopies<T> head_copies(p, threads);

#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t item = 0; item < p.B * p.h_kv * parts * q_blocks; ++item) {
    const std::int64_t b = item / (p.h_kv * parts * q_blocks), kv = (item / (parts * q_blocks)) % p.h_kv;
    const std::int64_t head0 = kv * p.group() + (item / q_blocks) % parts * heads;
    // The last query blocks first: under causal they see the most keys, and the dynamic schedule
    // balances best when the longest items start first.
    const std::int64_t i0 = (q_blocks - 1 - item % q_blocks) * block_q, rows = std::min(block_q, p.L - i0);
    const int thread = omp_get_thread_num();
    ForwardBlock<T> w;
    w.s = floats.get() + thread * floats_per_thread;
    w.acc = w.s + s_size;
    w.m = w.acc + acc_size;
    w.l = w.m + heads * max_rows;
    w.v_copy = elements.get() + thread * elements_per_thread;
    w.q_copy = w.v_copy + v_size;
    w.p_rounded = rounded.get() + thread * rounded_per_thread;
    w.nonfinite = nonfinite_lists.data() + thread * kBlockK;
    w.ld_acc = ld_acc;
    w.key_flags = key_flags.data() + (b * p.h_kv + kv) * p.S;
    head_copies.use(w, thread, b, kv);
    ForwardQueryBlock(p, w, b, kv, head0, heads, i0, rows);
  }
}

void FlashForwardFloat(const AttentionParams<float>& p) { FlashForward(p); }
void FlashForwardBfloat16(const AttentionParams<bfloat16>& p) { FlashForward(p); }

}  // namespace mha::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha::detail {

HWY_EXPORT(FlashForwardFloat);
HWY_EXPORT(FlashForwardBfloat16);

void flash_attention_forward(const AttentionParams<float>& p) { HWY_DYNAMIC_DISPATCH(FlashForwardFloat)(p); }
void flash_attention_forward(const AttentionParams<bfloat16>& p) { HWY_DYNAMIC_DISPATCH(FlashForwardBfloat16)(p); }

}  // namespace mha::detail
#endif  // HWY_ONCE
