// The Python module `mha._distributed`: ring attention over MPI (mha/distributed.hpp) on NumPy shards,
// with the communicator an mpi4py Comm. Built when the library's distributed component is; the
// pure-Python layer is python/mha/distributed.py.
#include "mha/distributed.hpp"

#include <mpi4py/mpi4py.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include <pybind11/stl.h>

#include "arguments.hpp"
#include "error_translation.hpp"
#include "tensor_conversion.hpp"

namespace mha::python {
namespace {

using distributed::Layout;

// The MPI_Comm inside an mpi4py Comm; TypeError for anything else.
MPI_Comm communicator(py::handle comm) {
  MPI_Comm* c = PyMPIComm_Get(comm.ptr());
  if (c == nullptr) throw py::error_already_set();
  return *c;
}

struct HeldRingOptions {
  distributed::RingOptions options;
  std::optional<ArrayView> key_padding_mask, sinks, alibi_slopes, attn_mask;
};

// The score's arguments the ring takes besides causal and scale: the window (None or (left, right)),
// alibi_slopes [h] and sinks [h] (None or arrays), softcap (None or 0: none), and attn_mask (None, or
// anything else, which the library refuses by name on every rank).
struct RingVariants {
  py::handle window, alibi_slopes, softcap, sinks, attn_mask;
};

// scale (None: the default), dropout_p, dropout_seed, window and softcap converted by name (arguments.hpp).
HeldRingOptions ring_options(bool causal, py::handle scale, Layout layout, py::handle key_padding_mask,
                             std::vector<std::int64_t> key_lengths, py::handle dropout_p, py::handle dropout_seed,
                             Kernel kernel, const RingVariants& variants) {
  HeldRingOptions held;
  held.key_padding_mask = optional_view_of(key_padding_mask, "key_padding_mask", Accept::Mask);
  held.sinks = optional_view_of(variants.sinks, "sinks", Accept::Float);
  held.alibi_slopes = optional_view_of(variants.alibi_slopes, "alibi_slopes", Accept::Float);
  held.attn_mask = optional_view_of(variants.attn_mask, "attn_mask", Accept::Mask);
  distributed::RingOptions& o = held.options;
  o.scale = optional_float_arg(scale, "scale");
  o.causal = causal;
  o.layout = layout;
  if (held.key_padding_mask) o.key_padding_mask = held.key_padding_mask->view;
  o.key_lengths = std::move(key_lengths);
  o.dropout_p = float_arg(dropout_p, "dropout_p");
  o.dropout_seed = uint64_arg(dropout_seed, "dropout_seed");
  o.kernel = kernel;
  if (held.sinks) o.sinks = held.sinks->view;
  if (held.alibi_slopes) o.alibi_slopes = held.alibi_slopes->view;
  if (held.attn_mask) o.attn_mask = held.attn_mask->view;
  if (const auto window = window_arg(variants.window)) o.window_left = window->first, o.window_right = window->second;
  o.softcap = softcap_arg(variants.softcap);
  return held;
}

py::tuple ring(py::handle q, py::handle k, py::handle v, py::handle comm, bool causal, py::handle scale, Layout layout,
               py::handle key_padding_mask, std::vector<std::int64_t> key_lengths, py::handle dropout_p,
               py::handle dropout_seed, Kernel kernel, py::handle sinks, py::handle window, py::handle alibi_slopes,
               py::handle softcap, py::handle attn_mask) {
  const MPI_Comm c = communicator(comm);
  const ArrayView qv = view_of(q, "q", Accept::Float), kv = view_of(k, "k", Accept::Float),
                  vv = view_of(v, "v", Accept::Float);
  const HeldRingOptions held = ring_options(causal, scale, layout, key_padding_mask, std::move(key_lengths), dropout_p,
                                            dropout_seed, kernel, {window, alibi_slopes, softcap, sinks, attn_mask});
  distributed::RingResult r;
  {
    py::gil_scoped_release release;
    r = distributed::ring_attention(qv.view, kv.view, vv.view, c, held.options);
  }
  return py::make_tuple(to_numpy(std::move(r.out)), to_numpy(std::move(r.lse)));
}

py::tuple ring_backward(py::handle dout, py::handle q, py::handle k, py::handle v, py::handle out, py::handle lse,
                        py::handle comm, bool causal, py::handle scale, Layout layout, py::handle key_padding_mask,
                        std::vector<std::int64_t> key_lengths, py::handle dropout_p, py::handle dropout_seed,
                        Kernel kernel, py::handle sinks, py::handle window, py::handle alibi_slopes, py::handle softcap,
                        py::handle attn_mask) {
  const MPI_Comm c = communicator(comm);
  const ArrayView dv = view_of(dout, "dout", Accept::Float), qv = view_of(q, "q", Accept::Float),
                  kv = view_of(k, "k", Accept::Float), vv = view_of(v, "v", Accept::Float),
                  ov = view_of(out, "out", Accept::Float), lv = view_of(lse, "lse", Accept::Float);
  const HeldRingOptions held = ring_options(causal, scale, layout, key_padding_mask, std::move(key_lengths), dropout_p,
                                            dropout_seed, kernel, {window, alibi_slopes, softcap, sinks, attn_mask});
  AttentionGradients g;
  {
    py::gil_scoped_release release;
    g = distributed::ring_attention_backward(dv.view, qv.view, kv.view, vv.view, ov.view, lv.view, c, held.options);
  }
  return gradients_to_python(std::move(g), BFloat16Out::Float32, held.options.sinks.has_value());
}

}  // namespace
}  // namespace mha::python

PYBIND11_MODULE(_distributed, m) {
  namespace py = pybind11;
  using namespace mha::python;
  if (import_mpi4py() < 0) throw py::error_already_set();
  // mha::Error arrives as mha._core.Error (the class `import mha` exposes as mha.Error).
  static py::object error_class = py::module_::import("mha._core").attr("Error");
  translate_mha_errors_to(error_class);
  py::enum_<mha::distributed::Layout>(m, "Layout")
      .value("contiguous", mha::distributed::Layout::Contiguous)
      .value("zigzag", mha::distributed::Layout::Zigzag);
  m.def("shard_chunks", [](std::int64_t n, int ranks, int rank, mha::distributed::Layout layout) {
    std::vector<std::pair<std::int64_t, std::int64_t>> out;
    for (auto c : mha::distributed::shard_chunks(n, ranks, rank, layout)) out.emplace_back(c.start, c.length);
    return out;
  });
  m.def("ring_attention", &ring, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("comm"), py::kw_only(),
        py::arg("causal"), py::arg("scale"), py::arg("layout"), py::arg("key_padding_mask"), py::arg("key_lengths"),
        py::arg("dropout_p"), py::arg("dropout_seed"), py::arg("kernel"), py::arg("sinks") = py::none(),
        py::arg("window") = py::none(), py::arg("alibi_slopes") = py::none(), py::arg("softcap") = py::none(),
        py::arg("attn_mask") = py::none());
  m.def("ring_attention_backward", &ring_backward, py::arg("dout"), py::arg("q"), py::arg("k"), py::arg("v"),
        py::arg("out"), py::arg("lse"), py::arg("comm"), py::kw_only(), py::arg("causal"), py::arg("scale"),
        py::arg("layout"), py::arg("key_padding_mask"), py::arg("key_lengths"), py::arg("dropout_p"),
        py::arg("dropout_seed"), py::arg("kernel"), py::arg("sinks") = py::none(), py::arg("window") = py::none(),
        py::arg("alibi_slopes") = py::none(), py::arg("softcap") = py::none(), py::arg("attn_mask") = py::none());
}
