// Binds scaled_dot_product_attention and its backward (mha/attention.hpp), the Kernel choice and the
// thread count.
#include "mha/attention.hpp"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/stl.h>

#include "arguments.hpp"
#include "bindings.hpp"
#include "mha/error.hpp"
#include "score_arguments.hpp"
#include "tensor_conversion.hpp"

namespace mha::python {

namespace {

// AttentionOptions built from Python arguments: the score (score_arguments.hpp), with the arrays its
// views point into, and the call's own.
struct HeldOptions {
  AttentionOptions options;
  HeldScore score;
};

HeldOptions attention_options(ScoreArguments score, py::handle dropout_p, py::handle dropout_seed, Kernel kernel) {
  HeldOptions held{{}, score_of(std::move(score))};
  static_cast<ScoreSpec&>(held.options) = held.score.score;
  held.options.dropout_p = float_arg(dropout_p, "dropout_p");
  held.options.dropout_seed = uint64_arg(dropout_seed, "dropout_seed");
  held.options.kernel = kernel;
  return held;
}

// q: [B, h, L, d_k], k: [B, h, S, d_k], v: [B, h, S, d_v]. Returns (out [B, h, L, d_v],
// weights [B, h, L, S] or None, lse [B, h, L] or None); bfloat16 results are float32 arrays, or
// BFloat16Bits when q is one.
py::tuple sdpa(py::handle q, py::handle k, py::handle v, py::handle attn_mask, bool is_causal, py::handle scale,
               py::handle key_padding_mask, std::vector<std::int64_t> key_lengths, py::handle dropout_p,
               py::handle dropout_seed, bool need_weights, bool need_lse, Kernel kernel, py::handle window,
               py::handle alibi_slopes, py::handle softcap, py::handle sinks) {
  const ArrayView q_view = view_of(q, "q", Accept::Float);
  const ArrayView k_view = view_of(k, "k", Accept::Float);
  const ArrayView v_view = view_of(v, "v", Accept::Float);
  HeldOptions held = attention_options(
      {attn_mask, is_causal, scale, key_padding_mask, std::move(key_lengths), window, alibi_slopes, softcap, sinks},
      dropout_p, dropout_seed, kernel);
  held.options.need_weights = need_weights;
  held.options.need_lse = need_lse;

  AttentionResult result;
  {
    py::gil_scoped_release release;
    result = scaled_dot_product_attention(q_view.view, k_view.view, v_view.view, held.options);
  }
  const BFloat16Out bfloat16_out = bfloat16_out_like(q);  // bfloat16 results as q came in
  return py::make_tuple(to_python(std::move(result.out), bfloat16_out),
                        to_python_or_none(std::move(result.weights), bfloat16_out),
                        to_numpy_or_none(std::move(result.lse)));
}

// dout, out: [B, h, L, d_v], lse: [B, h, L] from the forward with the same inputs and options.
// Returns (dq [B, h, L, d_k], dk [B, h, S, d_k], dv [B, h, S, d_v]), and dsinks [h] last when sinks are given.
py::tuple sdpa_backward(py::handle dout, py::handle q, py::handle k, py::handle v, py::handle out, py::handle lse,
                        py::handle attn_mask, bool is_causal, py::handle scale, py::handle key_padding_mask,
                        std::vector<std::int64_t> key_lengths, py::handle dropout_p, py::handle dropout_seed,
                        Kernel kernel, py::handle window, py::handle alibi_slopes, py::handle softcap,
                        py::handle sinks) {
  const ArrayView dout_view = view_of(dout, "dout", Accept::Float);
  const ArrayView q_view = view_of(q, "q", Accept::Float);
  const ArrayView k_view = view_of(k, "k", Accept::Float);
  const ArrayView v_view = view_of(v, "v", Accept::Float);
  const ArrayView out_view = view_of(out, "out", Accept::Float);
  const ArrayView lse_view = view_of(lse, "lse", Accept::Float);
  const HeldOptions held = attention_options(
      {attn_mask, is_causal, scale, key_padding_mask, std::move(key_lengths), window, alibi_slopes, softcap, sinks},
      dropout_p, dropout_seed, kernel);

  AttentionGradients grads;
  {
    py::gil_scoped_release release;
    grads = scaled_dot_product_attention_backward(dout_view.view, q_view.view, k_view.view, v_view.view, out_view.view,
                                                  lse_view.view, held.options);
  }
  // bfloat16 gradients as dout came in
  return gradients_to_python(std::move(grads), bfloat16_out_like(dout), held.options.sinks.has_value());
}

}  // namespace

void register_attention(py::module_& m) {
  py::enum_<Kernel>(m, "Kernel", "Which implementation computes the attention core")
      .value("flash", Kernel::Flash)
      .value("reference", Kernel::Reference);

  const Kernel default_kernel = AttentionOptions{}.kernel;
  m.def("scaled_dot_product_attention", &sdpa, py::arg("q"), py::arg("k"), py::arg("v"), py::kw_only(),
        py::arg("attn_mask") = py::none(), py::arg("is_causal") = false, py::arg("scale") = py::none(),
        py::arg("key_padding_mask") = py::none(), py::arg("key_lengths") = std::vector<std::int64_t>{},
        py::arg("dropout_p") = 0.0, py::arg("dropout_seed") = 0, py::arg("need_weights") = false,
        py::arg("need_lse") = false, py::arg("kernel") = default_kernel, py::arg("window") = py::none(),
        py::arg("alibi_slopes") = py::none(), py::arg("softcap") = 0.0, py::arg("sinks") = py::none(),
        "softmax(q k^T * scale + mask) v. q: [B, h, L, d_k], k: [B, h_kv, S, d_k], v: [B, h_kv, S, d_v].\n"
        "sinks: [h] logits joining each row's softmax with no value (the lse includes them).\n"
        "Returns (out [B, h, L, d_v], weights [B, h, L, S] or None, lse [B, h, L] or None).");

  m.def("scaled_dot_product_attention_backward", &sdpa_backward, py::arg("dout"), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("out"), py::arg("lse"), py::kw_only(), py::arg("attn_mask") = py::none(),
        py::arg("is_causal") = false, py::arg("scale") = py::none(), py::arg("key_padding_mask") = py::none(),
        py::arg("key_lengths") = std::vector<std::int64_t>{}, py::arg("dropout_p") = 0.0, py::arg("dropout_seed") = 0,
        py::arg("kernel") = default_kernel, py::arg("window") = py::none(), py::arg("alibi_slopes") = py::none(),
        py::arg("softcap") = 0.0, py::arg("sinks") = py::none(),
        "The gradients (dq, dk, dv) of scaled_dot_product_attention, given dout = dLoss/dout and the\n"
        "forward's out and lse (need_lse=True), with the forward's options; (dq, dk, dv, dsinks) when\n"
        "sinks are given (dsinks [h] in the sinks' dtype). New arrays, nothing accumulated.");

  m.def(
      "set_num_threads",
      [](py::handle threads) {
        const std::int64_t n = int64_arg(threads, "threads");
        if (n != static_cast<int>(n))  // beyond C int: out of [1, max_num_threads()] either way
          throw Error("threads: " + std::to_string(n) +
                      (n < 1 ? std::string(" is not a positive thread count")
                             : " is more than this machine's bound: at most " + std::to_string(max_num_threads())));
        set_num_threads(static_cast<int>(n));
      },
      py::arg("threads"),
      "Sets the number of OpenMP threads the library's calls made from the calling thread use, in\n"
      "[1, max_num_threads()]; raises mha.Error naming the value and the bound otherwise.\n\n"
      "Scope: the calling thread only, silently (OpenMP keeps one count per thread). A call from\n"
      "another threading.Thread runs with that thread's own count, which starts at OpenMP's default\n"
      "(OMP_NUM_THREADS, else one per core) whatever was set here; call set_num_threads in each\n"
      "thread that calls the library.");
  m.def("num_threads", &num_threads, "The number of OpenMP threads the calling thread's library calls use.");
  m.def("max_num_threads", &max_num_threads,
        "The largest count set_num_threads accepts: max(64, 4 x the machine's cores). More threads\n"
        "than that run no faster and risk the process (each costs a stack and a workspace).");
}

}  // namespace mha::python
