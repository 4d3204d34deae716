// Binds varlen_attention and its backward (mha/varlen.hpp): packed variable-length batches, FlashAttention's
// flash_attn_varlen_func layout. q, k, v viewed in place; cu_seqlens viewed in place when they are
// contiguous int32 or int64 arrays.
//
// Legend: n sequences, h query heads, h_kv key/value heads, total_q / total_k packed query / key rows.
#include "mha/varlen.hpp"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "arguments.hpp"
#include "bindings.hpp"
#include "mha/error.hpp"
#include "score_arguments.hpp"
#include "tensor_conversion.hpp"

namespace mha::python {

namespace {

// cu_seqlens as the library reads them, with the array that holds them.
struct HeldOffsets {
  py::array array;
  CuSeqlens offsets;
};

template <class Int>
HeldOffsets contiguous_offsets(const py::array& array) {
  auto held = py::array_t<Int, py::array::c_style>::ensure(array);  // native byte order, contiguous
  const std::span<const Int> offsets(held.data(), static_cast<std::size_t>(held.size()));
  return HeldOffsets{std::move(held), CuSeqlens(offsets)};
}

// An int32 or int64 array-like of rank 1, [n + 1]; anything else is refused naming `name`. The
// library checks the values (prefix sums starting at 0, ending at the packed rows).
HeldOffsets offsets_of(py::handle obj, const char* name) {
  const std::string expected = std::string(name) + ": expected an int32 or int64 array [n + 1] of prefix sums of the " +
                               "sequence lengths, got ";
  py::array array = py::array::ensure(obj);
  if (!array) throw Error(expected + py::str(py::type::handle_of(obj).attr("__name__")).cast<std::string>());
  const py::dtype dtype = array.dtype();
  const char kind = dtype.kind();
  if (kind != 'i' || (dtype.itemsize() != 4 && dtype.itemsize() != 8))
    throw Error(expected + py::str(py::handle(dtype)).cast<std::string>());
  if (array.ndim() != 1) {
    Shape shape;
    for (py::ssize_t d = 0; d < array.ndim(); ++d) shape.push_back(array.shape(d));
    throw Error(expected + "rank " + std::to_string(array.ndim()) + " " + shape_str(shape));
  }
  return dtype.itemsize() == 4 ? contiguous_offsets<std::int32_t>(array) : contiguous_offsets<std::int64_t>(array);
}

// AttentionOptions from Python's arguments, with the arrays its views point into. attn_mask,
// key_padding_mask, key_lengths and need_weights are passed on for the library to refuse by name.
struct HeldOptions {
  AttentionOptions options;
  HeldScore score;
};

struct VarlenArguments {
  ScoreArguments score;
  py::handle dropout_p, dropout_seed;
  Kernel kernel;
};

HeldOptions varlen_options(VarlenArguments a) {
  HeldOptions held{{}, score_of(std::move(a.score))};
  static_cast<ScoreSpec&>(held.options) = held.score.score;
  held.options.dropout_p = float_arg(a.dropout_p, "dropout_p");
  held.options.dropout_seed = uint64_arg(a.dropout_seed, "dropout_seed");
  held.options.kernel = a.kernel;
  return held;
}

std::vector<std::int64_t> key_lengths_of(py::handle obj) {
  return obj.is_none() ? std::vector<std::int64_t>{} : int64_sequence_arg(obj, "key_lengths");
}

// q [total_q, h, d_k], k [total_k, h_kv, d_k], v [total_k, h_kv, d_v]. Returns (out [total_q, h, d_v],
// lse [h, total_q] or None); bfloat16 results are float32 arrays, or BFloat16Bits when q is one.
py::tuple varlen(py::handle q, py::handle k, py::handle v, py::handle cu_seqlens_q, py::handle cu_seqlens_k,
                 bool is_causal, py::handle scale, py::handle window, py::handle alibi_slopes, py::handle softcap,
                 py::handle sinks, py::handle dropout_p, py::handle dropout_seed, py::handle need_lse, Kernel kernel,
                 py::handle attn_mask, py::handle key_padding_mask, py::handle key_lengths, py::handle need_weights) {
  const ArrayView q_view = view_of(q, "q", Accept::Float);
  const ArrayView k_view = view_of(k, "k", Accept::Float);
  const ArrayView v_view = view_of(v, "v", Accept::Float);
  const HeldOffsets cu_q = offsets_of(cu_seqlens_q, "cu_seqlens_q"), cu_k = offsets_of(cu_seqlens_k, "cu_seqlens_k");
  HeldOptions held = varlen_options({{attn_mask, is_causal, scale, key_padding_mask, key_lengths_of(key_lengths),
                                      window, alibi_slopes, softcap, sinks},
                                     dropout_p,
                                     dropout_seed,
                                     kernel});
  held.options.need_lse = flag_arg(need_lse, "need_lse");
  held.options.need_weights = flag_arg(need_weights, "need_weights");
  VarlenResult result;
  {
    py::gil_scoped_release release;
    result = varlen_attention(q_view.view, k_view.view, v_view.view, cu_q.offsets, cu_k.offsets, held.options);
  }
  return py::make_tuple(to_python(std::move(result.out), bfloat16_out_like(q)),
                        to_numpy_or_none(std::move(result.lse)));
}

// dout, out [total_q, h, d_v], lse [h, total_q] from the forward with the same inputs and options.
// Returns (dq [total_q, h, d_k], dk [total_k, h_kv, d_k], dv [total_k, h_kv, d_v]), and dsinks [h] last with sinks.
py::tuple varlen_backward(py::handle dout, py::handle q, py::handle k, py::handle v, py::handle out, py::handle lse,
                          py::handle cu_seqlens_q, py::handle cu_seqlens_k, bool is_causal, py::handle scale,
                          py::handle window, py::handle alibi_slopes, py::handle softcap, py::handle sinks,
                          py::handle dropout_p, py::handle dropout_seed, Kernel kernel, py::handle attn_mask,
                          py::handle key_padding_mask, py::handle key_lengths) {
  const ArrayView dout_view = view_of(dout, "dout", Accept::Float);
  const ArrayView q_view = view_of(q, "q", Accept::Float);
  const ArrayView k_view = view_of(k, "k", Accept::Float);
  const ArrayView v_view = view_of(v, "v", Accept::Float);
  const ArrayView out_view = view_of(out, "out", Accept::Float);
  const ArrayView lse_view = view_of(lse, "lse", Accept::Float);
  const HeldOffsets cu_q = offsets_of(cu_seqlens_q, "cu_seqlens_q"), cu_k = offsets_of(cu_seqlens_k, "cu_seqlens_k");
  const HeldOptions held = varlen_options({{attn_mask, is_causal, scale, key_padding_mask, key_lengths_of(key_lengths),
                                            window, alibi_slopes, softcap, sinks},
                                           dropout_p,
                                           dropout_seed,
                                           kernel});
  AttentionGradients grads;
  {
    py::gil_scoped_release release;
    grads = varlen_attention_backward(dout_view.view, q_view.view, k_view.view, v_view.view, out_view.view,
                                      lse_view.view, cu_q.offsets, cu_k.offsets, held.options);
  }
  // bfloat16 gradients as dout came in
  return gradients_to_python(std::move(grads), bfloat16_out_like(dout), held.options.sinks.has_value());
}

constexpr const char* kVarlenDoc = R"(Attention over a packed batch of variable-length sequences (FlashAttention's
flash_attn_varlen_func layout and meaning), without padding: the work is sum_i L_i S_i.

Layout: the n sequences lie one after another in the rows of
    q: [total_q, h, d_k],  k: [total_k, h_kv, d_k],  v: [total_k, h_kv, d_v]
(float32 or float64 arrays, or bfloat16 as BFloat16Bits; any strides). cu_seqlens_q and cu_seqlens_k are
int32 or int64 arrays [n + 1] (the same n), the prefix sums of the lengths: starting at 0, non-decreasing,
ending at total_q and total_k. Sequence i's queries are q's rows cu_seqlens_q[i] .. cu_seqlens_q[i+1] - 1
(L_i of them) and attend only to its keys, k's rows cu_seqlens_k[i] .. cu_seqlens_k[i+1] - 1 (S_i).
h_kv divides h (grouped-query attention: query head j reads key/value head j // (h // h_kv)).

Meaning: per sequence, exactly scaled_dot_product_attention on [1, h, L_i, d] (same kernel). Positions are
per sequence: query r sits at r + S_i - L_i, so is_causal is bottom-right aligned within each sequence
(query r sees key j iff j <= r + S_i - L_i), and window (left, right) and ALiBi's -slope * |r + S_i - L_i
- j| are measured there too. scale, softcap, alibi_slopes [h] and sinks [h] as scaled_dot_product_attention
takes them; kernel: mha.Kernel.flash (the default; float64 runs the reference) or mha.Kernel.reference.
An empty sequence is fine (S_i = 0: output 0, lse -inf, or sinks[head] with sinks).
Dropout: each sequence draws its own mask at its packed positions (the hash of scaled_dot_product_attention
at rows cu_seqlens_q[i] + r and keys cu_seqlens_k[i] + j), the same for the same seed, whatever the threads.

Refused (mha.Error naming the argument): attn_mask, key_padding_mask and key_lengths (they are laid out
over a [B, S] batch that a packed batch does not have: pack only the real keys), need_weights=True (no
[B, h, L, S] layout), and cu_seqlens that are not int32 / int64 rank-1 prefix sums as above.

Returns (out [total_q, h, d_v], lse [h, total_q] or None): lse (need_lse=True) is each row's log-sum-exp,
float32 for bfloat16 q, FlashAttention's layout, as varlen_attention_backward takes it.)";

constexpr const char* kVarlenBackwardDoc =
    R"(The gradients (dq, dk, dv) of varlen_attention (and dsinks [h] last, in the sinks' dtype, when sinks are
given: summed over the sequences in order, in float64): dout = dLoss/dout
[total_q, h, d_v], with the forward's out [total_q, h, d_v] and lse [h, total_q] (need_lse=True), the same
q, k, v, cu_seqlens and options (dropout_p and dropout_seed regenerate the mask). Returns dq [total_q, h,
d_k], dk [total_k, h_kv, d_k], dv [total_k, h_kv, d_v] (grouped heads summed over their group) as new arrays:
nothing is accumulated. The keys of a sequence without queries get 0. The sinks get no gradient here.
Refuses what varlen_attention refuses, naming the argument.)";

}  // namespace

void register_varlen(py::module_& m) {
  const Kernel default_kernel = AttentionOptions{}.kernel;
  m.def("varlen_attention", &varlen, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("cu_seqlens_q"),
        py::arg("cu_seqlens_k"), py::kw_only(), py::arg("is_causal") = false, py::arg("scale") = py::none(),
        py::arg("window") = py::none(), py::arg("alibi_slopes") = py::none(), py::arg("softcap") = py::none(),
        py::arg("sinks") = py::none(), py::arg("dropout_p") = 0.0, py::arg("dropout_seed") = 0,
        py::arg("need_lse") = false, py::arg("kernel") = default_kernel, py::arg("attn_mask") = py::none(),
        py::arg("key_padding_mask") = py::none(), py::arg("key_lengths") = py::none(), py::arg("need_weights") = false,
        kVarlenDoc);
  m.def("varlen_attention_backward", &varlen_backward, py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("out"), py::arg("lse"), py::arg("cu_seqlens_q"), py::arg("cu_seqlens_k"), py::kw_only(),
        py::arg("is_causal") = false, py::arg("scale") = py::none(), py::arg("window") = py::none(),
        py::arg("alibi_slopes") = py::none(), py::arg("softcap") = py::none(), py::arg("sinks") = py::none(),
        py::arg("dropout_p") = 0.0, py::arg("dropout_seed") = 0, py::arg("kernel") = default_kernel,
        py::arg("attn_mask") = py::none(), py::arg("key_padding_mask") = py::none(),
        py::arg("key_lengths") = py::none(), kVarlenBackwardDoc);
}

}  // namespace mha::python
