// How an mha::Error becomes a Python exception, for every extension of the package (mha._core and
// mha._distributed raise the same class, mha._core.Error).
#pragma once

#include <cstring>
#include <exception>

#include <pybind11/pybind11.h>

#include "mha/error.hpp"

namespace mha::python {

// The class the module raises for mha::Error (one per extension module: each is its own shared object).
inline PyObject*& mha_error_class() {
  static PyObject* error_class = nullptr;
  return error_class;
}

// Registers a translator that raises `error_class` with the mha::Error's message. The message is UTF-8
// where it can be; bytes that are not (a file name, as the system gave it) come out as \xNN rather
// than losing the whole message to a UnicodeDecodeError. error_class must outlive the module (static).
inline void translate_mha_errors_to(const pybind11::object& error_class) {
  mha_error_class() = error_class.ptr();
  pybind11::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const mha::Error& e) {
      const pybind11::object message = pybind11::reinterpret_steal<pybind11::object>(
          PyUnicode_DecodeUTF8(e.what(), static_cast<Py_ssize_t>(std::strlen(e.what())), "backslashreplace"));
      PyErr_SetObject(mha_error_class(), message.ptr());
    }
  });
}

}  // namespace mha::python
