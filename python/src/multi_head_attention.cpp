// Binds MultiHeadAttentionConfig and MultiHeadAttention (mha/multi_head_attention.hpp). The
// torch.nn.MultiheadAttention-like class that users see is python/mha/__init__.py on top of these.
#include "mha/multi_head_attention.hpp"

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/stl.h>

#include "arguments.hpp"
#include "bindings.hpp"
#include "mha/error.hpp"
#include "mha/io.hpp"
#include "score_arguments.hpp"
#include "tensor_conversion.hpp"

namespace mha::python {

namespace {

// The bound object: the C++ module and a lock. The compute releases the GIL, so two Python threads
// can call one module at once, and forward() is not const (dropout counter, the activations kept for
// backward) while load_state_dict() writes the parameters: every call into the module takes the
// lock. A call that releases the GIL takes the lock after releasing it and drops it before taking
// the GIL back, so a thread never waits for the GIL while holding the lock (no deadlock).
//
// Training-mode forwards lend the caller's arrays to the module (borrow_inputs: no copies); `lent`
// holds references to them until the next forward, so that backward() reads live memory. It changes
// under the lock, with the module's saved state, but only by moves (no reference counts change
// without the GIL): forward() swaps the new references in and drops the old ones once it holds the
// GIL again.
struct LockedModule {
  LockedModule(const MultiHeadAttentionConfig& config, std::uint64_t seed) : module(config, seed) {}
  MultiHeadAttention module;
  std::mutex mutex;
  std::vector<py::object> lent;  // the arrays the last training-mode forward borrowed (guarded by mutex)
};

using Lock = std::lock_guard<std::mutex>;

// The score (score_arguments.hpp), head gate and flags of forward / forward_cached, with the arrays they
// view kept alive.
struct HeldInputs {
  HeldScore score;
  std::optional<ArrayView> head_gate;
  MultiHeadAttentionInputs inputs;
};

HeldInputs inputs_of(ScoreArguments score, py::handle head_gate, bool need_weights, bool average_attn_weights) {
  HeldInputs held{score_of(std::move(score)), optional_view_of(head_gate, "head_gate", Accept::Float), {}};
  static_cast<ScoreSpec&>(held.inputs) = held.score.score;
  if (held.head_gate) held.inputs.head_gate = held.head_gate->view;  // float32 / float64, as it is
  held.inputs.need_weights = need_weights;
  held.inputs.average_attn_weights = average_attn_weights;
  return held;
}

// An input array of a layer whose dtype is `layer_dtype`, viewed in place; for a bfloat16 layer,
// float32 / float64 NumPy data is rounded to bfloat16 first (NumPy has no bfloat16 to pass; a
// BFloat16Bits is viewed in place). Other mixes reach the library, which refuses them naming both dtypes.
ArrayView layer_input(py::handle obj, const std::string& name, DType layer_dtype) {
  ArrayView view = view_of(obj, name, Accept::Float);
  if (layer_dtype != DType::BFloat16) return view;
  return converted_to(std::move(view), DType::BFloat16);
}

// query, key, value as layer inputs; one array passed twice (self-attention) stays one view, which is
// how the layer recognises it (and converts it once).
struct QueryKeyValue {
  ArrayView query, key, value;
};
QueryKeyValue layer_inputs(py::handle query, py::handle key, py::handle value, DType layer_dtype) {
  ArrayView q = layer_input(query, "query", layer_dtype);
  ArrayView k = key.is(query) ? q : layer_input(key, "key", layer_dtype);
  ArrayView v = value.is(key) ? k : value.is(query) ? q : layer_input(value, "value", layer_dtype);
  return {std::move(q), std::move(k), std::move(v)};
}

// query [B, L, E] / [L, B, E] / [L, E], key [.., S, kdim], value [.., S, vdim].
// Returns (out like query, weights or None); bfloat16 results are float32 arrays, or BFloat16Bits
// when query is one. A training-mode forward keeps the arrays (not copies)
// for backward, which raises mha.Error if one was modified in between.
py::tuple forward(LockedModule& self, py::handle query, py::handle key, py::handle value, py::handle key_padding_mask,
                  py::handle attn_mask, py::handle head_gate, std::vector<std::int64_t> key_lengths, bool is_causal,
                  bool need_weights, bool average_attn_weights, py::handle window, py::handle alibi_slopes,
                  py::handle softcap, py::handle cu_seqlens, py::handle cu_seqlens_k, py::handle positions,
                  py::handle key_positions) {
  const auto [query_view, key_view, value_view] = layer_inputs(query, key, value, self.module.config().dtype);
  HeldInputs held =
      inputs_of({attn_mask, is_causal, {}, key_padding_mask, std::move(key_lengths), window, alibi_slopes, softcap},
                head_gate, need_weights, average_attn_weights);
  // Packed sequences (MultiHeadAttentionInputs::cu_seqlens): integer offsets, by name.
  if (!cu_seqlens.is_none()) held.inputs.cu_seqlens = int64_sequence_arg(cu_seqlens, "cu_seqlens");
  if (!cu_seqlens_k.is_none()) held.inputs.cu_seqlens_k = int64_sequence_arg(cu_seqlens_k, "cu_seqlens_k");
  // Explicit rotary positions (MultiHeadAttentionInputs::positions): views on int64 / int32 arrays held here.
  const HeldPositions query_positions = positions_arg(positions, "positions");
  const HeldPositions key_positions_held = positions_arg(key_positions, "key_positions");
  held.inputs.positions = query_positions.view;
  held.inputs.key_positions = key_positions_held.view;
  held.inputs.borrow_inputs = true;  // backward() reads the arrays themselves, kept alive by self.lent
  // References taken here, with the GIL; after the call `lent` holds what the module no longer needs
  // (the previous forward's arrays, or these after an eval-mode forward), released with the GIL.
  std::vector<py::object> lent = {query_view.array, key_view.array, value_view.array};
  lent.reserve(6);
  MultiHeadAttentionOutput output;
  {
    py::gil_scoped_release release;
    const Lock lock(self.mutex);
    output = self.module.forward(query_view.view, key_view.view, value_view.view, held.inputs);
    if (self.module.training()) {
      std::swap(self.lent, lent);
    } else {  // nothing kept: the previous forward's arrays go too
      for (py::object& array : self.lent) lent.push_back(std::move(array));
      self.lent.clear();  // moved-from (null) handles: no reference counts change
    }
  }
  const BFloat16Out bfloat16_out = bfloat16_out_like(query);
  return py::make_tuple(to_python(std::move(output.out), bfloat16_out),
                        to_python_or_none(std::move(output.weights), bfloat16_out));
}

// The gradients of the last training-mode forward, given dout = dLoss/dout (shaped like its out).
// Returns (d query, d key, d value, {name: d parameter} in state_dict order, d head_gate or None);
// bfloat16 gradients are float32 arrays, or BFloat16Bits when dout is one (the gate's gradient has the
// gate's dtype, float32 or float64).
py::tuple backward(LockedModule& self, py::handle dout) {
  const ArrayView dout_view = layer_input(dout, "dout", self.module.config().dtype);
  MultiHeadAttentionGradients grads;
  std::vector<std::string> names;
  {
    py::gil_scoped_release release;
    const Lock lock(self.mutex);
    grads = self.module.backward(dout_view.view);
    names = self.module.parameter_names();
  }
  const BFloat16Out bfloat16_out = bfloat16_out_like(dout);
  py::dict parameters;
  for (const std::string& name : names) {
    auto it = grads.parameters.find(name);
    if (it != grads.parameters.end()) parameters[py::str(name)] = to_python(std::move(it->second), bfloat16_out);
  }
  return py::make_tuple(to_python(std::move(grads.query), bfloat16_out), to_python(std::move(grads.key), bfloat16_out),
                        to_python(std::move(grads.value), bfloat16_out), parameters,
                        to_numpy_or_none(std::move(grads.head_gate)));
}

// Projects key and value (the layout forward takes) and appends them to `cache`.
void append_to_cache(LockedModule& self, py::handle cache_obj, py::handle key, py::handle value) {
  KeyValueCache& cache = object_arg<KeyValueCache>(cache_obj, "cache", "an mha.KeyValueCache");
  const DType layer_dtype = self.module.config().dtype;
  const ArrayView key_view = layer_input(key, "key", layer_dtype);
  const ArrayView value_view = value.is(key) ? key_view : layer_input(value, "value", layer_dtype);
  py::gil_scoped_release release;
  const Lock lock(self.mutex);
  self.module.append_to_cache(cache, key_view.view, value_view.view);
}

// query (the layout forward takes) attended to every position in `cache`, in evaluation mode; masks
// refer to cache positions. Returns (out like query, weights or None).
py::tuple forward_cached(LockedModule& self, py::handle query, py::handle cache_obj, py::handle key_padding_mask,
                         py::handle attn_mask, py::handle head_gate, std::vector<std::int64_t> key_lengths,
                         bool is_causal, bool need_weights, bool average_attn_weights, py::handle window,
                         py::handle alibi_slopes, py::handle softcap) {
  const KeyValueCache& cache = object_arg<KeyValueCache>(cache_obj, "cache", "an mha.KeyValueCache");
  const ArrayView query_view = layer_input(query, "query", self.module.config().dtype);
  const HeldInputs held =
      inputs_of({attn_mask, is_causal, {}, key_padding_mask, std::move(key_lengths), window, alibi_slopes, softcap},
                head_gate, need_weights, average_attn_weights);
  MultiHeadAttentionOutput output;
  {
    py::gil_scoped_release release;
    const Lock lock(self.mutex);
    output = self.module.forward_cached(query_view.view, cache, held.inputs);
  }
  const BFloat16Out bfloat16_out = bfloat16_out_like(query);
  return py::make_tuple(to_python(std::move(output.out), bfloat16_out),
                        to_python_or_none(std::move(output.weights), bfloat16_out));
}

// Loads a {name: array} dict; every value must be a float32 or float64 array-like or a BFloat16Bits
// (converted to the layer's dtype).
void load_state_dict(LockedModule& self, const py::dict& state) {
  std::vector<ArrayView> held;  // keeps the arrays (or their copies) alive during the load
  held.reserve(state.size());
  std::map<std::string, TensorView> views;
  for (const auto& [key, value] : state) {
    const std::string name = utf8_arg(key, "state_dict key");
    held.push_back(view_of(value, name, Accept::Float));
    views.emplace(name, held.back().view);
  }
  const Lock lock(self.mutex);
  self.module.load_state_dict(views);
}

// {name: copy of the parameter} in PyTorch's state_dict order (a dict keeps insertion order).
py::dict state_dict(LockedModule& self) {
  std::vector<std::pair<std::string, Tensor>> copies;
  {
    const Lock lock(self.mutex);
    for (const std::string& name : self.module.parameter_names()) {
      copies.emplace_back(name, self.module.parameter(name).clone());
    }
  }
  py::dict state;
  for (auto& [name, tensor] : copies) state[py::str(name)] = to_numpy(std::move(tensor));
  return state;
}

}  // namespace

void register_multi_head_attention(py::module_& m) {
  using Config = MultiHeadAttentionConfig;
  py::class_<Config>(m, "MultiHeadAttentionConfig",
                     "Hyper-parameters of MultiHeadAttention; 0 for d_k, d_v, kdim, vdim means the default")
      .def(py::init<>())
      .def_readwrite("d_model", &Config::d_model)
      .def_readwrite("num_heads", &Config::num_heads)
      .def_readwrite("num_kv_heads", &Config::num_kv_heads)
      .def_readwrite("d_k", &Config::d_k)
      .def_readwrite("d_v", &Config::d_v)
      .def_readwrite("kdim", &Config::kdim)
      .def_readwrite("vdim", &Config::vdim)
      .def_readwrite("bias", &Config::bias)
      .def_readwrite("add_bias_kv", &Config::add_bias_kv)
      .def_readwrite("add_zero_attn", &Config::add_zero_attn)
      .def_readwrite("sinks", &Config::sinks)
      .def_readwrite("rotary_dim", &Config::rotary_dim)
      .def_readwrite("rotary_base", &Config::rotary_base)
      .def_readwrite("rotary_interleaved", &Config::rotary_interleaved)
      .def_readwrite("dropout", &Config::dropout)
      .def_readwrite("batch_first", &Config::batch_first)
      .def_readwrite("dtype", &Config::dtype);

  // Not locked: one cache must not be used from two threads at once (one per decoding stream).
  py::class_<KeyValueCache>(m, "KeyValueCache",
                            "Projected keys and values of the positions seen so far, for incremental decoding")
      .def(py::init<>())
      .def_property_readonly("batch", &KeyValueCache::batch, "B (0 before the first append)")
      .def_property_readonly("length", &KeyValueCache::length, "positions held")
      .def_property_readonly("capacity", &KeyValueCache::capacity)
      .def("clear", &KeyValueCache::clear, "Length 0, keeps the storage")
      .def("__len__", &KeyValueCache::length);

  py::class_<LockedModule>(m, "MultiHeadAttention", "Multi-head attention with PyTorch's parameter names")
      .def(py::init<const Config&, std::uint64_t>(), py::arg("config"), py::arg("seed") = 0)
      .def_property_readonly(
          "config", [](const LockedModule& self) { return self.module.config(); },
          "The config with every default resolved (a copy)")
      .def_property_readonly("packed_in_proj", [](const LockedModule& self) { return self.module.packed_in_proj(); })
      .def("parameter_names", [](const LockedModule& self) { return self.module.parameter_names(); })
      .def(
          "parameter",
          [](LockedModule& self, const std::string& name) {
            Tensor copy;
            {
              const Lock lock(self.mutex);
              copy = self.module.parameter(name).clone();
            }
            return to_numpy(std::move(copy));
          },
          py::arg("name"), "A copy of the parameter `name`")
      .def(
          "set_parameter",
          [](LockedModule& self, const std::string& name, py::handle value) {
            const ArrayView view = view_of(value, name, Accept::Float);
            const Lock lock(self.mutex);
            self.module.set_parameter(name, view.view);
          },
          py::arg("name"), py::arg("value"))
      .def("load_state_dict", &load_state_dict, py::arg("state_dict"))
      .def("state_dict", &state_dict)
      .def(
          "train",
          [](LockedModule& self, bool mode) {
            const Lock lock(self.mutex);
            self.module.train(mode);
          },
          py::arg("mode") = true)
      .def("eval",
           [](LockedModule& self) {
             const Lock lock(self.mutex);
             self.module.eval();
           })
      .def_property_readonly("training",
                             [](LockedModule& self) {
                               const Lock lock(self.mutex);
                               return self.module.training();
                             })
      .def_property(
          "kernel",
          [](LockedModule& self) {
            const Lock lock(self.mutex);
            return self.module.kernel();
          },
          [](LockedModule& self, Kernel kernel) {
            const Lock lock(self.mutex);
            self.module.set_kernel(kernel);
          })
      .def("forward", &forward, py::arg("query"), py::arg("key"), py::arg("value"), py::kw_only(),
           py::arg("key_padding_mask") = py::none(), py::arg("attn_mask") = py::none(),
           py::arg("head_gate") = py::none(), py::arg("key_lengths") = std::vector<std::int64_t>{},
           py::arg("is_causal") = false, py::arg("need_weights") = true, py::arg("average_attn_weights") = true,
           py::arg("window") = py::none(), py::arg("alibi_slopes") = py::none(), py::arg("softcap") = 0.0,
           py::arg("cu_seqlens") = py::none(), py::arg("cu_seqlens_k") = py::none(), py::arg("positions") = py::none(),
           py::arg("key_positions") = py::none(), "Returns (out like query, weights or None)")
      .def(
          "save_safetensors",
          [](LockedModule& self, py::handle path_obj) {
            const std::string path = path_arg(path_obj);
            py::gil_scoped_release release;
            const Lock lock(self.mutex);
            mha::save_safetensors(self.module, path);
          },
          py::arg("path"), "Parameters under state_dict names, the config in __metadata__")
      .def("append_to_cache", &append_to_cache, py::arg("cache"), py::arg("key"), py::arg("value"),
           "Projects key and value and appends them to the cache")
      .def("forward_cached", &forward_cached, py::arg("query"), py::arg("cache"), py::kw_only(),
           py::arg("key_padding_mask") = py::none(), py::arg("attn_mask") = py::none(),
           py::arg("head_gate") = py::none(), py::arg("key_lengths") = std::vector<std::int64_t>{},
           py::arg("is_causal") = false, py::arg("need_weights") = true, py::arg("average_attn_weights") = true,
           py::arg("window") = py::none(), py::arg("alibi_slopes") = py::none(), py::arg("softcap") = 0.0,
           "Attends query to every cached position (evaluation mode); returns (out like query, weights or None)")
      .def(
          "saved_bytes",
          [](LockedModule& self) {
            const Lock lock(self.mutex);
            return self.module.saved_bytes();
          },
          "Bytes the last training-mode forward keeps for backward (the inputs are borrowed, not copied)")
      .def(
          "backward", &backward, py::arg("dout"),
          "Gradients of the last training-mode forward: (d query, d key, d value, {name: d parameter}, d head_gate or None)");
}

}  // namespace mha::python
