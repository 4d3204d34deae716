// The register_* functions of the Python module `mha._core`, one per bound thing (one .cpp each);
// module.cpp only calls them, in this order.
#pragma once

#include <pybind11/pybind11.h>

namespace mha::python {

namespace py = pybind11;

void register_error(py::module_& m);                 // error.cpp: mha::Error -> mha._core.Error (a ValueError)
void register_tensor(py::module_& m);                // tensor_conversion.cpp: DType
void register_attention(py::module_& m);             // attention.cpp: Kernel, scaled_dot_product_attention, threads
void register_multi_head_attention(py::module_& m);  // multi_head_attention.cpp: config and module
void register_io(py::module_& m);                    // io.cpp: safetensors and .npy
void register_paged_kv_cache(py::module_& m);        // paged_kv_cache.cpp: PagedKVCache
void register_decode(py::module_& m);                // decode.cpp: decode_attention over a PagedKVCache
void register_varlen(py::module_& m);                // varlen.cpp: varlen_attention and its backward
void register_rotary(py::module_& m);                // rotary.cpp: apply_rotary and its backward

}  // namespace mha::python
