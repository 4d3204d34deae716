// mha::Error arrives in Python as mha._core.Error, a subclass of ValueError, with the same message.
#include "mha/error.hpp"

#include "bindings.hpp"

namespace mha::python {

void register_error(py::module_& m) { py::register_exception<mha::Error>(m, "Error", PyExc_ValueError); }

}  // namespace mha::python
