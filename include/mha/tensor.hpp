/// \file
/// Tensor (owning, 64-byte aligned, contiguous) and TensorView (non-owning, strided, read-only).
///
/// Shapes are std::int64_t, outermost dimension first; strides are counted in elements, not bytes.
/// A TensorView is how caller memory (a NumPy array, a std::vector) reaches the library without a copy.
#pragma once

#if __cplusplus < 202002L
#error "mha needs C++20 (std::span): compile with -std=c++20 or later"
#endif

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "mha/bfloat16.hpp"

namespace mha {

/// Element types. BFloat16 (mha::bfloat16) is a compute dtype like the other two floating ones: its
/// products accumulate in float32 and its softmax runs in float32.
enum class DType : std::uint8_t { Float32, Float64, Bool, BFloat16 };

using Shape = std::vector<std::int64_t>;

std::size_t dtype_size(DType dtype);        ///< bytes per element: 4, 8, 1, 2
const char* dtype_name(DType dtype);        ///< "float32", "float64", "bool", "bfloat16"
std::string shape_str(const Shape& shape);  ///< "[2, 3, 4]"
/// The product of the sizes; 1 for rank 0, 0 when a size is 0; mha::Error when it overflows 64 bits.
std::int64_t shape_numel(const Shape& shape);

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::Float32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::Float64;
}
template <>
constexpr DType dtype_of<bool>() {
  return DType::Bool;
}
template <>
constexpr DType dtype_of<bfloat16>() {
  return DType::BFloat16;
}

/// Row-major (C order) strides of a shape, in elements; mha::Error when one overflows 64 bits.
Shape contiguous_strides(const Shape& shape);

namespace detail {
/// Whether elements of `dtype` may be read as T: float for Float32, double for Float64, bool or
/// std::uint8_t (one byte, nonzero = true) for Bool, mha::bfloat16 for BFloat16.
template <class T>
constexpr bool element_type_matches(DType dtype) {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, float>) return dtype == DType::Float32;
  if constexpr (std::is_same_v<U, double>) return dtype == DType::Float64;
  if constexpr (std::is_same_v<U, bool> || std::is_same_v<U, std::uint8_t>) return dtype == DType::Bool;
  if constexpr (std::is_same_v<U, bfloat16>) return dtype == DType::BFloat16;
  return false;
}
/// Throws mha::Error: data_as<`requested`>() on elements of `dtype`.
[[noreturn]] void throw_element_type_mismatch(DType dtype, const char* requested);
template <class T>
constexpr const char* element_type_name() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, float>) return "float";
  if constexpr (std::is_same_v<U, double>) return "double";
  if constexpr (std::is_same_v<U, bool>) return "bool";
  if constexpr (std::is_same_v<U, std::uint8_t>) return "std::uint8_t";
  if constexpr (std::is_same_v<U, bfloat16>) return "mha::bfloat16";
  return "another type";
}
template <class T>
void check_element_type(DType dtype) {
  if (!element_type_matches<T>(dtype)) throw_element_type_mismatch(dtype, element_type_name<T>());
}
}  // namespace detail

/// A read-only window on memory the caller owns. Bool elements are one byte, nonzero = true.
///
/// The typed constructors are the ones to use: the dtype follows the element type, and the view is
/// checked to stay inside the span,
///
///     std::vector<float> x(2 * 5 * 16);
///     mha::TensorView input(x, {2, 5, 16});   // float32 [2, 5, 16]; mha::Error if x is too short
///
/// The raw-pointer forms are for memory whose extent the library cannot see (an array from another
/// library, a mapped file): the caller promises that `data` holds elements of `dtype` at every offset
/// the shape and strides reach (the sum of (size - 1) x stride over the dimensions, plus one).
class TensorView {
 public:
  TensorView() = default;
  /// C-order view of `data`, whose dtype follows the element type. mha::Error when `data` holds fewer
  /// elements than the shape's (more are allowed: a view of the first ones), or as below.
  TensorView(std::span<const float> data, Shape shape);
  TensorView(std::span<const double> data, Shape shape);
  TensorView(std::span<const bool> data, Shape shape);
  TensorView(std::span<const bfloat16> data, Shape shape);
  /// Strided view of `data`: mha::Error when the shape and strides reach past its end, or as below.
  TensorView(std::span<const float> data, Shape shape, Shape strides);
  TensorView(std::span<const double> data, Shape shape, Shape strides);
  TensorView(std::span<const bool> data, Shape shape, Shape strides);
  TensorView(std::span<const bfloat16> data, Shape shape, Shape strides);

  /// Raw form (see above: the caller vouches for the extent). Strides in elements; may be zero
  /// (broadcast) or any non-negative value. Sizes must be non-negative, and the product of the nonzero
  /// ones at most 2^60 - 1 (as for Tensor); otherwise mha::Error.
  TensorView(const void* data, DType dtype, Shape shape, Shape strides);
  /// C-order raw view of `data`.
  TensorView(const void* data, DType dtype, Shape shape);

  const void* data() const { return data_; }
  /// The elements as T; mha::Error when T does not match the dtype (float for float32, double for
  /// float64, bool or std::uint8_t for bool, mha::bfloat16 for bfloat16).
  template <class T>
  const T* data_as() const {
    detail::check_element_type<T>(dtype_);
    return static_cast<const T*>(data_);
  }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  std::int64_t rank() const { return static_cast<std::int64_t>(shape_.size()); }
  std::int64_t size(std::int64_t dim) const { return shape_.at(static_cast<std::size_t>(dim)); }
  std::int64_t stride(std::int64_t dim) const { return strides_.at(static_cast<std::size_t>(dim)); }
  std::int64_t numel() const { return shape_numel(shape_); }
  bool is_contiguous() const;

 private:
  const void* data_ = nullptr;
  DType dtype_ = DType::Float32;
  Shape shape_;
  Shape strides_;
};

/// Owning, contiguous (C order), 64-byte aligned, zero-initialised storage (unless made uninitialized()). Move-only;
/// copy with clone().
///
/// Freed storage of 64 KiB to 16 MiB is kept in a process-wide cache and reused by the next tensor of
/// the same size (rounded up to 4 KiB), so that a training loop's per-step tensors land on memory
/// already mapped instead of faulting in new pages. The cache holds at most 64 MiB (oldest freed
/// first out); the environment variable MHA_STORAGE_CACHE_MIB, read when the first tensor is
/// allocated, sets another limit in MiB (0: no cache).
class Tensor {
 public:
  Tensor() = default;  ///< an undefined tensor: defined() is false
  /// mha::Error when a size is negative or the shape is too large for its sizes to be counted: the
  /// product of its nonzero sizes must be at most 2^60 - 1 elements, so that the byte size of any
  /// dtype fits 63 bits (NumPy refuses the same shapes). A shape within that limit whose memory
  /// cannot be allocated throws std::bad_alloc.
  Tensor(DType dtype, Shape shape);

  /// Like Tensor(dtype, shape), but the contents are unspecified: for buffers that the caller
  /// overwrites whole before reading (the library's own outputs), saving the zero fill.
  static Tensor uninitialized(DType dtype, Shape shape);

  /// A contiguous copy of any view, converted to `dtype` (between float32, float64 and bfloat16, rounding
  /// to nearest even where the target is narrower; bool stays bool).
  static Tensor copy_of(const TensorView& view, DType dtype);
  static Tensor copy_of(const TensorView& view) { return copy_of(view, view.dtype()); }
  Tensor clone() const { return copy_of(view()); }

  bool defined() const { return data_ != nullptr || defined_empty_; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  Shape strides() const { return contiguous_strides(shape_); }
  std::int64_t rank() const { return static_cast<std::int64_t>(shape_.size()); }
  std::int64_t size(std::int64_t dim) const { return shape_.at(static_cast<std::size_t>(dim)); }
  std::int64_t numel() const { return shape_numel(shape_); }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype_); }

  void* data() { return data_.get(); }
  const void* data() const { return data_.get(); }
  /// The elements as T; mha::Error when T does not match the dtype (as TensorView::data_as).
  template <class T>
  T* data_as() {
    detail::check_element_type<T>(dtype_);
    return static_cast<T*>(data());
  }
  template <class T>
  const T* data_as() const {
    detail::check_element_type<T>(dtype_);
    return static_cast<const T*>(data());
  }

  TensorView view() const { return TensorView(data(), dtype_, shape_); }
  operator TensorView() const { return view(); }  // NOLINT: a tensor is usable wherever a view is

  /// Same elements, new shape with the same element count (contiguous storage makes this free).
  Tensor reshaped(Shape shape) &&;

 private:
  struct Free {
    std::size_t bytes;  // what the storage was acquired for (value-initialised: 0)
    void operator()(std::byte* p) const;
  };
  void allocate();  // storage for shape_, contents unspecified; checks the shape
  std::unique_ptr<std::byte, Free> data_;
  DType dtype_ = DType::Float32;
  Shape shape_;
  bool defined_empty_ = false;  // defined but zero elements, so no storage
};

}  // namespace mha
