// Text made safe for the terminal the command prints to.
#pragma once

#include <string>
#include <string_view>

namespace mha_cli {

// `text` in double quotes with every byte outside printable ASCII (control bytes such as ESC and NUL,
// bytes >= 0x7f), the backslash and the double quote written as \xNN: what a user typed, echoed in a
// message, can neither drive the terminal (colours, cursor moves) nor cut the message short (a NUL
// ends what std::exception::what() returns). E.g. "\x1b[31m" for ESC [ 3 1 m.
std::string quoted_printable(std::string_view text);

// A message for the terminal: bytes below the space other than the newline, and DEL, as \xNN; the
// rest unchanged (UTF-8 file names stay readable). For messages that may carry text from outside.
std::string terminal_safe(std::string_view message);

}  // namespace mha_cli
