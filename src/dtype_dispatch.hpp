// The one place where a run-time DType becomes a C++ element type. Adding a floating dtype to the
// library is one edit here (and one to gemm.hpp for its product).
#pragma once

#include <string>
#include <type_traits>

#include "mha/error.hpp"
#include "mha/tensor.hpp"

namespace mha::detail {

// The type sums and kernels compute in for elements of type T: T itself for float and double, float
// for bfloat16 (its products accumulate in float32; its softmax, scale, masks, log-sum-exp and sums
// are float32, rounded to bfloat16 once where a result is stored).
template <class T>
using compute_t = std::conditional_t<std::is_same_v<T, bfloat16>, float, T>;

// Whether attention and the layer compute in this dtype (bool is only for masks).
constexpr bool is_floating(DType dtype) {
  return dtype == DType::Float32 || dtype == DType::Float64 || dtype == DType::BFloat16;
}

// "float32, float64 or bfloat16": the floating dtypes, as error messages list them.
inline const char* floating_dtype_names() { return "float32, float64 or bfloat16"; }

// Calls f(T{}) with T the element type of `dtype` (float for float32, double for float64, mha::bfloat16
// for bfloat16) and returns its result. Callers validate the dtype first; anything else is an internal
// error.
template <class F>
decltype(auto) dispatch_floating(DType dtype, F&& f) {
  switch (dtype) {
    case DType::Float32: return f(float{});
    case DType::Float64: return f(double{});
    case DType::BFloat16: return f(bfloat16{});
    default: throw Error(std::string("internal: no floating kernel for dtype ") + dtype_name(dtype));
  }
}

// As dispatch_floating, for the parts of the library that do not take bfloat16 yet (they refuse it at
// their boundary): float32 and float64 only.
template <class F>
decltype(auto) dispatch_float32_or_float64(DType dtype, F&& f) {
  switch (dtype) {
    case DType::Float32: return f(float{});
    case DType::Float64: return f(double{});
    default: throw Error(std::string("internal: no float32 or float64 kernel for dtype ") + dtype_name(dtype));
  }
}

}  // namespace mha::detail
