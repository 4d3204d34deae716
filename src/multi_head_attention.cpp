// MultiHeadAttention: configuration, parameters (PyTorch's names and layouts), forward.
//
// Legend: B batch, L queries, S keys, E = d_model, h heads, d_k, d_v per-head widths; S' = S plus the
// appended bias_k / zero-attention positions. "Rows" are the flattened (batch, position) pairs of an
// input in its own order: batch_first [B, T, *] has row b*T + t, sequence-first [T, B, *] row t*B + b.
#include "mha/multi_head_attention.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>

#include "attention/attention_core.hpp"
#include "attention/dropout.hpp"
#include "linear.hpp"
#include "mha/error.hpp"
#include "random_init.hpp"

namespace mha {

namespace {

[[noreturn]] void fail(const std::string& message) { throw Error(message); }

std::string str(std::int64_t v) { return std::to_string(v); }

MultiHeadAttentionConfig resolve(MultiHeadAttentionConfig c) {
  if (c.num_heads <= 0) fail("num_heads: expected a positive number of heads, got " + str(c.num_heads));
  if (c.d_model <= 0) fail("d_model: expected a positive width, got " + str(c.d_model));
  for (auto [value, name] : {std::pair{&c.d_k, "d_k"}, std::pair{&c.d_v, "d_v"}}) {
    if (*value < 0) fail(std::string(name) + ": expected a positive width or 0 for d_model / num_heads, got " + str(*value));
    if (*value == 0) {
      if (c.d_model % c.num_heads != 0)
        fail("d_model: expected a multiple of num_heads = " + str(c.num_heads) + " when " + name +
             " is not set, got " + str(c.d_model));
      *value = c.d_model / c.num_heads;
    }
  }
  for (auto [value, name] : {std::pair{&c.kdim, "kdim"}, std::pair{&c.vdim, "vdim"}}) {
    if (*value < 0) fail(std::string(name) + ": expected a positive width or 0 for d_model, got " + str(*value));
    if (*value == 0) *value = c.d_model;
  }
  if (!(c.dropout >= 0.0 && c.dropout < 1.0))
    fail("dropout: expected a probability in [0, 1), got " + std::to_string(c.dropout));
  if (c.dtype != DType::Float32 && c.dtype != DType::Float64)
    fail(std::string("dtype: expected float32 or float64, got ") + dtype_name(c.dtype));
  return c;
}

// Fills t with f() converted to its dtype.
template <class F>
void fill(Tensor& t, F f) {
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const double x = f();
    if (t.dtype() == DType::Float64) t.data_as<double>()[i] = x;
    else t.data_as<float>()[i] = static_cast<float>(x);
  }
}

// xavier_uniform_ for a [fan_out, fan_in] weight: U(-a, a), a = sqrt(6 / (fan_in + fan_out)).
void xavier_uniform(Tensor& w, detail::InitRng& rng) {
  const double bound = std::sqrt(6.0 / static_cast<double>(w.size(0) + w.size(1)));
  fill(w, [&] { return rng.uniform(-bound, bound); });
}

}  // namespace

MultiHeadAttention::MultiHeadAttention(const MultiHeadAttentionConfig& config, std::uint64_t seed)
    : config_(resolve(config)), dropout_seed_(detail::mix64(seed ^ 0x6d68612d64726f70ULL)) {
  const auto& c = config_;
  const std::int64_t E = c.d_model, qk = c.num_heads * c.d_k, vw = c.num_heads * c.d_v;
  detail::InitRng rng(seed);
  auto add = [&](const std::string& name, Shape shape) -> Tensor& {
    return parameters_[name] = Tensor(c.dtype, std::move(shape));
  };
  // Created and initialised in PyTorch's state_dict order.
  if (packed_in_proj()) {
    xavier_uniform(add("in_proj_weight", {2 * qk + vw, E}), rng);
  } else {
    xavier_uniform(add("q_proj_weight", {qk, E}), rng);
    xavier_uniform(add("k_proj_weight", {qk, c.kdim}), rng);
    xavier_uniform(add("v_proj_weight", {vw, c.vdim}), rng);
  }
  if (c.bias) add("in_proj_bias", {2 * qk + vw});  // zeros
  if (c.add_bias_kv) {
    // xavier_normal_ of a [1, 1, n] tensor: fan_in = fan_out = n, so std = sqrt(2 / 2n).
    for (auto [name, n] : {std::pair{"bias_k", qk}, std::pair{"bias_v", vw}}) {
      const double std_dev = std::sqrt(1.0 / static_cast<double>(n));
      fill(add(name, {1, 1, n}), [&] { return std_dev * rng.normal(); });
    }
  }
  // nn.Linear's kaiming_uniform_(a = sqrt(5)) reduces to U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
  const double out_bound = 1.0 / std::sqrt(static_cast<double>(vw));
  fill(add("out_proj.weight", {E, vw}), [&] { return rng.uniform(-out_bound, out_bound); });
  if (c.bias) add("out_proj.bias", {E});  // zeros, as PyTorch's _reset_parameters sets it
}

bool MultiHeadAttention::packed_in_proj() const {
  return config_.kdim == config_.d_model && config_.vdim == config_.d_model && config_.d_k == config_.d_v;
}

std::vector<std::string> MultiHeadAttention::parameter_names() const {
  std::vector<std::string> names;
  for (const char* name : {"in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
                           "bias_k", "bias_v", "out_proj.weight", "out_proj.bias"})
    if (parameters_.count(name)) names.emplace_back(name);
  return names;
}

const Tensor& MultiHeadAttention::parameter(const std::string& name) const {
  auto it = parameters_.find(name);
  if (it == parameters_.end()) {
    std::string known;
    for (const auto& n : parameter_names()) known += (known.empty() ? "" : ", ") + n;
    fail("parameter: no parameter named '" + name + "' in this layer; it has " + known);
  }
  return it->second;
}

Tensor& MultiHeadAttention::mutable_parameter(const std::string& name) {
  return const_cast<Tensor&>(parameter(name));
}

void MultiHeadAttention::set_parameter(const std::string& name, const TensorView& value) {
  Tensor& p = mutable_parameter(name);
  if (value.dtype() == DType::Bool) fail(name + ": expected a float32 or float64 array, got bool");
  if (value.shape() != p.shape())
    fail(name + ": expected shape " + shape_str(p.shape()) + ", got " + shape_str(value.shape()));
  p = Tensor::copy_of(value, config_.dtype);
}

void MultiHeadAttention::load_state_dict(const std::map<std::string, TensorView>& state) {
  // Check everything first, so a failed load changes nothing.
  for (const auto& [name, value] : state) {
    const Tensor& p = parameter(name);
    if (value.dtype() == DType::Bool) fail(name + ": expected a float32 or float64 array, got bool");
    if (value.shape() != p.shape())
      fail(name + ": expected shape " + shape_str(p.shape()) + ", got " + shape_str(value.shape()));
  }
  for (const auto& name : parameter_names())
    if (!state.count(name)) fail("state_dict: missing parameter '" + name + "'");
  for (const auto& [name, value] : state) set_parameter(name, value);
}

std::map<std::string, TensorView> MultiHeadAttention::state_dict() const {
  std::map<std::string, TensorView> views;
  for (const auto& [name, tensor] : parameters_) views.emplace(name, tensor.view());
  return views;
}

namespace {

// Where the rows of an input with T positions live: row (b, t) = b * batch + t * position.
struct RowLayout {
  std::int64_t batch, position;
};

// A projection output [rows, h * width] viewed as [B, h, T, width].
TensorView heads_view(const Tensor& projected, std::int64_t B, std::int64_t h, std::int64_t T,
                      std::int64_t width, RowLayout rows) {
  const std::int64_t W = h * width;
  return TensorView(projected.data(), projected.dtype(), {B, h, T, width},
                    {rows.batch * W, width, rows.position * W, 1});
}

// The user's masks in kernel terms ([B, h, L, S'] with S' = S + extra), owning any tensor it built.
struct KernelMasks {
  AttentionOptions options;
  Tensor attn_mask, key_padding_mask;  // storage for masks built here

  // Points the options at copies owned here, so the masks outlive the caller's arrays.
  void own_views() {
    for (auto [view, storage] : {std::pair{&options.key_padding_mask, &key_padding_mask},
                                 std::pair{&options.attn_mask, &attn_mask}}) {
      if (*view && (*view)->data() != storage->data()) {
        *storage = Tensor::copy_of(**view);
        *view = storage->view();
      }
    }
  }
};

// Pads masks for `extra` appended key positions, which every query may attend to (as PyTorch pads
// attn_mask and key_padding_mask with zeros). Causal is folded into attn_mask, since it concerns the
// S input keys only. options: validated, in terms of the S input keys.
template <class T>
void pad_masks_for_extra_keys(KernelMasks& m, std::int64_t B, std::int64_t h, std::int64_t L, std::int64_t S,
                              std::int64_t extra) {
  AttentionOptions& o = m.options;
  const std::int64_t S2 = S + extra;
  if (o.key_padding_mask || !o.key_lengths.empty()) {
    Tensor padding(DType::Bool, {B, S2});  // [B, S'], extra columns false
    auto* dst = padding.data_as<std::uint8_t>();
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t j = 0; j < S; ++j) {
        bool padded = !o.key_lengths.empty() && j >= o.key_lengths[static_cast<std::size_t>(b)];
        if (o.key_padding_mask) {
          const auto& kpm = *o.key_padding_mask;
          padded = padded || kpm.data_as<std::uint8_t>()[b * kpm.stride(0) + j * kpm.stride(1)] != 0;
        }
        dst[b * S2 + j] = padded;
      }
    m.key_padding_mask = std::move(padding);
    o.key_padding_mask = m.key_padding_mask.view();
    o.key_lengths.clear();
  }
  if (o.attn_mask || o.causal) {
    const bool additive = o.attn_mask && o.attn_mask->dtype() != DType::Bool;
    const std::int64_t N = o.attn_mask && o.attn_mask->rank() == 3 ? B * h : 0;  // 0: a 2-D mask
    Tensor mask(additive ? dtype_of<T>() : DType::Bool, N ? Shape{N, L, S2} : Shape{L, S2});
    for (std::int64_t n = 0; n < std::max<std::int64_t>(N, 1); ++n)
      for (std::int64_t i = 0; i < L; ++i)
        for (std::int64_t j = 0; j < S; ++j) {
          const std::int64_t at = (n * L + i) * S2 + j;
          const bool hidden_by_causal = o.causal && j > i + S - L;
          if (additive) {
            const auto& a = *o.attn_mask;
            const std::int64_t src = (N ? n * a.stride(0) : 0) + i * a.stride(a.rank() - 2) + j * a.stride(a.rank() - 1);
            mask.data_as<T>()[at] = hidden_by_causal ? -std::numeric_limits<T>::infinity() : a.data_as<T>()[src];
          } else {
            bool hidden = hidden_by_causal;
            if (o.attn_mask) {
              const auto& a = *o.attn_mask;
              const std::int64_t src = (N ? n * a.stride(0) : 0) + i * a.stride(a.rank() - 2) + j * a.stride(a.rank() - 1);
              hidden = hidden || a.data_as<std::uint8_t>()[src] != 0;
            }
            mask.data_as<std::uint8_t>()[at] = hidden;
          }
        }
    m.attn_mask = std::move(mask);
    o.attn_mask = m.attn_mask.view();
    o.causal = false;
  }
}

// Projects the rows of x ([B*T, width], contiguous, laid out as `rows` says) with weight w [N, width]
// and bias into y, batch by batch: position t of batch b goes to row b * y_batch_rows + t of y [*, N].
template <class T>
void project_per_batch(const TensorView& x, RowLayout rows, std::int64_t B, std::int64_t positions, const T* w,
                       std::int64_t N, const T* bias, T* y, std::int64_t y_batch_rows) {
  const std::int64_t width = x.shape().back();
  const T* xp = x.data_as<T>();
  for (std::int64_t b = 0; b < B; ++b)
    detail::linear_forward(xp + b * rows.batch * width, rows.position * width, positions, width, w, N, bias,
                           y + b * y_batch_rows * N, N);
}

// Projects the rows of x ([B*T, width], contiguous, laid out as `rows` says) with weight w [N, width]
// and bias into y. extra == 0: y is [B*T, N] in x's row order. extra > 0: y is [B, T + extra, N]
// (batch-first), the appended positions left for the caller.
template <class T>
void project(const TensorView& x, RowLayout rows, std::int64_t B, std::int64_t positions, std::int64_t extra,
             const T* w, std::int64_t N, const T* bias, Tensor& y) {
  const std::int64_t width = x.shape().back();
  if (extra == 0) return detail::linear_forward(x.data_as<T>(), width, B * positions, width, w, N, bias, y.data_as<T>(), N);
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
    detail::gemm<T>(true, false, N, width, B * positions, dyp, N, xp, width, false, dw, width);
    if (dbias) detail::column_sums(dyp, N, B * positions, N, dbias);
    detail::gemm<T>(false, false, B * positions, width, N, dyp, N, w, width, false, dxp, width);
    return;
  }
  // y is [B, positions + extra, N]; x and dx keep the input's row layout.
  std::vector<T> batch_bias(static_cast<std::size_t>(N));
  for (std::int64_t b = 0; b < B; ++b) {
    const T* dy_b = dyp + b * (positions + extra) * N;
    const std::int64_t x_offset = b * rows.batch * width, ld = rows.position * width;
    detail::gemm<T>(true, false, N, width, positions, dy_b, N, xp + x_offset, ld, b > 0, dw, width);
    if (dbias) {
      detail::column_sums(dy_b, N, positions, N, batch_bias.data());
      for (std::int64_t n = 0; n < N; ++n) dbias[n] += batch_bias[static_cast<std::size_t>(n)];
    }
    detail::gemm<T>(false, false, positions, width, N, dy_b, N, w, width, false, dxp + x_offset, ld);
  }
}

template <class T>
struct ProjectionWeights {
  const T *q, *k, *v, *out;                      // [h*d_k, E], [h*d_k, kdim], [h*d_v, vdim], [E, h*d_v]
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
    w.q_bias = in_b, w.k_bias = in_b + qk, w.v_bias = in_b + 2 * qk;
    w.out_bias = layer.parameter("out_proj.bias").data_as<T>();
  }
  return w;
}

}  // namespace

// What a training-mode forward keeps for the backward.

namespace detail {

struct SavedForward {
  std::int64_t B = 0, L = 0, S = 0, extra = 0;
  RowLayout q_rows{}, kv_input_rows{}, kv_rows{};
  Tensor x[3];                          // copies of query, key, value (training mode, or to close gaps)
  TensorView x_view[3];                 // what the projections read: x[i] or the caller's input
  Tensor q_proj, k_proj, v_proj, context, lse;
  KernelMasks masks;                    // in kernel terms, owning their storage
  Shape out_shape;
};

}  // namespace detail

namespace {

// The projections viewed per head, and the layout of the concatenated heads.
struct HeadViews {
  TensorView q, k, v;   // [B, h, L, d_k], [B, h, S', d_k], [B, h, S', d_v]
  TensorView context;   // [B, h, L, d_v]
  Shape context_strides;
};

HeadViews head_views(const detail::SavedForward& f, const MultiHeadAttentionConfig& c) {
  const std::int64_t h = c.num_heads, S2 = f.S + f.extra;
  HeadViews v;
  v.q = heads_view(f.q_proj, f.B, h, f.L, c.d_k, f.q_rows);
  v.k = heads_view(f.k_proj, f.B, h, S2, c.d_k, f.kv_rows);
  v.v = heads_view(f.v_proj, f.B, h, S2, c.d_v, f.kv_rows);
  v.context = heads_view(f.context, f.B, h, f.L, c.d_v, f.q_rows);
  v.context_strides = v.context.strides();
  return v;
}

// ---- shared by forward() and the cached decoding ------------------------------------------------

std::int64_t extra_positions(const MultiHeadAttentionConfig& c) {
  return (c.add_bias_kv ? 1 : 0) + (c.add_zero_attn ? 1 : 0);
}

// Where the batch and position dimensions of an input lie in the layer's layout: rank 3 is batched
// ([B, T, *] batch_first, else [T, B, *]), rank 2 unbatched [T, *] with B = 1.
struct InputDims {
  bool batched, seq_first;
  int batch_dim, pos_dim;

  InputDims(const MultiHeadAttentionConfig& c, std::int64_t rank)
      : batched(rank == 3), seq_first(batched && !c.batch_first), batch_dim(seq_first ? 1 : 0),
        pos_dim(batched && c.batch_first ? 1 : 0) {}
  std::int64_t batch(const TensorView& t) const { return batched ? t.size(batch_dim) : 1; }
  std::int64_t positions(const TensorView& t) const { return t.size(pos_dim); }
  RowLayout rows(std::int64_t B, std::int64_t T) const { return seq_first ? RowLayout{1, B} : RowLayout{T, 1}; }
};

// Throws unless t has rank 3 (batched) or 2 (unbatched); `positions` and `width` name its dimensions
// in the message ("L", "E").
void check_input_rank(const TensorView& t, const char* name, bool batch_first, const std::string& positions,
                      const std::string& width) {
  if (t.rank() == 2 || t.rank() == 3) return;
  const std::string layout = batch_first ? "[B, " + positions + ", " + width + "] (batch_first)"
                                         : "[" + positions + ", B, " + width + "] (sequence first)";
  fail(std::string(name) + ": expected rank 3 " + layout + " or rank 2 [" + positions + ", " + width +
       "] (unbatched), got rank " + str(t.rank()) + " " + shape_str(t.shape()));
}

void check_dtype(const TensorView& t, const char* name, DType dtype) {
  if (t.dtype() != dtype)
    fail(std::string(name) + ": expected " + dtype_name(dtype) + " (the layer's dtype), got " +
         dtype_name(t.dtype()) + " " + shape_str(t.shape()));
}

void check_width(const TensorView& t, const char* name, std::int64_t width, const char* width_name) {
  if (t.shape().back() != width)
    fail(std::string(name) + ": expected last dimension " + width_name + " = " + str(width) + ", got shape " +
         shape_str(t.shape()));
}

// Throws unless t has the rank of `like`.
void check_same_rank(const TensorView& t, const char* name, const TensorView& like, const char* like_name) {
  if (t.rank() != like.rank())
    fail(std::string(name) + ": expected rank " + str(like.rank()) + " like " + like_name + " " +
         shape_str(like.shape()) + ", got rank " + str(t.rank()) + " " + shape_str(t.shape()));
}

// Throws unless batched t has batch size B, that of `like`.
void check_same_batch(const TensorView& t, const char* name, const InputDims& dims, std::int64_t B,
                      const TensorView& like, const char* like_name) {
  if (dims.batched && t.size(dims.batch_dim) != B)
    fail(std::string(name) + ": expected batch size " + str(B) + " like " + like_name + " " +
         shape_str(like.shape()) + ", got shape " + shape_str(t.shape()));
}

// x when contiguous, else a contiguous copy held in `storage` (the GEMMs read plain [rows, width]).
TensorView contiguous_view(const TensorView& x, Tensor& storage) {
  if (x.is_contiguous()) return x;
  storage = Tensor::copy_of(x);
  return storage.view();
}

// The user's masks over S keys in kernel terms, [B, h, L, S'] with S' = S + the extra positions:
// validated, a float attn_mask of the other float dtype converted, padded for the extra positions.
KernelMasks kernel_masks(const MultiHeadAttentionInputs& in, const MultiHeadAttentionConfig& c, bool batched,
                         std::int64_t B, std::int64_t L, std::int64_t S) {
  const std::int64_t h = c.num_heads;
  KernelMasks masks;
  AttentionOptions& o = masks.options;
  o.causal = in.causal;
  o.key_lengths = in.key_lengths;
  if (in.key_padding_mask) {
    const TensorView& kpm = *in.key_padding_mask;
    if (!batched) {
      if (kpm.rank() != 1 || kpm.size(0) != S)
        fail("key_padding_mask: expected shape [S] = [" + str(S) + "] for unbatched input, got " + shape_str(kpm.shape()));
      o.key_padding_mask = TensorView(kpm.data(), kpm.dtype(), {1, S}, {0, kpm.stride(0)});
    } else {
      o.key_padding_mask = kpm;
    }
  }
  if (in.attn_mask) {
    const TensorView& am = *in.attn_mask;
    if (am.dtype() != DType::Bool && am.dtype() != c.dtype) {  // the other float dtype: convert
      masks.attn_mask = Tensor::copy_of(am, c.dtype);
      o.attn_mask = masks.attn_mask.view();
    } else {
      o.attn_mask = am;
    }
  }
  detail::validate_attention_masks(o, c.dtype, B, h, L, S);
  if (const std::int64_t extra = extra_positions(c)) {
    if (c.dtype == DType::Float64) pad_masks_for_extra_keys<double>(masks, B, h, L, S, extra);
    else pad_masks_for_extra_keys<float>(masks, B, h, L, S, extra);
  }
  return masks;
}

// Writes the extra key / value positions after the S keys of each batch: bias_k / bias_v at position S
// (add_bias_kv), then a zero position (add_zero_attn). k: [B, batch_rows, h*d_k], v: [B, batch_rows,
// h*d_v], row b * batch_rows + t for position t of batch b; batch_rows >= S + extra.
template <class T>
void write_extra_positions(const MultiHeadAttention& layer, T* k, T* v, std::int64_t B, std::int64_t batch_rows,
                           std::int64_t S) {
  const auto& c = layer.config();
  const std::int64_t qk = c.num_heads * c.d_k, vw = c.num_heads * c.d_v;
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

// The weights as forward returns them, from the kernel's per-head [B, h, L, S']: averaged over the
// heads to [B, L, S'] when `average`, without the batch dimension (of 1) when the input was unbatched.
template <class T>
Tensor output_weights(Tensor per_head, bool average, bool batched) {
  Tensor weights = std::move(per_head);
  if (average) {  // mean over heads: [B, h, L, S'] -> [B, L, S']
    const std::int64_t B = weights.size(0), h = weights.size(1), L = weights.size(2), S2 = weights.size(3);
    Tensor mean(weights.dtype(), {B, L, S2});
    const T* p = weights.data_as<T>();
    T* m = mean.data_as<T>();
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t i = 0; i < L * S2; ++i) {
        T sum = 0;
        for (std::int64_t head = 0; head < h; ++head) sum += p[(b * h + head) * L * S2 + i];
        m[b * L * S2 + i] = sum / static_cast<T>(h);
      }
    weights = std::move(mean);
  }
  if (!batched) {  // drop the batch dimension of 1
    Shape s(weights.shape().begin() + 1, weights.shape().end());
    weights = std::move(weights).reshaped(s);
  }
  return weights;
}

// The second half of forward: attends per head, writing heads.context into `context` [rows of query,
// h*d_v] (the concatenated heads), then projects back, out [rows of query, E] = context W_o^T + b_o.
// weights ([B, h, L, S']) and lse ([B, h, L]) are filled when the options ask for them.
template <class T>
void attend_and_project_out(const HeadViews& heads, const AttentionOptions& o, const ProjectionWeights<T>& w,
                            Tensor& context, Tensor& out, Tensor& weights, Tensor& lse) {
  const std::int64_t rows = context.size(0), vw = context.size(1), E = out.shape().back();
  detail::run_attention(heads.q, heads.k, heads.v, o, context.data(), heads.context_strides, weights, lse);
  detail::linear_forward(context.data_as<T>(), vw, rows, vw, w.out, E, w.out_bias, out.data_as<T>(), E);
}

}  // namespace

MultiHeadAttentionOutput MultiHeadAttention::forward(const TensorView& query, const TensorView& key,
                                                     const TensorView& value, const MultiHeadAttentionInputs& in) {
  const auto& c = config_;
  const std::int64_t E = c.d_model, qk = c.num_heads * c.d_k, vw = c.num_heads * c.d_v;

  // ---- validate the inputs --------------------------------------------------------------------
  check_input_rank(query, "query", c.batch_first, "L", "E");
  for (auto [t, name] : {std::pair{&query, "query"}, std::pair{&key, "key"}, std::pair{&value, "value"}}) {
    check_dtype(*t, name, c.dtype);
    check_same_rank(*t, name, query, "query");
  }
  const InputDims dims(c, query.rank());
  const std::int64_t B = dims.batch(query), L = dims.positions(query), S = dims.positions(key);
  for (auto [t, name, width, width_name] :
       {std::tuple{&query, "query", E, "d_model"}, std::tuple{&key, "key", c.kdim, "kdim"},
        std::tuple{&value, "value", c.vdim, "vdim"}}) {
    check_width(*t, name, width, width_name);
    check_same_batch(*t, name, dims, B, query, "query");
  }
  if (dims.positions(value) != S)
    fail("value: expected " + str(S) + " positions like key " + shape_str(key.shape()) + ", got shape " +
         shape_str(value.shape()));

  // ---- masks, in kernel terms [B, h, L, S'] ---------------------------------------------------
  KernelMasks masks = kernel_masks(in, c, dims.batched, B, L, S);
  AttentionOptions& o = masks.options;
  const std::int64_t extra = extra_positions(c), S2 = S + extra;
  o.need_weights = in.need_weights;
  o.kernel = kernel_;
  if (training_ && c.dropout > 0) {
    o.dropout_p = c.dropout;
    o.dropout_seed = detail::mix64(dropout_seed_ + dropout_calls_++);
  }

  // ---- project, attend, project back --------------------------------------------------------
  auto saved = std::make_shared<detail::SavedForward>();
  detail::SavedForward& f = *saved;
  f.B = B, f.L = L, f.S = S, f.extra = extra;
  f.q_rows = dims.rows(B, L);
  f.kv_input_rows = dims.rows(B, S);
  f.kv_rows = extra ? RowLayout{S2, 1} : f.kv_input_rows;
  // Inputs with gaps between rows are copied once so the GEMMs read plain [rows, width] matrices;
  // training mode keeps its own copies for the backward.
  const TensorView* inputs[3] = {&query, &key, &value};
  for (int i = 0; i < 3; ++i) {
    if (training_) {
      f.x[i] = Tensor::copy_of(*inputs[i]);
      f.x_view[i] = f.x[i].view();
    } else {
      f.x_view[i] = contiguous_view(*inputs[i], f.x[i]);
    }
  }
  f.q_proj = Tensor(c.dtype, {B * L, qk});   // [rows of query, h*d_k]
  f.k_proj = Tensor(c.dtype, {B * S2, qk});  // [rows of key (+ extra per batch), h*d_k]
  f.v_proj = Tensor(c.dtype, {B * S2, vw});  // [rows of value (+ extra per batch), h*d_v]
  f.context = Tensor(c.dtype, {B * L, vw});  // [rows of query, h*d_v]: the concatenated heads
  o.need_lse = training_;
  Shape out_shape = query.shape();
  out_shape.back() = E;
  MultiHeadAttentionOutput result;
  result.out = Tensor(c.dtype, out_shape);

  auto run = [&]<class T>(T) {
    const ProjectionWeights<T> w = projection_weights<T>(*this);
    project<T>(f.x_view[0], f.q_rows, B, L, 0, w.q, qk, w.q_bias, f.q_proj);
    project<T>(f.x_view[1], f.kv_input_rows, B, S, extra, w.k, qk, w.k_bias, f.k_proj);
    project<T>(f.x_view[2], f.kv_input_rows, B, S, extra, w.v, vw, w.v_bias, f.v_proj);
    if (extra) write_extra_positions<T>(*this, f.k_proj.data_as<T>(), f.v_proj.data_as<T>(), B, S2, S);
    Tensor weights;
    attend_and_project_out<T>(head_views(f, c), o, w, f.context, result.out, weights, f.lse);
    if (in.need_weights) result.weights = output_weights<T>(std::move(weights), in.average_attn_weights, dims.batched);
  };
  if (c.dtype == DType::Float64) run(double{});
  else run(float{});

  if (training_) {
    f.masks = std::move(masks);
    f.masks.own_views();
    f.out_shape = out_shape;
    saved_ = std::move(saved);
  } else {
    saved_.reset();
  }
  return result;
}

MultiHeadAttentionGradients MultiHeadAttention::backward(const TensorView& dout) {
  if (!saved_)
    fail("backward: no training-mode forward to differentiate; call train() and forward() first");
  const detail::SavedForward& f = *saved_;
  const auto& c = config_;
  const std::int64_t E = c.d_model, qk = c.num_heads * c.d_k, vw = c.num_heads * c.d_v;
  const std::int64_t B = f.B, L = f.L, S = f.S, S2 = f.S + f.extra;
  if (dout.dtype() != c.dtype)
    fail(std::string("dout: expected ") + dtype_name(c.dtype) + " like the output, got " + dtype_name(dout.dtype()));
  if (dout.shape() != f.out_shape)
    fail("dout: expected the output's shape " + shape_str(f.out_shape) + ", got " + shape_str(dout.shape()));
  Tensor dout_copy;
  TensorView dy = dout;
  if (!dy.is_contiguous()) {
    dout_copy = Tensor::copy_of(dout);
    dy = dout_copy.view();
  }

  MultiHeadAttentionGradients g;
  for (const auto& name : parameter_names()) g.parameters[name] = Tensor(c.dtype, parameter(name).shape());
  for (int i = 0; i < 3; ++i) (i == 0 ? g.query : i == 1 ? g.key : g.value) = Tensor(c.dtype, f.x_view[i].shape());
  Tensor dcontext(c.dtype, {B * L, vw});  // [rows of query, h*d_v]
  Tensor dq_proj(c.dtype, {B * L, qk}), dk_proj(c.dtype, {B * S2, qk}), dv_proj(c.dtype, {B * S2, vw});

  auto run = [&]<class T>(T) {
    const ProjectionWeights<T> w = projection_weights<T>(*this);
    auto grad = [&](const char* name) { return g.parameters.at(name).template data_as<T>(); };
    const T* dy_p = dy.data_as<T>();
    // Output projection. Forward: out = context W_o^T + b_o.
    if (c.bias) detail::column_sums(dy_p, E, B * L, E, grad("out_proj.bias"));
    detail::gemm<T>(true, false, E, vw, B * L, dy_p, E, f.context.data_as<T>(), vw, false, grad("out_proj.weight"), vw);
    detail::gemm<T>(false, false, B * L, vw, E, dy_p, E, w.out, vw, false, dcontext.data_as<T>(), vw);

    // Attention core. Forward: context = Attention(q_proj, k_proj, v_proj) per head.
    const HeadViews heads = head_views(f, c);
    const TensorView dcontext_heads(dcontext.data(), c.dtype, heads.context.shape(), heads.context_strides);
    detail::run_attention_backward(dcontext_heads, heads.q, heads.k, heads.v, heads.context, f.lse.view(), f.masks.options,
                                   {dq_proj.data(), heads.q.strides()}, {dk_proj.data(), heads.k.strides()},
                                   {dv_proj.data(), heads.v.strides()});
    if (c.add_bias_kv) {  // forward: k_proj[b, S] = bias_k, v_proj[b, S] = bias_v for every b
      T* dbias_k = grad("bias_k");
      T* dbias_v = grad("bias_v");
      for (std::int64_t b = 0; b < B; ++b) {
        for (std::int64_t n = 0; n < qk; ++n) dbias_k[n] += dk_proj.data_as<T>()[(b * S2 + S) * qk + n];
        for (std::int64_t n = 0; n < vw; ++n) dbias_v[n] += dv_proj.data_as<T>()[(b * S2 + S) * vw + n];
      }
    }

    // Input projections. Forward: q_proj = query W_q^T + b_q (likewise k, v).
    T* dw = packed_in_proj() ? grad("in_proj_weight") : nullptr;
    T* db = c.bias ? grad("in_proj_bias") : nullptr;
    project_backward<T>(dq_proj, f.x_view[0], f.q_rows, B, L, 0, w.q, qk, dw ? dw : grad("q_proj_weight"),
                        db, g.query);
    project_backward<T>(dk_proj, f.x_view[1], f.kv_input_rows, B, S, f.extra, w.k, qk,
                        dw ? dw + qk * E : grad("k_proj_weight"), db ? db + qk : nullptr, g.key);
    project_backward<T>(dv_proj, f.x_view[2], f.kv_input_rows, B, S, f.extra, w.v, vw,
                        dw ? dw + 2 * qk * E : grad("v_proj_weight"), db ? db + 2 * qk : nullptr, g.value);
  };
  if (c.dtype == DType::Float64) run(double{});
  else run(float{});
  return g;
}

// ---- incremental decoding -----------------------------------------------------------------------

namespace {

// The first append allocates room for at least this many positions, so that short decodes do not
// regrow at every step; beyond it the capacity doubles.
constexpr std::int64_t kMinCacheCapacity = 16;

// "h = 2, d_k = 4, d_v = 4, float64, add_bias_kv": what a cache and its layer must agree on.
std::string cache_signature(std::int64_t h, std::int64_t d_k, std::int64_t d_v, DType dtype, bool add_bias_kv,
                            bool add_zero_attn) {
  return "h = " + str(h) + ", d_k = " + str(d_k) + ", d_v = " + str(d_v) + ", " + dtype_name(dtype) +
         (add_bias_kv ? ", add_bias_kv" : "") + (add_zero_attn ? ", add_zero_attn" : "");
}

}  // namespace

void KeyValueCache::reserve(std::int64_t positions) {
  if (positions <= capacity_) return;
  const std::int64_t capacity = std::max({positions, 2 * capacity_, kMinCacheCapacity});
  const std::int64_t qk = num_heads_ * d_k_, vw = num_heads_ * d_v_;
  Tensor keys(dtype_, {batch_, capacity, qk}), values(dtype_, {batch_, capacity, vw});
  if (length_ > 0) {  // copy the rows held, batch by batch (the extra positions are rewritten by append)
    const std::size_t elem = dtype_size(dtype_);
    for (auto [to, from, width] : {std::tuple{&keys, &keys_, qk}, std::tuple{&values, &values_, vw}}) {
      const std::size_t old_batch = static_cast<std::size_t>(capacity_ * width) * elem;
      const std::size_t new_batch = static_cast<std::size_t>(capacity * width) * elem;
      for (std::int64_t b = 0; b < batch_; ++b)
        std::memcpy(static_cast<std::byte*>(to->data()) + static_cast<std::size_t>(b) * new_batch,
                    static_cast<const std::byte*>(from->data()) + static_cast<std::size_t>(b) * old_batch,
                    static_cast<std::size_t>(length_ * width) * elem);
    }
  }
  keys_ = std::move(keys);
  values_ = std::move(values);
  capacity_ = capacity;
}

void MultiHeadAttention::check_cache_layer(const KeyValueCache& cache) const {
  const auto& c = config_;
  if (cache.num_heads_ != c.num_heads || cache.d_k_ != c.d_k || cache.d_v_ != c.d_v || cache.dtype_ != c.dtype ||
      cache.add_bias_kv_ != c.add_bias_kv || cache.add_zero_attn_ != c.add_zero_attn)
    fail("cache: filled by a layer with " +
         cache_signature(cache.num_heads_, cache.d_k_, cache.d_v_, cache.dtype_, cache.add_bias_kv_,
                         cache.add_zero_attn_) +
         ", but this layer has " + cache_signature(c.num_heads, c.d_k, c.d_v, c.dtype, c.add_bias_kv, c.add_zero_attn) +
         "; use one cache per layer");
  if (c.add_bias_kv && cache.length_ > 0) {  // position `length` of batch 0 holds the appending layer's bias_k / bias_v
    const std::size_t elem = dtype_size(c.dtype);
    const std::size_t qk = static_cast<std::size_t>(c.num_heads * c.d_k), vw = static_cast<std::size_t>(c.num_heads * c.d_v);
    const auto* k_row = static_cast<const std::byte*>(cache.keys_.data()) + static_cast<std::size_t>(cache.length_) * qk * elem;
    const auto* v_row = static_cast<const std::byte*>(cache.values_.data()) + static_cast<std::size_t>(cache.length_) * vw * elem;
    if (std::memcmp(k_row, parameter("bias_k").data(), qk * elem) != 0 ||
        std::memcmp(v_row, parameter("bias_v").data(), vw * elem) != 0)
      fail("cache: its bias_k / bias_v differ from this layer's: it was filled by another layer, or the "
           "parameters changed since its last append");
  }
}

void MultiHeadAttention::append_to_cache(KeyValueCache& cache, const TensorView& key, const TensorView& value) const {
  const auto& c = config_;
  const std::int64_t h = c.num_heads, qk = h * c.d_k, vw = h * c.d_v;

  // ---- validate (nothing changes before this is done) ------------------------------------------
  check_input_rank(key, "key", c.batch_first, "S_new", "kdim");
  check_dtype(key, "key", c.dtype);
  check_dtype(value, "value", c.dtype);
  check_same_rank(value, "value", key, "key");
  const InputDims dims(c, key.rank());
  const std::int64_t B = dims.batch(key), S_new = dims.positions(key);
  check_width(key, "key", c.kdim, "kdim");
  check_width(value, "value", c.vdim, "vdim");
  check_same_batch(value, "value", dims, B, key, "key");
  if (dims.positions(value) != S_new)
    fail("value: expected " + str(S_new) + " positions like key " + shape_str(key.shape()) + ", got shape " +
         shape_str(value.shape()));
  if (S_new < 1) fail("key: expected at least one position to append, got shape " + shape_str(key.shape()));
  if (cache.length_ > 0) {
    check_cache_layer(cache);
    if (B != cache.batch_)
      fail("key: expected batch size " + str(cache.batch_) + " like the cache's (cache.batch()), got shape " +
           shape_str(key.shape()));
  } else {  // an empty cache (new or cleared) starts over with this layer and batch size
    const bool storage_fits = cache.batch_ == B && cache.dtype_ == c.dtype && cache.num_heads_ * cache.d_k_ == qk &&
                              cache.num_heads_ * cache.d_v_ == vw;
    if (!storage_fits) cache = KeyValueCache{};
    cache.batch_ = B, cache.num_heads_ = h, cache.d_k_ = c.d_k, cache.d_v_ = c.d_v, cache.dtype_ = c.dtype;
    cache.add_bias_kv_ = c.add_bias_kv, cache.add_zero_attn_ = c.add_zero_attn;
  }

  // ---- project into rows [length, length + S_new) of every batch, then the extra positions -------
  const std::int64_t S0 = cache.length_, S1 = S0 + S_new;
  cache.reserve(S1 + extra_positions(c));
  Tensor copies[2];
  const TensorView k_in = contiguous_view(key, copies[0]), v_in = contiguous_view(value, copies[1]);
  const RowLayout rows = dims.rows(B, S_new);
  auto run = [&]<class T>(T) {
    const ProjectionWeights<T> w = projection_weights<T>(*this);
    T* keys = cache.keys_.data_as<T>();      // [B, capacity, h*d_k]
    T* values = cache.values_.data_as<T>();  // [B, capacity, h*d_v]
    project_per_batch<T>(k_in, rows, B, S_new, w.k, qk, w.k_bias, keys + S0 * qk, cache.capacity_);
    project_per_batch<T>(v_in, rows, B, S_new, w.v, vw, w.v_bias, values + S0 * vw, cache.capacity_);
    write_extra_positions<T>(*this, keys, values, B, cache.capacity_, S1);
  };
  if (c.dtype == DType::Float64) run(double{});
  else run(float{});
  cache.length_ = S1;
}

MultiHeadAttentionOutput MultiHeadAttention::forward_cached(const TensorView& query, const KeyValueCache& cache,
                                                            const MultiHeadAttentionInputs& in) const {
  const auto& c = config_;
  const std::int64_t E = c.d_model, h = c.num_heads, qk = h * c.d_k, vw = h * c.d_v;

  // ---- validate the inputs --------------------------------------------------------------------
  if (cache.length_ == 0)
    fail("cache: empty (length 0); append_to_cache() the keys and values of at least one position first");
  check_cache_layer(cache);
  check_input_rank(query, "query", c.batch_first, "L_new", "E");
  check_dtype(query, "query", c.dtype);
  check_width(query, "query", E, "d_model");
  const InputDims dims(c, query.rank());
  const std::int64_t B = dims.batch(query), L = dims.positions(query), S = cache.length_;
  const std::int64_t S2 = S + extra_positions(c);
  if (B != cache.batch_)
    fail("query: expected batch size " + str(cache.batch_) + " like the cache's (cache.batch()), got shape " +
         shape_str(query.shape()));

  // ---- masks over the cache's S positions, in kernel terms [B, h, L, S'] ----------------------
  KernelMasks masks = kernel_masks(in, c, dims.batched, B, L, S);
  AttentionOptions& o = masks.options;
  o.need_weights = in.need_weights;
  o.kernel = kernel_;  // evaluation mode: no dropout, no log-sum-exps

  // ---- project the queries, attend to the cache in place, project back -------------------------
  Tensor query_copy;
  const TensorView q_in = contiguous_view(query, query_copy);
  const RowLayout q_rows = dims.rows(B, L), cache_rows{cache.capacity_, 1};
  Tensor q_proj(c.dtype, {B * L, qk});    // [rows of query, h*d_k]
  Tensor context(c.dtype, {B * L, vw});   // [rows of query, h*d_v]: the concatenated heads
  Shape out_shape = query.shape();
  out_shape.back() = E;
  MultiHeadAttentionOutput result;
  result.out = Tensor(c.dtype, out_shape);

  auto run = [&]<class T>(T) {
    const ProjectionWeights<T> w = projection_weights<T>(*this);
    project<T>(q_in, q_rows, B, L, 0, w.q, qk, w.q_bias, q_proj);
    HeadViews heads;
    heads.q = heads_view(q_proj, B, h, L, c.d_k, q_rows);                 // [B, h, L, d_k]
    heads.k = heads_view(cache.keys_, B, h, S2, c.d_k, cache_rows);       // [B, h, S', d_k]
    heads.v = heads_view(cache.values_, B, h, S2, c.d_v, cache_rows);     // [B, h, S', d_v]
    heads.context = heads_view(context, B, h, L, c.d_v, q_rows);          // [B, h, L, d_v]
    heads.context_strides = heads.context.strides();
    Tensor weights, lse;
    attend_and_project_out<T>(heads, o, w, context, result.out, weights, lse);
    if (in.need_weights) result.weights = output_weights<T>(std::move(weights), in.average_attn_weights, dims.batched);
  };
  if (c.dtype == DType::Float64) run(double{});
  else run(float{});
  return result;
}

}  // namespace mha
