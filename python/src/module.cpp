// The Python module `mha._core`: thin bindings of the C++ API. The torch-like Python API lives in
// python/mha/__init__.py on top of it.
#include "bindings.hpp"

PYBIND11_MODULE(_core, m) {
  m.doc() = "Multi-head attention (Vaswani et al. 2017): bindings of the mha C++ library";
  mha::python::register_error(m);
  mha::python::register_tensor(m);
  mha::python::register_attention(m);
  mha::python::register_multi_head_attention(m);
  mha::python::register_io(m);
  mha::python::register_paged_kv_cache(m);
  mha::python::register_decode(m);
  mha::python::register_varlen(m);
  mha::python::register_rotary(m);
}
