// File paths and string keys from Python; see arguments.hpp.
#include "arguments.hpp"

#include "mha/error.hpp"

namespace mha::python {

namespace {

std::string type_name(py::handle obj) { return py::str(py::type::handle_of(obj).attr("__name__")).cast<std::string>(); }

// repr(obj) for an error message; ascii() keeps the message printable whatever obj holds.
std::string ascii_repr(py::handle obj) {
  return py::module_::import("builtins").attr("ascii")(obj).cast<std::string>();
}

}  // namespace

std::string path_arg(py::handle obj, const std::string& name) {
  py::object encoded;
  try {
    encoded = py::module_::import("os").attr("fsencode")(obj);
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_TypeError) && !e.matches(PyExc_UnicodeError)) throw;
    throw Error(name + ": expected a str, bytes or os.PathLike path, got " + type_name(obj) + " " + ascii_repr(obj));
  }
  return encoded.cast<std::string>();  // bytes: any content, NUL included (the library refuses NUL)
}

std::string utf8_arg(py::handle obj, const std::string& what) {
  if (!py::isinstance<py::str>(obj))
    throw Error(what + ": expected a str, got " + type_name(obj) + " " + ascii_repr(obj));
  const py::object utf8 = py::reinterpret_steal<py::object>(PyUnicode_AsUTF8String(obj.ptr()));
  if (!utf8) {
    PyErr_Clear();
    throw Error(what + ": " + ascii_repr(obj) + " cannot be encoded as UTF-8 (it holds a lone surrogate)");
  }
  return utf8.cast<std::string>();
}

std::map<std::string, std::string> utf8_dict_arg(py::handle obj, const std::string& what) {
  if (!py::isinstance<py::dict>(obj)) throw Error(what + ": expected a dict of str, got " + type_name(obj));
  std::map<std::string, std::string> out;
  for (const auto& [key, value] : py::reinterpret_borrow<py::dict>(obj)) {
    const std::string k = utf8_arg(key, what + " key");
    out[k] = utf8_arg(value, what + "[" + ascii_repr(key) + "]");
  }
  return out;
}

}  // namespace mha::python
