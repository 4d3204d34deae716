// PNG heat map of an attention weight matrix [L, S].
//
// Pixels are drawn into an RGB buffer and saved with stb_image_write (libstb-dev). Text uses
// stb_easy_font (same package), which turns ASCII into axis-aligned quads, so rasterising it is
// filling rectangles: no font files and no text-layout library are needed for a few labels.
#include "attention_map_png.hpp"

#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <stb/stb_image_write.h>

// stb_easy_font defines its functions `static` in the header; the ones we do not call would warn.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wsign-conversion"
#include <stb/stb_easy_font.h>
#pragma GCC diagnostic pop

namespace mha_cli {
namespace {

constexpr int kCell = 22;        // pixels per weight, grid line included
constexpr int kFontScale = 2;    // stb_easy_font glyphs are ~5x7 "pixels"; each becomes 2x2
constexpr int kLineHeight = 12 * kFontScale;  // stb_easy_font's line advance, scaled
constexpr int kMargin = 12;      // around everything
constexpr int kLabelBand = 26;   // width of the query labels, height of the key labels
constexpr int kColourBarWidth = 200;
constexpr int kColourBarHeight = 14;

constexpr Rgb kBackground{255, 255, 255};
constexpr Rgb kGridLine{215, 215, 215};
constexpr Rgb kInk{35, 35, 35};

// stb_easy_font draws ASCII 32..126 only (it indexes a table by c - 32).
std::string printable(const std::string& text) {
  std::string out = text;
  for (char& c : out) {
    if (c < 32 || c > 126) c = '?';
  }
  return out;
}

// Width in pixels of `text` at kFontScale, without the spacing after the last glyph.
int text_width(const std::string& text) {
  if (text.empty()) return 0;
  std::string buffer = printable(text);
  return (stb_easy_font_width(buffer.data()) - 1) * kFontScale;
}

class Canvas {
 public:
  Canvas(int width, int height) : width_(width), height_(height), pixels_(3 * std::size_t(width) * std::size_t(height)) {
    fill(0, 0, width, height, kBackground);
  }

  // Fills the rectangle [x, x + w) x [y, y + h), clipped to the canvas.
  void fill(int x, int y, int w, int h, Rgb colour) {
    for (int row = std::max(y, 0); row < std::min(y + h, height_); ++row) {
      for (int col = std::max(x, 0); col < std::min(x + w, width_); ++col) {
        std::uint8_t* p = &pixels_[3 * (std::size_t(row) * std::size_t(width_) + std::size_t(col))];
        p[0] = colour.r;
        p[1] = colour.g;
        p[2] = colour.b;
      }
    }
  }

  // A frame `thickness` pixels wide just inside the rectangle.
  void frame(int x, int y, int w, int h, int thickness, Rgb colour) {
    fill(x, y, w, thickness, colour);
    fill(x, y + h - thickness, w, thickness, colour);
    fill(x, y, thickness, h, colour);
    fill(x + w - thickness, y, thickness, h, colour);
  }

  // Draws `text` with its top-left corner at (x, y).
  void text(int x, int y, const std::string& text, Rgb colour) {
    std::string buffer = printable(text);
    // stb_easy_font needs "~270 bytes per character" of vertex buffer; 4 vertices of 16 bytes per quad.
    std::vector<char> vertices(buffer.size() * 512 + 64);
    const int quads = stb_easy_font_print(0.0f, 0.0f, buffer.data(), nullptr, vertices.data(),
                                          static_cast<int>(vertices.size()));
    for (int q = 0; q < quads; ++q) {
      float corner0[2], corner2[2];  // vertex 0 is the top-left, vertex 2 the bottom-right corner
      std::memcpy(corner0, vertices.data() + q * 64, sizeof corner0);
      std::memcpy(corner2, vertices.data() + q * 64 + 32, sizeof corner2);
      fill(x + static_cast<int>(corner0[0]) * kFontScale, y + static_cast<int>(corner0[1]) * kFontScale,
           static_cast<int>(corner2[0] - corner0[0]) * kFontScale,
           static_cast<int>(corner2[1] - corner0[1]) * kFontScale, colour);
    }
  }

  void save_png(const std::filesystem::path& path) const {
    if (stbi_write_png(path.string().c_str(), width_, height_, 3, pixels_.data(), 3 * width_) == 0) {
      throw std::runtime_error("cannot write " + path.string());
    }
  }

 private:
  int width_, height_;
  std::vector<std::uint8_t> pixels_;  // [height, width, 3] RGB
};

}  // namespace

void write_attention_map_png(const std::filesystem::path& path, const AttentionMap& map) {
  const int rows = static_cast<int>(map.rows());
  const int cols = static_cast<int>(map.cols());
  if (map.weights.size() != std::size_t(rows) * std::size_t(cols) ||
      !(map.marked.empty() || map.marked.size() == map.weights.size())) {
    throw std::logic_error("write_attention_map_png: weights/marked do not match the labels' [L, S]");
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
  const int width = std::max({grid_x + grid_w, kMargin + text_width(map.title),
                              bar_x + kColourBarWidth + 8 + text_width(legend_high),
                              grid_x + text_width(caption), grid_x + text_width(map.note)}) + kMargin;
  const int note_y = caption_y + kLineHeight;
  const int height = (map.note.empty() ? caption_y : note_y) + kLineHeight + kMargin;

  Canvas canvas(width, height);
  canvas.text(kMargin, kMargin, map.title, kInk);

  // Labels are centred on their cell; stb_easy_font glyphs sit in the top ~8 of their 12-row line.
  constexpr int kGlyphHeight = 8 * kFontScale;
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
