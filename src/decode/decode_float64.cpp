// The decode kernel for float64 caches (the verification dtype): the same work items, blocks and merge
// as the float32 kernel (decode_kernel.cpp), in plain loops.
//
// Legend: R rows of an item (its query heads x Lq), d_k, d_v, T the sequence's length.
#include <algorithm>
#include <cmath>
#include <limits>

#include "attention/online_softmax.hpp"
#include "decode/decode_driver.hpp"

namespace mha::detail {
namespace {

using decode::kKeyBlock;

// Fills the item's slot: m, l and the unnormalised acc over positions [item.begin, item.end).
void decode_chunk(const DecodeParams<double, double>& p, const decode::WorkItem& item, const decode::SlotLayout& layout,
                  double* slot, const decode::ChunkScratch<double, double>& w) {
  constexpr double kMinusInf = -std::numeric_limits<double>::infinity();
  const std::int64_t R = layout.rows, T_s = p.lengths[static_cast<std::size_t>(item.seq)];
  double* acc = slot;  // [R, ld]
  double* m = slot + layout.m_offset();
  double* l = slot + layout.l_offset();
  std::fill(acc, acc + R * layout.ld, 0.0);
  std::fill(m, m + R, kMinusInf);
  std::fill(l, l + R, 0.0);
  if (decode::before_every_window(p, T_s, item)) return;  // no weight anywhere: the merge skips it
  const std::int64_t Rg = R / item.kv_heads;              // the rows of one kv head: its g query heads x Lq
  for (std::int64_t t0 = item.begin; t0 < item.end; t0 += kKeyBlock) {
    const std::int64_t kb = std::min(kKeyBlock, item.end - t0);
    decode::block_visibility(p, T_s, R, t0, w.visible, w.visible_begin);
    for (std::int64_t r = 0; r < R; ++r) {
      if (r % Rg == 0) decode::block_rows(p, item.seq, item.kv_head + r / Rg, t0, kb, w.k_rows, w.v_rows);
      const double* q = p.query_row(item.seq, r % p.q_len, item.first_head + r / p.q_len);
      double* s = w.s + r * kKeyBlock;
      for (std::int64_t j = 0; j < kb; ++j) {
        s[j] = kMinusInf;
        if (j >= w.visible[r] || j < w.visible_begin[r]) continue;
        double dot = 0;
        for (std::int64_t c = 0; c < p.d_k; ++c) dot += q[c * p.q_stride[3]] * w.k_rows[j][c];
        s[j] = dot * p.scale;
      }
      if (p.has_variants())
        decode::apply_score_variants(p, item, r, 1, T_s, t0, kb, w.visible + r, w.visible_begin + r, s, kKeyBlock);
      double block_max = kMinusInf;
      for (std::int64_t j = 0; j < kb; ++j)
        if (!(s[j] <= block_max)) block_max = s[j];                                 // a NaN logit becomes the max
      const OnlineSoftmaxStep<double> step = online_softmax_step(m[r], block_max);  // online_softmax.hpp's rule
      if (step.no_weight) continue;                                                 // nothing with weight yet
      double sum = 0;
      for (std::int64_t j = 0; j < kb; ++j) sum += s[j] = std::exp(s[j] - step.m_new);
      l[r] = l[r] * step.rescale + sum;
      double* a = acc + r * layout.ld;
      if (step.rescale != 1.0)
        for (std::int64_t e = 0; e < p.d_v; ++e) a[e] *= step.rescale;
      for (std::int64_t j = 0; j < kb; ++j) {
        if (s[j] == 0.0) continue;  // weight 0: the value is not read
        for (std::int64_t e = 0; e < p.d_v; ++e) a[e] += s[j] * w.v_rows[j][e];
      }
      m[r] = step.m_new;
    }
  }
}

}  // namespace

void decode_attention_kernel(const DecodeParams<double, double>& p, DecodeMode mode) {
  decode::run_decode(p, mode, decode_chunk);
}

}  // namespace mha::detail
