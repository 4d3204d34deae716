// MultiHeadAttention's forward and backward: project, attend per head, project back; and the
// gradients of all of it, in reverse order, from what a training-mode forward keeps.
//
// Legend: B batch, L queries, S keys, E = d_model, h heads, d_k, d_v per-head widths; S' = S plus the
// appended bias_k / zero-attention positions. "Rows" are the flattened (batch, position) pairs of an
// input in its own order (see layer/inputs.hpp).
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "attention/sinks.hpp"
#include "dtype_dispatch.hpp"
#include "layer/attend.hpp"
#include "layer/buffer_pool.hpp"
#include "layer/fingerprint.hpp"
#include "layer/head_gate.hpp"
#include "layer/inputs.hpp"
#include "layer/masks.hpp"
#include "layer/projections.hpp"
#include "layer/rotary_heads.hpp"
#include "layer/unseen_keys.hpp"
#include "mha/error.hpp"
#include "mha/multi_head_attention.hpp"
#include "splitmix64.hpp"

namespace mha {

namespace detail {

// What a training-mode forward keeps for the backward.
struct SavedForward {
  std::int64_t B = 0, L = 0, S = 0, extra = 0;
  RowLayout q_rows{}, kv_input_rows{}, kv_rows{};
  Tensor x[3];                        // copies of query, key, value (training mode, or to close gaps)
  TensorView x_view[3];               // what the projections read: x[i], x[source[i]] or the caller's input
  int source[3] = {0, 1, 2};          // the first role passed the same array (self-attention: 0, 0, 0)
  bool borrowed[3] = {};              // x_view[i] is the caller's memory, lent with borrow_inputs
  std::uint64_t fingerprint[3] = {};  // of each borrowed input, at the forward
  Tensor q_proj, k_proj, v_proj, context, lse;
  // With a head_gate: the gate, and the gated heads [rows of query, h*d_v] that W^O projected (context
  // keeps the heads as the kernel wrote them, for the kernel's backward).
  HeadGate gate;
  Tensor gated_context;
  KernelMasks masks;       // in kernel terms, owning their storage
  RotaryPositions rotary;  // explicit rotary positions (inputs.positions), or not given
  Shape out_shape;
  std::uint64_t parameters_version = 0;  // the layer's parameters_version_ at the forward
};

}  // namespace detail

namespace {

using namespace detail;

[[noreturn]] void fail(const std::string& message) { throw Error(message); }

std::string str(std::int64_t v) { return std::to_string(v); }

constexpr const char* kRoleName[3] = {"query", "key", "value"};

// True when a and b are one array: same memory, dtype, shape and strides.
bool same_array(const TensorView& a, const TensorView& b) {
  return a.data() == b.data() && a.dtype() == b.dtype() && a.shape() == b.shape() && a.strides() == b.strides();
}

// A contiguous copy of x, in a buffer from the pool when x is contiguous (else a new one).
Tensor copy_into_pooled(const TensorView& x, BufferPool& pool) {
  if (!x.is_contiguous()) return Tensor::copy_of(x);
  Tensor copy = pool.take(x.dtype(), x.shape());
  if (copy.nbytes() > 0) std::memcpy(copy.data(), x.data(), copy.nbytes());
  return copy;
}

// Gives the buffers of a forward that nobody else holds back to the pool, for the next call.
void recycle(std::shared_ptr<SavedForward>&& saved, BufferPool& pool) {
  if (saved && saved.use_count() == 1) {  // not shared with a copy of the layer
    SavedForward& f = *saved;
    for (Tensor* t : {&f.x[0], &f.x[1], &f.x[2], &f.q_proj, &f.k_proj, &f.v_proj, &f.context, &f.gated_context})
      pool.give(std::move(*t));
  }
  saved.reset();
}

// Decides what the projections (and, in training mode, the backward) read for each of query, key
// and value: a role passed the same array as an earlier one reads that one's view; otherwise a copy
// (training mode unless borrowed), or the caller's memory (a contiguous copy if it has gaps).
void keep_inputs(const TensorView* const inputs[3], bool training, bool borrow, BufferPool& pool, SavedForward& f) {
  for (int i = 0; i < 3; ++i) {
    int j = 0;
    while (j < i && !same_array(*inputs[j], *inputs[i])) ++j;
    f.source[i] = j;
    if (j < i) {
      f.x_view[i] = f.x_view[j];
      continue;
    }
    if (training && !borrow) {
      f.x[i] = copy_into_pooled(*inputs[i], pool);
      f.x_view[i] = f.x[i].view();
    } else {
      f.x_view[i] = contiguous_view(*inputs[i], f.x[i]);
    }
    f.borrowed[i] = training && !f.x[i].defined();
    if (f.borrowed[i]) f.fingerprint[i] = fingerprint(f.x_view[i]);
  }
}

// Throws mha::Error when an input lent to the forward (borrow_inputs) changed since.
void check_borrowed_inputs(const SavedForward& f) {
  for (int i = 0; i < 3; ++i) {
    if (!f.borrowed[i] || fingerprint(f.x_view[i]) == f.fingerprint[i]) continue;
    std::string also;  // the other roles given the same array
    for (int k = i + 1; k < 3; ++k)
      if (f.source[k] == i) also += std::string(also.empty() ? "" : " and ") + kRoleName[k];
    const std::string name = kRoleName[i] + (also.empty() ? "" : " (passed also as " + also + ")");
    fail(name + " changed between forward and backward; the training-mode forward borrowed it (borrow_inputs), so "
                "the gradients would be wrong. Keep borrowed inputs unchanged until backward() returns, or leave "
                "borrow_inputs false so that the layer keeps a copy");
  }
}

HeadViews head_views(const SavedForward& f, const MultiHeadAttentionConfig& c) {
  const std::int64_t h = c.num_heads, S2 = f.S + f.extra;
  HeadViews v;
  v.q = heads_view(f.q_proj, f.B, h, f.L, c.d_k, f.q_rows);
  v.k = heads_view(f.k_proj, f.B, c.num_kv_heads, S2, c.d_k, f.kv_rows);
  v.v = heads_view(f.v_proj, f.B, c.num_kv_heads, S2, c.d_v, f.kv_rows);
  v.context = heads_view(f.context, f.B, h, f.L, c.d_v, f.q_rows);
  return v;
}

// The rotary embedding of the projected queries [rows of query, h*d_k] and keys [rows of key, h_kv*d_k]
// (or, inverse, of their gradients): query i at position i + S - L, key j at j.
// Packed sequences: each row at its sequence's own position (packed.hpp); explicit positions where given.
void rotate_projections(const SavedForward& f, const PackedRows& packed, const MultiHeadAttentionConfig& c,
                        bool inverse, Tensor& q, Tensor& k) {
  const TensorView q_heads = heads_view(q, f.B, c.num_heads, f.L, c.d_k, f.q_rows);
  const TensorView k_heads = heads_view(k, f.B, c.num_kv_heads, f.S, c.d_k, f.kv_rows);
  if (packed.packed()) {
    rotate_heads_at(q_heads, c, packed_query_positions(packed), inverse);
    rotate_heads_at(k_heads, c, packed_key_positions(packed), inverse);
    return;
  }
  if (f.rotary.given) {
    rotate_heads_at(q_heads, c, f.rotary.query, inverse);
    rotate_heads_at(k_heads, c, f.rotary.key, inverse);
    return;
  }
  const std::int64_t query_first[1] = {f.S - f.L}, key_first[1] = {0};
  rotate_heads(q_heads, c, query_first, inverse);
  rotate_heads(k_heads, c, key_first, inverse);
}

// The sizes of a forward's inputs, once they are checked.
struct ForwardSizes {
  InputDims dims;
  std::int64_t B, L, S;
};

// Checks query, key and value against the layer (ranks, dtypes, widths, batch sizes, positions).
ForwardSizes check_forward_inputs(const TensorView& query, const TensorView& key, const TensorView& value,
                                  const MultiHeadAttentionConfig& c) {
  check_input_rank(query, "query", c.batch_first, "L", "E");
  for (auto [t, name] : {std::pair{&query, "query"}, std::pair{&key, "key"}, std::pair{&value, "value"}}) {
    check_dtype(*t, name, c.dtype);
    check_same_rank(*t, name, query, "query");
  }
  const InputDims dims(c, query.rank());
  const std::int64_t B = dims.batch(query), L = dims.positions(query), S = dims.positions(key);
  for (auto [t, name, width, width_name] :
       {std::tuple{&query, "query", c.d_model, "d_model"}, std::tuple{&key, "key", c.kdim, "kdim"},
        std::tuple{&value, "value", c.vdim, "vdim"}}) {
    check_width(*t, name, width, width_name);
    check_same_batch(*t, name, dims, B, query, "query");
  }
  if (dims.positions(value) != S)
    fail("value: expected " + str(S) + " positions like key " + shape_str(key.shape()) + ", got shape " +
         shape_str(value.shape()));
  return {dims, B, L, S};
}

}  // namespace

MultiHeadAttentionOutput MultiHeadAttention::forward(const TensorView& query, const TensorView& key,
                                                     const TensorView& value, const MultiHeadAttentionInputs& in) {
  const auto& c = config_;
  const std::int64_t qk = c.num_heads * c.d_k, vw = c.num_heads * c.d_v;
  const std::int64_t kk = c.num_kv_heads * c.d_k, kv = c.num_kv_heads * c.d_v;  // key and value widths
  const auto [dims, B, L, S] = check_forward_inputs(query, key, value, c);

  // ---- masks, in kernel terms [B, h, L, S'] ---------------------------------------------------
  KernelMasks masks = kernel_masks(in, c, dims.batched, B, L, S, c.sinks ? &parameter("sinks") : nullptr);
  AttentionOptions& o = masks.options;
  const std::int64_t extra = extra_positions(c), S2 = S + extra;
  o.need_weights = in.need_weights && !masks.packed.packed();  // packed: no [L, S] weights (see cu_seqlens)
  o.need_lse = training_;
  o.kernel = kernel_;
  HeadGate gate = head_gate_of(in.head_gate, c, dims.batched, B);  // validated before any state changes
  RotaryPositions rotary = rotary_positions(in, c, B, L, S);
  if (training_ && c.dropout > 0) {
    o.dropout_p = c.dropout;
    o.dropout_seed = in.dropout_seed ? *in.dropout_seed : mix64(dropout_seed_ + dropout_calls_++);
  }

  // ---- project, attend, project back --------------------------------------------------------
  // The inputs and masks are valid: the previous forward's state makes way (its buffers are reused).
  BufferPool& pool = buffer_pool();
  pool.start_cycle();
  recycle(std::move(saved_), pool);
  auto saved = std::make_shared<SavedForward>();
  SavedForward& f = *saved;
  f.B = B, f.L = L, f.S = S, f.extra = extra;
  f.gate = std::move(gate);
  f.rotary = std::move(rotary);
  f.q_rows = dims.rows(B, L);
  f.kv_input_rows = dims.rows(B, S);
  f.kv_rows = extra ? RowLayout{S2, 1} : f.kv_input_rows;
  // Inputs with gaps between rows are copied once so the GEMMs read plain [rows, width] matrices;
  // training mode keeps its own copies for the backward unless the caller lends its inputs.
  const TensorView* const inputs[3] = {&query, &key, &value};
  keep_inputs(inputs, training_, in.borrow_inputs, pool, f);
  // Every element of these is written below (the kernel writes 0 for a query with no allowed key).
  f.q_proj = pool.take(c.dtype, {B * L, qk});   // [rows of query, h*d_k]
  f.context = pool.take(c.dtype, {B * L, vw});  // [rows of query, h*d_v]: the concatenated heads
  f.k_proj = pool.take(c.dtype, {B * S2, kk});  // [rows of key (+ extra per batch), h_kv*d_k]
  f.v_proj = pool.take(c.dtype, {B * S2, kv});  // [rows of value (+ extra per batch), h_kv*d_v]
  // The gated heads: in a buffer of their own in training mode (the backward reads both), else in place.
  if (f.gate.given && training_) f.gated_context = pool.take(c.dtype, {B * L, vw});
  Tensor& gated = f.gated_context.defined() ? f.gated_context : f.context;
  Shape out_shape = query.shape();
  out_shape.back() = c.d_model;
  MultiHeadAttentionOutput result;
  result.out = Tensor::uninitialized(c.dtype, out_shape);  // written whole by the output projection

  dispatch_floating(c.dtype, [&]<class T>(T) {
    const ProjectionWeights<T> w = projection_weights<T>(*this);
    project<T>(f.x_view[0], f.q_rows, B, L, 0, w.q, qk, w.q_bias, f.q_proj);
    project<T>(f.x_view[1], f.kv_input_rows, B, S, extra, w.k, kk, w.k_bias, f.k_proj);
    project<T>(f.x_view[2], f.kv_input_rows, B, S, extra, w.v, kv, w.v_bias, f.v_proj);
    if (extra) write_extra_positions<T>(*this, f.k_proj.data_as<T>(), f.v_proj.data_as<T>(), B, S2, S);
    if (has_rotary(c)) rotate_projections(f, masks.packed, c, /*inverse=*/false, f.q_proj, f.k_proj);
    Tensor weights;
    attend_and_project_out<T>(head_views(f, c), o, w, f.gate, f.context, gated.data_as<T>(), result.out, weights, f.lse,
                              masks.packed);
    if (o.need_weights) result.weights = output_weights<T>(std::move(weights), in.average_attn_weights, dims.batched);
  });

  if (training_) {
    f.masks = std::move(masks);
    f.masks.own_views();
    f.out_shape = result.out.shape();
    f.parameters_version = parameters_version_;
    saved_ = std::move(saved);
  } else {
    recycle(std::move(saved), pool);
  }
  return result;
}

namespace {

// The gradient of an appended bias position (bias_k / bias_v at position S of each batch): d_proj
// [B, S2, width] summed over the batches into dbias [width].
template <class T>
void sum_over_batches(const Tensor& d_proj, std::int64_t B, std::int64_t S, std::int64_t S2, std::int64_t width,
                      T* dbias) {
  for (std::int64_t n = 0; n < width; ++n) {
    compute_t<T> sum = 0;
    for (std::int64_t b = 0; b < B; ++b) sum += d_proj.data_as<T>()[(b * S2 + S) * width + n];
    dbias[n] = T(sum);
  }
}

// The attention core's backward: dq_proj, dk_proj, dv_proj (written whole) from dcontext [B, h, L, d_v],
// per packed sequence when the forward was packed.
void attention_core_backward(const SavedForward& f, const MultiHeadAttentionConfig& c, const TensorView& dcontext,
                             const HeadViews& heads, Tensor& dq_proj, Tensor& dk_proj, Tensor& dv_proj) {
  if (f.masks.packed.packed())
    return packed_attention_backward(dcontext, heads.q, heads.k, heads.v, heads.context, f.lse.view(), f.masks.options,
                                     f.masks.packed, dq_proj, dk_proj, dv_proj);
  // Each gradient in its own buffer's layout, [rows, h*d] (not taken from the head views it differentiates).
  const std::int64_t S2 = f.S + f.extra;
  run_attention_backward(dcontext, heads.q, heads.k, heads.v, heads.context, f.lse.view(), f.masks.options,
                         {dq_proj.data(), heads_view(dq_proj, f.B, c.num_heads, f.L, c.d_k, f.q_rows).strides()},
                         {dk_proj.data(), heads_view(dk_proj, f.B, c.num_kv_heads, S2, c.d_k, f.kv_rows).strides()},
                         {dv_proj.data(), heads_view(dv_proj, f.B, c.num_kv_heads, S2, c.d_v, f.kv_rows).strides()});
}

// The sinks parameter's gradient [h] (forward: one more logit, sinks[head], in each row's softmax;
// attention/sinks.hpp), from the heads' dout and out and the forward's log-sum-exps.
template <class T>
void sink_parameter_gradient(const TensorView& dout_heads, const TensorView& out_heads, const SavedForward& f,
                             T* dsinks) {
  const TensorView& sinks = *f.masks.options.sinks;
  std::vector<double> sums(static_cast<std::size_t>(sinks.size(0)), 0.0);
  accumulate_sink_gradient(dout_heads, out_heads, f.lse.view(), sinks, sums);
  for (std::size_t head = 0; head < sums.size(); ++head) dsinks[head] = T(sums[head]);
}

}  // namespace

MultiHeadAttentionGradients MultiHeadAttention::backward(const TensorView& dout) {
  if (!saved_) fail("backward: no training-mode forward to differentiate; call train() and forward() first");
  const SavedForward& f = *saved_;
  if (f.parameters_version != parameters_version_)
    fail("backward: the parameters changed (set_parameter / load_state_dict) after the training-mode forward, so "
         "its saved state no longer matches them; call forward() again before backward()");
  const auto& c = config_;
  const std::int64_t E = c.d_model, qk = c.num_heads * c.d_k, vw = c.num_heads * c.d_v;
  const std::int64_t kk = c.num_kv_heads * c.d_k, kv = c.num_kv_heads * c.d_v;  // key and value widths
  const std::int64_t B = f.B, L = f.L, S = f.S, S2 = f.S + f.extra;
  check_borrowed_inputs(f);
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
  for (int i = 0; i < 3; ++i)  // written whole by project_backward
    (i == 0 ? g.query : i == 1 ? g.key : g.value) = Tensor::uninitialized(c.dtype, f.x_view[i].shape());
  BufferPool& pool = buffer_pool();
  Tensor dcontext = pool.take(c.dtype, {B * L, vw});  // [rows of query, h*d_v], overwritten below
  // The kernel's gradients, written whole by it: [rows of query, h*d_k], [rows of key (+ extra), h_kv*d_k], ...
  Tensor dq_proj = pool.take(c.dtype, {B * L, qk}), dk_proj = pool.take(c.dtype, {B * S2, kk});
  Tensor dv_proj = pool.take(c.dtype, {B * S2, kv});

  auto run = [&]<class T>(T) {
    const ProjectionWeights<T> w = projection_weights<T>(*this);
    auto grad = [&](const char* name) { return g.parameters.at(name).template data_as<T>(); };
    const T* dy_p = dy.data_as<T>();
    // Output projection. Forward: out = context W_o^T + b_o (context gated, with a head gate).
    const Tensor& concat = f.gate.given ? f.gated_context : f.context;
    if (c.bias) column_sums(dy_p, E, B * L, E, grad("out_proj.bias"));
    gemm<T>(E, vw, B * L, transposed(dy_p, E), plain(concat.data_as<T>(), vw), overwrite(grad("out_proj.weight"), vw));
    gemm<T>(B * L, vw, E, plain(dy_p, E), plain(w.out, vw), overwrite(dcontext.data_as<T>(), vw));
    const HeadViews heads = head_views(f, c);
    if (f.gate.given) g.head_gate = head_gate_backward<T>(f.gate, heads.context, dcontext.data_as<T>());

    // Attention core. Forward: context = Attention(q_proj, k_proj, v_proj) per head.
    const TensorView dcontext_heads(dcontext.data(), c.dtype, heads.context.shape(), heads.context.strides());
    attention_core_backward(f, c, dcontext_heads, heads, dq_proj, dk_proj, dv_proj);
    if (has_rotary(c)) rotate_projections(f, f.masks.packed, c, /*inverse=*/true, dq_proj, dk_proj);  // q = R q_lin
    if (c.sinks) sink_parameter_gradient(dcontext_heads, heads.context, f, grad("sinks"));
    if (c.add_bias_kv) {  // forward: k_proj[b, S] = bias_k, v_proj[b, S] = bias_v for every b
      sum_over_batches<T>(dk_proj, B, S, S2, kk, grad("bias_k"));
      sum_over_batches<T>(dv_proj, B, S, S2, kv, grad("bias_v"));
    }

    // Input projections. Forward: q_proj = query W_q^T + b_q (likewise k, v). Packed: rows [q | k | v] of one
    // weight and of in_proj_bias (the weights are packed only without grouping, kk = qk). A key no query
    // sees reads its input row as 0 in dW_k and dW_v, so a NaN there reaches neither (layer/unseen_keys.hpp).
    T* dw = packed_in_proj() ? grad("in_proj_weight") : nullptr;
    T* db = c.bias ? grad("in_proj_bias") : nullptr;
    Tensor zeroed[2];
    const TensorView xk = without_unseen_nonfinite_rows(f.x_view[1], f.kv_input_rows, B, S, f.masks.options,
                                                        c.num_heads, L, S2, f.masks.packed, zeroed[0]);
    const TensorView xv = f.source[2] == f.source[1]
                              ? xk  // value is key's array: scanned once
                              : without_unseen_nonfinite_rows(f.x_view[2], f.kv_input_rows, B, S, f.masks.options,
                                                              c.num_heads, L, S2, f.masks.packed, zeroed[1]);
    project_backward<T>(dq_proj, f.x_view[0], f.q_rows, B, L, 0, w.q, qk, dw ? dw : grad("q_proj_weight"), db, g.query);
    project_backward<T>(dk_proj, xk, f.kv_input_rows, B, S, f.extra, w.k, kk, dw ? dw + qk * E : grad("k_proj_weight"),
                        db ? db + qk : nullptr, g.key);
    project_backward<T>(dv_proj, xv, f.kv_input_rows, B, S, f.extra, w.v, kv,
                        dw ? dw + 2 * qk * E : grad("v_proj_weight"), db ? db + qk + kk : nullptr, g.value);
  };
  dispatch_floating(c.dtype, run);
  for (Tensor* t : {&dcontext, &dq_proj, &dk_proj, &dv_proj}) pool.give(std::move(*t));
  return g;
}

BufferPool& MultiHeadAttention::buffer_pool() {
  if (!pool_ || pool_.use_count() > 1) pool_ = std::make_shared<BufferPool>();  // a copied layer's own
  return *pool_;
}

std::int64_t MultiHeadAttention::saved_bytes() const {
  if (!saved_) return 0;
  const SavedForward& f = *saved_;
  std::size_t bytes = 0;
  for (const Tensor* t : {&f.x[0], &f.x[1], &f.x[2], &f.q_proj, &f.k_proj, &f.v_proj, &f.context, &f.gated_context,
                          &f.lse, &f.masks.attn_mask, &f.masks.key_padding_mask})
    if (t->defined()) bytes += t->nbytes();
  return static_cast<std::int64_t>(bytes);
}

}  // namespace mha
