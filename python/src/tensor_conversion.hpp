// NumPy arrays <-> mha::TensorView / mha::Tensor, without copies where the memory allows.
//
// In:  any array-like becomes a TensorView on the array's own memory (data pointer, dtype, shape,
//      strides converted from bytes to elements). A contiguous copy is made only when the strides
//      are negative, not a multiple of the element size, or the data is misaligned, or the array is
//      not in native byte order.
// Out: a returned mha::Tensor is moved into a heap object owned by a capsule that serves as the
//      NumPy array's base, so the array uses the tensor's memory directly.
#pragma once

#include <optional>
#include <string>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "mha/tensor.hpp"

namespace mha::python {

namespace py = pybind11;

// The element types an argument accepts.
enum class Accept {
  Float,   // float32 or float64: query, key, value, parameters
  Mask,    // bool, float32 or float64; an integer array is read as bool (nonzero = true), as
           // PyTorch reads a uint8 mask. 1-byte integers are viewed in place, wider ones converted.
  Stored,  // bool, float32 or float64 and nothing else: what the file writers store. An integer array
           // is refused, not read as a mask (the writers would store [0, 1, 2, 300] as bool).
};

// A view on an array together with the array that owns the memory (the caller's array itself, or
// the copy made for it). Keep it alive while the view is in use.
struct ArrayView {
  py::array array;
  TensorView view;
};

// Views `obj` (anything numpy.asarray accepts). Throws mha::Error naming `name` when the dtype is
// not accepted.
ArrayView view_of(py::handle obj, const std::string& name, Accept accept);
// view_of, or nullopt for None.
std::optional<ArrayView> optional_view_of(py::handle obj, const std::string& name, Accept accept);

py::dtype numpy_dtype(DType dtype);

// Moves `tensor` into a NumPy array that shares its memory (no copy).
py::array to_numpy(Tensor&& tensor);
// to_numpy, or None when `tensor` is undefined (e.g. weights that were not requested).
py::object to_numpy_or_none(Tensor&& tensor);

}  // namespace mha::python
