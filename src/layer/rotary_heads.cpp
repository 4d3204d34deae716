// rotate_heads (rotary_heads.hpp): the positions of each row, their table of cos and sin (float64
// angles, attention/rotary.hpp), and the strided rotation in place.
#include "layer/rotary_heads.hpp"

#include <vector>

#include "attention/rotary.hpp"
#include "dtype_dispatch.hpp"
#include "mha/error.hpp"

namespace mha::detail {

namespace {

[[noreturn]] void fail(const std::string& message) { throw Error(message); }

// The positions `p` of T rows for B batch rows, [T] or [B, T], read through their strides into [1 or B, T].
std::vector<std::int64_t> read_positions(const PositionsView& p, const char* name, std::int64_t B, std::int64_t T,
                                         const char* T_name) {
  const Shape& shape = p.shape();
  const bool shared = p.rank() == 1 && shape[0] == T;
  if (!shared && !(p.rank() == 2 && shape[0] == B && shape[1] == T))
    fail(std::string(name) + ": expected [" + T_name + "] = [" + std::to_string(T) + "] or [B, " + T_name + "] = [" +
         std::to_string(B) + ", " + std::to_string(T) + "] rotary positions, got shape " + shape_str(shape));
  const std::int64_t rows = shared ? 1 : B;
  const std::int64_t row_stride = shared ? 0 : p.strides()[0], column_stride = p.strides()[p.rank() - 1];
  std::vector<std::int64_t> values(static_cast<std::size_t>(rows * T));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t t = 0; t < T; ++t) {
      const std::int64_t v = p.at_offset(r * row_stride + t * column_stride);
      if (v < 0)
        fail(std::string(name) + ": expected positions >= 0, got " + std::to_string(v) + " at [" +
             (shared ? "" : std::to_string(r) + ", ") + std::to_string(t) + "]");
      values[static_cast<std::size_t>(r * T + t)] = v;
    }
  return values;
}

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

RotaryPositions rotary_positions(const MultiHeadAttentionInputs& in, const MultiHeadAttentionConfig& c, std::int64_t B,
                                 std::int64_t L, std::int64_t S) {
  if (!in.positions && !in.key_positions) return {};
  if (!has_rotary(c))
    fail(std::string(in.positions ? "positions" : "key_positions") +
         ": the layer has no rotary embedding (rotary_dim 0); positions place rotated queries and keys only");
  if (!in.cu_seqlens.empty())
    fail(std::string(in.positions ? "positions" : "key_positions") +
         ": not with cu_seqlens (packed sequences count rotary positions from 0 in each)");
  if (!in.positions) fail("key_positions: given without positions (the queries'); give both");
  if (!in.key_positions && S != L)
    fail("key_positions: required with positions when key has S = " + std::to_string(S) + " positions and query L = " +
         std::to_string(L) + " (only self-attention, S = L, reuses positions for the keys)");
  RotaryPositions r;
  r.given = true;
  r.query = read_positions(*in.positions, "positions", B, L, "L");
  r.key = in.key_positions ? read_positions(*in.key_positions, "key_positions", B, S, "S") : r.query;
  return r;
}

void refuse_rotary_positions(const MultiHeadAttentionInputs& in, const char* call) {
  if (in.positions || in.key_positions)
    fail(std::string(in.positions ? "positions" : "key_positions") + ": " + call +
         " takes no explicit rotary positions (each new position is rotated at its index in its sequence)");
}

}  // namespace mha::detail
