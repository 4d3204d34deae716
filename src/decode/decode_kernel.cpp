// The decode kernel for float32, bfloat16, int8 and float8 caches: split-KV (flash-decoding, Dao et al.
// 2023) with the query heads of a group packed together, so each key/value byte is read once per group.
//
// One work item: positions [begin, end) of one sequence, all its kv heads (one in the per-head mode),
// the R_g = g x Lq query rows of each:
//   m = -inf, l = 0, acc = 0                                    per row; acc [R, d_v]
//   for each block of kKeyBlock positions, for each kv head k (rows found through the page table):
//     S = scale Q_k K_blk,k^T   (-inf where the row may not see the key)    [R_g, kKeyBlock]
//     m' = max(m, rowmax S);  P = exp(S - m');  a = exp(m - m')
//     l = a l + rowsum P;  acc = a acc + P V_blk,k;  m = m'        (the rows of head group k)
// leaving (m, l, acc) in the item's slot; decode_driver.hpp merges the slots by log-sum-exp. The heads'
// blocks are read in address order and the next one is prefetched while one is computed (split_kv.hpp
// says why). Every row is computed as it would be alone, so the packed and per-head results agree
// bitwise. Both products and the softmax are float32 in Highway vectors (bfloat16 rows widened as they
// are loaded), dispatched once per call to the best SIMD target of the machine; int8 pages' products run
// on AMX tiles where the CPU has them (int8_tiles-inl.h, amx_int8.hpp), the softmax as for the others.
//
// Legend: n sequences, Lq new queries per sequence, h query heads, h_kv key/value heads, g = h / h_kv,
// R rows of an item, d_k, d_v, T the sequence's length.
#include "decode/decode_params.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "decode/decode_kernel.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <limits>
#include <type_traits>
#include <utility>

#include "decode/decode_driver.hpp"
#include "decode/decode_rows-inl.h"
#include "decode/int8_tiles-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mha::detail::HWY_NAMESPACE {

using decode::ChunkScratch;
using decode::SlotLayout;
using decode::WorkItem;

// The item's query rows into w.q [R, ld_q] as float32 (bfloat16 widened exactly), zero-padded to ld_q.
template <class T>
void GatherQueryRows(const DecodeParams<T, float>& p, const WorkItem& item, std::int64_t R,
                     const ChunkScratch<T, float>& w) {
  for (std::int64_t r = 0; r < R; ++r) {
    const query_t<T>* q = p.query_row(item.seq, r % p.q_len, item.first_head + r / p.q_len);
    float* row = w.q + r * w.ld_q;
    for (std::int64_t c = 0; c < p.d_k; ++c) row[c] = static_cast<float>(q[c * p.q_stride[3]]);
    std::fill(row + p.d_k, row + w.ld_q, 0.0f);
  }
}

// Fills the item's slot: m, l and the unnormalised acc over positions [item.begin, item.end).
template <class T>
void DecodeChunk(const DecodeParams<T, float>& p, const WorkItem& item, const SlotLayout& layout, float* slot,
                 const ChunkScratch<T, float>& w) {
  const std::int64_t R = layout.rows, T_s = p.lengths[static_cast<std::size_t>(item.seq)];
  const std::int64_t Rg = R / item.kv_heads;  // the rows of one kv head: its g query heads x Lq
  float* acc = slot;                          // [R, ld]
  float* m = slot + layout.m_offset();
  float* l = slot + layout.l_offset();
  std::fill(acc, acc + R * layout.ld, 0.0f);
  std::fill(m, m + R, -std::numeric_limits<float>::infinity());
  std::fill(l, l + R, 0.0f);
  if (decode::before_every_window(p, T_s, item)) return;  // no weight anywhere: the merge skips it
  GatherQueryRows(p, item, R, w);
  // int8 pages on AMX tiles where the driver gave this call their scratch (int8_tiles-inl.h).
  [[maybe_unused]] Int8TileRows tiles;
  constexpr bool kMayTile = std::is_same_v<T, std::int8_t>;
  const bool tiled = kMayTile && w.tiles != nullptr;
  if (tiled) tiles.Start(w.q, w.ld_q, Rg, item.kv_heads, p.d_k, p.d_v, w.tiles);
  // Each key's logit scale (float pages: p.scale for all; quantized: times the row's, for each block) and
  // each value row's scale (quantized pages).
  HWY_ALIGN float logit_scales[kKeyBlock], value_scales[kKeyBlock];
  std::fill(logit_scales, logit_scales + kKeyBlock, p.scale);
  // The rows of the block being computed and of the block read next: each block's rows are found once,
  // as the next block's (and prefetched then), and become the current ones on the next step.
  const T **k_rows = w.k_rows, **v_rows = w.v_rows, **k_next = w.k_ahead, **v_next = w.v_ahead;
  RowsAhead<T> ahead{k_next,
                     v_next,
                     0,
                     p.d_k * static_cast<std::int64_t>(sizeof(T)),
                     p.d_v * static_cast<std::int64_t>(sizeof(T)),
                     decode_prefetch_level()};
  {  // the first block of the first kv head is asked for now; each block then asks for the next
    const std::int64_t kb = std::min(kKeyBlock, item.end - item.begin);
    decode::block_rows(p, item.seq, item.kv_head, item.begin, kb, k_next, v_next);
    PrefetchRowPairs(k_next, v_next, kb, ahead.k_bytes, ahead.v_bytes, ahead.level);
    if constexpr (kQuantized<T>) PrefetchBlockScales(p, item.seq, item.kv_head, item.begin, kb, ahead.level);
  }
  for (std::int64_t t0 = item.begin; t0 < item.end; t0 += kKeyBlock) {
    const std::int64_t kb = std::min(kKeyBlock, item.end - t0);
    decode::block_visibility(p, T_s, Rg, t0, w.visible, w.visible_begin);  // the same for every kv head's rows
    for (std::int64_t kh = 0; kh < item.kv_heads; ++kh) {                  // rows [kh Rg, (kh + 1) Rg) read kv head kh
      std::swap(k_rows, k_next), std::swap(v_rows, v_next);
      const bool last_head = kh + 1 == item.kv_heads;
      const std::int64_t next_t0 = last_head ? t0 + kKeyBlock : t0, next_head = last_head ? 0 : kh + 1;
      ahead.count = std::max<std::int64_t>(0, std::min(kKeyBlock, item.end - next_t0));
      ahead.k = k_next, ahead.v = v_next;
      if (ahead.count > 0) {
        decode::block_rows(p, item.seq, item.kv_head + next_head, next_t0, ahead.count, k_next, v_next);
        if constexpr (kQuantized<T>)
          PrefetchBlockScales(p, item.seq, item.kv_head + next_head, next_t0, ahead.count, ahead.level);
      }
      float* acc_g = acc + kh * Rg * layout.ld;
      if constexpr (kQuantized<T>)
        GatherBlockScales(p, item.seq, item.kv_head + kh, t0, kb, logit_scales, value_scales);
      if constexpr (kMayTile)
        if (tiled) tiles.BlockLogits(kh, k_rows, kb, logit_scales, w.visible, ahead, w.s);
      if (!tiled)
        BlockLogits(w.q + kh * Rg * w.ld_q, w.ld_q, Rg, k_rows, kb, p.d_k, logit_scales, w.visible, ahead, w.s);
      if (p.has_variants())
        decode::apply_score_variants(p, item, kh * Rg, Rg, T_s, t0, kb, w.visible, w.visible_begin, w.s, kKeyBlock);
      BlockOnlineSoftmax(w.s, Rg, m + kh * Rg, l + kh * Rg, acc_g, layout.ld);
      const bool block_weighted = FlagWeightedKeys(w.s, Rg, kb, w.all_weighted);
      if constexpr (kQuantized<T>) ScaleWeightsByValueScales(w.s, Rg, value_scales);
      if constexpr (kMayTile)
        if (tiled) tiles.BlockAccumulate(w.s, v_rows, kb, block_weighted, w.all_weighted, acc_g, layout.ld);
      if (!tiled) BlockAccumulate(w.s, Rg, v_rows, kb, p.d_v, block_weighted, w.all_weighted, acc_g, layout.ld);
    }
  }
}

template <class T>
void Decode(const DecodeParams<T, float>& p, DecodeMode mode) {
  decode::run_decode(p, mode, [](const auto&... args) { DecodeChunk<T>(args...); });
}

void DecodeFloat(const DecodeParams<float, float>& p, DecodeMode mode) { Decode(p, mode); }
void DecodeBfloat16(const DecodeParams<bfloat16, float>& p, DecodeMode mode) { Decode(p, mode); }
void DecodeInt8(const DecodeParams<std::int8_t, float>& p, DecodeMode mode) { Decode(p, mode); }
void DecodeFloat8(const DecodeParams<Float8E4M3, float>& p, DecodeMode mode) { Decode(p, mode); }

}  // namespace mha::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace mha::detail {

HWY_EXPORT(DecodeFloat);
HWY_EXPORT(DecodeBfloat16);
HWY_EXPORT(DecodeInt8);
HWY_EXPORT(DecodeFloat8);

void decode_attention_kernel(const DecodeParams<float, float>& p, DecodeMode mode) {
  HWY_DYNAMIC_DISPATCH(DecodeFloat)(p, mode);
}
void decode_attention_kernel(const DecodeParams<bfloat16, float>& p, DecodeMode mode) {
  HWY_DYNAMIC_DISPATCH(DecodeBfloat16)(p, mode);
}
void decode_attention_kernel(const DecodeParams<std::int8_t, float>& p, DecodeMode mode) {
  HWY_DYNAMIC_DISPATCH(DecodeInt8)(p, mode);
}
void decode_attention_kernel(const DecodeParams<Float8E4M3, float>& p, DecodeMode mode) {
  HWY_DYNAMIC_DISPATCH(DecodeFloat8)(p, mode);
}

}  // namespace mha::detail
#endif  // HWY_ONCE
