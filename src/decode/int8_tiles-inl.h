// The decode kernel's blocks over int8 pages on AMX tiles (amx_int8.hpp), for the items where
// amx::int8_tiles() chose them: the same steps as BlockLogits and BlockAccumulate (decode_rows-inl.h),
// the products on tiles, the rows the tiles cannot represent (amx_int8.hpp says which) through those
// vector functions, one row at a time.
//
// Legend: R_g rows of one kv head in an item, groups of 4 of them per tile product, kb keys in a block.
//
// Included once per SIMD target through Highway's foreach_target.h.
#if defined(MHA_DECODE_INT8_TILES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_DECODE_INT8_TILES_INL_H_
#undef MHA_DECODE_INT8_TILES_INL_H_
#else
#define MHA_DECODE_INT8_TILES_INL_H_
#endif

#include <algorithm>
#include <cstdint>
#include <optional>

#include "decode/amx_int8.hpp"
#include "decode/decode_rows-inl.h"
#include "decode/prefetch_rows-inl.h"
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace mha::detail::HWY_NAMESPACE {

static_assert(decode::kKeyBlock == amx::kBlockKeys, "a P V tile product covers one block");

// One item's state on the tiles: its query rows' digits, per kv head and group of 4 rows, and the
// thread's tile registers (configured at Start, released with this object).
class Int8TileRows {
 public:
  // q [kv_heads R_g, ld_q]: the item's query rows; scratch: amx::scratch_bytes for this item's shape.
  void Start(const float* q, std::int64_t ld_q, std::int64_t rows_per_head, std::int64_t kv_heads, std::int64_t d_k,
             std::int64_t d_v, void* scratch) {
    q_ = q, ld_q_ = ld_q, rows_per_head_ = rows_per_head, d_k_ = d_k, d_v_ = d_v;
    groups_per_head_ = (rows_per_head + amx::kGroupRows - 1) / amx::kGroupRows;
    s_ = amx::carve_scratch(scratch, kv_heads, rows_per_head, d_k, d_v);
    config_.emplace(d_k);
    for (std::int64_t kh = 0; kh < kv_heads; ++kh)
      for (std::int64_t g = 0; g < groups_per_head_; ++g) {
        const std::int64_t first = kh * rows_per_head + amx::kGroupRows * g, at = kh * groups_per_head_ + g;
        s_.query_groups[at] = amx::query_digits(q + first * ld_q, ld_q, GroupRows(g), d_k, Digits(at));
      }
  }

  // BlockLogits for kv head kh's rows: s [R_g, kKeyBlock].
  // The rows ahead are prefetched over this and BlockAccumulate (amx::LinesAhead), which must follow.
  void BlockLogits(std::int64_t kh, const std::int8_t* const* k_rows, std::int64_t kb,
                   const float* HWY_RESTRICT logit_scales, const std::int64_t* visible,
                   const RowsAhead<std::int8_t>& ahead, float* HWY_RESTRICT s) {
    lines_ahead_ = amx::LinesAhead(ahead.k, ahead.v, std::max<std::int64_t>(ahead.count, 0), ahead.k_bytes,
                                   ahead.v_bytes, ahead.level == PrefetchLevel::L2);
    const std::int8_t* tiles[4];  // the block's four key tiles: runs of 16 rows in a page, or gathered
    for (std::int64_t t = 0; t < 4; ++t) {
      const std::int64_t j0 = amx::kTileKeys * t, n = std::clamp<std::int64_t>(kb - j0, 0, amx::kTileKeys);
      bool run = n == amx::kTileKeys;
      for (std::int64_t j = 1; j < n && run; ++j) run = k_rows[j0 + j] == k_rows[j0] + j * d_k_;
      std::int8_t* copy = s_.keys + t * amx::kTileKeys * d_k_;
      if (!run) amx::gather_key_tile(k_rows + j0, n, d_k_, copy);
      tiles[t] = run ? k_rows[j0] : copy;
    }
    for (std::int64_t g = 0; g < groups_per_head_; ++g) {  // the first group prefetches 32% of the lines ahead
      const std::int64_t at = kh * groups_per_head_ + g;
      amx::key_block_dots(tiles, d_k_, d_k_, Digits(at), s_.query_groups[at], GroupRows(g),
                          s + amx::kGroupRows * g * decode::kKeyBlock, decode::kKeyBlock, s_.sums,
                          g == 0 ? &lines_ahead_ : nullptr);
    }
    lines_ahead_.issue_until(0.4);  // before the scaling and the softmax
    ScaleAndMaskLogits(s, rows_per_head_, logit_scales, visible, kb);
    const RowsAhead<std::int8_t> none{};
    for (std::int64_t r = 0; r < rows_per_head_; ++r)
      if (!Tiled(s_.query_groups[kh * groups_per_head_ + r / amx::kGroupRows], r))
        mha::detail::HWY_NAMESPACE::BlockLogits(q_ + (kh * rows_per_head_ + r) * ld_q_, ld_q_, 1, k_rows, kb, d_k_,
                                                logit_scales, visible + r, none, s + r * decode::kKeyBlock);
  }

  // BlockAccumulate for kv head kh's rows: acc [R_g, ld_acc] += P [R_g, kKeyBlock] V_block.
  void BlockAccumulate(const float* HWY_RESTRICT p, const std::int8_t* const* v_rows, std::int64_t kb,
                       bool block_weighted, const std::uint8_t* all_weighted, float* HWY_RESTRICT acc,
                       std::int64_t ld_acc) {
    bool laid_out = false;
    lines_ahead_.issue_until(0.45);
    for (std::int64_t g = 0; g < groups_per_head_; ++g) {
      const float* p_g = p + amx::kGroupRows * g * decode::kKeyBlock;
      float* acc_g = acc + amx::kGroupRows * g * ld_acc;
      const int rows = GroupRows(g);
      const amx::RowGroup weights = amx::weight_digits(p_g, decode::kKeyBlock, rows, s_.weights);
      if (HasWeight(weights)) {
        if (!laid_out) amx::value_tiles(v_rows, kb, d_v_, s_.values, lines_ahead_, 0.45, 0.8), laid_out = true;
        amx::accumulate_values(s_.weights, weights, rows, s_.values, d_v_, acc_g, ld_acc, s_.sums, lines_ahead_, 0.8,
                               0.98);
      }
      for (int r = 0; r < rows; ++r)
        if (!Tiled(weights, r))
          mha::detail::HWY_NAMESPACE::BlockAccumulate(p_g + r * decode::kKeyBlock, 1, v_rows, kb, d_v_, block_weighted,
                                                      all_weighted, acc_g + r * ld_acc, ld_acc);
    }
    lines_ahead_.issue_until(1.0);
  }

 private:
  static bool Tiled(const amx::RowGroup& group, std::int64_t r) {
    return (group.tiled >> (r % amx::kGroupRows) & 1) != 0;
  }
  static bool HasWeight(const amx::RowGroup& group) {
    for (int r = 0; r < amx::kGroupRows; ++r)
      if ((group.tiled >> r & 1) != 0 && group.unscale[r] != 0.0f) return true;
    return false;
  }
  int GroupRows(std::int64_t g) const {
    return static_cast<int>(std::min<std::int64_t>(amx::kGroupRows, rows_per_head_ - amx::kGroupRows * g));
  }
  std::int8_t* Digits(std::int64_t at) const { return s_.query_digits + at * 16 * d_k_; }

  const float* q_ = nullptr;
  std::int64_t ld_q_ = 0, rows_per_head_ = 0, groups_per_head_ = 0, d_k_ = 0, d_v_ = 0;
  amx::Scratch s_{};
  std::optional<amx::TileConfig> config_;
  amx::LinesAhead lines_ahead_;  // the block read next: BlockLogits starts it, BlockAccumulate finishes it
};

}  // namespace mha::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard toggled per target
