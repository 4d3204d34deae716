// The one place where a run-time DType becomes a C++ element type. Adding a floating dtype to the
// library is one edit here (and one to gemm.hpp for its product).
#pragma once

#include <string>

#include "mha/error.hpp"
#include "mha/tensor.hpp"

namespace mha::detail {

// Whether attention and the layer compute in this dtype (bool is only for masks).
constexpr bool is_floating(DType dtype) { return dtype == DType::Float32 || dtype == DType::Float64; }

// "float32 or float64": the floating dtypes, as error messages list them.
inline const char* floating_dtype_names() { return "float32 or float64"; }

// Calls f(T{}) with T the element type of `dtype` (float for float32, double for float64) and returns
// its result. Callers validate the dtype first; anything else is an internal error.
template <class F>
decltype(auto) dispatch_floating(DType dtype, F&& f) {
  switch (dtype) {
    case DType::Float32: return f(float{});
    case DType::Float64: return f(double{});
    default: throw Error(std::string("internal: no floating kernel for dtype ") + dtype_name(dtype));
  }
}

}  // namespace mha::detail
