// The PNG canvas: rectangles, lines, stb_easy_font text, stb_image_write output.
#include "render/png_canvas.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include <stb/stb_image_write.h>

// stb_easy_font defines its functions `static` in the header; the ones we do not call would warn.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wsign-conversion"
#include <stb/stb_easy_font.h>
#pragma GCC diagnostic pop

namespace mha_cli {
namespace {

// stb_easy_font draws ASCII 32..126 only (it indexes a table by c - 32).
std::string printable(const std::string& text) {
  std::string out = text;
  for (char& c : out) {
    if (c < 32 || c > 126) c = '?';
  }
  return out;
}

// One glyph rectangle of stb_easy_font's output, in unscaled font pixels: [x0, x1) x [y0, y1).
struct Quad {
  int x0, y0, x1, y1;
};

std::vector<Quad> text_quads(const std::string& text) {
  std::string buffer = printable(text);
  // stb_easy_font needs "~270 bytes per character" of vertex buffer; 4 vertices of 16 bytes per quad.
  std::vector<char> vertices(buffer.size() * 512 + 64);
  const int quads =
      stb_easy_font_print(0.0f, 0.0f, buffer.data(), nullptr, vertices.data(), static_cast<int>(vertices.size()));
  std::vector<Quad> out;
  for (int q = 0; q < quads; ++q) {
    float corner0[2], corner2[2];  // vertex 0 is the top-left, vertex 2 the bottom-right corner
    std::memcpy(corner0, vertices.data() + q * 64, sizeof corner0);
    std::memcpy(corner2, vertices.data() + q * 64 + 32, sizeof corner2);
    out.push_back({static_cast<int>(corner0[0]), static_cast<int>(corner0[1]), static_cast<int>(corner2[0]),
                   static_cast<int>(corner2[1])});
  }
  return out;
}

}  // namespace

int text_width(const std::string& text, int scale) {
  if (text.empty()) return 0;
  std::string buffer = printable(text);
  return (stb_easy_font_width(buffer.data()) - 1) * scale;
}

Canvas::Canvas(int width, int height, Rgb background)
    : width_(width), height_(height), pixels_(3 * std::size_t(width) * std::size_t(height)) {
  fill(0, 0, width, height, background);
}

void Canvas::fill(int x, int y, int w, int h, Rgb colour) {
  for (int row = std::max(y, 0); row < std::min(y + h, height_); ++row) {
    for (int col = std::max(x, 0); col < std::min(x + w, width_); ++col) {
      std::uint8_t* p = &pixels_[3 * (std::size_t(row) * std::size_t(width_) + std::size_t(col))];
      p[0] = colour.r;
      p[1] = colour.g;
      p[2] = colour.b;
    }
  }
}

void Canvas::frame(int x, int y, int w, int h, int thickness, Rgb colour) {
  fill(x, y, w, thickness, colour);
  fill(x, y + h - thickness, w, thickness, colour);
  fill(x, y, thickness, h, colour);
  fill(x + w - thickness, y, thickness, h, colour);
}

void Canvas::line(double x0, double y0, double x1, double y1, int thickness, Rgb colour, int dash) {
  // Stamps a thickness x thickness square at every pixel step along the line.
  const double length = std::hypot(x1 - x0, y1 - y0);
  const int steps = std::max(1, static_cast<int>(std::ceil(length)));
  const int half = thickness / 2;
  for (int i = 0; i <= steps; ++i) {
    if (dash > 0 && (i / dash) % 2 == 1) continue;  // a gap
    const double t = static_cast<double>(i) / steps;
    const int x = static_cast<int>(std::lround(x0 + t * (x1 - x0)));
    const int y = static_cast<int>(std::lround(y0 + t * (y1 - y0)));
    fill(x - half, y - half, thickness, thickness, colour);
  }
}

void Canvas::text(int x, int y, const std::string& text, Rgb colour, int scale) {
  for (const Quad& q : text_quads(text)) {
    fill(x + q.x0 * scale, y + q.y0 * scale, (q.x1 - q.x0) * scale, (q.y1 - q.y0) * scale, colour);
  }
}

void Canvas::text_up(int x, int y, const std::string& text, Rgb colour, int scale) {
  // Turning anticlockwise maps the text's rightward axis to up and its downward axis to right.
  for (const Quad& q : text_quads(text)) {
    fill(x + q.y0 * scale, y - q.x1 * scale, (q.y1 - q.y0) * scale, (q.x1 - q.x0) * scale, colour);
  }
}

void Canvas::save_png(const std::filesystem::path& path) const {
  if (stbi_write_png(path.string().c_str(), width_, height_, 3, pixels_.data(), 3 * width_) == 0) {
    throw std::runtime_error("cannot write " + path.string());
  }
}

}  // namespace mha_cli
