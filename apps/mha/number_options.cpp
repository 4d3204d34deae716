// integer_in, unsigned_integer, number_in (number_options.hpp).
#include "number_options.hpp"

#include <charconv>
#include <cmath>
#include <limits>
#include <string>
#include <system_error>
#include <type_traits>

#include <fmt/core.h>

#include "render/terminal_text.hpp"

namespace mha_cli {

namespace {

// Reads the whole of `text` with std::from_chars (decimal only: no '+', no spaces, no 0x). False when
// it is not a number of T's kind; `out_of_range` when it is one that T cannot hold (for an unsigned T,
// a negative integer too).
template <class T>
bool read_whole(const std::string& text, T& value, bool& out_of_range) {
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  out_of_range = ec == std::errc::result_out_of_range && ptr == end;
  if constexpr (std::is_integral_v<T> && std::is_unsigned_v<T>) {
    if (ec != std::errc() && !text.empty() && text[0] == '-') {
      std::int64_t negative = 0;
      bool too_negative = false;
      out_of_range = read_whole(text, negative, too_negative) || too_negative;
    }
  }
  return ec == std::errc() && ptr == end;
}

// "010", "00", "-07": digits that start with a 0 and do not stop there. C's strtol (base 0), CLI11 and
// the shell's $(( )) read them as octal, from_chars and Python as decimal: refused, not guessed at.
bool has_leading_zero(const std::string& text) {
  const std::size_t digits = !text.empty() && text[0] == '-' ? 1 : 0;
  return text.size() > digits + 1 && text[digits] == '0';
}

template <class T>
CLI::Option* integer_option(CLI::Option* option, T lo, T hi) {
  const std::string range = fmt::format("in [{}, {}]", lo, hi);
  option->transform(CLI::Validator(
      [lo, hi, range](std::string& input) -> std::string {
        T value{};
        bool out_of_range = false;
        if (!read_whole(input, value, out_of_range) && !out_of_range)
          return fmt::format("{} is not a decimal integer; expected an integer {}", quoted_printable(input), range);
        if (has_leading_zero(input))  // before the range: 0100 is 64 in octal, inside --beam's [1, 64]
          return fmt::format("{} has a leading zero, which some tools read as octal; expected a decimal integer {} "
                             "written without one",
                             input, range);
        if (out_of_range || value < lo || value > hi)
          return fmt::format("{} is out of range; expected an integer {}", input, range);
        input = fmt::format("{}", value);  // "-0" -> "0": CLI11 reads what was checked
        return "";
      },
      ""));
  return option->type_name("INT " + range);
}

}  // namespace

CLI::Option* integer_in(CLI::Option* option, std::int64_t lo, std::int64_t hi) {
  return integer_option(option, lo, hi);
}

CLI::Option* unsigned_integer(CLI::Option* option) {
  return integer_option(option, std::uint64_t{0}, std::numeric_limits<std::uint64_t>::max());
}

CLI::Option* number_in(CLI::Option* option, double lo, double hi) {
  const std::string range = fmt::format("in [{}, {}]", lo, hi);
  option->transform(CLI::Validator(
      [lo, hi, range](std::string& input) -> std::string {
        double value = 0;
        bool out_of_range = false;
        if (!read_whole(input, value, out_of_range) && !out_of_range)
          return fmt::format("{} is not a decimal number; expected a number {}", quoted_printable(input), range);
        if (!out_of_range && !std::isfinite(value))
          return fmt::format("{} is not a finite number; expected a number {}", input, range);
        if (out_of_range || value < lo || value > hi)
          return fmt::format("{} is out of range; expected a number {}", input, range);
        input = fmt::format("{}", value);  // the shortest text that reads back as the same double
        return "";
      },
      ""));
  return option->type_name("FLOAT " + range);
}

}  // namespace mha_cli
