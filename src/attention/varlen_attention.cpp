// Attention over packed variable-length sequences (mha/varlen.hpp). Validated once, at the boundary;
// then each sequence's rows are viewed in place as a batch of one,
//
//     q_i = q[cu_q[i] : cu_q[i+1]]   [total_q, h, d_k] rows viewed as [1, h, L_i, d_k],
//           strides (0, q.stride(1), q.stride(0), q.stride(2))      (k_i, v_i, dout_i, out_i likewise)
//
// and run through the kernel the options choose (attention_core.hpp), which writes its results straight
// into the packed outputs through their strides. Nothing is padded: the work is sum_i L_i S_i. Long
// sequences run one after another, each parallel inside its call (heads and query blocks); the short ones
// run many at a time, one thread each (varlen_schedule.hpp).
//
// Legend: n sequences, h query heads, h_kv key/value heads, total_q / total_k packed query / key rows,
// L_i = cu_q[i+1] - cu_q[i] and S_i = cu_k[i+1] - cu_k[i] the queries and keys of sequence i, d_k
// query/key width, d_v value width.
#include "mha/varlen.hpp"

#include <cstddef>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "attention/attention_core.hpp"
#include "attention/sinks.hpp"
#include "attention/varlen_checks.hpp"
#include "attention/varlen_schedule.hpp"
#include "dtype_dispatch.hpp"
#include "mha/error.hpp"

namespace mha {

namespace detail {

// `cu` ([n + 1]) checked to be prefix sums over the `total` rows of `rows` ("q's rows").
void validate_offsets(const CuSeqlens& cu, const char* name, std::int64_t total, const char* total_name,
                      const char* rows) {
  const std::string at = std::string(name) + "[";
  if (cu.size() < 1) throw Error(std::string(name) + ": expected [n + 1] offsets (n >= 0 sequences), got none");
  if (cu[0] != 0)
    throw Error(std::string(name) + ": expected prefix sums starting at 0, got " + at +
                "0] = " + std::to_string(cu[0]));
  for (std::int64_t i = 1; i < cu.size(); ++i)
    if (cu[i] < cu[i - 1])
      throw Error(std::string(name) + ": expected non-decreasing prefix sums, got " + at + std::to_string(i) + "] = " +
                  std::to_string(cu[i]) + " after " + at + std::to_string(i - 1) + "] = " + std::to_string(cu[i - 1]));
  const std::int64_t last = cu.size() - 1;
  if (cu[last] != total)
    throw Error(std::string(name) + ": expected prefix sums ending at " + total_name + " = " + std::to_string(total) +
                " (" + rows + "), got " + at + std::to_string(last) + "] = " + std::to_string(cu[last]));
}

// What a packed batch cannot take: arguments laid out over a [B, S] or [L, S] batch, and the weights.
void refuse_batch_options(const AttentionOptions& o) {
  const char* why = ": not taken by varlen_attention: a packed batch has no [B, S] batch to lay it over";
  if (o.attn_mask)
    throw Error(std::string("attn_mask") + why +
                " (each sequence's keys are its own; causal and window mask within a sequence)");
  if (o.key_padding_mask)
    throw Error(std::string("key_padding_mask") + why +
                " (pack only the real keys: cu_seqlens_k says where each ends)");
  if (!o.key_lengths.empty())
    throw Error(std::string("key_lengths") + why + " (the key lengths are cu_seqlens_k's differences)");
  if (o.need_weights)
    throw Error("need_weights: not taken by varlen_attention: a packed batch's weights have no [B, h, L, S] layout");
}

}  // namespace detail

namespace {

using detail::refuse_batch_options;
using detail::validate_offsets;

[[noreturn]] void fail(const std::string& message) { throw Error(message); }

std::string describe(const TensorView& t) { return std::string(dtype_name(t.dtype())) + " " + shape_str(t.shape()); }

// The dtype of the log-sum-exp: float32 for bfloat16 inputs, else the inputs' own.
DType lse_dtype(DType inputs) { return inputs == DType::BFloat16 ? DType::Float32 : inputs; }

void expect_rank3(const TensorView& t, const char* name, const char* layout) {
  if (t.rank() != 3)
    fail(std::string(name) + ": expected rank 3 " + layout + " (packed sequences), got rank " +
         std::to_string(t.rank()) + " " + shape_str(t.shape()));
}

// The batch of one that validate_attention checks: [total, heads, d] viewed as [1, heads, total, d].
TensorView as_batch_of_one(const TensorView& t) {
  return TensorView(t.data(), t.dtype(), {1, t.size(1), t.size(0), t.size(2)},
                    {0, t.stride(1), t.stride(0), t.stride(2)});
}

// q [total_q, h, d_k], k [total_k, h_kv, d_k], v [total_k, h_kv, d_v], the offsets and the options.
void validate_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const CuSeqlens& cu_q,
                     const CuSeqlens& cu_k, const AttentionOptions& o) {
  expect_rank3(q, "q", "[total_q, h, d_k]");
  expect_rank3(k, "k", "[total_k, h_kv, d_k]");
  expect_rank3(v, "v", "[total_k, h_kv, d_v]");
  if (!detail::is_floating(q.dtype()))
    fail(std::string("q: expected ") + detail::floating_dtype_names() + ", got " + describe(q));
  if (k.dtype() != q.dtype()) fail(std::string("k: expected ") + dtype_name(q.dtype()) + " like q, got " + describe(k));
  if (v.dtype() != q.dtype()) fail(std::string("v: expected ") + dtype_name(q.dtype()) + " like q, got " + describe(v));
  const std::int64_t h = q.size(1), d_k = q.size(2), total_k = k.size(0), h_kv = k.size(1);
  if (k.size(2) != d_k)
    fail("k: expected [total_k, h_kv, d_k] with d_k = " + std::to_string(d_k) + " like q " + shape_str(q.shape()) +
         ", got " + shape_str(k.shape()));
  if (h_kv < 1 ? h != 0 : (h_kv > h || h % h_kv != 0))
    fail("k: expected a number of key/value heads h_kv that divides q's h = " + std::to_string(h) +
         " (h_kv = h; fewer for grouped-query attention, 1 for multi-query), got h_kv = " + std::to_string(h_kv) +
         " in k " + shape_str(k.shape()));
  if (v.size(0) != total_k || v.size(1) != h_kv)
    fail("v: expected [total_k, h_kv, d_v] = [" + std::to_string(total_k) + ", " + std::to_string(h_kv) +
         ", d_v] to match k, got " + shape_str(v.shape()));
  if (d_k < 1) fail("q: expected d_k >= 1, got shape " + shape_str(q.shape()));
  validate_offsets(cu_q, "cu_seqlens_q", q.size(0), "total_q", "q's rows");
  if (cu_k.size() != cu_q.size())
    fail("cu_seqlens_k: expected n + 1 = " + std::to_string(cu_q.size()) + " offsets, as cu_seqlens_q has, got " +
         std::to_string(cu_k.size()));
  validate_offsets(cu_k, "cu_seqlens_k", total_k, "total_k", "k's rows");
  refuse_batch_options(o);
  // The rest (dropout, scale, window, ALiBi slopes, sinks, softcap) as scaled_dot_product_attention checks it.
  detail::validate_attention(as_batch_of_one(q), as_batch_of_one(k), as_batch_of_one(v), o);
}

// dout and out [total_q, h, d_v] of q's dtype, lse [h, total_q] of the log-sum-exp's.
void validate_backward_extras(const TensorView& dout, const TensorView& q, const TensorView& v, const TensorView& out,
                              const TensorView& lse) {
  const Shape out_shape{q.size(0), q.size(1), v.size(2)};
  for (auto [t, name] : {std::pair{&dout, "dout"}, std::pair{&out, "out"}}) {
    if (t->dtype() != q.dtype())
      fail(std::string(name) + ": expected " + dtype_name(q.dtype()) + " like q, got " + describe(*t));
    if (t->shape() != out_shape)
      fail(std::string(name) + ": expected shape [total_q, h, d_v] = " + shape_str(out_shape) + ", got " +
           shape_str(t->shape()));
  }
  const DType want = lse_dtype(q.dtype());
  if (lse.dtype() != want)
    fail(std::string("lse: expected ") + dtype_name(want) +
         (q.dtype() == DType::BFloat16 ? " (the log-sum-exp of bfloat16 q)" : " like q") + ", got " + describe(lse));
  const Shape lse_shape{q.size(1), q.size(0)};
  if (lse.shape() != lse_shape)
    fail("lse: expected shape [h, total_q] = " + shape_str(lse_shape) + " (varlen_attention's), got " +
         shape_str(lse.shape()));
}

// Element `row` of dimension 0 of `t`: the address rows [row, ...) start at.
const void* row_address(const TensorView& t, std::int64_t row) {
  return static_cast<const std::byte*>(t.data()) + row * t.stride(0) * static_cast<std::int64_t>(dtype_size(t.dtype()));
}

// Rows [begin, end) of a packed [total, heads, d] view, as the batch of one [1, heads, end - begin, d].
TensorView sequence_rows(const TensorView& t, std::int64_t begin, std::int64_t end) {
  return TensorView(row_address(t, begin), t.dtype(), {1, t.size(1), end - begin, t.size(2)},
                    {0, t.stride(1), t.stride(0), t.stride(2)});
}

// Where a kernel writes rows [begin, ...) of a packed, contiguous [total, heads, d] tensor: [1, heads, T, d].
detail::StridedOutput sequence_output(Tensor& t, std::int64_t begin) {
  const std::int64_t heads = t.size(1), d = t.size(2);
  void* data = static_cast<std::byte*>(t.data()) + begin * heads * d * static_cast<std::int64_t>(dtype_size(t.dtype()));
  return {data, {0, d, heads * d, 1}};
}

// Columns [begin, begin + L_i) of a packed lse [h, total_q] view, as the [1, h, L_i] one sequence's backward reads.
TensorView sequence_lse(const TensorView& lse, std::int64_t begin, std::int64_t end) {
  const void* data = static_cast<const std::byte*>(lse.data()) +
                     begin * lse.stride(1) * static_cast<std::int64_t>(dtype_size(lse.dtype()));
  return TensorView(data, lse.dtype(), {1, lse.size(0), end - begin}, {0, lse.stride(0), lse.stride(1)});
}

// packed [h, total_q] columns [begin, begin + L_i) = one sequence's lse [1, h, L_i] (contiguous, same dtype).
void copy_sequence_lse(const Tensor& sequence, Tensor& packed, std::int64_t begin) {
  const std::int64_t h = sequence.size(1), L_i = sequence.size(2), total_q = packed.size(1);
  const auto elem = static_cast<std::int64_t>(dtype_size(packed.dtype()));
  const auto* from = static_cast<const std::byte*>(sequence.data());
  auto* to = static_cast<std::byte*>(packed.data());
  for (std::int64_t head = 0; head < h; ++head)
    std::memcpy(to + (head * total_q + begin) * elem, from + head * L_i * elem, static_cast<std::size_t>(L_i * elem));
}

// The options of sequence i: dropout drawn at its packed positions (its rows and keys start at
// q_begin and k_begin), so that every sequence gets its own mask whatever order they run in.
AttentionOptions sequence_options(const AttentionOptions& o, std::int64_t q_begin, std::int64_t k_begin) {
  AttentionOptions s = o;
  s.dropout_query_offset += q_begin;
  s.dropout_key_offset += k_begin;
  return s;
}

}  // namespace

VarlenResult varlen_attention(const TensorView& q, const TensorView& k, const TensorView& v, CuSeqlens cu_q,
                              CuSeqlens cu_k, const AttentionOptions& options) {
  validate_varlen(q, k, v, cu_q, cu_k, options);
  const std::int64_t total_q = q.size(0), h = q.size(1), d_v = v.size(2);
  VarlenResult result;
  // out: [total_q, h, d_v], written whole: every row belongs to one sequence, whose call writes it
  result.out = Tensor::uninitialized(q.dtype(), {total_q, h, d_v});
  if (options.need_lse) result.lse = Tensor::uninitialized(lse_dtype(q.dtype()), {h, total_q});  // likewise
  detail::for_each_sequence(cu_q, cu_k, [&](std::int64_t i) {
    const std::int64_t q_begin = cu_q[i], q_end = cu_q[i + 1], k_begin = cu_k[i], k_end = cu_k[i + 1];
    Tensor weights, lse;  // lse: [1, h, L_i] when need_lse
    detail::run_attention(sequence_rows(q, q_begin, q_end), sequence_rows(k, k_begin, k_end),
                          sequence_rows(v, k_begin, k_end), sequence_options(options, q_begin, k_begin),
                          sequence_output(result.out, q_begin), weights, lse);
    if (options.need_lse) copy_sequence_lse(lse, result.lse, q_begin);
  });
  return result;
}

AttentionGradients varlen_attention_backward(const TensorView& dout, const TensorView& q, const TensorView& k,
                                             const TensorView& v, const TensorView& out, const TensorView& lse,
                                             CuSeqlens cu_q, CuSeqlens cu_k, const AttentionOptions& options) {
  validate_varlen(q, k, v, cu_q, cu_k, options);
  validate_backward_extras(dout, q, v, out, lse);
  // Zeroed, as the kernels want them; each sequence writes its own rows (disjoint), and the keys of a
  // sequence without queries keep their zeros.
  AttentionGradients grads;
  grads.dq = Tensor(q.dtype(), q.shape());  // [total_q, h, d_k]
  grads.dk = Tensor(q.dtype(), k.shape());  // [total_k, h_kv, d_k]
  grads.dv = Tensor(q.dtype(), v.shape());  // [total_k, h_kv, d_v]
  // d sinks per sequence [n][h], each a float64 sum over its rows, then added in sequence order.
  const auto h = static_cast<std::size_t>(q.size(1));
  std::vector<std::vector<double>> sequence_dsinks(options.sinks ? static_cast<std::size_t>(cu_q.size() - 1) : 0);
  detail::for_each_sequence(cu_q, cu_k, [&](std::int64_t i) {  // L_i = 0 is skipped: its keys' gradients are 0
    const std::int64_t q_begin = cu_q[i], q_end = cu_q[i + 1], k_begin = cu_k[i], k_end = cu_k[i + 1];
    detail::run_attention_backward(sequence_rows(dout, q_begin, q_end), sequence_rows(q, q_begin, q_end),
                                   sequence_rows(k, k_begin, k_end), sequence_rows(v, k_begin, k_end),
                                   sequence_rows(out, q_begin, q_end), sequence_lse(lse, q_begin, q_end),
                                   sequence_options(options, q_begin, k_begin), sequence_output(grads.dq, q_begin),
                                   sequence_output(grads.dk, k_begin), sequence_output(grads.dv, k_begin));
    if (!options.sinks) return;
    std::vector<double>& dsinks = sequence_dsinks[static_cast<std::size_t>(i)];
    dsinks.assign(h, 0.0);
    detail::accumulate_sink_gradient(sequence_rows(dout, q_begin, q_end), sequence_rows(out, q_begin, q_end),
                                     sequence_lse(lse, q_begin, q_end), *options.sinks, dsinks);
  });
  if (!options.sinks) return grads;
  std::vector<double> dsinks(h, 0.0);
  for (const std::vector<double>& one : sequence_dsinks)  // empty for a sequence without queries
    for (std::size_t head = 0; head < one.size(); ++head) dsinks[head] += one[head];
  grads.dsinks = detail::sink_gradient_tensor(dsinks, options.sinks->dtype());
  return grads;
}

}  // namespace mha
