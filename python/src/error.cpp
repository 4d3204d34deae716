// mha::Error arrives in Python as mha._core.Error, a subclass of ValueError, with the same message.
#include "mha/error.hpp"

#include <cstring>

#include "bindings.hpp"

namespace mha::python {

void register_error(py::module_& m) {
  static py::exception<mha::Error> error(m, "Error", PyExc_ValueError);
  // The message is UTF-8 where it can be; bytes that are not (a file name, as the system gave it) come
  // out as \xNN rather than losing the whole message to a UnicodeDecodeError.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const mha::Error& e) {
      const py::object message = py::reinterpret_steal<py::object>(
          PyUnicode_DecodeUTF8(e.what(), static_cast<Py_ssize_t>(std::strlen(e.what())), "backslashreplace"));
      PyErr_SetObject(error.ptr(), message.ptr());
    }
  });
}

}  // namespace mha::python
