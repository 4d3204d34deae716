// The fused backward's work-item state (flash_backward.cpp): one thread's tiles and block copies, the
// key/value blocks of a tile, where a work item adds its dQ, and what the work items share.
#pragma once

#include <omp.h>

#include <cstdint>
#include <type_traits>

#include "attention/bf16_transpose.hpp"
#include "attention/flash_config.hpp"
#include "attention/nonfinite.hpp"
#include "attention/params.hpp"
#include "attention/query_block.hpp"
#include "gemm.hpp"
#include "mha/bfloat16.hpp"

namespace mha::detail {

// One thread's tiles and block copies; T is the inputs' type (float or bfloat16).
template <class T>
struct BackwardTiles {
  float *s, *dp, *pd;                        // [block_q, flash::kBlockK] each
  float* cap_slope;                          // [block_q, flash::kBlockK]: d cap / d logit (softcap only)
  T *k_copy, *v_copy, *q_copy, *do_copy;     // [flash::kBlockK, max(d_k, d_v)] x 2, [block_q, max(d_k, d_v)] x 2
  float *dk_block, *dv_block;                // [flash::kBlockK, d_k], [flash::kBlockK, d_v]: a key block's dK and dV
  bfloat16 *pd_rounded, *ds_rounded;         // rounded_tile() each: dropout(P) (or its transpose) and dS in bfloat16
  std::int64_t *nonfinite_k, *nonfinite_v;   // [flash::kBlockK] each
  std::int64_t *nonfinite_q, *nonfinite_do;  // [block_q] each
  const T* q_head = nullptr;                 // [L, d_k] of the item's (b, head), adjacent (the caller's rows or a copy)
  const T* do_head = nullptr;                // [L, d_v], likewise
  float* dq_head = nullptr;      // [g, L, d_k]: group 0's dQ, where the output's rows are not adjacent (float32)
  std::int64_t query_head = -1;  // the (b * h + head) q_head and do_head point at, -1 for none yet
};

// The K and V blocks of keys j0.., safe for whole-block products (nonfinite.hpp).
template <class T>
struct KeyBlocks {
  SafeBlock<T> k, v;
};

// Where one work item adds its share of dQ for one (b, head): rows [L, d_k], row stride ld.
struct DqTarget {
  float* data;
  std::int64_t ld;
};

// What the backward's work items share: the parameters, D = rowsum(dO * O) and the lse gathered
// contiguous ([B*h*L] each), the non-finite flags of the query rows ([B*h*L]: kQueryRow, kDoutRow) and
// of the key rows ([B*h*S]: kKeyRow, kValueRow), and the per-thread workspace.
//
// Per thread, in `floats`: the three tiles (four with softcap), then dK and dV of a key block (kv_size each) and group
// 0's dQ rows where the output's are not adjacent (dq_head_size); in `elements` (of T): the K, V block and Q, dO block
// copies, then the Q and dO rows of a head where they are not adjacent (head_copy_size); in `rounded` (bfloat16 inputs
// only): the two rounded tiles.
template <class T>
struct BackwardContext {
  const AttentionBackwardParams<T>& p;
  const float* D;
  const float* lse;
  const std::uint8_t* query_flags;
  const std::uint8_t* key_flags;
  float* floats;
  T* elements;
  bfloat16* rounded;
  std::int64_t tile, kv_size, q_size, head_copy_size, dq_head_size;
  std::int64_t* nonfinite_lists;              // kListsPerThread per thread
  std::int64_t block_q = query_block_rows();  // query rows per block

  static constexpr std::int64_t kListsPerThread = 2 * flash::kBlockK + 2 * flash::kBlockQTall;
  static constexpr bool kRounds = std::is_same_v<T, bfloat16>;  // products in bfloat16

  // Whether dV += dropout(P)^T dO reads P^T written by the backward itself, rounded to bfloat16 as it is
  // transposed (transpose_rounding_to_bf16), into pd_rounded [seen, transposed_row_stride(rows)]: where gemm_tile would
  // copy the transposed operand plain anyway (AMX). The same bits as rounding P's rows and leaving the
  // transpose to gemm_tile, with one pass fewer over P.
  bool writes_transposed_p = kRounds && gemm_tile_copies_transposed_bf16();

  std::int64_t tiles_per_thread() const { return p.softcap > 0 ? 4 : 3; }
  std::int64_t floats_per_thread() const { return tiles_per_thread() * tile + 2 * kv_size + dq_head_size; }
  std::int64_t elements_per_thread() const { return 2 * kv_size + 2 * q_size + head_copy_size; }
  // A rounded tile: [rows, kBlockK], or P^T [kBlockK, transposed_row_stride(rows)] (writes_transposed_p).
  std::int64_t rounded_tile() const { return transposed_row_stride(tile / flash::kBlockK) * flash::kBlockK; }
  std::int64_t rounded_per_thread() const { return kRounds ? 2 * rounded_tile() : 0; }

  BackwardTiles<T> tiles() const {
    const int thread = omp_get_thread_num();
    float* f = floats + thread * floats_per_thread();
    T* e = elements + thread * elements_per_thread();
    bfloat16* r = rounded + thread * rounded_per_thread();
    std::int64_t* lists = nonfinite_lists + thread * kListsPerThread;
    BackwardTiles<T> t;
    t.s = f, t.dp = f + tile, t.pd = f + 2 * tile, t.cap_slope = f + 3 * tile;
    t.dk_block = f + tiles_per_thread() * tile, t.dv_block = t.dk_block + kv_size;
    t.dq_head = t.dv_block + kv_size;
    t.k_copy = e, t.v_copy = e + kv_size, t.q_copy = e + 2 * kv_size, t.do_copy = t.q_copy + q_size;
    t.pd_rounded = r, t.ds_rounded = r + (kRounds ? rounded_tile() : 0);
    t.nonfinite_k = lists, t.nonfinite_v = lists + flash::kBlockK;
    t.nonfinite_q = lists + 2 * flash::kBlockK, t.nonfinite_do = t.nonfinite_q + flash::kBlockQTall;
    return t;
  }
  // Points t.q_head and t.do_head at the Q and dO rows of (b, head), copied adjacent where they are not
  // (the layer's [B, L, h, d] layout): once per work item without grouping, for all its tiles; once per
  // key block and head of the group with it.
  void use_query_head(BackwardTiles<T>& t, std::int64_t b, std::int64_t head) const {
    if (t.query_head == b * p.h + head) return;
    t.query_head = b * p.h + head;
    T* q_copy = elements + omp_get_thread_num() * elements_per_thread() + 2 * kv_size + 2 * q_size;
    T* do_copy = q_copy + (p.q.stride[2] != p.d_k ? p.L * p.d_k : 0);
    t.q_head = adjacent_rows(p.q.pointer(b, head, 0, 0), p.q.stride[2], p.L, p.d_k, q_copy);
    t.do_head = adjacent_rows(p.dout.pointer(b, head, 0, 0), p.dout.stride[2], p.L, p.d_v, do_copy);
  }
  KeyBlocks<T> key_blocks(const BackwardTiles<T>& t, std::int64_t b, std::int64_t kv, std::int64_t j0,
                          std::int64_t cols) const {
    const std::uint8_t* flags = key_flags + (b * p.h_kv + kv) * p.S;
    return {safe_block(p, p.k.pointer(b, kv, 0, 0), p.k.stride[2], b, kv, j0, cols, p.d_k, flags, kKeyRow, t.k_copy,
                       t.nonfinite_k),
            safe_block(p, p.v.pointer(b, kv, 0, 0), p.v.stride[2], b, kv, j0, cols, p.d_v, flags, kValueRow, t.v_copy,
                       t.nonfinite_v)};
  }
};

// Whether SoftmaxBackwardTile can round P and dS to bfloat16 row by row: bfloat16 inputs, and no pass
// changes them after it (dropout's copy of P, soft-capping's slope, the NaN of a non-finite v row).
template <class T>
bool RoundsRowByRow(const BackwardContext<T>& ctx, const KeyBlocks<T>& kv) {
  return BackwardContext<T>::kRounds && ctx.p.dropout_p == 0 && ctx.p.softcap == 0 && kv.v.nonfinite_count == 0;
}

}  // namespace mha::detail
