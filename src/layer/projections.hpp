// The layer's projections: the input projections (q, k, v) and their gradients, the projected arrays
// viewed per head, and the extra key positions (bias_k / bias_v, the zero position). Templates on the
// element type T; the products go through layer/linear.hpp and gemm.hpp.
//
// Legend: B batch, T positions, h heads, E = d_model, N a projection's output width (h*d_k or h*d_v).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "dtype_dispatch.hpp"
#include "gemm.hpp"
#include "layer/inputs.hpp"
#include "layer/linear.hpp"
#include "mha/multi_head_attention.hpp"

namespace mha::detail {

// A projection output [rows, h * width] viewed as [B, h, T, width].
inline TensorView heads_view(const Tensor& projected, std::int64_t B, std::int64_t h, std::int64_t T,
                             std::int64_t width, RowLayout rows) {
  const std::int64_t W = h * width;
  return TensorView(projected.data(), projected.dtype(), {B, h, T, width},
                    {rows.batch * W, width, rows.position * W, 1});
}

// The layer's projection weights and biases, by role.
template <class T>
struct ProjectionWeights {
  const T *q, *k, *v, *out;                      // [h*d_k, E], [h_kv*d_k, kdim], [h_kv*d_v, vdim], [E, h*d_v]
  const T *q_bias, *k_bias, *v_bias, *out_bias;  // null without bias
};

template <class T>
ProjectionWeights<T> projection_weights(const MultiHeadAttention& layer) {
  const auto& c = layer.config();
  const std::int64_t qk = c.num_heads * c.d_k, E = c.d_model;
  ProjectionWeights<T> w{};
  if (layer.packed_in_proj()) {  // rows [q | k | v]
    const T* in_w = layer.parameter("in_proj_weight").data_as<T>();
    w.q = in_w, w.k = in_w + qk * E, w.v = in_w + 2 * qk * E;
  } else {
    w.q = layer.parameter("q_proj_weight").data_as<T>();
    w.k = layer.parameter("k_proj_weight").data_as<T>();
    w.v = layer.parameter("v_proj_weight").data_as<T>();
  }
  w.out = layer.parameter("out_proj.weight").data_as<T>();
  if (c.bias) {
    const T* in_b = layer.parameter("in_proj_bias").data_as<T>();
    w.q_bias = in_b, w.k_bias = in_b + qk, w.v_bias = in_b + qk + c.num_kv_heads * c.d_k;
    w.out_bias = layer.parameter("out_proj.bias").data_as<T>();
  }
  return w;
}

// Projects the rows of x ([B*T, width], contiguous, laid out as `rows` says) with weight w [N, width]
// and bias into y, batch by batch: position t of batch b goes to row b * y_batch_rows + t of y [*, N].
template <class T>
void project_per_batch(const TensorView& x, RowLayout rows, std::int64_t B, std::int64_t positions, const T* w,
                       std::int64_t N, const T* bias, T* y, std::int64_t y_batch_rows) {
  const std::int64_t width = x.shape().back();
  const T* xp = x.data_as<T>();
  for (std::int64_t b = 0; b < B; ++b)
    linear_forward(xp + b * rows.batch * width, rows.position * width, positions, width, w, N, bias,
                   y + b * y_batch_rows * N, N);
}

// Projects the rows of x ([B*T, width], contiguous, laid out as `rows` says) with weight w [N, width]
// and bias into y. extra == 0: y is [B*T, N] in x's row order. extra > 0: y is [B, T + extra, N]
// (batch-first), the appended positions left for the caller.
template <class T>
void project(const TensorView& x, RowLayout rows, std::int64_t B, std::int64_t positions, std::int64_t extra,
             const T* w, std::int64_t N, const T* bias, Tensor& y) {
  const std::int64_t width = x.shape().back();
  if (extra == 0) return linear_forward(x.data_as<T>(), width, B * positions, width, w, N, bias, y.data_as<T>(), N);
  project_per_batch(x, rows, B, positions, w, N, bias, y.data_as<T>(), positions + extra);
}

// The inverse of project(): given dy (shaped as project's y), accumulates nothing and writes
// dw [N, width] = dy^T x, dbias [N] = column sums of dy (when bias), dx [rows of x, width] = dy w.
template <class T>
void project_backward(const Tensor& dy, const TensorView& x, RowLayout rows, std::int64_t B, std::int64_t positions,
                      std::int64_t extra, const T* w, std::int64_t N, T* dw, T* dbias, Tensor& dx) {
  const std::int64_t width = x.shape().back();
  const T* xp = x.data_as<T>();
  const T* dyp = dy.data_as<T>();
  T* dxp = dx.data_as<T>();
  if (extra == 0) {
    gemm<T>(N, width, B * positions, transposed(dyp, N), plain(xp, width), overwrite(dw, width));
    if (dbias) column_sums(dyp, N, B * positions, N, dbias);
    gemm<T>(B * positions, width, N, plain(dyp, N), plain(w, width), overwrite(dxp, width));
    return;
  }
  // y is [B, positions + extra, N]; x and dx keep the input's row layout. dW and the bias gradient are
  // summed over the batches; for bfloat16 in float32 (dw_sums), rounded once at the end.
  std::vector<compute_t<T>> batch_bias(static_cast<std::size_t>(N)), bias_sums(static_cast<std::size_t>(N));
  std::vector<float> dw_sums(std::is_same_v<T, bfloat16> ? static_cast<std::size_t>(N * width) : 0);
  for (std::int64_t b = 0; b < B; ++b) {
    const T* dy_b = dyp + b * (positions + extra) * N;
    const std::int64_t x_offset = b * rows.batch * width, ld = rows.position * width;
    if constexpr (std::is_same_v<T, bfloat16>)
      gemm(N, width, positions, transposed(dy_b, N), plain(xp + x_offset, ld),
           GemmOutput<float>{dw_sums.data(), width, b > 0});
    else gemm<T>(N, width, positions, transposed(dy_b, N), plain(xp + x_offset, ld), GemmOutput<T>{dw, width, b > 0});
    if (dbias) {
      std::fill(batch_bias.begin(), batch_bias.end(), compute_t<T>(0));
      for (std::int64_t t = 0; t < positions; ++t)
        for (std::int64_t n = 0; n < N; ++n) batch_bias[static_cast<std::size_t>(n)] += dy_b[t * N + n];
      for (std::int64_t n = 0; n < N; ++n)
        bias_sums[static_cast<std::size_t>(n)] += batch_bias[static_cast<std::size_t>(n)];
    }
    gemm<T>(positions, width, N, plain(dy_b, N), plain(w, width), overwrite(dxp + x_offset, ld));
  }
  if (dbias)
    for (std::int64_t n = 0; n < N; ++n) dbias[n] = T(bias_sums[static_cast<std::size_t>(n)]);
  if constexpr (std::is_same_v<T, bfloat16>)
    for (std::int64_t e = 0; e < N * width; ++e) dw[e] = dw_sums[static_cast<std::size_t>(e)];
}

// Writes the extra key / value positions after the S keys of each batch: bias_k / bias_v at position S
// (add_bias_kv), then a zero position (add_zero_attn). k: [B, batch_rows, h_kv*d_k], v: [B, batch_rows,
// h_kv*d_v], row b * batch_rows + t for position t of batch b; batch_rows >= S + extra.
template <class T>
void write_extra_positions(const MultiHeadAttention& layer, T* k, T* v, std::int64_t B, std::int64_t batch_rows,
                           std::int64_t S) {
  const auto& c = layer.config();
  const std::int64_t qk = c.num_kv_heads * c.d_k, vw = c.num_kv_heads * c.d_v;  // the key and value widths
  for (std::int64_t b = 0; b < B; ++b) {
    std::int64_t row = b * batch_rows + S;
    if (c.add_bias_kv) {
      std::copy_n(layer.parameter("bias_k").data_as<T>(), qk, k + row * qk);
      std::copy_n(layer.parameter("bias_v").data_as<T>(), vw, v + row * vw);
      ++row;
    }
    if (c.add_zero_attn) {
      std::fill_n(k + row * qk, qk, T(0));
      std::fill_n(v + row * vw, vw, T(0));
    }
  }
}

}  // namespace mha::detail
