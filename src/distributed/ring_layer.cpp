// RingMultiHeadAttention (mha/distributed.hpp): the layer over sequence-sharded inputs. Forward and
// backward side by side; the products and the per-head views are the single-process layer's own
// (layer/projections.hpp), the attention core is ring_attention. With rotary_dim > 0 each rank rotates
// its own rows of q and k at their positions in the whole sequence (query i at i + S - L, key j at j,
// as the single-process layer places them), and rotates dq and dk back (R^T) in the backward.
//
// Legend: B batch, L_r / S_r this rank's query / key rows, E = d_model, h heads, qk = h*d_k,
// vw = h*d_v. Rows of an input are in its own layout (RowLayout: batch-first or sequence-first).
#include <mpi.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "distributed/agreement.hpp"
#include "dtype_dispatch.hpp"
#include "layer/projections.hpp"
#include "layer/rotary_heads.hpp"
#include "mha/distributed.hpp"

namespace mha::distributed {

struct RingMultiHeadAttention::Saved {
  Tensor query, key, value;  // contiguous copies of the inputs, in their layout
  Tensor q, k, v;            // projections [rows, qk], [rows, qk], [rows, vw]
  Tensor out, lse;           // the ring's [B, h, L_r, d_v] and [B, h, L_r]
  Tensor concat;             // the heads side by side [rows of query, vw]
  RingOptions options;
  Tensor padding;                                      // the key padding mask, copied (options point into it)
  Tensor sinks;                                        // the layer's sinks parameter, copied (likewise)
  std::vector<std::int64_t> q_positions, k_positions;  // [L_r], [S_r]: rotary positions of this rank's rows
  std::int64_t B = 0, L_r = 0, S_r = 0;
};

namespace {

using mha::detail::RowLayout;

RowLayout rows_of(const MultiHeadAttentionConfig& c, std::int64_t B, std::int64_t T) {
  return c.batch_first ? RowLayout{T, 1} : RowLayout{1, B};
}

// Local checks of a forward's arguments (what the projections rely on); throws mha::Error.
void check_inputs(const MultiHeadAttentionConfig& c, const TensorView& query, const TensorView& key,
                  const TensorView& value) {
  if (c.add_bias_kv || c.add_zero_attn)
    throw Error("RingMultiHeadAttention: add_bias_kv and add_zero_attn add one key to the whole sequence and are "
                "not offered across shards");
  const std::pair<const char*, const TensorView*> inputs[] = {{"query", &query}, {"key", &key}, {"value", &value}};
  const std::int64_t widths[] = {c.d_model, c.kdim, c.vdim};
  const char* layout = c.batch_first ? "[B, rows, width] (batch_first)" : "[rows, B, width]";
  for (int i = 0; i < 3; ++i) {
    const auto& [name, t] = inputs[i];
    if (t->dtype() != c.dtype)
      throw Error(std::string(name) + ": expected the layer's dtype " + dtype_name(c.dtype) + ", got " +
                  dtype_name(t->dtype()));
    if (t->rank() != 3 || t->size(2) != widths[i])
      throw Error(std::string(name) + ": expected " + layout + " with width " + std::to_string(widths[i]) + ", got " +
                  shape_str(t->shape()));
  }
  const int batch = c.batch_first ? 0 : 1, rows = 1 - batch;
  if (key.size(batch) != query.size(batch) || value.size(batch) != query.size(batch))
    throw Error("key, value: expected query's batch size " + std::to_string(query.size(batch)) + ", got " +
                shape_str(key.shape()) + " and " + shape_str(value.shape()));
  if (key.size(rows) != value.size(rows))
    throw Error("key, value: expected as many rows, got " + shape_str(key.shape()) + " and " +
                shape_str(value.shape()));
}

// The RankCall of a layer call: its attention core's sizes and options, and this rank's error.
detail::RankCall describe_layer_call(const MultiHeadAttentionConfig& c, const TensorView& query, const TensorView& key,
                                     const RingOptions& o, const std::string& error) {
  detail::RankCall call;
  std::copy_n(error.begin(), std::min(error.size(), sizeof call.error - 1), call.error);
  const int batch = c.batch_first ? 0 : 1, rows = 1 - batch;
  call.dtype = static_cast<std::int32_t>(c.dtype);
  call.causal = o.causal, call.layout = static_cast<std::int32_t>(o.layout);
  call.kernel = static_cast<std::int32_t>(o.kernel), call.has_padding = o.key_padding_mask.has_value();
  call.B = query.rank() == 3 ? query.size(batch) : -1;
  call.L_r = query.rank() == 3 ? query.size(rows) : -1;
  call.S_r = key.rank() == 3 ? key.size(rows) : -1;
  call.h = c.num_heads, call.d_k = c.d_k, call.d_v = c.d_v;
  call.scale = std::numeric_limits<double>::quiet_NaN(), call.dropout_p = o.dropout_p;
  call.dropout_seed = o.dropout_seed;
  call.key_lengths_count = static_cast<std::int64_t>(o.key_lengths.size());
  call.key_lengths_digest = detail::key_lengths_digest(o.key_lengths);
  call.rotary_dim = c.rotary_dim, call.rotary_base = c.rotary_dim > 0 ? c.rotary_base : 0.0;
  call.rotary_interleaved = c.rotary_dim > 0 && c.rotary_interleaved;
  return call;
}

// The positions in the whole sequence of the rows a rank holds, in the order its shard stores them:
// [rows of the chunks], each chunk's row t at chunk.start + t + offset.
std::vector<std::int64_t> positions_of(const std::vector<SequenceChunk>& chunks, std::int64_t offset) {
  std::vector<std::int64_t> positions;
  for (const SequenceChunk& chunk : chunks)
    for (std::int64_t t = 0; t < chunk.length; ++t) positions.push_back(chunk.start + t + offset);
  return positions;
}

// per_head [B, h, T, d] (contiguous) into y [rows, h*d] in the layout `rows`: the heads side by side.
template <class T>
Tensor heads_side_by_side(const Tensor& per_head, RowLayout rows) {
  const std::int64_t B = per_head.size(0), h = per_head.size(1), n = per_head.size(2), d = per_head.size(3);
  Tensor y = Tensor::uninitialized(per_head.dtype(), {B * n, h * d});
  const T* src = per_head.data_as<T>();
  T* dst = y.data_as<T>();
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t head = 0; head < h; ++head)
      for (std::int64_t t = 0; t < n; ++t)
        std::copy_n(src + ((b * h + head) * n + t) * d, d,
                    dst + (b * rows.batch + t * rows.position) * h * d + head * d);
  return y;
}

template <class T>
Tensor forward_typed(MultiHeadAttention& layer, MPI_Comm comm, RingMultiHeadAttention::Saved& s) {
  const auto& c = layer.config();
  const std::int64_t B = s.B, h = c.num_heads, qk = h * c.d_k, vw = h * c.d_v;
  const RowLayout q_rows = rows_of(c, B, s.L_r), kv_rows = rows_of(c, B, s.S_r);
  const auto w = mha::detail::projection_weights<T>(layer);
  s.q = Tensor::uninitialized(c.dtype, {B * s.L_r, qk});
  s.k = Tensor::uninitialized(c.dtype, {B * s.S_r, qk});
  s.v = Tensor::uninitialized(c.dtype, {B * s.S_r, vw});
  mha::detail::project<T>(s.query, q_rows, B, s.L_r, 0, w.q, qk, w.q_bias, s.q);
  mha::detail::project<T>(s.key, kv_rows, B, s.S_r, 0, w.k, qk, w.k_bias, s.k);
  mha::detail::project<T>(s.value, kv_rows, B, s.S_r, 0, w.v, vw, w.v_bias, s.v);
  if (mha::detail::has_rotary(c)) {  // q = R q_lin, k = R k_lin at the rows' global positions
    mha::detail::rotate_heads_at(mha::detail::heads_view(s.q, B, h, s.L_r, c.d_k, q_rows), c, s.q_positions, false);
    mha::detail::rotate_heads_at(mha::detail::heads_view(s.k, B, h, s.S_r, c.d_k, kv_rows), c, s.k_positions, false);
  }
  RingResult r = ring_attention(mha::detail::heads_view(s.q, B, h, s.L_r, c.d_k, q_rows),
                                mha::detail::heads_view(s.k, B, h, s.S_r, c.d_k, kv_rows),
                                mha::detail::heads_view(s.v, B, h, s.S_r, c.d_v, kv_rows), comm, s.options);
  s.out = std::move(r.out), s.lse = std::move(r.lse);
  s.concat = heads_side_by_side<T>(s.out, q_rows);
  Tensor y = Tensor::uninitialized(c.dtype, s.query.shape());  // like query
  mha::detail::linear_forward<T>(s.concat.data_as<T>(), vw, B * s.L_r, vw, w.out, c.d_model, w.out_bias, y.data_as<T>(),
                                 c.d_model);
  return y;
}

// Sums every rank's gradients in rank order (the same bits on every rank and every run).
template <class T>
void sum_over_ranks(std::map<std::string, Tensor>& grads, const std::vector<std::string>& names, MPI_Comm comm) {
  int P = 1;
  MPI_Comm_size(comm, &P);
  std::vector<T> mine;
  for (const std::string& n : names)
    mine.insert(mine.end(), grads[n].data_as<T>(), grads[n].data_as<T>() + grads[n].numel());
  std::vector<T> all(mine.size() * static_cast<std::size_t>(P));
  const MPI_Datatype type = std::is_same_v<T, float> ? MPI_FLOAT : MPI_DOUBLE;
  MPI_Allgather(mine.data(), static_cast<int>(mine.size()), type, all.data(), static_cast<int>(mine.size()), type,
                comm);
  std::size_t at = 0;
  for (const std::string& n : names) {
    T* g = grads[n].data_as<T>();
    for (std::int64_t i = 0; i < grads[n].numel(); ++i, ++at) {
      T sum = all[at];
      for (int r = 1; r < P; ++r) sum += all[static_cast<std::size_t>(r) * mine.size() + at];
      g[i] = sum;
    }
  }
}

template <class T>
MultiHeadAttentionGradients backward_typed(MultiHeadAttention& layer, MPI_Comm comm,
                                           const RingMultiHeadAttention::Saved& s, const Tensor& dy) {
  const auto& c = layer.config();
  const std::int64_t B = s.B, h = c.num_heads, qk = h * c.d_k, vw = h * c.d_v, E = c.d_model;
  const RowLayout q_rows = rows_of(c, B, s.L_r), kv_rows = rows_of(c, B, s.S_r);
  const auto w = mha::detail::projection_weights<T>(layer);
  MultiHeadAttentionGradients g;
  for (const std::string& name : layer.parameter_names())
    g.parameters[name] = Tensor(c.dtype, layer.parameter(name).shape());
  // Where each projection's gradient goes: rows of in_proj_weight / in_proj_bias, or its own tensors.
  const bool packed = layer.packed_in_proj();
  T* dw_q = (packed ? g.parameters["in_proj_weight"] : g.parameters["q_proj_weight"]).template data_as<T>();
  T* dw_k = packed ? dw_q + qk * E : g.parameters["k_proj_weight"].template data_as<T>();
  T* dw_v = packed ? dw_q + 2 * qk * E : g.parameters["v_proj_weight"].template data_as<T>();
  T* db_q = c.bias ? g.parameters["in_proj_bias"].template data_as<T>() : nullptr;
  T* db_out = c.bias ? g.parameters["out_proj.bias"].template data_as<T>() : nullptr;

  // out projection: y = concat W_o^T + b_o
  Tensor dconcat = Tensor::uninitialized(c.dtype, {B * s.L_r, vw});
  mha::detail::project_backward<T>(dy, s.concat, q_rows, B, s.L_r, 0, w.out, E,
                                   g.parameters["out_proj.weight"].template data_as<T>(), db_out, dconcat);
  // the attention core, over the ring
  AttentionGradients core =
      ring_attention_backward(mha::detail::heads_view(dconcat, B, h, s.L_r, c.d_v, q_rows),
                              mha::detail::heads_view(s.q, B, h, s.L_r, c.d_k, q_rows),
                              mha::detail::heads_view(s.k, B, h, s.S_r, c.d_k, kv_rows),
                              mha::detail::heads_view(s.v, B, h, s.S_r, c.d_v, kv_rows), s.out, s.lse, comm, s.options);
  if (mha::detail::has_rotary(c)) {  // forward: q = R q_lin, so dq_lin = R^T dq (likewise k)
    mha::detail::rotate_heads_at(core.dq.view(), c, s.q_positions, /*inverse=*/true);
    mha::detail::rotate_heads_at(core.dk.view(), c, s.k_positions, /*inverse=*/true);
  }
  // the input projections
  g.query = Tensor::uninitialized(c.dtype, s.query.shape());
  g.key = Tensor::uninitialized(c.dtype, s.key.shape());
  g.value = Tensor::uninitialized(c.dtype, s.value.shape());
  mha::detail::project_backward<T>(heads_side_by_side<T>(core.dq, q_rows), s.query, q_rows, B, s.L_r, 0, w.q, qk, dw_q,
                                   db_q, g.query);
  mha::detail::project_backward<T>(heads_side_by_side<T>(core.dk, kv_rows), s.key, kv_rows, B, s.S_r, 0, w.k, qk, dw_k,
                                   db_q ? db_q + qk : nullptr, g.key);
  mha::detail::project_backward<T>(heads_side_by_side<T>(core.dv, kv_rows), s.value, kv_rows, B, s.S_r, 0, w.v, vw,
                                   dw_v, db_q ? db_q + 2 * qk : nullptr, g.value);
  sum_over_ranks<T>(g.parameters, layer.parameter_names(), comm);
  if (c.sinks) g.parameters["sinks"] = std::move(core.dsinks);  // summed over the ranks already (rank order)
  return g;
}

}  // namespace

RingMultiHeadAttention::RingMultiHeadAttention(MultiHeadAttention& layer, MPI_Comm comm, Layout layout)
    : layer_(&layer), comm_(comm), layout_(layout) {
  if (layer.config().dtype == DType::BFloat16)
    throw Error("RingMultiHeadAttention: the layer is bfloat16; the ring takes float32 or float64 layers (bfloat16 "
                "across ranks is not built yet)");
  if (layer.config().num_kv_heads != layer.config().num_heads)
    throw Error("RingMultiHeadAttention: the layer has num_kv_heads = " + std::to_string(layer.config().num_kv_heads) +
                " < num_heads = " + std::to_string(layer.config().num_heads) +
                "; the ring takes one key/value head per head (grouped-query attention across ranks is not built yet)");
}
RingMultiHeadAttention::~RingMultiHeadAttention() = default;
RingMultiHeadAttention::RingMultiHeadAttention(RingMultiHeadAttention&&) noexcept = default;
RingMultiHeadAttention& RingMultiHeadAttention::operator=(RingMultiHeadAttention&&) noexcept = default;

Tensor RingMultiHeadAttention::forward(const TensorView& query, const TensorView& key, const TensorView& value,
                                       const RingLayerInputs& inputs) {
  const auto& c = layer_->config();
  auto s = std::make_unique<Saved>();
  s->options.causal = inputs.causal;
  s->options.layout = layout_;
  s->options.key_lengths = inputs.key_lengths;
  s->options.kernel = layer_->kernel();
  if (c.sinks) s->sinks = Tensor::copy_of(layer_->parameter("sinks")), s->options.sinks = s->sinks.view();
  if (layer_->training()) s->options.dropout_p = c.dropout, s->options.dropout_seed = inputs.dropout_seed;
  std::string error;
  try {
    check_inputs(c, query, key, value);
    if (inputs.key_padding_mask) {
      s->padding = Tensor::copy_of(*inputs.key_padding_mask);
      s->options.key_padding_mask = s->padding.view();
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (inputs.key_padding_mask && !s->options.key_padding_mask) s->options.key_padding_mask = *inputs.key_padding_mask;
  // Every rank learns of any rank's bad input here, before the projections and the ring.
  const detail::AgreedCall agreed = detail::agree(comm_, describe_layer_call(c, query, key, s->options, error),
                                                  s->options, "RingMultiHeadAttention::forward");
  if (mha::detail::has_rotary(c)) {
    int rank = 0;
    MPI_Comm_rank(comm_, &rank);
    s->q_positions = positions_of(agreed.q_chunks(rank), agreed.S - agreed.L);
    s->k_positions = positions_of(agreed.kv_chunks(rank), 0);
  }
  const int batch = c.batch_first ? 0 : 1;
  s->B = query.size(batch), s->L_r = query.size(1 - batch), s->S_r = key.size(1 - batch);
  s->query = Tensor::copy_of(query), s->key = Tensor::copy_of(key), s->value = Tensor::copy_of(value);
  Tensor y = mha::detail::dispatch_float32_or_float64(
      c.dtype, [&](auto t) { return forward_typed<decltype(t)>(*layer_, comm_, *s); });
  saved_ = layer_->training() ? std::move(s) : nullptr;
  return y;
}

MultiHeadAttentionGradients RingMultiHeadAttention::backward(const TensorView& dout) {
  std::string error;
  if (!saved_) error = "no training-mode forward to take the gradient of";
  else if (dout.shape() != saved_->query.shape() || dout.dtype() != saved_->query.dtype())
    error = "dout: expected " + std::string(dtype_name(saved_->query.dtype())) + " " +
            shape_str(saved_->query.shape()) + " like the forward's output, got " + dtype_name(dout.dtype()) + " " +
            shape_str(dout.shape());
  detail::agree_on_errors(comm_, error, "RingMultiHeadAttention::backward");  // every rank stops if any must
  const Tensor dy = Tensor::copy_of(dout);
  const auto& c = layer_->config();
  auto g = mha::detail::dispatch_float32_or_float64(
      c.dtype, [&](auto t) { return backward_typed<decltype(t)>(*layer_, comm_, *saved_, dy); });
  saved_.reset();
  return g;
}

}  // namespace mha::distributed
