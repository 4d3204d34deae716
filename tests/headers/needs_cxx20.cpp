// Compiled by ctest (tests/CMakeLists.txt) with -std=c++17: the public headers must stop with a message
// that names the standard they need (std::span), not with an error deep inside them.
#include <mha/io.hpp>
