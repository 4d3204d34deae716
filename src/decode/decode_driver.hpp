// The decode kernel's outer loops, the same for every element type: plan the work items (split_kv.hpp),
// run them on the OpenMP threads (each writes its own partial slot, so any thread may run any item),
// then merge each group's partials in chunk order and write out (and lse). The per-chunk work is the
// caller's `chunk` function: Highway rows for float32 and bfloat16 (decode_kernel.cpp), plain loops
// for float64 (decode_float64.cpp).
//
// Legend: n sequences, Lq new queries per sequence, h query heads, h_kv key/value heads, g = h / h_kv,
// R rows of an item (its query heads x Lq), d_k, d_v.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

#include "decode/amx_int8.hpp"
#include "decode/decode_params.hpp"
#include "decode/split_kv.hpp"
#include "hwy/aligned_allocator.h"
#include "parallel.hpp"

namespace mha::detail::decode {

// One thread's workspace for its items.
template <class T, class A>
struct ChunkScratch {
  A* s = nullptr;                         // [R, kKeyBlock]: a block's logits, then its weights
  A* q = nullptr;                         // [R, ld_q]: the item's query rows, in A
  std::int64_t ld_q = 0;                  // a multiple of 16
  std::int64_t* visible = nullptr;        // [R]: row r sees the block's keys j < visible[r] ...
  std::int64_t* visible_begin = nullptr;  // [R]: ... and j >= visible_begin[r]
  // Two pairs of row-pointer arrays, [kKeyBlock] each: the block being computed and the block read next
  // (split_kv.hpp); the kernel swaps their roles at each step.
  const T** k_rows = nullptr;            // key rows
  const T** v_rows = nullptr;            // value rows
  const T** k_ahead = nullptr;           // key rows
  const T** v_ahead = nullptr;           // value rows
  std::uint8_t* all_weighted = nullptr;  // [kKeyBlock]: no row has weight exactly 0 at key j
  void* tiles = nullptr;                 // int8 pages on AMX tiles: amx::scratch_bytes (else nullptr)
};

// The bytes of one thread's tile scratch for items of `kv_heads` x `rows_per_head` rows: int8 pages where
// amx_int8.hpp's tiles run this call, else 0 (the vector kernel). Whether they run depends on the call's
// shape alone, the query rows of a kv head's group (g x Lq), not on how the items split them, so the
// group-packed and per-head modes still agree bitwise.
template <class T, class A>
std::int64_t tile_scratch_bytes(const DecodeParams<T, A>& p, std::int64_t kv_heads, std::int64_t rows_per_head) {
  if constexpr (std::is_same_v<T, std::int8_t>)
    if (amx::int8_tiles().tiles && amx::takes(p.d_k, p.d_v, p.h / p.h_kv * p.q_len))
      return amx::scratch_bytes(kv_heads, rows_per_head, p.d_k, p.d_v);
  return 0;
}

template <class E>
hwy::AlignedFreeUniquePtr<E[]> allocate_aligned(std::int64_t count) {
  auto p = hwy::AllocateAligned<E>(static_cast<std::size_t>(count > 0 ? count : 1));
  if (!p) throw std::bad_alloc();
  return p;
}

// Positions [t0, t0 + kb) of sequence s, page by page: f(page, row, rows, j) for each run of `rows`
// positions t0 + j .. t0 + j + rows - 1 that lie in rows row .. row + rows - 1 of page `page` (an index
// into k_pages / v_pages and the scale pages). One division per block.
template <class T, class A, class F>
void for_each_page_run(const DecodeParams<T, A>& p, std::int64_t s, std::int64_t t0, std::int64_t kb, F&& f) {
  std::size_t page = static_cast<std::size_t>(p.first_page[static_cast<std::size_t>(s)] + t0 / p.page_size);
  for (std::int64_t j = 0, row = t0 % p.page_size; j < kb; row = 0, ++page) {
    const std::int64_t rows = std::min(p.page_size - row, kb - j);
    f(page, row, rows, j);
    j += rows;
  }
}

// Row pointers of positions [t0, t0 + kb) of sequence s, kv head `head`.
template <class T, class A>
void block_rows(const DecodeParams<T, A>& p, std::int64_t s, std::int64_t head, std::int64_t t0, std::int64_t kb,
                const T** k_rows, const T** v_rows) {
  for_each_page_run(p, s, t0, kb, [&](std::size_t page, std::int64_t row, std::int64_t rows, std::int64_t j) {
    const T* k = p.k_pages[page] + (head * p.page_size + row) * p.d_k;
    const T* v = p.v_pages[page] + (head * p.page_size + row) * p.d_v;
    for (std::int64_t i = 0; i < rows; ++i) k_rows[j + i] = k + i * p.d_k, v_rows[j + i] = v + i * p.d_v;
  });
}

// Runs the call: chunk(p, item, layout, slot, scratch) fills an item's slot (m, l and unnormalised O
// over its positions, see split_kv.hpp).
template <class T, class A, class Chunk>
void run_decode(const DecodeParams<T, A>& p, DecodeMode mode, Chunk chunk) {
  const bool packed = mode == DecodeMode::GroupPacked;
  const WorkPlan plan = plan_work(p.lengths, p.page_size, p.h, p.h_kv, packed);
  const std::int64_t R = (packed ? p.h : 1) * p.q_len, items = static_cast<std::int64_t>(plan.items.size());
  const SlotLayout layout{R, (p.d_v + 15) / 16 * 16};
  const auto partials = allocate_aligned<A>(items * layout.size());
  double positions = 0;
  for (std::int64_t T_s : p.lengths) positions += static_cast<double>(T_s);
  const SerialIfSmall serial_if_small(2.0 * positions * static_cast<double>(p.h * p.q_len * (p.d_k + p.d_v)));

  const int threads = omp_get_max_threads();
  const std::int64_t ld_q = (p.d_k + 15) / 16 * 16;
  const std::int64_t per_thread = R * kKeyBlock + R * ld_q;  // s, then q
  const auto floats = allocate_aligned<A>(threads * per_thread);
  std::vector<std::int64_t> visible(static_cast<std::size_t>(threads * 2 * R));
  std::vector<const T*> rows(static_cast<std::size_t>(threads * 4 * kKeyBlock));
  std::vector<std::uint8_t> flags(static_cast<std::size_t>(threads * kKeyBlock));
  const std::int64_t kv_heads = packed ? p.h_kv : 1, tile_bytes = tile_scratch_bytes(p, kv_heads, R / kv_heads);
  const auto tiles = allocate_aligned<std::int8_t>(threads * tile_bytes);
#pragma omp parallel for schedule(dynamic, 1)
  for (std::int64_t i = 0; i < items; ++i) {
    const int t = omp_get_thread_num();
    ChunkScratch<T, A> w;
    w.s = floats.get() + t * per_thread;
    w.q = w.s + R * kKeyBlock;
    w.ld_q = ld_q;
    w.visible = visible.data() + t * 2 * R;
    w.visible_begin = w.visible + R;
    w.k_rows = rows.data() + t * 4 * kKeyBlock;
    w.v_rows = w.k_rows + kKeyBlock;
    w.k_ahead = w.v_rows + kKeyBlock;
    w.v_ahead = w.k_ahead + kKeyBlock;
    w.all_weighted = flags.data() + t * kKeyBlock;
    w.tiles = tile_bytes > 0 ? tiles.get() + t * tile_bytes : nullptr;
    chunk(p, plan.items[static_cast<std::size_t>(i)], layout, partials.get() + i * layout.size(), w);
  }

  const std::int64_t groups = static_cast<std::int64_t>(plan.group_first.size()) - 1;
#pragma omp parallel
  {
    std::vector<A> row(static_cast<std::size_t>(p.d_v));
#pragma omp for schedule(static)
    for (std::int64_t k = 0; k < groups; ++k) {
      const std::int64_t first = plan.group_first[static_cast<std::size_t>(k)];
      const WorkItem& item = plan.items[static_cast<std::size_t>(first)];
      const std::int64_t chunks = plan.group_first[static_cast<std::size_t>(k) + 1] - first;
      for (std::int64_t r = 0; r < R; ++r) {
        const std::int64_t head = item.first_head + r / p.q_len, i = r % p.q_len;
        const A sink = p.sinks.empty() ? -std::numeric_limits<A>::infinity() : p.sinks[static_cast<std::size_t>(head)];
        const A lse = merge_row(partials.get(), layout, first, chunks, r, sink, p.d_v, row.data());
        const std::int64_t at = (item.seq * p.q_len + i) * p.h + head;  // [n, Lq, h]
        for (std::int64_t e = 0; e < p.d_v; ++e) p.out[at * p.d_v + e] = query_t<T>(row[static_cast<std::size_t>(e)]);
        if (p.lse) p.lse[at] = lse;
      }
    }
  }
}

// The rows of an item, r = (query head - first_head) * Lq + i: query i of the sequence, at position
// i' = T - Lq + i, sees positions [begin, end): end = i' + 1 (causal) or T, at most i' + window_right + 1;
// begin = i' - window_left, or 0. visible_begin[r] and visible[r] are those bounds relative to the block
// starting at t0.
template <class T, class A>
void block_visibility(const DecodeParams<T, A>& p, std::int64_t T_s, std::int64_t R, std::int64_t t0,
                      std::int64_t* visible, std::int64_t* visible_begin) {
  for (std::int64_t r = 0; r < R; ++r) {
    const std::int64_t position = T_s - p.q_len + r % p.q_len;
    std::int64_t end = p.causal ? position + 1 : T_s;
    if (p.window_right >= 0) end = std::min(end, position + p.window_right + 1);
    visible[r] = end - t0;
    visible_begin[r] = (p.window_left >= 0 ? std::max<std::int64_t>(0, position - p.window_left) : 0) - t0;
  }
}

// Whether no row of an item sees any of its positions [begin, end): all lie before every query's window.
template <class T, class A>
bool before_every_window(const DecodeParams<T, A>& p, std::int64_t T_s, const WorkItem& item) {
  return p.window_left >= 0 && item.end <= T_s - p.q_len - p.window_left;  // where query 0's window starts
}

// The score's variants on the logits s [R, ld_s] of rows [r0, r0 + R) of an item over keys [t0, t0 + kb)
// (scaled, -inf past each row's end): keys before a row's window become -inf; each visible logit x
// becomes softcap tanh(x / softcap) (softcap > 0), then gets ALiBi's -slope[head] |i' - t|, in the order
// the prefill kernels apply them. Called only when p.has_variants().
template <class T, class A>
void apply_score_variants(const DecodeParams<T, A>& p, const WorkItem& item, std::int64_t r0, std::int64_t R,
                          std::int64_t T_s, std::int64_t t0, std::int64_t kb, const std::int64_t* visible,
                          const std::int64_t* visible_begin, A* s, std::int64_t ld_s) {
  for (std::int64_t r = 0; r < R; ++r) {
    const std::int64_t row_in_item = r0 + r, head = item.first_head + row_in_item / p.q_len;
    const std::int64_t position = T_s - p.q_len + row_in_item % p.q_len;
    A* row = s + r * ld_s;
    const std::int64_t begin = std::clamp<std::int64_t>(visible_begin[r], 0, kb);
    const std::int64_t end = std::clamp<std::int64_t>(visible[r], begin, kb);
    for (std::int64_t j = 0; j < begin; ++j) row[j] = -std::numeric_limits<A>::infinity();
    const A slope = p.alibi_slopes.empty() ? A(0) : p.alibi_slopes[static_cast<std::size_t>(head)];
    for (std::int64_t j = begin; j < end; ++j) {
      A x = row[j];
      if (p.softcap > 0) x = p.softcap * std::tanh(x / p.softcap);
      if (!p.alibi_slopes.empty()) {
        const std::int64_t distance = position - (t0 + j);
        x += -slope * static_cast<A>(distance < 0 ? -distance : distance);
      }
      row[j] = x;
    }
  }
}

}  // namespace mha::detail::decode
