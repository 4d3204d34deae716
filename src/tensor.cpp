// Tensor and TensorView: storage, shapes, strides, conversion.
#include "mha/tensor.hpp"

#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <type_traits>

#include "bf16_conversion.hpp"
#include "checked_arithmetic.hpp"
#include "mha/error.hpp"
#include "storage_cache.hpp"

namespace mha {

static_assert(detail::kStorageAlignment == 64);  // one cache line; also the widest SIMD register (AVX-512)

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::Float32: return 4;
    case DType::Float64: return 8;
    case DType::Bool: return 1;
    case DType::BFloat16: return 2;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
    case DType::Bool: return "bool";
    case DType::BFloat16: return "bfloat16";
  }
  return "unknown";
}

std::string shape_str(const Shape& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::int64_t shape_numel(const Shape& shape) {
  for (std::int64_t d : shape)
    if (d == 0) return 0;
  std::int64_t n = 1;
  for (std::int64_t d : shape) {
    const auto product = detail::checked_mul(n, d);
    if (!product) throw Error("shape " + shape_str(shape) + ": its element count overflows 64 bits");
    n = *product;
  }
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  std::int64_t s = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    if (i == 0) break;  // the product of every size is no stride
    const auto next = detail::checked_mul(s, shape[i]);
    if (!next) throw Error("shape " + shape_str(shape) + ": its strides overflow 64 bits");
    s = *next;
  }
  return strides;
}

namespace {

// Refuses a shape with more elements than a tensor may hold (detail::kMaxElements, counting the nonzero
// sizes as NumPy does), so that element counts, byte sizes and offsets computed from it cannot overflow.
void check_not_too_large(const char* what, const Shape& shape) {
  if (!detail::nonzero_size_product(shape))
    throw Error(std::string(what) + ": shape " + shape_str(shape) + " is too large: more than " +
                std::to_string(detail::kMaxElements) + " elements (2^60), the most a tensor may hold");
}

}  // namespace

// ---- TensorView ----------------------------------------------------------------------------------

TensorView::TensorView(const void* data, DType dtype, Shape shape, Shape strides)
    : data_(data), dtype_(dtype), shape_(std::move(shape)), strides_(std::move(strides)) {
  if (shape_.size() != strides_.size())
    throw Error("TensorView: shape " + shape_str(shape_) + " and strides " + shape_str(strides_) + " differ in rank");
  for (std::size_t i = 0; i < shape_.size(); ++i) {
    if (shape_[i] < 0) throw Error("TensorView: negative size in shape " + shape_str(shape_));
    if (strides_[i] < 0) throw Error("TensorView: negative stride in strides " + shape_str(strides_));
  }
  check_not_too_large("TensorView", shape_);
  if (data_ == nullptr && shape_numel(shape_) != 0) throw Error("TensorView: null data for shape " + shape_str(shape_));
}

TensorView::TensorView(const void* data, DType dtype, Shape shape)
    : TensorView(data, dtype, shape, contiguous_strides(shape)) {}

namespace {

// The number of elements a view's shape and strides reach from its start: 1 + sum (size - 1) x stride,
// or 0 for a view without elements. Called after the view's own checks (sizes and strides >= 0).
std::int64_t elements_reached(const TensorView& v) {
  if (v.numel() == 0) return 0;
  std::int64_t last = 0;
  for (std::int64_t i = 0; i < v.rank(); ++i) {
    const auto step = detail::checked_mul(v.size(i) - 1, v.stride(i));
    const auto sum = step ? detail::checked_add(last, *step) : std::nullopt;
    if (!sum)
      throw Error("TensorView: shape " + shape_str(v.shape()) + " with strides " + shape_str(v.strides()) +
                  " reaches past any buffer (the offset overflows 64 bits)");
    last = *sum;
  }
  return last + 1;
}

template <class T>
TensorView checked_view(std::span<const T> data, Shape shape, Shape strides) {
  const TensorView view(data.data(), dtype_of<T>(), std::move(shape), std::move(strides));
  const std::int64_t reached = elements_reached(view);
  if (static_cast<std::uint64_t>(reached) > data.size())
    throw Error("TensorView: shape " + shape_str(view.shape()) + " with strides " + shape_str(view.strides()) +
                " reaches " + std::to_string(reached) + " elements, but the " + dtype_name(dtype_of<T>()) +
                " data holds " + std::to_string(data.size()));
  return view;
}

}  // namespace

TensorView::TensorView(std::span<const float> data, Shape shape) : TensorView(data, shape, contiguous_strides(shape)) {}
TensorView::TensorView(std::span<const double> data, Shape shape)
    : TensorView(data, shape, contiguous_strides(shape)) {}
TensorView::TensorView(std::span<const bool> data, Shape shape) : TensorView(data, shape, contiguous_strides(shape)) {}
TensorView::TensorView(std::span<const bfloat16> data, Shape shape)
    : TensorView(data, shape, contiguous_strides(shape)) {}
TensorView::TensorView(std::span<const bfloat16> data, Shape shape, Shape strides)
    : TensorView(checked_view(data, std::move(shape), std::move(strides))) {}
TensorView::TensorView(std::span<const float> data, Shape shape, Shape strides)
    : TensorView(checked_view(data, std::move(shape), std::move(strides))) {}
TensorView::TensorView(std::span<const double> data, Shape shape, Shape strides)
    : TensorView(checked_view(data, std::move(shape), std::move(strides))) {}
TensorView::TensorView(std::span<const bool> data, Shape shape, Shape strides)
    : TensorView(checked_view(data, std::move(shape), std::move(strides))) {}

void detail::throw_element_type_mismatch(DType dtype, const char* requested) {
  throw Error(std::string("data_as<") + requested + ">() on " + dtype_name(dtype) + " elements (read " +
              dtype_name(dtype) + " as " +
              (dtype == DType::Float32    ? "float"
               : dtype == DType::Float64  ? "double"
               : dtype == DType::BFloat16 ? "mha::bfloat16"
                                          : "bool or std::uint8_t") +
              ")");
}

bool TensorView::is_contiguous() const {
  std::int64_t expected = 1;
  for (std::size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] != 1 && strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

// ---- Tensor --------------------------------------------------------------------------------------

void Tensor::Free::operator()(std::byte* p) const { detail::release_storage(p, bytes); }

Tensor::Tensor(DType dtype, Shape shape) : Tensor(uninitialized(dtype, std::move(shape))) {
  if (data_) std::memset(data_.get(), 0, nbytes());
}

Tensor Tensor::uninitialized(DType dtype, Shape shape_in) {
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape_in);
  t.allocate();
  return t;
}

void Tensor::allocate() {
  for (std::int64_t d : shape_)
    if (d < 0) throw Error("Tensor: negative size in shape " + shape_str(shape_));
  check_not_too_large("Tensor", shape_);  // so the byte size below is at most 8 * kMaxElements < 2^63
  const std::size_t bytes = static_cast<std::size_t>(shape_numel(shape_)) * dtype_size(dtype_);
  if (bytes == 0) {
    defined_empty_ = true;
    return;
  }
  data_ = std::unique_ptr<std::byte, Free>(detail::acquire_storage(bytes), Free{bytes});
}

namespace {

template <class Dst, class Src>
void copy_strided(const TensorView& src, Dst* dst) {
  const Shape& shape = src.shape();
  const Shape& strides = src.strides();
  const auto* base = src.data_as<Src>();
  const std::int64_t n = src.numel();
  if (src.is_contiguous()) {  // element i at base[i]: one copy, or one loop in vectors
    if constexpr (std::is_same_v<Dst, Src>) {
      std::memcpy(dst, base, static_cast<std::size_t>(n) * sizeof(Src));
      return;
    } else if constexpr (std::is_same_v<Dst, float> && std::is_same_v<Src, bfloat16>) {
      detail::widen_bfloat16(base, n, dst);
      return;
    } else if constexpr (std::is_same_v<Dst, bfloat16> && std::is_same_v<Src, float>) {
      detail::round_to_bfloat16(base, n, dst);
      return;
    } else if constexpr (!(std::is_same_v<Dst, bfloat16> && std::is_same_v<Src, double>)) {
      for (std::int64_t i = 0; i < n; ++i) dst[i] = static_cast<Dst>(base[i]);
      return;
    }
  }
  const std::size_t rank = shape.size();
  std::vector<std::int64_t> index(rank, 0);
  std::int64_t offset = 0;  // element offset of `index` in src
  for (std::int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<Dst, bfloat16> && std::is_same_v<Src, double>)
      dst[i] = bfloat16::from_double(base[offset]);  // rounded once, not through float
    else dst[i] = static_cast<Dst>(base[offset]);
    for (std::size_t d = rank; d-- > 0;) {  // odometer increment, innermost first
      if (++index[d] < shape[d]) {
        offset += strides[d];
        break;
      }
      offset -= strides[d] * (shape[d] - 1);
      index[d] = 0;
    }
  }
}

template <class Dst>
void copy_from(const TensorView& src, Dst* dst) {
  switch (src.dtype()) {
    case DType::Float32: return copy_strided<Dst, float>(src, dst);
    case DType::Float64: return copy_strided<Dst, double>(src, dst);
    case DType::Bool: return copy_strided<Dst, std::uint8_t>(src, dst);
    case DType::BFloat16: return copy_strided<Dst, bfloat16>(src, dst);
  }
}

}  // namespace

Tensor Tensor::copy_of(const TensorView& view, DType dtype) {
  if ((dtype == DType::Bool) != (view.dtype() == DType::Bool))
    throw Error(std::string("Tensor::copy_of: cannot convert ") + dtype_name(view.dtype()) + " to " +
                dtype_name(dtype));
  Tensor t = uninitialized(dtype, view.shape());  // every element written below
  if (t.numel() == 0) return t;
  switch (dtype) {
    case DType::Float32: copy_from(view, t.data_as<float>()); break;
    case DType::Float64: copy_from(view, t.data_as<double>()); break;
    case DType::BFloat16: copy_from(view, t.data_as<bfloat16>()); break;
    case DType::Bool: {
      auto* dst = t.data_as<std::uint8_t>();
      copy_from(view, dst);
      for (std::int64_t i = 0; i < t.numel(); ++i) dst[i] = dst[i] != 0;  // canonical 0 / 1
      break;
    }
  }
  return t;
}

Tensor Tensor::reshaped(Shape shape) && {
  for (std::int64_t d : shape)
    if (d < 0) throw Error("Tensor::reshaped: negative size in shape " + shape_str(shape));
  if (shape_numel(shape) != numel())
    throw Error("Tensor::reshaped: cannot view " + shape_str(shape_) + " as " + shape_str(shape));
  shape_ = std::move(shape);
  return std::move(*this);
}

}  // namespace mha
