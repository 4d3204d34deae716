// PNG heat map of an attention weight matrix [L, S], drawn on a png_canvas.hpp Canvas.
#include "render/attention_map_png.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "render/png_canvas.hpp"

namespace mha_cli {
namespace {

constexpr int kCell = 22;       // pixels per weight, grid line included
constexpr int kMargin = 12;     // around everything
constexpr int kLabelBand = 26;  // width of the query labels, height of the key labels
constexpr int kColourBarWidth = 200;
constexpr int kColourBarHeight = 14;

constexpr Rgb kBackground{255, 255, 255};
constexpr Rgb kGridLine{215, 215, 215};
constexpr Rgb kInk{35, 35, 35};

}  // namespace

void write_attention_map_png(const std::filesystem::path& path, const AttentionMap& map) {
  const int rows = static_cast<int>(map.rows());
  const int cols = static_cast<int>(map.cols());
  if (!map.consistent()) {
    throw std::logic_error("write_attention_map_png: weights/marked/highlights do not match the labels' [L, S]");
  }
  const std::string caption = "rows: queries, columns: keys";
  const std::string legend_low = "0", legend_high = "1";

  // Layout, top to bottom: title, key labels, grid (query labels on its left), colour bar, caption.
  const int grid_x = kMargin + kLabelBand;
  const int grid_y = kMargin + kLineHeight + kLabelBand;
  const int grid_w = cols * kCell + 1;
  const int grid_h = rows * kCell + 1;
  const int bar_y = grid_y + grid_h + kMargin;
  const int caption_y = bar_y + kColourBarHeight + kMargin;
  const int bar_x = grid_x + text_width(legend_low) + 8;
  const int width =
      std::max({grid_x + grid_w, kMargin + text_width(map.title), bar_x + kColourBarWidth + 8 + text_width(legend_high),
                grid_x + text_width(caption), grid_x + text_width(map.note)}) +
      kMargin;
  const int note_y = caption_y + kLineHeight;
  const int height = (map.note.empty() ? caption_y : note_y) + kLineHeight + kMargin;

  Canvas canvas(width, height, kBackground);
  canvas.text(kMargin, kMargin, map.title, kInk);

  // Labels are centred on their cell.
  for (int j = 0; j < cols; ++j) {
    const int x = grid_x + j * kCell + (kCell - text_width(map.key_labels[std::size_t(j)])) / 2;
    canvas.text(x, grid_y - kLabelBand + (kLabelBand - kGlyphHeight) / 2, map.key_labels[std::size_t(j)], kInk);
  }
  for (int i = 0; i < rows; ++i) {
    const int x = kMargin + (kLabelBand - text_width(map.query_labels[std::size_t(i)])) / 2;
    canvas.text(x, grid_y + i * kCell + (kCell - kGlyphHeight) / 2 + 1, map.query_labels[std::size_t(i)], kInk);
  }

  // The grid: grid-line colour underneath, each cell's interior on top.
  canvas.fill(grid_x, grid_y, grid_w, grid_h, kGridLine);
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < cols; ++j) {
      const std::size_t at = std::size_t(i) * std::size_t(cols) + std::size_t(j);
      const int x = grid_x + j * kCell + 1, y = grid_y + i * kCell + 1;
      canvas.fill(x, y, kCell - 1, kCell - 1, weight_colour(map.weights[at]));
      if (!map.marked.empty() && map.marked[at] != 0) canvas.frame(x, y, kCell - 1, kCell - 1, 2, kMarkColour);
    }
  }

  // Highlighted blocks: a frame on the block's outer grid lines, 3 pixels wide, over the cells.
  for (const Highlight& h : map.highlights) {
    canvas.frame(grid_x + int(h.col) * kCell - 1, grid_y + int(h.row) * kCell - 1, int(h.cols) * kCell + 3,
                 int(h.rows) * kCell + 3, 3, h.colour);
  }

  // Colour bar from 0 to 1, with its end values.
  canvas.text(grid_x, bar_y, legend_low, kInk);
  for (int k = 0; k < kColourBarWidth; ++k) {
    canvas.fill(bar_x + k, bar_y, 1, kColourBarHeight, weight_colour(float(k) / float(kColourBarWidth - 1)));
  }
  canvas.frame(bar_x - 1, bar_y - 1, kColourBarWidth + 2, kColourBarHeight + 2, 1, kGridLine);
  canvas.text(bar_x + kColourBarWidth + 8, bar_y, legend_high, kInk);
  canvas.text(grid_x, caption_y, caption, kInk);
  canvas.text(grid_x, note_y, map.note, kInk);

  canvas.save_png(path);
}

}  // namespace mha_cli
