// Validation of attention arguments and dispatch to a kernel.
//
// Legend: B batch, h query heads, h_kv key/value heads, L queries, S keys, d_k query/key width, d_v value width.
#include "attention/attention_core.hpp"

#include <cmath>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "attention/flash.hpp"
#include "attention/params.hpp"
#include "attention/reference.hpp"
#include "attention/sinks.hpp"
#include "attention/widening.hpp"
#include "dtype_dispatch.hpp"
#include "gemm.hpp"
#include "logit_scalars.hpp"
#include "mha/error.hpp"

namespace mha::detail {

namespace {

[[noreturn]] void fail(const std::string& message) { throw Error(message); }

std::string describe(const TensorView& t) { return std::string(dtype_name(t.dtype())) + " " + shape_str(t.shape()); }

// A float mask added to the logits has q's dtype; with bfloat16 q it may also be float32 (the dtype the
// logits are computed in).
bool additive_mask_dtype_ok(DType mask, DType q) {
  return mask == q || (q == DType::BFloat16 && mask == DType::Float32);
}
std::string additive_mask_dtypes(DType q) {
  return q == DType::BFloat16 ? "bfloat16 or float32 (q is bfloat16)"
                              : std::string(dtype_name(q)) + " (the dtype of q)";
}

void expect_rank(const TensorView& t, const char* name, std::int64_t rank, const char* layout) {
  if (t.rank() != rank)
    fail(std::string(name) + ": expected rank " + std::to_string(rank) + " " + layout + ", got rank " +
         std::to_string(t.rank()) + " " + shape_str(t.shape()));
}

}  // namespace

void validate_score(const ScoreSpec& o, DType dtype, std::int64_t B, std::int64_t h, std::int64_t L, std::int64_t S) {
  if (o.scale && !zero_or_normal(*o.scale, dtype))
    fail("scale: expected 0 or a finite number of magnitude in " + normal_range(dtype) + ", got " +
         number_str(*o.scale));
  if (o.window_left < -1 || o.window_right < -1)
    fail("window: expected extents >= 0, or -1 for unbounded, got window_left = " + std::to_string(o.window_left) +
         ", window_right = " + std::to_string(o.window_right));
  if (o.alibi_slopes) {
    const TensorView& a = *o.alibi_slopes;
    if (a.dtype() != DType::Float32 && a.dtype() != DType::Float64)
      fail("alibi_slopes: expected float32 or float64 [h], got " + describe(a));
    if (a.shape() != Shape{h})
      fail("alibi_slopes: expected one slope per query head, [h] = " + shape_str({h}) + ", got " +
           shape_str(a.shape()));
    for (std::int64_t head = 0; head < h; ++head) {
      const double slope = per_head_value(a, head);
      if (!zero_or_normal(slope, dtype))
        fail("alibi_slopes: expected each slope 0 or a finite number of magnitude in " + normal_range(dtype) +
             ", got " + number_str(slope) + " for head " + std::to_string(head));
    }
  }
  if (o.sinks) validate_sinks(*o.sinks, dtype, h);
  if (!(o.softcap >= 0.0 && zero_or_normal(o.softcap, dtype)))
    fail("softcap: expected 0 (none) or a finite number in " + normal_range(dtype) + ", got " + number_str(o.softcap));
  if (o.key_padding_mask) {
    const TensorView& m = *o.key_padding_mask;
    if (m.dtype() != DType::Bool && !additive_mask_dtype_ok(m.dtype(), dtype))
      fail(std::string("key_padding_mask: expected bool (true = padding) or ") + additive_mask_dtypes(dtype) +
           " (added to the logits), got " + describe(m));
    if (m.shape() != Shape{B, S})
      fail("key_padding_mask: expected shape [B, S] = " + shape_str({B, S}) + ", got " + shape_str(m.shape()));
  }
  if (!o.key_lengths.empty()) {
    if (static_cast<std::int64_t>(o.key_lengths.size()) != B)
      fail("key_lengths: expected B = " + std::to_string(B) + " lengths, got " + std::to_string(o.key_lengths.size()));
    for (std::size_t b = 0; b < o.key_lengths.size(); ++b)
      if (o.key_lengths[b] < 0 || o.key_lengths[b] > S)
        fail("key_lengths: expected each length in [0, S = " + std::to_string(S) + "], got " +
             std::to_string(o.key_lengths[b]) + " for batch " + std::to_string(b));
  }
  if (o.attn_mask) {
    const TensorView& m = *o.attn_mask;
    if (m.dtype() != DType::Bool && !additive_mask_dtype_ok(m.dtype(), dtype))
      fail(std::string("attn_mask: expected bool or ") + additive_mask_dtypes(dtype) + ", got " + describe(m));
    const bool ok = (m.rank() == 2 && m.shape() == Shape{L, S}) || (m.rank() == 3 && m.shape() == Shape{B * h, L, S});
    if (!ok)
      fail("attn_mask: expected shape [L, S] = " + shape_str({L, S}) + " or [B*h, L, S] = " + shape_str({B * h, L, S}) +
           ", got " + shape_str(m.shape()));
  }
}

void validate_attention(const TensorView& q, const TensorView& k, const TensorView& v, const AttentionOptions& o) {
  expect_rank(q, "q", 4, "[B, h, L, d_k]");
  expect_rank(k, "k", 4, "[B, h_kv, S, d_k]");
  expect_rank(v, "v", 4, "[B, h_kv, S, d_v]");
  if (!is_floating(q.dtype())) fail(std::string("q: expected ") + floating_dtype_names() + ", got " + describe(q));
  if (k.dtype() != q.dtype()) fail(std::string("k: expected ") + dtype_name(q.dtype()) + " like q, got " + describe(k));
  if (v.dtype() != q.dtype()) fail(std::string("v: expected ") + dtype_name(q.dtype()) + " like q, got " + describe(v));

  const std::int64_t B = q.size(0), h = q.size(1), L = q.size(2), d_k = q.size(3), S = k.size(2);
  const std::int64_t h_kv = k.size(1);
  if (k.size(0) != B || k.size(3) != d_k)
    fail("k: expected [B, h_kv, S, d_k] = [" + std::to_string(B) + ", h_kv, S, " + std::to_string(d_k) +
         "] to match q " + shape_str(q.shape()) + ", got " + shape_str(k.shape()));
  if (h_kv < 1 ? h != 0 : (h_kv > h || h % h_kv != 0))
    fail("k: expected a number of key/value heads h_kv that divides q's h = " + std::to_string(h) +
         " (h_kv = h; fewer for grouped-query attention, 1 for multi-query), got h_kv = " + std::to_string(h_kv) +
         " in k " + shape_str(k.shape()));
  if (v.size(0) != B || v.size(1) != h_kv || v.size(2) != S)
    fail("v: expected [B, h_kv, S, d_v] = [" + std::to_string(B) + ", " + std::to_string(h_kv) + ", " +
         std::to_string(S) + ", d_v] to match q and k, got " + shape_str(v.shape()));
  if (d_k < 1) fail("q: expected d_k >= 1, got shape " + shape_str(q.shape()));

  if (!(o.dropout_p >= 0.0 && o.dropout_p < 1.0))
    fail("dropout_p: expected a probability in [0, 1), got " + std::to_string(o.dropout_p));
  if (o.dropout_query_offset < 0 || o.dropout_key_offset < 0)
    fail("dropout_query_offset, dropout_key_offset: expected positions >= 0, got " +
         std::to_string(o.dropout_query_offset) + ", " + std::to_string(o.dropout_key_offset));
  validate_score(o, q.dtype(), B, h, L, S);
}

namespace {

template <class U>
Strided4<const U> strided4(const TensorView& t) {
  Strided4<const U> s;
  s.data = t.data_as<U>();
  for (int d = 0; d < 4; ++d) s.stride[d] = t.stride(d);
  return s;
}

// An [L, S] or [B*h, L, S] mask viewed as [B, h, L, S] by broadcast strides.
template <class U>
Strided4<const U> mask4(const TensorView& m, std::int64_t h) {
  Strided4<const U> s;
  s.data = m.data_as<U>();
  if (m.rank() == 2) {
    s.stride[2] = m.stride(0);
    s.stride[3] = m.stride(1);
  } else {
    s.stride[0] = h * m.stride(0);
    s.stride[1] = m.stride(0);
    s.stride[2] = m.stride(1);
    s.stride[3] = m.stride(2);
  }
  return s;
}

// The parameters shared by forward and backward: sizes, q, k, v, scale, masks, dropout, and where the
// queries sit relative to the keys (query_shift: S - L, bottom-right aligned, unless given).
template <class T>
void fill_common(AttentionInputs<T>& p, const TensorView& q, const TensorView& k, const TensorView& v,
                 const AttentionOptions& o, std::optional<std::int64_t> query_shift) {
  p.B = q.size(0), p.h = q.size(1), p.h_kv = k.size(1), p.L = q.size(2), p.d_k = q.size(3), p.S = k.size(2),
  p.d_v = v.size(3);
  p.query_shift = query_shift ? *query_shift : p.S - p.L;
  p.q = strided4<T>(q);
  p.k = strided4<T>(k);
  p.v = strided4<T>(v);
  using Acc = compute_t<T>;  // masks reach here in it (with_compute_masks)
  p.scale = static_cast<Acc>(o.scale ? *o.scale : 1.0 / std::sqrt(static_cast<double>(p.d_k)));
  p.causal = o.causal;
  if (o.key_padding_mask) {  // bool: padding; float: added to the logits of each key
    const TensorView& m = *o.key_padding_mask;
    auto columns = [&](auto& s) {
      s.stride[0] = m.stride(0);
      s.stride[3] = m.stride(1);
    };
    if (m.dtype() == DType::Bool) p.key_padding.data = m.data_as<std::uint8_t>(), columns(p.key_padding);
    else p.key_bias.data = m.data_as<Acc>(), columns(p.key_bias);
  }
  if (!o.key_lengths.empty()) p.key_lengths = o.key_lengths.data();
  p.window_left = o.window_left, p.window_right = o.window_right;
  p.softcap = static_cast<Acc>(o.softcap);
  if (o.alibi_slopes) p.alibi_slopes = o.alibi_slopes->data_as<Acc>();  // contiguous (with_compute_masks)
  if (o.sinks) p.sinks = o.sinks->data_as<Acc>();                       // likewise
  if (o.attn_mask) {
    if (o.attn_mask->dtype() == DType::Bool) p.bool_mask = mask4<std::uint8_t>(*o.attn_mask, p.h);
    else p.additive_mask = mask4<Acc>(*o.attn_mask, p.h);
  }
  p.dropout_p = static_cast<Acc>(o.dropout_p);
  p.dropout_seed = o.dropout_seed;
  p.dropout_query_offset = o.dropout_query_offset;
  p.dropout_key_offset = o.dropout_key_offset;
}

template <class T>
Strided4<T> strided_output(const StridedOutput& o) {
  Strided4<T> s;
  s.data = static_cast<T*>(o.data);
  for (int d = 0; d < 4; ++d) s.stride[d] = o.strides[static_cast<std::size_t>(d)];
  return s;
}

// The dtype the kernels read float masks and write the log-sum-exp in: float32 for bfloat16 inputs.
DType compute_dtype(DType dtype) { return dtype == DType::BFloat16 ? DType::Float32 : dtype; }

// The options with their float masks in the compute dtype: converted copies (in `storage`) of those
// that are not (bfloat16 masks of bfloat16 inputs), and the ALiBi slopes and sinks contiguous in it.
AttentionOptions with_compute_masks(const AttentionOptions& o, DType compute, Tensor (&storage)[4]) {
  AttentionOptions converted = o;
  auto convert = [&](std::optional<TensorView>& mask, Tensor& copy) {
    if (!mask || mask->dtype() == DType::Bool || mask->dtype() == compute) return;
    copy = Tensor::copy_of(*mask, compute);
    mask = copy.view();
  };
  convert(converted.key_padding_mask, storage[0]);
  convert(converted.attn_mask, storage[1]);
  if (o.alibi_slopes) {
    storage[2] = Tensor::copy_of(*o.alibi_slopes, compute);
    converted.alibi_slopes = storage[2].view();
  }
  if (o.sinks) {
    storage[3] = Tensor::copy_of(*o.sinks, compute);
    converted.sinks = storage[3].view();
  }
  return converted;
}

template <class T>
void run_typed(const TensorView& q, const TensorView& k, const TensorView& v, const AttentionOptions& o,
               const StridedOutput& out, Tensor& weights, Tensor& lse, bool partial_over_keys,
               std::optional<std::int64_t> query_shift);

// bfloat16 attention computed in float32: the inputs widened (exactly), the float32 kernel run, its
// results rounded to bfloat16 once. The reference kernel runs so for bfloat16 inputs, and so does the
// fused kernel where this process's bfloat16 products run on sgemm (runs_in_float32).
void forward_in_float32(const TensorView& q, const TensorView& k, const TensorView& v, const AttentionOptions& o,
                        const StridedOutput& out, Tensor& weights, Tensor& lse, bool partial_over_keys,
                        std::optional<std::int64_t> query_shift) {
  const Tensor q32 = widened(q), k32 = widened(k), v32 = widened(v);
  Tensor out32(DType::Float32, {q.size(0), q.size(1), q.size(2), v.size(3)}), weights32;
  run_typed<float>(q32, k32, v32, o, {out32.data(), out32.strides()}, weights32, lse, partial_over_keys, query_shift);
  round_into(out32, out);
  if (weights32.defined()) weights = Tensor::copy_of(weights32, DType::BFloat16);
}

// Whether bfloat16 attention runs as float32 (forward_in_float32, backward_in_float32): always on the
// reference kernel; on the fused kernel where this process's bfloat16 products run on sgemm over widened
// operands (gemm.hpp's bf16_gemm_path). There the bfloat16 kernel would widen every tile's operands again,
// each K/V block once per query block, and round P (and dS) to bfloat16 and widen it back: measured on a
// Zen 5 with the path forced, its core ran at 0.84-0.90x of the float32 kernel's speed (issue 32). Widened
// once per call instead, the float32 kernel runs on them, its P and dS never rounded: more accurate than
// the bfloat16 products' path, at the float32 kernel's speed plus the widening.
bool fused_bf16_in_float32() { return bf16_gemm_path() == Bf16Path::WidenedSgemm; }
bool runs_in_float32(bool flash) { return !flash || fused_bf16_in_float32(); }

template <class T>
void run_typed(const TensorView& q, const TensorView& k, const TensorView& v, const AttentionOptions& o,
               const StridedOutput& out, Tensor& weights, Tensor& lse, bool partial_over_keys,
               std::optional<std::int64_t> query_shift) {
  const bool flash = o.kernel == Kernel::Flash && v.size(3) > 0;  // d_v = 0: nothing to tile
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (runs_in_float32(flash))
      return forward_in_float32(q, k, v, o, out, weights, lse, partial_over_keys, query_shift);
  }
  AttentionParams<T> p;
  fill_common(p, q, k, v, o, query_shift);
  p.partial_over_keys = partial_over_keys;
  if (partial_over_keys) p.sinks = nullptr;  // the caller's merge adds the sink once
  p.out = strided_output<T>(out);
  if (o.need_weights) {
    weights = Tensor::uninitialized(dtype_of<T>(), {p.B, p.h, p.L, p.S});  // written whole by the kernels
    p.weights = weights.data_as<T>();
  }
  if (o.need_lse) {
    lse = Tensor::uninitialized(dtype_of<compute_t<T>>(), {p.B, p.h, p.L});
    p.lse = lse.data_as<compute_t<T>>();
  }
  if constexpr (std::is_same_v<T, double>) {
    reference_attention_forward(p);
  } else {
    if (flash) return flash_attention_forward(p);
    if constexpr (std::is_same_v<T, float>) reference_attention_forward(p);
  }
}

void backward_in_float32(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                         const TensorView& out, const TensorView& lse, const AttentionOptions& o,
                         const StridedOutput& dq, const StridedOutput& dk, const StridedOutput& dv,
                         std::optional<std::int64_t> query_shift);

// The backward's parameter object for inputs of type T (the lse in compute_t<T>).
template <class T>
AttentionBackwardParams<T> backward_params(const TensorView& dout, const TensorView& q, const TensorView& k,
                                           const TensorView& v, const TensorView& out, const TensorView& lse,
                                           const AttentionOptions& o, const StridedOutput& dq, const StridedOutput& dk,
                                           const StridedOutput& dv, std::optional<std::int64_t> query_shift) {
  AttentionBackwardParams<T> p;
  fill_common(p, q, k, v, o, query_shift);
  p.dout = strided4<T>(dout);
  p.o = strided4<T>(out);
  p.lse_in.data = lse.data_as<compute_t<T>>();
  for (int d = 0; d < 3; ++d) p.lse_in.stride[d] = lse.stride(d);
  p.dq = strided_output<T>(dq);
  p.dk = strided_output<T>(dk);
  p.dv = strided_output<T>(dv);
  return p;
}

template <class T>
void run_backward_typed(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& lse, const AttentionOptions& o,
                        const StridedOutput& dq, const StridedOutput& dk, const StridedOutput& dv,
                        std::optional<std::int64_t> shift) {
  // d_v = 0, L = 0 or S = 0: nothing to tile (and the reference zeroes what has no gradient)
  const bool flash = o.kernel == Kernel::Flash && v.size(3) > 0 && q.size(2) > 0 && k.size(2) > 0;
  if constexpr (std::is_same_v<T, double>) {
    reference_attention_backward(backward_params<T>(dout, q, k, v, out, lse, o, dq, dk, dv, shift));
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    if (runs_in_float32(flash)) return backward_in_float32(dout, q, k, v, out, lse, o, dq, dk, dv, shift);
    flash_attention_backward(backward_params<T>(dout, q, k, v, out, lse, o, dq, dk, dv, shift));
  } else if (flash) {
    flash_attention_backward(backward_params<T>(dout, q, k, v, out, lse, o, dq, dk, dv, shift));
  } else {
    reference_attention_backward(backward_params<T>(dout, q, k, v, out, lse, o, dq, dk, dv, shift));
  }
}

// The backward of forward_in_float32: bfloat16 inputs widened, the float32 kernel run, the gradients
// rounded to bfloat16 once (runs_in_float32 says when).
void backward_in_float32(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                         const TensorView& out, const TensorView& lse, const AttentionOptions& o,
                         const StridedOutput& dq, const StridedOutput& dk, const StridedOutput& dv,
                         std::optional<std::int64_t> query_shift) {
  const Tensor dout32 = widened(dout), q32 = widened(q), k32 = widened(k), v32 = widened(v), out32 = widened(out);
  Tensor dq32(DType::Float32, q.shape()), dk32(DType::Float32, k.shape()), dv32(DType::Float32, v.shape());
  run_backward_typed<float>(dout32, q32, k32, v32, out32, lse, o, {dq32.data(), dq32.strides()},
                            {dk32.data(), dk32.strides()}, {dv32.data(), dv32.strides()}, query_shift);
  round_into(dq32, dq);
  round_into(dk32, dk);
  round_into(dv32, dv);
}

}  // namespace

void validate_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
                                 const TensorView& out, const TensorView& lse, const AttentionOptions& o) {
  validate_attention(q, k, v, o);
  const Shape out_shape{q.size(0), q.size(1), q.size(2), v.size(3)};
  for (auto [t, name] : {std::pair{&dout, "dout"}, std::pair{&out, "out"}}) {
    if (t->dtype() != q.dtype())
      fail(std::string(name) + ": expected " + dtype_name(q.dtype()) + " like q, got " + describe(*t));
    if (t->shape() != out_shape)
      fail(std::string(name) + ": expected shape [B, h, L, d_v] = " + shape_str(out_shape) + ", got " +
           shape_str(t->shape()));
  }
  const Shape lse_shape{q.size(0), q.size(1), q.size(2)};
  if (lse.dtype() != compute_dtype(q.dtype()))
    fail(std::string("lse: expected ") + dtype_name(compute_dtype(q.dtype())) +
         (q.dtype() == DType::BFloat16 ? " (the log-sum-exp of bfloat16 q)" : " like q") + ", got " + describe(lse));
  if (lse.shape() != lse_shape)
    fail("lse: expected shape [B, h, L] = " + shape_str(lse_shape) + ", got " + shape_str(lse.shape()));
}

namespace {

// The kernels' products read q, k, v and dout as matrices of rows [T, d] with unit stride along a row
// and a row stride of at least the row width (oneDNN's sgemm refuses less). Views that are not such
// matrices (a transposed NumPy array; a row stride of 0, as in a broadcast one-query view; rows that
// overlap, as in a sliding window) are copied once into `storage`, contiguous.
bool rows_readable_by_products(const TensorView& t) {
  const bool unit_inner = t.size(3) <= 1 || t.stride(3) == 1;
  return unit_inner && t.stride(2) >= t.size(3);
}

TensorView with_readable_rows(const TensorView& t, Tensor& storage) {
  if (rows_readable_by_products(t)) return t;
  storage = Tensor::copy_of(t);
  return storage.view();
}

}  // namespace

std::string fused_bf16_attention_kernel() {
  return fused_bf16_in_float32() ? "the float32 kernel over q, k, v widened once per call, P and dS in float32"
                                 : "the bf16 kernel, P and dS rounded to bf16 for the products";
}

void run_attention_backward(const TensorView& dout_in, const TensorView& q_in, const TensorView& k_in,
                            const TensorView& v_in, const TensorView& out, const TensorView& lse,
                            const AttentionOptions& o, const StridedOutput& dq, const StridedOutput& dk,
                            const StridedOutput& dv, std::optional<std::int64_t> query_shift) {
  Tensor copies[4];
  const TensorView q = with_readable_rows(q_in, copies[0]);
  const TensorView k = with_readable_rows(k_in, copies[1]);
  const TensorView v = with_readable_rows(v_in, copies[2]);
  const TensorView dout = with_readable_rows(dout_in, copies[3]);
  Tensor masks[4];
  const AttentionOptions oc = with_compute_masks(o, compute_dtype(q.dtype()), masks);
  dispatch_floating(q.dtype(),
                    [&]<class T>(T) { run_backward_typed<T>(dout, q, k, v, out, lse, oc, dq, dk, dv, query_shift); });
}

void run_attention(const TensorView& q_in, const TensorView& k_in, const TensorView& v_in, const AttentionOptions& o,
                   const StridedOutput& out, Tensor& weights, Tensor& lse, bool partial_over_keys,
                   std::optional<std::int64_t> query_shift) {
  Tensor copies[3];
  const TensorView q = with_readable_rows(q_in, copies[0]);
  const TensorView k = with_readable_rows(k_in, copies[1]);
  const TensorView v = with_readable_rows(v_in, copies[2]);
  Tensor masks[4];
  const AttentionOptions oc = with_compute_masks(o, compute_dtype(q.dtype()), masks);
  dispatch_floating(q.dtype(),
                    [&]<class T>(T) { run_typed<T>(q, k, v, oc, out, weights, lse, partial_over_keys, query_shift); });
}

}  // namespace mha::detail
