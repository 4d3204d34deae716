// Tensor elements as the file formats store them: the element types files may hold, the checked
// size of a stated shape, reading elements (converting them) and writing a view in C order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "io/binary_file.hpp"
#include "mha/tensor.hpp"

namespace mha::io {

// An element type as stored in a file; F16 and BF16 have no DType and are widened when read.
enum class StoredType : std::uint8_t { F64, F32, F16, BF16, Bool };

std::size_t stored_size(StoredType type);  // 8, 4, 2, 2, 1
// The dtype a stored type is read as when the caller asks for none: F64 -> Float64, Bool -> Bool,
// F32 / F16 / BF16 -> Float32.
DType natural_dtype(StoredType type);

// The byte size of a tensor of `shape` (entries already checked non-negative) and `itemsize`, or
// nullopt when the product of its nonzero sizes exceeds INT64_MAX / 8 elements (the limit Tensor
// itself enforces), which also keeps every byte count below 2^63.
std::optional<std::uint64_t> checked_byte_size(const Shape& shape, std::size_t itemsize);

// Reads a tensor of `shape` whose elements, of type `stored`, lie in C order at `offset` of `source`,
// converted to `dtype` (Float32 or Float64 for floating types, Bool for Bool). The caller has checked
// that the bytes lie inside the source; conversion goes through a small buffer, so nothing larger
// than the result is allocated. Bool bytes are normalised to 0 / 1.
Tensor read_elements(const ByteSource& source, std::uint64_t offset, StoredType stored, const Shape& shape,
                     DType dtype);

// Writes the elements of `view` in C order, in its own dtype (bool as one byte 0 / 1).
void write_c_order(ByteSink& sink, const TensorView& view);

}  // namespace mha::io
