// Software prefetch of the decode kernel's rows (decode_rows-inl.h): a row's lines, the key and value
// rows of the block read next, and a quantized block's scales, into the L1 or the L2 as prefetch_level.hpp
// chose for this processor.
//
// Included once per SIMD target through Highway's foreach_target.h.
#if defined(MHA_DECODE_PREFETCH_ROWS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef MHA_DECODE_PREFETCH_ROWS_INL_H_
#undef MHA_DECODE_PREFETCH_ROWS_INL_H_
#else
#define MHA_DECODE_PREFETCH_ROWS_INL_H_
#endif

#include <cstdint>

#include "decode/decode_driver.hpp"  // for_each_page_run
#include "decode/decode_params.hpp"
#include "decode/prefetch_level.hpp"
#include "hwy/highway.h"
#include "prefetch_lines.hpp"

HWY_BEFORE_NAMESPACE();
namespace mha::detail::HWY_NAMESPACE {

// Asks for the `bytes` of `row` to be brought into the L1 (prefetcht0 on x86; locality 3 of GCC's
// builtin) or the L2 (prefetcht2, locality 1), whichever this machine reads faster from memory
// (prefetch_level.hpp: on a Zen 4 the L2 2.9-3.1x faster for float32, on a Zen 5 the L1 1.1-1.25x).
// Every 64-byte line the bytes touch is asked for, where the row starts mid-line too.
HWY_INLINE void PrefetchRow(const void* row, std::int64_t bytes, PrefetchLevel level) {
  const LineSpan span = line_span(row, bytes);
  if (level == PrefetchLevel::L1)
    for (std::int64_t i = 0; i < span.lines; ++i) __builtin_prefetch(span.first + 64 * i, 0, 3);
  else
    for (std::int64_t i = 0; i < span.lines; ++i) __builtin_prefetch(span.first + 64 * i, 0, 1);
}

// PrefetchRow for the key rows k[0 .. n) and the value rows v[0 .. n), a key row's lines and then its
// value row's. Rows of at most two lines (int8 and float8 rows of 128 values) that lie back to back on
// each side (rows of one page, the usual case) are asked for by one walk over both spans, a key line and
// a value line in turn: 2-3% faster for those from memory on a Zen 5, where the same walk made float32
// and bfloat16 rows 8-14% slower than row by row (in-process A/B, 1 x 128k positions, 2026-12-05).
template <class T>
HWY_INLINE void PrefetchRowPairs(const T* const* k, const T* const* v, std::int64_t n, std::int64_t k_bytes,
                                 std::int64_t v_bytes, PrefetchLevel level) {
  if (n <= 0) return;
  const auto* k0 = reinterpret_cast<const char*>(k[0]);
  const auto* v0 = reinterpret_cast<const char*>(v[0]);
  const bool spans =
      k_bytes == v_bytes && k_bytes <= 128 && reinterpret_cast<const char*>(k[n - 1]) == k0 + (n - 1) * k_bytes &&
      reinterpret_cast<const char*>(v[n - 1]) == v0 + (n - 1) * v_bytes &&
      (reinterpret_cast<std::uintptr_t>(k0) & 63) == 0 && (reinterpret_cast<std::uintptr_t>(v0) & 63) == 0;
  if (!spans) {
    for (std::int64_t j = 0; j < n; ++j) PrefetchRow(k[j], k_bytes, level), PrefetchRow(v[j], v_bytes, level);
    return;
  }
  const std::int64_t bytes = n * k_bytes;
  if (level == PrefetchLevel::L1)
    for (std::int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(k0 + b, 0, 3), __builtin_prefetch(v0 + b, 0, 3);
  else
    for (std::int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(k0 + b, 0, 1), __builtin_prefetch(v0 + b, 0, 1);
}

// Quantized pages: the scales of positions [t0, t0 + kb) of kv head `head` of sequence s, asked for with
// the block's rows. A page keeps its rows' scales after its keys and values (a line per 16 rows of a
// head), so nothing else brings them near before the block reads them: from a 264 MiB int8 cache on the
// Zen 5, 45% of the samples outside the two products waited on those loads (docs/PERFORMANCE.md).
template <class T>
HWY_INLINE void PrefetchBlockScales(const DecodeParams<T, float>& p, std::int64_t s, std::int64_t head, std::int64_t t0,
                                    std::int64_t kb, PrefetchLevel level) {
  decode::for_each_page_run(p, s, t0, kb, [&](std::size_t page, std::int64_t row, std::int64_t rows, std::int64_t) {
    const std::int64_t bytes = rows * static_cast<std::int64_t>(sizeof(float));
    PrefetchRow(p.k_scale_pages[page] + head * p.page_size + row, bytes, level);
    PrefetchRow(p.v_scale_pages[page] + head * p.page_size + row, bytes, level);
  });
}

// The rows of the block read next, prefetched one key row and one value row per key of the current block.
template <class T>
struct RowsAhead {
  const T* const* k = nullptr;
  const T* const* v = nullptr;
  std::int64_t count = 0;  // 0: nothing ahead
  std::int64_t k_bytes = 0, v_bytes = 0;
  PrefetchLevel level = PrefetchLevel::L1;
};

}  // namespace mha::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard toggled per target
