/// \file
/// Rotary position embeddings (RoPE; Su et al., 2021, "RoFormer", section 3.2): each pair (a, b) of a
/// head's first r = rotary_dim components is rotated by an angle proportional to the token's position,
///
///     inv_freq_i = base^(-2i / r),   theta_i = position * inv_freq_i,   i in [0, r/2)
///     y_a = x_a cos theta_i - x_b sin theta_i
///     y_b = x_b cos theta_i + x_a sin theta_i
///
/// so that the dot product of a rotated query and a rotated key depends on their positions only through
/// the difference. The pairs are (a, b) = (i, i + r/2) by default (GPT-NeoX, Llama: "rotate half"), or
/// (2i, 2i + 1) when interleaved (GPT-J, the paper's layout). Components c >= r pass unchanged.
///
/// Legend: B batch, h heads, L positions (tokens), d head width, r rotary_dim.
///
/// Precision: the angle theta_i and its cos and sin are computed in float64 (positions reach 1e5 - 1e6,
/// where a float32 angle is off by up to 0.06 rad, its spacing at 1e6), then rounded to the compute dtype:
/// float64 for float64 inputs, float32 for float32 and bfloat16 inputs. bfloat16 is widened exactly,
/// rotated in float32 and rounded to bfloat16 once.
///
/// NaN and Inf: a non-finite component reaches exactly the two outputs of its pair (its own and its
/// partner's, in the same row; a component c >= r only its own); every other output is unchanged.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

#include "mha/tensor.hpp"

namespace mha {

/// Token positions for apply_rotary: integers >= 0 (int64 or int32), [L] (the same positions for every
/// batch row) or [B, L] (a row of positions per batch row: left-padded or packed inputs). A read-only view
/// on memory the caller owns, as TensorView is (DType has no integer types, hence a view of its own).
class PositionsView {
 public:
  /// C-order view of `values`; mha::Error naming positions when they hold fewer values than the shape.
  PositionsView(std::span<const std::int64_t> values, Shape shape);
  PositionsView(std::span<const std::int32_t> values, Shape shape);
  /// Raw strided form (strides in elements, >= 0; 0 broadcasts): the caller vouches that `data` holds a
  /// value at every offset the shape and strides reach. mha::Error naming positions when the ranks of
  /// shape and strides differ or a size or stride is negative.
  PositionsView(const std::int64_t* data, Shape shape, Shape strides);
  PositionsView(const std::int32_t* data, Shape shape, Shape strides);

  bool is_int32() const { return int32_ != nullptr; }  ///< int32 values (else int64)
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  std::int64_t rank() const { return static_cast<std::int64_t>(shape_.size()); }
  /// The value `offset` elements from the start (offset = the sum of index x stride).
  std::int64_t at_offset(std::int64_t offset) const { return int32_ ? int32_[offset] : int64_[offset]; }

 private:
  const std::int64_t* int64_ = nullptr;
  const std::int32_t* int32_ = nullptr;
  Shape shape_;
  Shape strides_;
};

struct RotaryOptions {
  /// The wavelength base: inv_freq_i = base^(-2i / r). Finite and > 0 (10000 in the paper and Llama 2;
  /// 500000 in Llama 3).
  double base = 10000.0;
  /// r: the number of leading components rotated, even, in [0, d]; 0 (the default) means d, the whole
  /// head (d must then be even). GPT-NeoX rotates a quarter of each head, GPT-J 64 components.
  std::int64_t rotary_dim = 0;
  /// Pairs (2i, 2i + 1) (GPT-J) instead of (i, i + r/2) (GPT-NeoX, Llama).
  bool interleaved = false;
};

/// x: [B, h, L, d], float32, float64 or bfloat16, any strides. Returns y = R(positions) x, [B, h, L, d]
/// in x's dtype (a new contiguous tensor). positions: nullopt for 0, 1, ..., L-1 in every batch row,
/// else [L] or [B, L] as PositionsView says. Throws mha::Error naming the argument (x, positions, base,
/// rotary_dim) on invalid input: x not rank 4 or not floating; positions of another rank or shape, or
/// a negative one; base not finite or <= 0, or so small that an angle overflows (base^(-(r-2)/r) times the
/// largest position is infinite); rotary_dim odd, negative or > d, or 0 with an odd d.
Tensor apply_rotary(const TensorView& x, const std::optional<PositionsView>& positions = std::nullopt,
                    const RotaryOptions& options = {});

/// The backward of apply_rotary: dx = R(positions)^T dy, the rotation of each pair by -theta_i (the
/// transpose of a rotation is its inverse), with the forward's positions and options. dy: [B, h, L, d];
/// returns dx [B, h, L, d] in dy's dtype, in a new tensor (it overwrites nothing and accumulates into
/// nothing). Throws mha::Error as apply_rotary does, naming dy for what it says of x.
Tensor apply_rotary_backward(const TensorView& dy, const std::optional<PositionsView>& positions = std::nullopt,
                             const RotaryOptions& options = {});

}  // namespace mha
