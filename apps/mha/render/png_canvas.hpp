// An RGB pixel canvas with rectangles, lines and text, saved as PNG: what the attention maps and the
// benchmark plot are drawn on.
//
// Pixels are saved with stb_image_write (libstb-dev). Text uses stb_easy_font (same package), which
// turns ASCII into axis-aligned quads, so rasterising it is filling rectangles: no font files and no
// text-layout library are needed for a few labels.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "render/colour.hpp"

namespace mha_cli {

inline constexpr int kFontScale = 2;                 // stb_easy_font glyphs are ~5x7 "pixels"; each becomes 2x2
inline constexpr int kLineHeight = 12 * kFontScale;  // stb_easy_font's line advance, scaled
inline constexpr int kGlyphHeight = 8 * kFontScale;  // glyphs sit in the top ~8 rows of their 12-row line

// Width in pixels of `text` drawn at `scale`, without the spacing after the last glyph.
int text_width(const std::string& text, int scale = kFontScale);

class Canvas {
 public:
  Canvas(int width, int height, Rgb background);

  int width() const { return width_; }
  int height() const { return height_; }

  // Fills the rectangle [x, x + w) x [y, y + h), clipped to the canvas.
  void fill(int x, int y, int w, int h, Rgb colour);
  // A frame `thickness` pixels wide just inside the rectangle.
  void frame(int x, int y, int w, int h, int thickness, Rgb colour);
  // A straight line from (x0, y0) to (x1, y1), `thickness` pixels wide; with dash > 0, drawn in
  // dashes of `dash` pixels separated by gaps of the same length.
  void line(double x0, double y0, double x1, double y1, int thickness, Rgb colour, int dash = 0);
  // Draws `text` with its top-left corner at (x, y), glyph pixels `scale` x `scale`.
  void text(int x, int y, const std::string& text, Rgb colour, int scale = kFontScale);
  // Draws `text` turned 90 degrees anticlockwise (read bottom to top), its bottom-left corner at (x, y).
  void text_up(int x, int y, const std::string& text, Rgb colour, int scale = kFontScale);

  // Throws std::runtime_error when the file cannot be written.
  void save_png(const std::filesystem::path& path) const;

 private:
  int width_, height_;
  std::vector<std::uint8_t> pixels_;  // [height, width, 3] RGB
};

}  // namespace mha_cli
