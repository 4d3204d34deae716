// Arguments that are not arrays, as the C++ API takes them: file paths, string keys, numbers, integers
// and sizes. Anything else is an mha::Error (mha.Error in Python) naming the argument, never pybind11's
// "Unable to cast" or "incompatible function arguments" TypeError, nor an OverflowError.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>

namespace mha::python {

namespace py = pybind11;

// A file path (str, bytes or os.PathLike) as the bytes the operating system gets: os.fsencode(obj),
// so bytes pass unchanged and a str is encoded as Python encodes file names (undecodable bytes of a
// name Python read from the system come back as they were). The library refuses a path holding NUL.
std::string path_arg(py::handle obj, const std::string& name = "path");

// A str as UTF-8 (`what` names it in the error when it is not a str, or holds a lone surrogate).
std::string utf8_arg(py::handle obj, const std::string& what);

// A {str: str} dict as UTF-8 strings; `what` names the dict ("metadata").
std::map<std::string, std::string> utf8_dict_arg(py::handle obj, const std::string& what);

// A real number as a double: a float, an int, a NumPy scalar, anything Python's float() takes except a
// str or bytes (float("0.5") parses text; a number argument does not). None, a complex, an int beyond
// float64's range are refused naming `name`. The library checks the range the value must be in.
double float_arg(py::handle obj, const std::string& name);
// float_arg, or nullopt for None (scale=None: the default scale).
std::optional<double> optional_float_arg(py::handle obj, const std::string& name);
// softcap: None or 0 is none (as window=None and alibi_slopes=None are), else float_arg.
double softcap_arg(py::handle obj);

// An integer (an int, a NumPy integer: anything with __index__, as operator.index takes) that fits
// std::int64_t / std::uint64_t; a float (1.5), a str, None or an int out of range (2**63, -2**63 - 1)
// is refused naming `name`.
std::int64_t int64_arg(py::handle obj, const std::string& name);
std::uint64_t uint64_arg(py::handle obj, const std::string& name);
// A sequence (list, tuple, 1-D array) of int64_arg integers, such as sequence ids.
std::vector<std::int64_t> int64_sequence_arg(py::handle obj, const std::string& name);
// window: None (no window) or (left, right), two int64_arg integers (the library checks them >= -1).
std::optional<std::pair<std::int64_t, std::int64_t>> window_arg(py::handle obj);
// A flag, by Python's truth value (as bool() reads it); an object without one (a NumPy array of two
// elements) is refused naming `name`.
bool flag_arg(py::handle obj, const std::string& name);

// Throws mha::Error "<name>: expected <expected>, got <type of obj> <its short repr>".
[[noreturn]] void refuse_type(py::handle obj, const std::string& name, const std::string& expected);

// obj as the bound C++ object of class T (a cache), or mha.Error naming `name` and `expected` (the
// Python class, "an mha.PagedKVCache") rather than pybind11's TypeError.
template <class T>
T& object_arg(py::handle obj, const std::string& name, const std::string& expected) {
  if (!py::isinstance<T>(obj)) refuse_type(obj, name, expected);
  return obj.cast<T&>();
}

}  // namespace mha::python
