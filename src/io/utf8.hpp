// UTF-8 validation (RFC 3629): the safetensors header must be UTF-8, and names we write must be.
#pragma once

#include <cstddef>
#include <optional>
#include <string_view>

namespace mha::io {

// The offset of the first byte that is not part of a valid UTF-8 sequence (overlong forms, UTF-16
// surrogates and code points above U+10FFFF are invalid), or nullopt when all of `text` is valid.
inline std::optional<std::size_t> first_invalid_utf8(std::string_view text) {
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(text[i]); };
  const auto continuation = [&](std::size_t i) { return i < text.size() && (byte(i) & 0xc0) == 0x80; };
  std::size_t i = 0;
  while (i < text.size()) {
    const unsigned char c = byte(i);
    if (c < 0x80) {
      ++i;
      continue;
    }
    std::size_t length;
    unsigned char lo = 0x80, hi = 0xbf;  // allowed range of the second byte
    if (c >= 0xc2 && c <= 0xdf) {
      length = 2;
    } else if (c >= 0xe0 && c <= 0xef) {
      length = 3;
      if (c == 0xe0) lo = 0xa0;  // overlong
      if (c == 0xed) hi = 0x9f;  // surrogates
    } else if (c >= 0xf0 && c <= 0xf4) {
      length = 4;
      if (c == 0xf0) lo = 0x90;  // overlong
      if (c == 0xf4) hi = 0x8f;  // above U+10FFFF
    } else {
      return i;  // a continuation byte, an overlong lead (0xc0, 0xc1) or 0xf5..0xff
    }
    if (i + 1 >= text.size() || byte(i + 1) < lo || byte(i + 1) > hi) return i;
    for (std::size_t k = 2; k < length; ++k)
      if (!continuation(i + k)) return i;
    i += length;
  }
  return std::nullopt;
}

}  // namespace mha::io
