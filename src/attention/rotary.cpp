// Rotary position embeddings (RoPE; Su et al., 2021): validation at the public boundary, the table of cos
// and sin, and the strided rotation. For each row (b, head, l) of x [B, h, L, d] and each pair i < r/2,
//
//     theta   = position(b, l) * base^(-2i / r)              (float64, then cos and sin in float64)
//     y_a     = x_a cos theta - x_b sin theta                 (a, b) = (i, i + r/2), or (2i, 2i + 1) interleaved
//     y_b     = x_b cos theta + x_a sin theta
//
// and the backward rotates by -theta (R^T = R^-1). Components c >= r are copied.
//
// Legend: B batch, h heads, L positions, d head width, r rotary_dim, P rows of positions (1 or B).
#include "attention/rotary.hpp"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dtype_dispatch.hpp"
#include "logit_scalars.hpp"
#include "mha/error.hpp"
#include "parallel.hpp"

namespace mha {

// ---- PositionsView ----------------------------------------------------------------------------------------

namespace {

[[noreturn]] void fail(const std::string& message) { throw Error(message); }

void check_positions_layout(const Shape& shape, const Shape& strides) {
  if (shape.size() != strides.size())
    fail("positions: shape " + shape_str(shape) + " and strides " + shape_str(strides) + " differ in rank");
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) fail("positions: negative size in shape " + shape_str(shape));
    if (strides[i] < 0) fail("positions: negative stride in strides " + shape_str(strides));
  }
}

void check_positions_count(std::size_t values, const Shape& shape) {
  const std::int64_t needed = shape_numel(shape);
  if (static_cast<std::int64_t>(values) < needed)
    fail("positions: shape " + shape_str(shape) + " needs " + std::to_string(needed) + " values, got " +
         std::to_string(values));
}

}  // namespace

PositionsView::PositionsView(const std::int64_t* data, Shape shape, Shape strides)
    : int64_(data), shape_(std::move(shape)), strides_(std::move(strides)) {
  check_positions_layout(shape_, strides_);
}
PositionsView::PositionsView(const std::int32_t* data, Shape shape, Shape strides)
    : int32_(data), shape_(std::move(shape)), strides_(std::move(strides)) {
  check_positions_layout(shape_, strides_);
}
PositionsView::PositionsView(std::span<const std::int64_t> values, Shape shape)
    : PositionsView(values.data(), shape, contiguous_strides(shape)) {
  check_positions_count(values.size(), shape_);
}
PositionsView::PositionsView(std::span<const std::int32_t> values, Shape shape)
    : PositionsView(values.data(), shape, contiguous_strides(shape)) {
  check_positions_count(values.size(), shape_);
}

namespace detail {

// ---- the table --------------------------------------------------------------------------------------------

namespace {

// The position of (batch row p, position index l): [L] positions ignore p.
std::int64_t position_at(const PositionsView& positions, std::int64_t p, std::int64_t l) {
  const Shape& s = positions.strides();
  return positions.rank() == 1 ? positions.at_offset(l * s[0]) : positions.at_offset(p * s[0] + l * s[1]);
}

// One float64 cos and sin pair takes about 15 ns on one core here (a std::cos and std::sin loop, -O3), some
// 700 flops at the GEMM rate parallel.hpp's threshold counts in.
constexpr double kSinCosFlops = 700.0;

// Multiply-adds per rotated pair: 4 products and 2 sums.
constexpr double kPairFlops = 6.0;

}  // namespace

template <class C>
RotaryTable<C> make_rotary_table(const PositionsView* positions, std::int64_t B, std::int64_t L,
                                 std::int64_t rotary_dim, const RotaryOptions& options) {
  RotaryTable<C> t;
  t.rows = positions && positions->rank() == 2 ? B : 1;
  t.L = L;
  t.half = rotary_dim / 2;
  t.interleaved = options.interleaved;
  const std::int64_t entries = t.rows * L;  // (p, l) pairs, each with r/2 angles
  t.cos.resize(static_cast<std::size_t>(entries * t.half));
  t.sin.resize(t.cos.size());

  std::vector<double> inv_freq(static_cast<std::size_t>(t.half));  // [r/2]: base^(-2i / r)
  for (std::int64_t i = 0; i < t.half; ++i)
    inv_freq[static_cast<std::size_t>(i)] =
        std::pow(options.base, -2.0 * static_cast<double>(i) / static_cast<double>(rotary_dim));

  const SerialIfSmall serial(kSinCosFlops * static_cast<double>(entries * t.half));
#pragma omp parallel for schedule(static)
  for (std::int64_t e = 0; e < entries; ++e) {
    const std::int64_t p = e / L, l = e % L;
    const double position = static_cast<double>(positions ? position_at(*positions, p, l) : l);
    C* cos = t.cos.data() + e * t.half;
    C* sin = t.sin.data() + e * t.half;
    for (std::int64_t i = 0; i < t.half; ++i) {
      const double angle = position * inv_freq[static_cast<std::size_t>(i)];  // float64, as the header says
      cos[i] = static_cast<C>(std::cos(angle));
      sin[i] = static_cast<C>(std::sin(angle));
    }
  }
  return t;
}

template RotaryTable<float> make_rotary_table<float>(const PositionsView*, std::int64_t, std::int64_t, std::int64_t,
                                                     const RotaryOptions&);
template RotaryTable<double> make_rotary_table<double>(const PositionsView*, std::int64_t, std::int64_t, std::int64_t,
                                                       const RotaryOptions&);

// ---- the rotation -----------------------------------------------------------------------------------------

namespace {

// One row: y[a], y[b] = the pair (x[a], x[b]) rotated by the angle whose cos and sin are cos[i], sin[i]
// (sin negated when inverse), for a = i * step and b = a + partner; then y[c] = x[c] for c in [r, d) when
// copy_rest. x, y: [d] with strides xc, yc (1 when kUnit, so that the compiler can vectorise).
template <bool kUnit, class T, class C>
void rotate_row(const T* x, std::int64_t xc, T* y, std::int64_t yc, const C* cos, const C* sin,
                const RotaryTable<C>& table, bool inverse, std::int64_t d, bool copy_rest) {
  const std::int64_t xs = kUnit ? 1 : xc, ys = kUnit ? 1 : yc;
  const std::int64_t step = table.interleaved ? 2 : 1;
  const std::int64_t partner = table.interleaved ? 1 : table.half;
  for (std::int64_t i = 0; i < table.half; ++i) {
    const std::int64_t a = i * step, b = a + partner;
    const C xa = static_cast<C>(x[a * xs]), xb = static_cast<C>(x[b * xs]);
    const C c = cos[i], s = inverse ? -sin[i] : sin[i];
    y[a * ys] = static_cast<T>(xa * c - xb * s);
    y[b * ys] = static_cast<T>(xb * c + xa * s);
  }
  if (copy_rest)
    for (std::int64_t k = 2 * table.half; k < d; ++k) y[k * ys] = x[k * xs];
}

template <class T>
void rotate_rows(const T* x, const std::int64_t (&xs)[4], T* y, const std::int64_t (&ys)[4], std::int64_t B,
                 std::int64_t h, std::int64_t L, std::int64_t d, const RotaryTable<compute_t<T>>& table, bool inverse,
                 bool copy_rest) {
  const std::int64_t rows = B * h * L;
  const bool unit = xs[3] == 1 && ys[3] == 1;
  const SerialIfSmall serial(kPairFlops * static_cast<double>(rows * table.half));
#pragma omp parallel for schedule(static)
  for (std::int64_t row = 0; row < rows; ++row) {
    const std::int64_t l = row % L, head = (row / L) % h, b = row / (L * h);
    const T* in = x + b * xs[0] + head * xs[1] + l * xs[2];
    T* out = y + b * ys[0] + head * ys[1] + l * ys[2];
    const auto* cos = table.cos_at(b, l);
    const auto* sin = table.sin_at(b, l);
    if (unit) rotate_row<true>(in, 1, out, 1, cos, sin, table, inverse, d, copy_rest);
    else rotate_row<false>(in, xs[3], out, ys[3], cos, sin, table, inverse, d, copy_rest);
  }
}

}  // namespace

template <class T>
void rotate(const T* x, const std::int64_t (&x_strides)[4], T* y, const std::int64_t (&y_strides)[4], std::int64_t B,
            std::int64_t h, std::int64_t L, std::int64_t d, const RotaryTable<compute_t<T>>& table, bool inverse) {
  rotate_rows(x, x_strides, y, y_strides, B, h, L, d, table, inverse, true);
}

template <class T>
void rotate_in_place(T* x, const std::int64_t (&strides)[4], std::int64_t B, std::int64_t h, std::int64_t L,
                     std::int64_t d, const RotaryTable<compute_t<T>>& table, bool inverse) {
  rotate_rows<T>(x, strides, x, strides, B, h, L, d, table, inverse, false);
}

#define MHA_ROTARY_INSTANTIATE(T)                                                                            \
  template void rotate<T>(const T*, const std::int64_t(&)[4], T*, const std::int64_t(&)[4], std::int64_t,    \
                          std::int64_t, std::int64_t, std::int64_t, const RotaryTable<compute_t<T>>&, bool); \
  template void rotate_in_place<T>(T*, const std::int64_t(&)[4], std::int64_t, std::int64_t, std::int64_t,   \
                                   std::int64_t, const RotaryTable<compute_t<T>>&, bool);
MHA_ROTARY_INSTANTIATE(float)
MHA_ROTARY_INSTANTIATE(double)
MHA_ROTARY_INSTANTIATE(bfloat16)
#undef MHA_ROTARY_INSTANTIATE

// ---- the public functions -----------------------------------------------------------------------------------

namespace {

std::string describe(const TensorView& t) { return std::string(dtype_name(t.dtype())) + " " + shape_str(t.shape()); }

// positions checked against x [B, h, L, d]: [L] or [B, L], each value >= 0. Returns the largest (0 if none).
std::int64_t validated_max_position(const PositionsView& positions, std::int64_t B, std::int64_t L) {
  const bool shared = positions.rank() == 1 && positions.shape() == Shape{L};
  if (!shared && !(positions.rank() == 2 && positions.shape() == Shape{B, L}))
    fail("positions: expected shape [L] = " + shape_str({L}) +
         " (shared by the batch rows) or [B, L] = " + shape_str({B, L}) + ", got " +
         std::string(positions.is_int32() ? "int32 " : "int64 ") + shape_str(positions.shape()));
  std::int64_t largest = 0;
  for (std::int64_t p = 0; p < (shared ? 1 : B); ++p)
    for (std::int64_t l = 0; l < L; ++l) {
      const std::int64_t value = position_at(positions, p, l);
      if (value < 0)
        fail("positions: expected positions >= 0, got " + std::to_string(value) + " at " +
             (shared ? shape_str({l}) : shape_str({p, l})));
      largest = std::max(largest, value);
    }
  return largest;
}

// Checks x (named `name`), positions and options; returns r, rotary_dim resolved (0 becomes d).
std::int64_t validated_rotary_dim(const TensorView& x, const std::string& name,
                                  const std::optional<PositionsView>& positions, const RotaryOptions& o) {
  if (x.rank() != 4)
    fail(name + ": expected rank 4 [B, h, L, d], got rank " + std::to_string(x.rank()) + " " + shape_str(x.shape()));
  if (!is_floating(x.dtype())) fail(name + ": expected " + floating_dtype_names() + ", got " + describe(x));
  const std::int64_t B = x.size(0), L = x.size(2), d = x.size(3);
  if (o.rotary_dim == 0 && d % 2 != 0)
    fail("rotary_dim: 0 rotates the whole head, but d = " + std::to_string(d) + " (" + name + " " +
         shape_str(x.shape()) + ") is odd; expected an even rotary_dim < d");
  if (o.rotary_dim < 0 || o.rotary_dim > d || o.rotary_dim % 2 != 0)
    fail("rotary_dim: expected an even number of components in [2, d = " + std::to_string(d) +
         "], or 0 for the whole head, got " + std::to_string(o.rotary_dim));
  const std::int64_t r = o.rotary_dim == 0 ? d : o.rotary_dim;
  if (!(std::isfinite(o.base) && o.base > 0.0)) fail("base: expected a finite number > 0, got " + number_str(o.base));
  const std::int64_t largest = positions ? validated_max_position(*positions, B, L) : std::max<std::int64_t>(L - 1, 0);
  // The fastest-turning pair has inv_freq 1 when base >= 1, base^(-(r-2)/r) when base < 1 (up to 1 / base).
  const double fastest = r < 2 ? 1.0 : std::max(1.0, std::pow(o.base, -static_cast<double>(r - 2) / r));
  if (!std::isfinite(static_cast<double>(largest) * fastest))
    fail("base: " + number_str(o.base) + " makes the angle of position " + std::to_string(largest) +
         " infinite (inv_freq up to " + number_str(fastest) + "); expected a base whose angles stay finite");
  return r;
}

// y = R x (inverse: R^T x) for x: [B, h, L, d] named `name`; y: a new contiguous [B, h, L, d] of x's dtype.
Tensor rotated(const TensorView& x, const std::string& name, const std::optional<PositionsView>& positions,
               const RotaryOptions& options, bool inverse) {
  const std::int64_t r = validated_rotary_dim(x, name, positions, options);
  Tensor y = Tensor::uninitialized(x.dtype(), x.shape());
  if (x.numel() == 0) return y;
  const std::int64_t B = x.size(0), h = x.size(1), L = x.size(2), d = x.size(3);
  const std::int64_t x_strides[4] = {x.stride(0), x.stride(1), x.stride(2), x.stride(3)};
  const std::int64_t y_strides[4] = {h * L * d, L * d, d, 1};
  dispatch_floating(x.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const auto table = make_rotary_table<compute_t<T>>(positions ? &*positions : nullptr, B, L, r, options);
    rotate<T>(x.data_as<T>(), x_strides, y.data_as<T>(), y_strides, B, h, L, d, table, inverse);
  });
  return y;
}

}  // namespace

}  // namespace detail

Tensor apply_rotary(const TensorView& x, const std::optional<PositionsView>& positions, const RotaryOptions& options) {
  return detail::rotated(x, "x", positions, options, false);
}

Tensor apply_rotary_backward(const TensorView& dy, const std::optional<PositionsView>& positions,
                             const RotaryOptions& options) {
  return detail::rotated(dy, "dy", positions, options, true);
}

}  // namespace mha
