// Number options of the command line, read strictly.
//
// CLI11 2.1's own reading of numbers lets wrong values through silently: strtoll clamps
// 9223372036854775808 to 2^63 - 1, strtoull reads -1 as 2^64 - 1, base 0 reads 010 as 8 and 0x10 as
// 16, and CLI::Range passes NaN (it compares false with both ends) and prints double ends with 300
// digits. These checks read a decimal integer or a finite decimal number, refuse anything else (an
// integer with a leading zero too: 010 is 8 to CLI11, C and the shell, 10 to others) and anything
// outside the option's range with a message that names the option (CLI11 puts its name in front),
// the value and the range, state the range in --help ("INT in [1, 1024]"), and hand CLI11 the value
// written canonically (they are transforms: CLI11 discards what a check writes), so that what it
// converts is what was checked.
#pragma once

#include <cstdint>

#include <CLI/CLI.hpp>

namespace mha_cli {

// `option` takes decimal integers in [lo, hi], without leading zeros (each item, for a list option).
CLI::Option* integer_in(CLI::Option* option, std::int64_t lo, std::int64_t hi);

// `option` takes decimal integers in [0, 2^64 - 1], without leading zeros (a seed).
CLI::Option* unsigned_integer(CLI::Option* option);

// `option` takes finite decimal numbers in [lo, hi]; NaN and infinities are refused.
CLI::Option* number_in(CLI::Option* option, double lo, double hi);

}  // namespace mha_cli
