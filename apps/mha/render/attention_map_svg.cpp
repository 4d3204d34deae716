// SVG heat map of an attention weight matrix [L, S]: rectangles and text, written by hand (SVG is
// plain XML; no library is needed to emit a few hundred elements).
#include "render/attention_map_svg.hpp"

#include <algorithm>
#include <fstream>
#include <stdexcept>
#include <string>

#include <fmt/core.h>

#include "render/xml_escape.hpp"

namespace mha_cli {
namespace {

constexpr int kCell = 22;  // as in the PNG
constexpr int kMargin = 12;
constexpr int kLabelBand = 26;
constexpr int kTitleHeight = 24;
constexpr int kFontSize = 15;

std::string hex(Rgb c) { return fmt::format("#{:02x}{:02x}{:02x}", c.r, c.g, c.b); }

}  // namespace

void write_attention_map_svg(const std::filesystem::path& path, const AttentionMap& map) {
  const int rows = static_cast<int>(map.rows());
  const int cols = static_cast<int>(map.cols());
  if (!map.consistent()) {
    throw std::logic_error("write_attention_map_svg: weights/marked/highlights do not match the labels' [L, S]");
  }
  const int grid_x = kMargin + kLabelBand;
  const int grid_y = kMargin + kTitleHeight + kLabelBand;
  const int caption_y = grid_y + rows * kCell + kMargin + kFontSize;
  constexpr int kCharWidth = 9;  // of a 15 px monospace font, about 0.6 em
  const int width = std::max({grid_x + cols * kCell, grid_x + kCharWidth * 52,
                              kMargin + kCharWidth * static_cast<int>(map.title.size()),
                              grid_x + kCharWidth * static_cast<int>(map.note.size())}) +
                    kMargin;
  const int height = caption_y + (map.note.empty() ? 0 : kFontSize + 6) + kMargin;

  std::string svg =
      fmt::format("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
                  "font-family=\"monospace\" font-size=\"{2}\">\n"
                  "<rect width=\"100%\" height=\"100%\" fill=\"#ffffff\"/>\n"
                  "<text x=\"{3}\" y=\"{4}\">{5}</text>\n",
                  width, height, kFontSize, kMargin, kMargin + kFontSize, xml_escape(map.title));
  for (int j = 0; j < cols; ++j) {
    svg += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", grid_x + j * kCell + kCell / 2,
                       grid_y - 8, xml_escape(map.key_labels[std::size_t(j)]));
  }
  for (int i = 0; i < rows; ++i) {
    svg += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", kMargin + kLabelBand / 2,
                       grid_y + i * kCell + kCell / 2 + 5, xml_escape(map.query_labels[std::size_t(i)]));
  }
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < cols; ++j) {
      const std::size_t at = std::size_t(i) * std::size_t(cols) + std::size_t(j);
      svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\" stroke=\"#d7d7d7\">"
                         "<title>query {} '{}', key {} '{}': {:.6f}</title></rect>\n",
                         grid_x + j * kCell, grid_y + i * kCell, kCell, kCell, hex(weight_colour(map.weights[at])), i,
                         xml_escape(map.query_labels[std::size_t(i)]), j, xml_escape(map.key_labels[std::size_t(j)]),
                         map.weights[at]);
    }
  }
  // Outlines in a second pass, so that no neighbouring cell paints over them.
  for (std::size_t at = 0; at < map.marked.size(); ++at) {
    if (map.marked[at] == 0) continue;
    const int i = static_cast<int>(at / std::size_t(cols)), j = static_cast<int>(at % std::size_t(cols));
    svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"{}\" "
                       "stroke-width=\"2\" pointer-events=\"none\"/>\n",
                       grid_x + j * kCell + 2, grid_y + i * kCell + 2, kCell - 4, kCell - 4, hex(kMarkColour));
  }
  for (const Highlight& h : map.highlights) {
    svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"{}\" "
                       "stroke-width=\"3\" pointer-events=\"none\"/>\n",
                       grid_x + h.col * kCell, grid_y + h.row * kCell, h.cols * kCell, h.rows * kCell, hex(h.colour));
  }
  svg += fmt::format("<text x=\"{}\" y=\"{}\">rows: queries, columns: keys; white: 0, dark blue: 1</text>\n", grid_x,
                     caption_y);
  if (!map.note.empty()) {
    svg += fmt::format("<text x=\"{}\" y=\"{}\">{}</text>\n", grid_x, caption_y + kFontSize + 6, xml_escape(map.note));
  }
  svg += "</svg>\n";

  std::ofstream file(path, std::ios::binary);
  file << svg;
  if (!file.flush()) throw std::runtime_error("cannot write " + path.string());
}

}  // namespace mha_cli
