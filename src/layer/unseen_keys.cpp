// Keys no query sees, and the input rows the layer's parameter gradients read as zero there
// (layer/unseen_keys.hpp says why).
//
// Legend: B batch, h heads, L queries, S input keys, S' the kernel's keys (S + extra positions).
#include "layer/unseen_keys.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>

#include "dtype_dispatch.hpp"
#include "mha/bfloat16.hpp"

namespace mha::detail {
namespace {

// Element `offset` (in elements) of a mask: true when it forbids (a nonzero bool, or an additive -inf).
bool forbids(const TensorView& mask, std::int64_t offset) {
  switch (mask.dtype()) {
    case DType::Bool: return mask.data_as<std::uint8_t>()[offset] != 0;
    case DType::Float32: return mask.data_as<float>()[offset] == -std::numeric_limits<float>::infinity();
    case DType::Float64: return mask.data_as<double>()[offset] == -std::numeric_limits<double>::infinity();
    case DType::BFloat16:
      return static_cast<float>(mask.data_as<bfloat16>()[offset]) == -std::numeric_limits<float>::infinity();
  }
  return false;
}

// Whether every element of row[0, width) is finite: its exponent bits are not all ones. An OR over
// integer tests, which the compiler vectorises (std::isfinite per element took 2.7% of a small layer's
// backward: B 8, S 64, E 256).
template <class T>
bool row_is_finite(const T* row, std::int64_t width) {
  using Bits = std::conditional_t<sizeof(T) == 8, std::uint64_t,
                                  std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint16_t>>;
  constexpr Bits exponent = sizeof(T) == 8   ? Bits(0x7ff0000000000000ull)
                            : sizeof(T) == 4 ? Bits(0x7f800000u)
                                             : Bits(0x7f80u);  // bf16: float's top
  bool nonfinite = false;
  for (std::int64_t c = 0; c < width; ++c) {
    Bits bits;
    std::memcpy(&bits, row + c, sizeof bits);
    nonfinite |= (bits & exponent) == exponent;
  }
  return !nonfinite;
}

}  // namespace

bool unseen_key(const AttentionOptions& o, std::int64_t b, std::int64_t j, std::int64_t h, std::int64_t L,
                std::int64_t S_kernel) {
  if (!o.key_lengths.empty() && j >= o.key_lengths[static_cast<std::size_t>(b)]) return true;
  if (const auto& kpm = o.key_padding_mask; kpm && forbids(*kpm, b * kpm->stride(0) + j * kpm->stride(1))) return true;
  // The queries that causal and the window let see key j: query i sits at i' = i + S' - L and sees j when
  // j <= i' (causal) and i' - window_left <= j <= i' + window_right.
  const std::int64_t shift = S_kernel - L;
  std::int64_t first = 0, last = L - 1;
  if (o.causal) first = std::max(first, j - shift);
  if (o.window_right >= 0) first = std::max(first, j - o.window_right - shift);
  if (o.window_left >= 0) last = std::min(last, j + o.window_left - shift);
  if (first > last) return true;
  if (!o.attn_mask) return false;
  const TensorView& a = *o.attn_mask;  // [L, S'] or [B*h, L, S']
  const std::int64_t r = a.rank(), heads = r == 3 ? h : 1;
  for (std::int64_t head = 0; head < heads; ++head)
    for (std::int64_t i = first; i <= last; ++i) {
      const std::int64_t at = (r == 3 ? (b * h + head) * a.stride(0) : 0) + i * a.stride(r - 2) + j * a.stride(r - 1);
      if (!forbids(a, at)) return false;
    }
  return true;
}

TensorView without_unseen_nonfinite_rows(const TensorView& x, RowLayout rows, std::int64_t B, std::int64_t S,
                                         const AttentionOptions& masks, std::int64_t h, std::int64_t L,
                                         std::int64_t S_kernel, const PackedRows& packed, Tensor& storage) {
  const std::int64_t width = x.shape().back();
  // Whether key t of batch b is seen by no query; packed: by no query of its own sequence i, at its place
  // t - cu_k[i] among that sequence's S_i keys (packed calls take no masks over a batch, only causal and
  // the window). The rows are visited in order, so the sequence advances with t.
  std::size_t i = 0;
  auto unseen = [&](std::int64_t b, std::int64_t t) {
    if (!packed.packed()) return unseen_key(masks, b, t, h, L, S_kernel);
    while (packed.cu_k[i + 1] <= t) ++i;
    const std::int64_t L_i = packed.cu_q[i + 1] - packed.cu_q[i], S_i = packed.cu_k[i + 1] - packed.cu_k[i];
    return L_i == 0 || unseen_key(masks, 0, t - packed.cu_k[i], h, L_i, S_i);
  };
  return dispatch_floating(x.dtype(), [&]<class T>(T) -> TensorView {
    T* copy = nullptr;  // made at the first row to zero
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < S; ++t) {
        const std::int64_t row = b * rows.batch + t * rows.position;
        if (row_is_finite(x.data_as<T>() + row * width, width) || !unseen(b, t)) continue;
        if (!copy) {
          storage = Tensor::copy_of(x);
          copy = storage.data_as<T>();
        }
        std::fill(copy + row * width, copy + (row + 1) * width, T(0));
      }
    return copy ? storage.view() : x;
  });
}

}  // namespace mha::detail
