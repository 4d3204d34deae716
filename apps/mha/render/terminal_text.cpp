// quoted_printable, terminal_safe (terminal_text.hpp).
#include "render/terminal_text.hpp"

#include <string>
#include <string_view>

namespace mha_cli {

namespace {

void append_hex(std::string& out, unsigned char byte) {
  static constexpr char kHex[] = "0123456789abcdef";
  out += "\\x";
  out += kHex[byte >> 4];
  out += kHex[byte & 15];
}

}  // namespace

std::string quoted_printable(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte >= 0x20 && byte < 0x7f && c != '\\' && c != '"') {
      out += c;
    } else {
      append_hex(out, byte);
    }
  }
  return out + "\"";
}

std::string terminal_safe(std::string_view message) {
  std::string out;
  for (const char c : message) {
    const auto byte = static_cast<unsigned char>(c);
    if ((byte < 0x20 && c != '\n') || byte == 0x7f) {
      append_hex(out, byte);
    } else {
      out += c;
    }
  }
  return out;
}

}  // namespace mha_cli
