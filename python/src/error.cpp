// mha::Error arrives in Python as mha._core.Error, a subclass of ValueError, with the same message.
#include "mha/error.hpp"

#include "bindings.hpp"
#include "error_translation.hpp"

namespace mha::python {

void register_error(py::module_& m) {
  static py::exception<mha::Error> error(m, "Error", PyExc_ValueError);
  translate_mha_errors_to(error);
}

}  // namespace mha::python
