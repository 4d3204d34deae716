// Stored element types, checked sizes, element conversion on read, C-order writes.
#include "io/tensor_bytes.hpp"

#include <algorithm>
#include <array>

#include "checked_arithmetic.hpp"
#include "io/half.hpp"
#include "io/little_endian.hpp"

namespace mha::io {

std::size_t stored_size(StoredType type) {
  switch (type) {
    case StoredType::F64: return 8;
    case StoredType::F32: return 4;
    case StoredType::F16:
    case StoredType::BF16: return 2;
    case StoredType::Bool: return 1;
  }
  return 0;
}

DType natural_dtype(StoredType type) {
  switch (type) {
    case StoredType::F64: return DType::Float64;
    case StoredType::Bool: return DType::Bool;
    case StoredType::BF16: return DType::BFloat16;
    default: return DType::Float32;
  }
}

std::optional<std::uint64_t> checked_byte_size(const Shape& shape, std::size_t itemsize) {
  const auto nonzero_product = detail::nonzero_size_product(shape);
  if (!nonzero_product) return std::nullopt;
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  return static_cast<std::uint64_t>(*nonzero_product) * itemsize;
}

namespace {

// Converts `n` stored elements at `src` into `dst`.
template <class Dst>
void convert(StoredType stored, const std::byte* src, std::size_t n, Dst* dst) {
  for (std::size_t i = 0; i < n; ++i) {
    const std::byte* p = src + i * stored_size(stored);
    switch (stored) {
      case StoredType::F64: dst[i] = static_cast<Dst>(load_le<double>(p)); break;
      case StoredType::F32: dst[i] = static_cast<Dst>(load_le<float>(p)); break;
      case StoredType::F16: dst[i] = static_cast<Dst>(half_to_float(load_le<std::uint16_t>(p))); break;
      case StoredType::BF16: dst[i] = static_cast<Dst>(bfloat16_to_float(load_le<std::uint16_t>(p))); break;
      case StoredType::Bool: dst[i] = static_cast<Dst>(p[0] != std::byte{0}); break;
    }
  }
}

}  // namespace

Tensor read_elements(const ByteSource& source, std::uint64_t offset, StoredType stored, const Shape& shape,
                     DType dtype) {
  Tensor t(dtype, shape);
  const auto n = static_cast<std::size_t>(t.numel());
  if (n == 0) return t;
  const std::size_t item = stored_size(stored);
  const bool same_layout = (stored == StoredType::F64 && dtype == DType::Float64) ||
                           (stored == StoredType::F32 && dtype == DType::Float32) ||
                           (stored == StoredType::BF16 && dtype == DType::BFloat16);
  if (same_layout) {
    source.read(offset, t.data(), n * item);
    return t;
  }
  // Convert chunk by chunk through a fixed buffer.
  std::array<std::byte, 1 << 16> buffer;
  const std::size_t per_chunk = buffer.size() / item;
  for (std::size_t done = 0; done < n;) {
    const std::size_t count = std::min(per_chunk, n - done);
    source.read(offset + done * item, buffer.data(), count * item);
    switch (dtype) {
      case DType::Float32: convert(stored, buffer.data(), count, t.data_as<float>() + done); break;
      case DType::Float64: convert(stored, buffer.data(), count, t.data_as<double>() + done); break;
      case DType::Bool: convert(stored, buffer.data(), count, t.data_as<std::uint8_t>() + done); break;
      case DType::BFloat16: convert(stored, buffer.data(), count, t.data_as<bfloat16>() + done); break;
    }
    done += count;
  }
  return t;
}

void write_c_order(ByteSink& sink, const TensorView& view) {
  if (view.numel() == 0) return;
  // Bool goes through copy_of, which normalises bytes to 0 / 1; floats are written in place when the
  // view is already C-ordered.
  if (view.is_contiguous() && view.dtype() != DType::Bool) {
    sink.write(view.data(), static_cast<std::size_t>(view.numel()) * dtype_size(view.dtype()));
    return;
  }
  const Tensor copy = Tensor::copy_of(view);
  sink.write(copy.data(), copy.nbytes());
}

}  // namespace mha::io
