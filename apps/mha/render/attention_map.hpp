// AttentionMap: an attention weight matrix with its labels, as the image writers take it, and the
// colour map they share.
//
// Legend: L queries (rows), S keys (columns).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "render/colour.hpp"

namespace mha_cli {

// A block of cells outlined in `colour`: rows [row, row + rows), columns [col, col + cols).
struct Highlight {
  std::int64_t row = 0, rows = 0, col = 0, cols = 0;
  Rgb colour{0, 0, 0};
};

struct AttentionMap {
  std::string title;                      // drawn above the map
  std::vector<std::string> query_labels;  // [L]: one short label per row (a token)
  std::vector<std::string> key_labels;    // [S]: one short label per column
  std::vector<float> weights;             // [L, S] row-major, each in [0, 1]
  std::vector<std::uint8_t> marked;       // [L, S] or empty: nonzero cells get an outline
  std::string note;                       // a line under the map, e.g. what the outlines mean
  std::vector<Highlight> highlights{};    // blocks of cells outlined in their colour, drawn over everything

  std::int64_t rows() const { return static_cast<std::int64_t>(query_labels.size()); }
  std::int64_t cols() const { return static_cast<std::int64_t>(key_labels.size()); }
  // Whether weights and marked are [L, S] and every highlight is a non-empty block inside the grid.
  bool consistent() const {
    const auto cells = static_cast<std::size_t>(rows() * cols());
    const bool blocks_inside = std::all_of(highlights.begin(), highlights.end(), [&](const Highlight& h) {
      return h.row >= 0 && h.rows > 0 && h.row + h.rows <= rows() && h.col >= 0 && h.cols > 0 &&
             h.col + h.cols <= cols();
    });
    return weights.size() == cells && (marked.empty() || marked.size() == cells) && blocks_inside;
  }
};

// White (0) to dark blue (1): matplotlib's "Blues" colour map, linear between its five stops.
inline Rgb weight_colour(float w) {
  static constexpr std::array<Rgb, 5> kStops = {Rgb{247, 251, 255}, Rgb{198, 219, 239}, Rgb{107, 174, 214},
                                                Rgb{33, 113, 181}, Rgb{8, 48, 107}};
  const float t = std::clamp(w, 0.0f, 1.0f) * static_cast<float>(kStops.size() - 1);
  const auto i = std::min(static_cast<std::size_t>(t), kStops.size() - 2);
  const float f = t - static_cast<float>(i);
  auto mix = [f](std::uint8_t a, std::uint8_t b) {
    return static_cast<std::uint8_t>(static_cast<float>(a) + f * (static_cast<float>(b) - static_cast<float>(a)) +
                                     0.5f);
  };
  return {mix(kStops[i].r, kStops[i + 1].r), mix(kStops[i].g, kStops[i + 1].g), mix(kStops[i].b, kStops[i + 1].b)};
}

inline constexpr Rgb kMarkColour{230, 110, 20};  // outline of the cells a head's rule designates

}  // namespace mha_cli
