// The learning curve (learning_curve_svg.hpp): two polylines on one plot, with a grid, ticks and a
// legend, written as plain SVG text.
#include "render/learning_curve_svg.hpp"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <stdexcept>
#include <string>

#include <fmt/core.h>

#include "render/xml_escape.hpp"

namespace mha_cli {
namespace {

constexpr double kWidth = 760, kHeight = 420;
constexpr double kLeft = 70, kRight = 70, kTop = 50, kBottom = 60;  // margins around the plot area
constexpr const char* kLossColour = "#1f65b4";
constexpr const char* kAccuracyColour = "#e66e14";

}  // namespace

void write_learning_curve_svg(const std::filesystem::path& path, const std::vector<transformer::CurvePoint>& curve,
                              const std::string& title) {
  const double w = kWidth - kLeft - kRight, h = kHeight - kTop - kBottom;
  double max_step = 1, max_loss = 0.1;
  for (const auto& p : curve) {
    max_step = std::max(max_step, static_cast<double>(p.step));
    max_loss = std::max(max_loss, p.loss);
  }
  max_loss = std::ceil(max_loss * 2) / 2;  // to a multiple of 0.5
  auto x = [&](double step) { return kLeft + step / max_step * w; };
  auto y_loss = [&](double loss) { return kTop + h - loss / max_loss * h; };
  auto y_accuracy = [&](double a) { return kTop + h - a * h; };

  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"13\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"28\" font-size=\"16\">{3}</text>\n",
      kWidth, kHeight, kLeft, xml_escape(title));
  for (int i = 0; i <= 5; ++i) {  // horizontal grid: 6 lines, labelled on both axes
    const double f = i / 5.0, yy = kTop + h - f * h;
    svg += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#e1e1e1\"/>\n", kLeft, yy,
                       kLeft + w, yy);
    svg += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\" fill=\"{}\">{:.2f}</text>\n", kLeft - 6, yy + 4,
                       kLossColour, f * max_loss);
    svg += fmt::format("<text x=\"{}\" y=\"{:.1f}\" fill=\"{}\">{:.0f}%</text>\n", kLeft + w + 6, yy + 4,
                       kAccuracyColour, f * 100);
  }
  for (int i = 0; i <= 5; ++i) {  // step ticks
    const double step = max_step * i / 5.0;
    svg +=
        fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{:.0f}</text>\n", x(step), kTop + h + 18, step);
  }
  svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" stroke=\"#333\"/>\n", kLeft,
                     kTop, w, h);
  svg +=
      fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">training step</text>\n", kLeft + w / 2, kHeight - 18);

  std::string loss_points, accuracy_points;
  for (const auto& p : curve) {
    loss_points += fmt::format("{:.1f},{:.1f} ", x(static_cast<double>(p.step)), y_loss(p.loss));
    if (p.accuracy >= 0)
      accuracy_points += fmt::format("{:.1f},{:.1f} ", x(static_cast<double>(p.step)), y_accuracy(p.accuracy));
  }
  svg += fmt::format("<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"/>\n", loss_points,
                     kLossColour);
  svg += fmt::format("<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"/>\n", accuracy_points,
                     kAccuracyColour);
  svg += fmt::format(
      "<text x=\"{0}\" y=\"{1}\" fill=\"{2}\">&#8212; training loss (label-smoothed, mean since the previous point)</text>\n"
      "<text x=\"{0}\" y=\"{3}\" fill=\"{4}\">&#8212; held-out exact match</text>\n</svg>\n",
      kLeft + 10, kTop + 18, kLossColour, kTop + 36, kAccuracyColour);

  std::ofstream out(path);
  out << svg;
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

}  // namespace mha_cli
