// Rgb: a colour as the PNG canvas and the SVG writers take it.
#pragma once

#include <cstdint>

namespace mha_cli {

struct Rgb {
  std::uint8_t r, g, b;
};

}  // namespace mha_cli
