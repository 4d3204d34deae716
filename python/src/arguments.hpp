// Arguments that are not arrays, as the C++ API takes them: file paths and string keys. Anything else
// is an mha::Error (mha.Error in Python) naming the argument, never pybind11's "Unable to cast".
#pragma once

#include <map>
#include <string>

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

}  // namespace mha::python
