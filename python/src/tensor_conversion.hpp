// NumPy arrays <-> mha::TensorView / mha::Tensor, without copies where the memory allows.
//
// In:  any array-like becomes a TensorView on the array's own memory (data pointer, dtype, shape,
//      strides converted from bytes to elements). A contiguous copy is made only when the strides
//      are negative, not a multiple of the element size, or the data is misaligned, or the array is
//      not in native byte order.
//      NumPy has no bfloat16: bfloat16 memory (a torch.bfloat16 tensor's, seen as int16) arrives as a
//      BFloat16Bits, an int16/uint16 array together with the statement that its elements are
//      bfloat16 bit patterns; it is viewed in place as DType::BFloat16, like any other array.
// Out: a returned mha::Tensor is moved into a heap object owned by a capsule that serves as the
//      NumPy array's base, so the array uses the tensor's memory directly. A bfloat16 tensor comes
//      back either converted to float32 (exact: every bfloat16 is a float32) or, for callers that hold
//      bfloat16 themselves (mha.torch), as a BFloat16Bits of an int16 array on the tensor's memory.
#pragma once

#include <optional>
#include <string>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include "mha/attention.hpp"
#include "mha/rotary.hpp"
#include "mha/tensor.hpp"

namespace mha::python {

namespace py = pybind11;

// The element types an argument accepts. A BFloat16Bits (bfloat16) is accepted by all three.
enum class Accept {
  Float,   // float32 or float64: query, key, value, parameters
  Mask,    // bool, float32 or float64; an integer array is read as bool (nonzero = true), as
           // PyTorch reads a uint8 mask. 1-byte integers are viewed in place, wider ones converted.
  Stored,  // bool, float32 or float64 and nothing else: what the file writers store. An integer array
           // is refused, not read as a mask (the writers would store [0, 1, 2, 300] as bool).
};

// bfloat16 data in Python: `bits` (int16 or uint16, any shape and strides) holds bfloat16 bit
// patterns. The explicit wrapper is what tells them apart from an integer array (a mask).
struct BFloat16Bits {
  py::array bits;
};

// How a bfloat16 result reaches Python.
enum class BFloat16Out {
  Float32,  // a float32 array (a converted copy; exact): what NumPy users get
  Bits,     // a BFloat16Bits of an int16 array on the tensor's own memory (no copy): for mha.torch
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

// The view converted to `dtype` when it holds another floating dtype (float32 / float64 NumPy data
// for a bfloat16 layer, rounded to nearest even); the copy is owned by the returned array. Views of
// `dtype`, and bool views, are returned as they are.
ArrayView converted_to(ArrayView view, DType dtype);

// BFloat16Out::Bits when `obj` is a BFloat16Bits (results come back in the form the input came in).
BFloat16Out bfloat16_out_like(py::handle obj);

py::dtype numpy_dtype(DType dtype);

// Moves `tensor` into a NumPy array that shares its memory (no copy); bfloat16 becomes float32 (a copy).
py::array to_numpy(Tensor&& tensor);
// to_numpy, or None when `tensor` is undefined (e.g. weights that were not requested).
py::object to_numpy_or_none(Tensor&& tensor);
// to_numpy, except that a bfloat16 tensor with BFloat16Out::Bits becomes a BFloat16Bits on its memory.
py::object to_python(Tensor&& tensor, BFloat16Out bfloat16_out);
// to_python, or None when `tensor` is undefined.
py::object to_python_or_none(Tensor&& tensor, BFloat16Out bfloat16_out);

// The gradients of an attention backward as Python returns them: (dq, dk, dv), and dsinks last (in the
// sinks' dtype) when the call had sinks; bfloat16 gradients as to_python says.
py::tuple gradients_to_python(AttentionGradients&& grads, BFloat16Out bfloat16_out, bool with_sinks);

// Rotary positions [L] or [B, L] from Python (mha/rotary.hpp), with the array their view points into
// (keep it alive while the view is in use): a C-order int64 or int32 array in native byte order, the
// caller's own when it is one.
struct HeldPositions {
  py::array array;
  std::optional<PositionsView> view;
};
// None (no view: the default positions), or an int64 or int32 array-like (a list of ints is int64);
// anything else is refused naming `name`.
HeldPositions positions_arg(py::handle obj, const std::string& name);

}  // namespace mha::python
