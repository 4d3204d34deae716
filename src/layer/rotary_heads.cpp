// rotate_heads (rotary_heads.hpp): the positions of each row, their table of cos and sin (float64
// angles, attention/rotary.hpp), and the strided rotation in place.
#include "layer/rotary_heads.hpp"

#include <vector>

#include "attention/rotary.hpp"
#include "dtype_dispatch.hpp"

namespace mha::detail {

namespace {

// heads [B, heads, T, d_k] rotated in place, row t of batch b at positions[t] ([T], shared by the batch
// rows) or positions[b T + t] ([B, T]).
void rotate_at(const TensorView& heads, const MultiHeadAttentionConfig& c, const std::vector<std::int64_t>& positions,
               bool inverse) {
  const std::int64_t B = heads.size(0), h = heads.size(1), T = heads.size(2), d = heads.size(3);
  const bool shared = static_cast<std::int64_t>(positions.size()) == T;
  const PositionsView view(positions, shared ? Shape{T} : Shape{B, T});
  const RotaryOptions options{c.rotary_base, c.rotary_dim, c.rotary_interleaved};
  const std::int64_t strides[4] = {heads.stride(0), heads.stride(1), heads.stride(2), heads.stride(3)};
  dispatch_floating(heads.dtype(), [&]<class T_>(T_) {
    const auto table = make_rotary_table<compute_t<T_>>(&view, B, T, c.rotary_dim, options);
    rotate_in_place<T_>(static_cast<T_*>(const_cast<void*>(heads.data())), strides, B, h, T, d, table, inverse);
  });
}

}  // namespace

void rotate_heads(const TensorView& heads, const MultiHeadAttentionConfig& c, std::span<const std::int64_t> first,
                  bool inverse) {
  const std::int64_t B = heads.size(0), h = heads.size(1), T = heads.size(2);
  if (B == 0 || h == 0 || T == 0) return;
  const bool shared = first.size() == 1;
  std::vector<std::int64_t> positions(static_cast<std::size_t>((shared ? 1 : B) * T));  // [1 or B, T]
  for (std::size_t row = 0; row < positions.size() / static_cast<std::size_t>(T); ++row)
    for (std::int64_t t = 0; t < T; ++t) positions[row * static_cast<std::size_t>(T) + t] = first[row] + t;
  rotate_at(heads, c, positions, inverse);
}

void rotate_heads_at(const TensorView& heads, const MultiHeadAttentionConfig& c,
                     const std::vector<std::int64_t>& positions, bool inverse) {
  if (heads.size(0) == 0 || heads.size(1) == 0 || heads.size(2) == 0) return;
  rotate_at(heads, c, positions, inverse);
}

}  // namespace mha::detail
