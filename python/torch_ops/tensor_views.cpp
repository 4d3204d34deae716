// torch tensors as mha views and mha results as torch tensors (tensor_views.hpp).
#include "tensor_views.hpp"

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include <utility>

namespace mha::torch_ops {

namespace {

// The mha dtype of a torch scalar type, or none.
std::optional<DType> dtype_of_scalar(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Float: return DType::Float32;
    case c10::ScalarType::Double: return DType::Float64;
    case c10::ScalarType::BFloat16: return DType::BFloat16;
    case c10::ScalarType::Bool: return DType::Bool;
    default: return std::nullopt;
  }
}

c10::ScalarType scalar_of_dtype(DType dtype) {
  switch (dtype) {
    case DType::Float32: return c10::ScalarType::Float;
    case DType::Float64: return c10::ScalarType::Double;
    case DType::BFloat16: return c10::ScalarType::BFloat16;
    case DType::Bool: return c10::ScalarType::Bool;
  }
  return c10::ScalarType::Undefined;
}

}  // namespace

TensorView view_of(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined(), name, ": expected a tensor, got an undefined one");
  TORCH_CHECK(t.device().is_cpu(), name, ": expected a CPU tensor (mha runs on the CPU only), got one on ", t.device());
  TORCH_CHECK(t.layout() == c10::kStrided, name, ": expected a dense (strided) tensor, got layout ", t.layout());
  const std::optional<DType> dtype = dtype_of_scalar(t.scalar_type());
  TORCH_CHECK(dtype, name, ": expected torch.float32, torch.float64, torch.bfloat16 or torch.bool, got ",
              t.scalar_type());
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  // data_ptr() already includes the storage offset; torch strides are never negative.
  return TensorView(t.data_ptr(), *dtype, Shape(sizes.begin(), sizes.end()), Shape(strides.begin(), strides.end()));
}

std::optional<TensorView> optional_view_of(const c10::optional<at::Tensor>& t, const char* name) {
  if (!t || !t->defined()) return std::nullopt;
  return view_of(*t, name);
}

at::Tensor tensor_of(Tensor&& result) {
  const Shape shape = result.shape();
  const c10::ScalarType type = scalar_of_dtype(result.dtype());
  auto* owner = new Tensor(std::move(result));  // deleted with the torch tensor's storage
  void* data = owner->data();
  if (data == nullptr) {  // zero elements: mha holds no storage, torch wants a tensor all the same
    delete owner;
    return at::empty(shape, at::TensorOptions().dtype(type));
  }
  return at::from_blob(
      data, shape, [owner](void*) { delete owner; }, at::TensorOptions().dtype(type));
}

}  // namespace mha::torch_ops
