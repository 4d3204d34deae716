// The 64-byte lines a span of memory touches, for software prefetch: the flash forward's next key block
// (attention/flash_forward.cpp) and the decode kernel's rows ahead (decode/prefetch_rows-inl.h).
#pragma once

#include <cstdint>

namespace mha::detail {

struct LineSpan {
  const char* first = nullptr;  // the line holding the span's first byte
  std::int64_t lines = 0;       // through the line holding its last byte (0 for no bytes at a line start)
};

// The lines of the `bytes` bytes at `start`, where it starts mid-line too.
inline LineSpan line_span(const void* start, std::int64_t bytes) {
  const auto address = reinterpret_cast<std::uintptr_t>(start);
  return {reinterpret_cast<const char*>(address & ~std::uintptr_t{63}),
          (static_cast<std::int64_t>(address & 63) + bytes + 63) / 64};
}

}  // namespace mha::detail
