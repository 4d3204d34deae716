// torch tensors as mha views (no copy) and mha results as torch tensors (no copy): the one place the op
// library crosses between the two tensor types.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <optional>

#include "mha/tensor.hpp"

namespace mha::torch_ops {

// A view of `t`'s elements with its sizes and strides (in elements, as both libraries count them), no
// copy: float32, float64, bfloat16 or bool on the CPU, strided layout. TORCH_CHECK naming `name`
// otherwise. The view is valid while `t` lives.
TensorView view_of(const at::Tensor& t, const char* name);
// view_of, or none for an absent or undefined tensor.
std::optional<TensorView> optional_view_of(const c10::optional<at::Tensor>& t, const char* name);

// A torch tensor that takes over `result`'s storage (freed when the last torch reference goes), no copy.
at::Tensor tensor_of(Tensor&& result);

}  // namespace mha::torch_ops
