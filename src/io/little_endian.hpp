// Little-endian loads and stores of unsigned integers from unaligned bytes (both file formats are
// little-endian). The element data of tensors is copied as is, which is right only on a little-endian
// machine: the static_assert keeps the library from building anywhere else rather than misreading.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace mha::io {

static_assert(std::endian::native == std::endian::little,
              "mha's file formats copy little-endian data as is; big-endian hosts are not supported");

template <class T>
T load_le(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <class T>
void store_le(std::byte* p, T v) {
  std::memcpy(p, &v, sizeof v);
}

}  // namespace mha::io
