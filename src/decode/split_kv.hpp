// Split-KV (flash-decoding): how a decode call is cut into work items, where each item keeps its
// partial softmax state, and how the partials of one group are merged by log-sum-exp.
//
// For the rows r of a group (its query heads x its Lq queries), a chunk c of positions gives
//   m_c = max_j s_rj,  l_c = sum_j exp(s_rj - m_c),  O_c = sum_j exp(s_rj - m_c) v_j      (j in chunk c)
// and the chunks merge, in chunk order, as
//   M = max_c m_c,  L = sum_c exp(m_c - M) l_c,  out = sum_c exp(m_c - M) O_c / L,  lse = M + log L.
//
// Legend: n sequences, Lq new queries per sequence, h query heads, h_kv key/value heads, d_v value
// width, P tokens per page, T a sequence's length, R rows of a work item (query heads x Lq).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention/online_softmax.hpp"

namespace mha::detail::decode {

// The fewest positions a chunk holds (rounded up to whole pages): below this, the merge and the
// item's start (its Q rows, its first page) cost more than the chunk's reads. 256 positions of
// d = 128 in float32 are 256 KiB of keys and values, about 10 us of one core's reads here.
inline constexpr std::int64_t kMinChunkPositions = 256;
// Chunks a sequence is cut into when it is long enough: enough that two threads (or a few more) finish
// together under a dynamic schedule (a chunk is at most 1/16 of the sequence's work), few enough that
// the partials stay small. A size of the problem, never the thread count: results must not depend on
// the number of threads.
inline constexpr std::int64_t kChunksPerSequence = 16;
// Positions per block inside a chunk: the logits tile of a block is R x kKeyBlock floats; its K rows are
// read by the logits and its V rows by P V (64 x 512 B each at d = 128 in float32). Each block costs a
// fixed share of bookkeeping (row pointers and scales, a max, a sum and a rescale per row); on the Zen 5
// 64 positions measured 2-3% faster than 32 for every cache dtype in the L2, 5-8% for float32 and bf16
// from memory, and 128 no faster than 64 (docs/PERFORMANCE.md, issue 33).
inline constexpr std::int64_t kKeyBlock = 64;
// What the kernel reads, in order, and what it prefetches: a group-packed item holds every kv head of
// its sequence and reads each block of positions head after head, so one block's reads walk through
// each page's keys [h_kv, P, d] and values in address order. (One item per head jumped from a head's
// P rows to the next page's, h_kv P d elements apart: on a Zen 3 with pages of 16 tokens, 1.4-1.6x
// slower for float32 on one core; the hardware's stream prefetchers stop at every jump.) While one
// head's block is computed, the next head's block (or the first head's next block) is prefetched:
// software prefetch is still needed (without it one core read 4-5 GB/s of the cache against 11-25 GB/s
// of a plain stream).

// Pages per chunk for a sequence of `length` positions: from the sequence's own size and the page size
// only, so a sequence's result does not depend on the rest of the batch (nor on the mode).
inline std::int64_t chunk_pages(std::int64_t length, std::int64_t page_size) {
  const std::int64_t pages = (length + page_size - 1) / page_size;
  const std::int64_t min_pages = (kMinChunkPositions + page_size - 1) / page_size;
  return std::max({min_pages, (pages + kChunksPerSequence - 1) / kChunksPerSequence, std::int64_t{1}});
}

// A work item: positions [begin, end) of one sequence for query heads [first_head, first_head + heads),
// which read kv heads [kv_head, kv_head + kv_heads): all h heads and all h_kv kv heads when group-packed
// (the g query heads of kv head k are the item's heads k g .. k g + g - 1), one of each per head.
struct WorkItem {
  std::int64_t seq = 0;
  std::int64_t kv_head = 0, kv_heads = 0;
  std::int64_t first_head = 0, heads = 0;
  std::int64_t begin = 0, end = 0;
};

// Items in merge order: by sequence, then group, then chunk; group_first[k] is the first item of group
// k (groups in the same order), group_first.back() the item count.
struct WorkPlan {
  std::vector<WorkItem> items;
  std::vector<std::int64_t> group_first;
};

// Group packing: one group of all h query heads per sequence; per head: h groups of one.
inline WorkPlan plan_work(const std::vector<std::int64_t>& lengths, std::int64_t page_size, std::int64_t h,
                          std::int64_t h_kv, bool group_packed) {
  WorkPlan plan;
  const std::int64_t g = h / h_kv, groups = group_packed ? 1 : h;
  for (std::size_t s = 0; s < lengths.size(); ++s) {
    const std::int64_t T = lengths[s], chunk = chunk_pages(T, page_size) * page_size;
    for (std::int64_t k = 0; k < groups; ++k) {
      plan.group_first.push_back(static_cast<std::int64_t>(plan.items.size()));
      const WorkItem group = group_packed ? WorkItem{static_cast<std::int64_t>(s), 0, h_kv, 0, h}
                                          : WorkItem{static_cast<std::int64_t>(s), k / g, 1, k, 1};
      for (std::int64_t begin = 0; begin < T; begin += chunk) {
        WorkItem item = group;
        item.begin = begin, item.end = std::min(T, begin + chunk);
        plan.items.push_back(item);
      }
    }
  }
  plan.group_first.push_back(static_cast<std::int64_t>(plan.items.size()));
  return plan;
}

// Where an item keeps its partial state, in a slot of its own: O [R, ld] (ld a multiple of 16, so
// every row starts on a 64-byte line when the slot does), then m [R], then l [R].
struct SlotLayout {
  std::int64_t rows = 0, ld = 0;
  std::int64_t m_offset() const { return rows * ld; }
  std::int64_t l_offset() const { return rows * ld + rows; }
  std::int64_t size() const { return (rows * ld + 2 * rows + 15) / 16 * 16; }
};

// Row r of a group: merges the partials of its chunks (the slots of items first .. first + chunks) and
// the row's attention sink (`sink`, -inf for none: a partial of no value) into out_row [d_v] and returns
// the row's lse. M = -inf means every visible logit was -inf and there is no sink: 0 / 0, NaN (as the
// reference). A NaN anywhere makes M, and so the row, NaN.
template <class A>
A merge_row(const A* partials, const SlotLayout& layout, std::int64_t first, std::int64_t chunks, std::int64_t r,
            A sink, std::int64_t d_v, A* out_row) {
  auto slot = [&](std::int64_t c) { return partials + (first + c) * layout.size(); };
  LseMerge<A> merge;  // online_softmax.hpp
  merge.see_max(sink);
  for (std::int64_t c = 0; c < chunks; ++c) merge.see_max(slot(c)[layout.m_offset() + r]);
  if (merge.no_weight()) {  // every visible logit -inf: 0 / 0
    std::fill(out_row, out_row + d_v, std::numeric_limits<A>::quiet_NaN());
    return std::numeric_limits<A>::quiet_NaN();
  }
  std::fill(out_row, out_row + d_v, A(0));
  for (std::int64_t c = 0; c < chunks; ++c)
    merge.add(slot(c)[layout.m_offset() + r], slot(c)[layout.l_offset() + r], slot(c) + r * layout.ld, d_v, out_row);
  merge.add_sink(sink);
  return merge.finish(d_v, out_row);
}

}  // namespace mha::detail::decode
