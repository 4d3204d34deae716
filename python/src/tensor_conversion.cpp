// NumPy <-> mha::TensorView / mha::Tensor conversions; see tensor_conversion.hpp.
#include "tensor_conversion.hpp"

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <pybind11/stl.h>

#include "arguments.hpp"
#include "bindings.hpp"
#include "mha/error.hpp"

namespace mha::python {

namespace {

// NumPy's type numbers (numpy/ndarraytypes.h, NPY_TYPES), stable across NumPy versions.
constexpr int kNpyFloat = 11;   // float32
constexpr int kNpyDouble = 12;  // float64

py::module_ numpy() { return py::module_::import("numpy"); }

std::string dtype_str(const py::dtype& dtype) { return py::str(py::handle(dtype)).cast<std::string>(); }

// The mha dtype of `array`, converting the array first where needed (byte order, wide integers).
DType accepted_dtype(py::array& array, const std::string& name, Accept accept) {
  if (!array.dtype().attr("isnative").cast<bool>()) {
    array = py::array::ensure(array.attr("astype")(array.dtype().attr("newbyteorder")("=")));
  }
  const py::dtype dtype = array.dtype();
  if (dtype.num() == kNpyFloat) return DType::Float32;
  if (dtype.num() == kNpyDouble) return DType::Float64;
  if (accept != Accept::Float && dtype.kind() == 'b') return DType::Bool;
  if (accept == Accept::Stored)
    throw Error(name + ": expected a bool, float32 or float64 array (what the file formats store), got " +
                dtype_str(dtype));
  if (accept == Accept::Mask) {
    if (dtype.kind() == 'i' || dtype.kind() == 'u') {
      // A bool element is one byte, nonzero = true, so 1-byte integers are viewed as they are.
      if (dtype.itemsize() != 1) array = py::array::ensure(numpy().attr("not_equal")(array, 0));
      return DType::Bool;
    }
    throw Error(name + ": expected a bool, integer, float32 or float64 array, got " + dtype_str(dtype));
  }
  throw Error(name + ": expected a float32 or float64 array, got " + dtype_str(dtype));
}

// True when every byte stride is a non-negative multiple of the element size and the data is
// aligned, i.e. when the array can be described by element strides.
bool has_element_strides(const py::array& array) {
  const auto itemsize = static_cast<std::intptr_t>(array.itemsize());
  if (reinterpret_cast<std::uintptr_t>(array.data()) % static_cast<std::uintptr_t>(itemsize) != 0) {
    return false;
  }
  for (py::ssize_t d = 0; d < array.ndim(); ++d) {
    const auto stride = static_cast<std::intptr_t>(array.strides(d));
    if (stride < 0 || stride % itemsize != 0) return false;
  }
  return true;
}

// A view of `array`'s elements as `dtype` (whose size is the array's itemsize), copying the array
// first when its strides cannot be counted in elements.
ArrayView strided_view(py::array array, DType dtype) {
  if (array.size() > 0 && !has_element_strides(array)) {
    // A fresh C-order copy (numpy.ascontiguousarray would keep a contiguous but misaligned array).
    array = py::array::ensure(numpy().attr("array")(array, py::arg("copy") = true, py::arg("order") = "C"));
  }
  Shape shape(static_cast<std::size_t>(array.ndim()));
  Shape strides(shape.size());
  for (py::ssize_t d = 0; d < array.ndim(); ++d) shape[d] = array.shape(d);
  if (array.size() > 0) {
    for (py::ssize_t d = 0; d < array.ndim(); ++d) strides[d] = array.strides(d) / array.itemsize();
  } else {
    strides = contiguous_strides(shape);  // an empty array's strides carry no information
  }
  TensorView view(array.data(), dtype, std::move(shape), std::move(strides));
  return ArrayView{std::move(array), std::move(view)};
}

// The NumPy dtype that holds `dtype`'s elements: int16 bit patterns for bfloat16.
py::dtype storage_dtype(DType dtype) {
  return dtype == DType::BFloat16 ? py::dtype::of<std::int16_t>() : numpy_dtype(dtype);
}

// Moves `tensor` into a NumPy array of storage_dtype that uses the tensor's memory (no copy).
py::array share_memory(Tensor&& tensor) {
  const py::dtype dtype = storage_dtype(tensor.dtype());
  std::vector<py::ssize_t> shape(tensor.shape().begin(), tensor.shape().end());
  std::vector<py::ssize_t> strides;
  for (const std::int64_t stride : tensor.strides()) {
    strides.push_back(static_cast<py::ssize_t>(stride) * dtype.itemsize());
  }
  if (tensor.numel() == 0) return py::array(dtype, shape, strides);  // no memory to share

  auto owner = std::make_unique<Tensor>(std::move(tensor));
  const void* data = owner->data();
  py::capsule base(owner.get(), [](void* p) { delete static_cast<Tensor*>(p); });
  owner.release();  // the capsule owns it now
  return py::array(dtype, shape, strides, data, base);
}

// `bits` checked to hold 2-byte integers, in native byte order.
py::array bfloat16_bits_arg(py::handle bits) {
  py::array array = py::array::ensure(bits);
  if (!array || array.itemsize() != 2 || (array.dtype().kind() != 'i' && array.dtype().kind() != 'u')) {
    const std::string got =
        array ? dtype_str(array.dtype()) : py::str(py::type::handle_of(bits).attr("__name__")).cast<std::string>();
    throw Error("BFloat16Bits: bits: expected an int16 or uint16 array of bfloat16 bit patterns "
                "(e.g. tensor.view(torch.int16).numpy()), got " +
                got);
  }
  if (!array.dtype().attr("isnative").cast<bool>()) {
    array = py::array::ensure(array.attr("astype")(array.dtype().attr("newbyteorder")("=")));
  }
  return array;
}

}  // namespace

ArrayView view_of(py::handle obj, const std::string& name, Accept accept) {
  if (py::isinstance<BFloat16Bits>(obj)) return strided_view(obj.cast<const BFloat16Bits&>().bits, DType::BFloat16);
  py::array array = py::array::ensure(obj);
  if (!array) {
    throw Error(name + ": expected an array, got " +
                py::str(py::type::handle_of(obj).attr("__name__")).cast<std::string>());
  }
  const DType dtype = accepted_dtype(array, name, accept);
  return strided_view(std::move(array), dtype);
}

std::optional<ArrayView> optional_view_of(py::handle obj, const std::string& name, Accept accept) {
  if (obj.is_none()) return std::nullopt;
  return view_of(obj, name, accept);
}

py::dtype numpy_dtype(DType dtype) {
  switch (dtype) {
    case DType::Float32: return py::dtype::of<float>();
    case DType::Float64: return py::dtype::of<double>();
    case DType::Bool: return py::dtype::of<bool>();
    case DType::BFloat16: break;  // NumPy has none: to_numpy converts to float32 first
  }
  throw Error(std::string("numpy_dtype: no NumPy dtype for ") + dtype_name(dtype));
}

ArrayView converted_to(ArrayView view, DType dtype) {
  const DType from = view.view.dtype();
  if (from == dtype || from == DType::Bool || dtype == DType::Bool) return view;
  py::array owner = share_memory(Tensor::copy_of(view.view, dtype));
  TensorView converted(owner.data(), dtype, view.view.shape());
  return ArrayView{std::move(owner), std::move(converted)};
}

BFloat16Out bfloat16_out_like(py::handle obj) {
  return py::isinstance<BFloat16Bits>(obj) ? BFloat16Out::Bits : BFloat16Out::Float32;
}

py::array to_numpy(Tensor&& tensor) {
  // NumPy has no bfloat16: such tensors reach Python as float32, which holds their values exactly.
  if (tensor.dtype() == DType::BFloat16) tensor = Tensor::copy_of(tensor, DType::Float32);
  return share_memory(std::move(tensor));
}

py::object to_python(Tensor&& tensor, BFloat16Out bfloat16_out) {
  if (tensor.dtype() == DType::BFloat16 && bfloat16_out == BFloat16Out::Bits) {
    return py::cast(BFloat16Bits{share_memory(std::move(tensor))});
  }
  return to_numpy(std::move(tensor));
}

py::object to_python_or_none(Tensor&& tensor, BFloat16Out bfloat16_out) {
  if (!tensor.defined()) return py::none();
  return to_python(std::move(tensor), bfloat16_out);
}

py::object to_numpy_or_none(Tensor&& tensor) {
  if (!tensor.defined()) return py::none();
  return to_numpy(std::move(tensor));
}

void register_tensor(py::module_& m) {
  py::enum_<DType>(m, "DType", "Element type of a tensor")
      .value("float32", DType::Float32)
      .value("float64", DType::Float64)
      .value("bool", DType::Bool)
      .value("bfloat16", DType::BFloat16);

  py::class_<BFloat16Bits>(m, "BFloat16Bits",
                           "bfloat16 data for the library: `bits`, an int16 or uint16 array (any shape and strides)\n"
                           "of bfloat16 bit patterns, read in place (NumPy has no bfloat16 dtype). A torch.bfloat16\n"
                           "tensor t crosses as BFloat16Bits(t.view(torch.int16).numpy()), without a copy.")
      .def(py::init([](py::handle bits) { return BFloat16Bits{bfloat16_bits_arg(bits)}; }), py::arg("bits"))
      .def_readonly("bits", &BFloat16Bits::bits, "The int16 / uint16 array of bit patterns")
      .def_property_readonly(
          "shape", [](const BFloat16Bits& self) { return py::tuple(self.bits.attr("shape")); }, "bits.shape")
      .def("__repr__", [](const BFloat16Bits& self) {
        return "BFloat16Bits(shape=" + py::str(self.bits.attr("shape")).cast<std::string>() + ")";
      });

  m.def(
      "to_bfloat16",
      [](py::handle array) {
        const ArrayView view = view_of(array, "array", Accept::Float);
        return to_python(Tensor::copy_of(view.view, DType::BFloat16), BFloat16Out::Bits);
      },
      py::arg("array"),
      "`array` (float32 or float64, any shape) rounded to bfloat16 (to nearest even, once), as a new\n"
      "BFloat16Bits: what the library's bfloat16 functions take without a conversion of their own.");
  m.def(
      "from_bfloat16",
      [](py::handle bits) {
        const ArrayView view = view_of(bits, "bits", Accept::Float);
        return to_numpy(Tensor::copy_of(view.view, DType::Float32));
      },
      py::arg("bits"), "A BFloat16Bits as a new float32 array (exact: every bfloat16 is a float32).");

  // For tests of the conversion: what the library receives for `obj`.
  m.def(
      "_describe_view",
      [](py::handle obj, const std::string& name, bool mask) {
        const ArrayView view = view_of(obj, name, mask ? Accept::Mask : Accept::Float);
        py::dict d;
        d["data"] = reinterpret_cast<std::uintptr_t>(view.view.data());
        d["dtype"] = std::string(dtype_name(view.view.dtype()));
        d["shape"] = py::tuple(py::cast(view.view.shape()));
        d["strides"] = py::tuple(py::cast(view.view.strides()));
        return d;
      },
      py::arg("obj"), py::arg("name") = "array", py::arg("mask") = false,
      "The data pointer, dtype, shape and element strides the library would see for `obj`.");
}

namespace {

template <class I>
HeldPositions held_positions(const py::array& array) {
  using Contiguous = py::array_t<I, py::array::c_style | py::array::forcecast>;
  Contiguous held = Contiguous::ensure(array);  // same values: the dtype is already an integer of I's width
  Shape shape(held.shape(), held.shape() + held.ndim());
  PositionsView view(held.data(), shape, contiguous_strides(shape));
  return HeldPositions{std::move(held), std::move(view)};
}

}  // namespace

py::tuple gradients_to_python(AttentionGradients&& grads, BFloat16Out bfloat16_out, bool with_sinks) {
  py::object dq = to_python(std::move(grads.dq), bfloat16_out), dk = to_python(std::move(grads.dk), bfloat16_out);
  py::object dv = to_python(std::move(grads.dv), bfloat16_out);
  if (!with_sinks) return py::make_tuple(dq, dk, dv);
  return py::make_tuple(dq, dk, dv, to_numpy(std::move(grads.dsinks)));
}

HeldPositions positions_arg(py::handle obj, const std::string& name) {
  if (obj.is_none()) return {};
  const char* expected = "None or an int64 or int32 array [L] or [B, L]";
  if (py::isinstance<BFloat16Bits>(obj)) refuse_type(obj, name, expected);
  const py::array array = py::array::ensure(obj);
  if (!array) refuse_type(obj, name, expected);
  const py::dtype dtype = array.dtype();
  if (dtype.kind() != 'i' || (dtype.itemsize() != 8 && dtype.itemsize() != 4))
    throw Error(name + ": expected an int64 or int32 array [L] or [B, L], got " +
                py::str(py::handle(dtype)).cast<std::string>() + " " +
                py::str(array.attr("shape")).cast<std::string>());
  return dtype.itemsize() == 8 ? held_positions<std::int64_t>(array) : held_positions<std::int32_t>(array);
}

}  // namespace mha::python
