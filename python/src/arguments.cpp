// File paths, string keys, numbers and integers from Python; see arguments.hpp.
#include "arguments.hpp"

#include <limits>

#include "mha/error.hpp"

namespace mha::python {

namespace {

std::string type_name(py::handle obj) { return py::str(py::type::handle_of(obj).attr("__name__")).cast<std::string>(); }

// repr(obj) for an error message; ascii() keeps the message printable whatever obj holds.
std::string ascii_repr(py::handle obj) {
  return py::module_::import("builtins").attr("ascii")(obj).cast<std::string>();
}

// ascii(obj), cut to its first 60 characters (an int of 400 digits, a long list).
std::string short_repr(py::handle obj) {
  const std::string r = ascii_repr(obj);
  return r.size() <= 60 ? r : r.substr(0, 57) + "...";
}

// obj as a Python int (operator.index), or throws naming `name` and `expected`.
py::int_ index_of(py::handle obj, const std::string& name, const std::string& expected) {
  if (obj.is_none() || py::isinstance<py::str>(obj) || py::isinstance<py::bytes>(obj))
    throw Error(name + ": expected " + expected + ", got " + type_name(obj) + " " + short_repr(obj));
  PyObject* index = PyNumber_Index(obj.ptr());
  if (index == nullptr) {
    PyErr_Clear();
    throw Error(name + ": expected " + expected + ", got " + type_name(obj) + " " + short_repr(obj));
  }
  return py::reinterpret_steal<py::int_>(index);
}

}  // namespace

double float_arg(py::handle obj, const std::string& name) {
  const std::string expected = name + ": expected a real number (float or int), got ";
  if (obj.is_none() || py::isinstance<py::str>(obj) || py::isinstance<py::bytes>(obj))
    throw Error(expected + type_name(obj) + " " + short_repr(obj));
  const double value = PyFloat_AsDouble(obj.ptr());
  if (value == -1.0 && PyErr_Occurred()) {
    const bool overflow = PyErr_ExceptionMatches(PyExc_OverflowError);
    PyErr_Clear();
    if (overflow) throw Error(name + ": " + short_repr(obj) + " is beyond the range of float64");
    throw Error(expected + type_name(obj) + " " + short_repr(obj));
  }
  return value;
}

std::optional<double> optional_float_arg(py::handle obj, const std::string& name) {
  if (obj.is_none()) return std::nullopt;
  return float_arg(obj, name);
}

double softcap_arg(py::handle obj) { return obj.is_none() ? 0.0 : float_arg(obj, "softcap"); }

std::int64_t int64_arg(py::handle obj, const std::string& name) {
  const py::int_ value = index_of(obj, name, "an integer");
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
  if (overflow != 0)
    throw Error(name + ": expected an integer in [-2**63, 2**63 - 1] (int64), got " + short_repr(value));
  return static_cast<std::int64_t>(v);
}

std::uint64_t uint64_arg(py::handle obj, const std::string& name) {
  const py::int_ value = index_of(obj, name, "an integer");
  const unsigned long long v = PyLong_AsUnsignedLongLong(value.ptr());
  if (PyErr_Occurred()) {  // negative, or 2**64 and beyond
    PyErr_Clear();
    throw Error(name + ": expected an integer in [0, 2**64 - 1] (uint64), got " + short_repr(value));
  }
  return static_cast<std::uint64_t>(v);
}

std::vector<std::int64_t> int64_sequence_arg(py::handle obj, const std::string& name) {
  if (obj.is_none() || py::isinstance<py::str>(obj) || py::isinstance<py::bytes>(obj) || !PySequence_Check(obj.ptr()))
    throw Error(name + ": expected a sequence of integers, got " + type_name(obj) + " " + short_repr(obj));
  const py::sequence items = py::reinterpret_borrow<py::sequence>(obj);
  std::vector<std::int64_t> out;
  out.reserve(items.size());
  for (std::size_t i = 0; i < items.size(); ++i)
    out.push_back(int64_arg(items[i], name + "[" + std::to_string(i) + "]"));
  return out;
}

std::optional<std::pair<std::int64_t, std::int64_t>> window_arg(py::handle obj) {
  if (obj.is_none()) return std::nullopt;
  const std::string expected = "window: expected None or (left, right), two integers >= -1 (-1: unbounded), got ";
  if (py::isinstance<py::str>(obj) || py::isinstance<py::bytes>(obj) || !PySequence_Check(obj.ptr()) ||
      PySequence_Size(obj.ptr()) != 2) {
    PyErr_Clear();  // PySequence_Size of an object without a length
    throw Error(expected + type_name(obj) + " " + short_repr(obj));
  }
  const py::sequence pair = py::reinterpret_borrow<py::sequence>(obj);
  return std::pair{int64_arg(pair[0], "window[0] (left)"), int64_arg(pair[1], "window[1] (right)")};
}

bool flag_arg(py::handle obj, const std::string& name) {
  const int truth = PyObject_IsTrue(obj.ptr());
  if (truth < 0) {
    PyErr_Clear();
    refuse_type(obj, name, "True or False");
  }
  return truth != 0;
}

void refuse_type(py::handle obj, const std::string& name, const std::string& expected) {
  throw Error(name + ": expected " + expected + ", got " + type_name(obj) + " " + short_repr(obj));
}

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
