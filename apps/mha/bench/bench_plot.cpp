// The benchmark plot, drawn on a render/png_canvas.hpp Canvas: two panels (forward; forward + backward), each
// with log-scale N on x and effective GFLOP/s on y, one line per implementation and causality.
#include "bench/bench_plot.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <fmt/core.h>

#include "render/colour.hpp"
#include "render/png_canvas.hpp"

namespace mha_cli::bench {
namespace {

constexpr int kWidth = 1400;
constexpr int kMargin = 24;
constexpr int kTitleScale = 3;
constexpr int kPanelTop = 150;  // below the title, subtitle and panel titles
constexpr int kPlotHeight = 430;
constexpr int kYLabelBand = 90;  // left of a plot: rotated axis label and tick labels
constexpr int kXLabelBand = 64;  // below a plot: tick labels and axis label
constexpr int kLineThickness = 3;
constexpr int kMarker = 9;  // marker side in pixels
constexpr int kDash = 9;    // dash length of causal and roof lines

constexpr Rgb kBackground{255, 255, 255};
constexpr Rgb kInk{35, 35, 35};
constexpr Rgb kGrid{225, 225, 225};
constexpr Rgb kOurs{31, 101, 180};    // blue
constexpr Rgb kTheirs{230, 110, 20};  // orange
constexpr Rgb kRoof{130, 130, 130};

struct Series {
  std::string label;
  Rgb colour;
  bool dashed = false;
  bool hollow = false;                            // hollow square markers (PyTorch) or filled (ours)
  std::vector<std::pair<double, double>> points;  // (N, GFLOP/s)
};

struct Panel {
  std::string title;
  std::vector<Series> series;
};

// The plot area of a panel in pixels, and the data range it shows.
struct Axes {
  int x, y, w, h;
  double n_min, n_max, y_max;
  double px(double n) const { return x + (std::log(n) - std::log(n_min)) / (std::log(n_max) - std::log(n_min)) * w; }
  double py(double v) const { return y + h - v / y_max * h; }
};

// A round tick step (1, 2 or 5 times a power of ten) giving about `ticks` ticks up to `top`.
double tick_step(double top, int ticks) {
  const double raw = top / ticks;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * magnitude >= raw) return m * magnitude;
  return 10 * magnitude;
}

std::string tick_label(double v) { return v == std::floor(v) ? fmt::format("{:.0f}", v) : fmt::format("{:g}", v); }

void marker(Canvas& canvas, double x, double y, const Series& s) {
  const int left = static_cast<int>(std::lround(x)) - kMarker / 2, top = static_cast<int>(std::lround(y)) - kMarker / 2;
  if (s.hollow) {
    canvas.fill(left, top, kMarker, kMarker, kBackground);
    canvas.frame(left, top, kMarker, kMarker, 2, s.colour);
  } else {
    canvas.fill(left, top, kMarker, kMarker, s.colour);
  }
}

void draw_panel(Canvas& canvas, const Axes& ax, const Panel& panel, const std::vector<double>& n_ticks, double roof) {
  // Grid, ticks and labels.
  const double step = tick_step(ax.y_max, 6);
  for (double v = 0; v <= ax.y_max + 1e-9; v += step) {
    const int y = static_cast<int>(std::lround(ax.py(v)));
    canvas.fill(ax.x, y, ax.w, 1, kGrid);
    const std::string label = tick_label(v);
    canvas.text(ax.x - 8 - text_width(label), y - kGlyphHeight / 2, label, kInk);
  }
  for (double n : n_ticks) {
    const int x = static_cast<int>(std::lround(ax.px(n)));
    canvas.fill(x, ax.y, 1, ax.h, kGrid);
    const std::string label = fmt::format("{}", static_cast<long long>(n));
    canvas.text(x - text_width(label) / 2, ax.y + ax.h + 8, label, kInk);
  }
  canvas.frame(ax.x - 1, ax.y - 1, ax.w + 2, ax.h + 2, 1, kInk);
  const std::string x_label = "N = L = S  (log scale)";
  canvas.text(ax.x + (ax.w - text_width(x_label)) / 2, ax.y + ax.h + 8 + kLineHeight + 4, x_label, kInk);
  const std::string y_label = "effective GFLOP/s";
  canvas.text_up(ax.x - kYLabelBand + 4, ax.y + (ax.h + text_width(y_label)) / 2, y_label, kInk);
  canvas.text(ax.x, ax.y - kLineHeight - 8, panel.title, kInk);

  // The roof, then the series (lines first, markers on top).
  canvas.line(ax.x, ax.py(roof), ax.x + ax.w, ax.py(roof), 2, kRoof, kDash);
  const std::string roof_label = fmt::format("roof {:.0f}", roof);
  canvas.text(ax.x + ax.w - text_width(roof_label) - 6, static_cast<int>(ax.py(roof)) - kLineHeight, roof_label, kRoof);
  for (const Series& s : panel.series) {
    for (std::size_t i = 1; i < s.points.size(); ++i) {
      canvas.line(ax.px(s.points[i - 1].first), ax.py(s.points[i - 1].second), ax.px(s.points[i].first),
                  ax.py(s.points[i].second), kLineThickness, s.colour, s.dashed ? kDash : 0);
    }
  }
  for (const Series& s : panel.series)
    for (const auto& [n, v] : s.points) marker(canvas, ax.px(n), ax.py(v), s);
}

void add_point(Series& s, double n, double gflops) {
  s.points.emplace_back(n, gflops);
  std::sort(s.points.begin(), s.points.end());
}

}  // namespace

void write_bench_plot(const std::filesystem::path& path, const BenchResults& r, int threads) {
  const std::string torch_name = r.torch_blas == "onednn"     ? "PyTorch 1.13 (sgemm on oneDNN)"
                                 : r.torch_blas == "openblas" ? "PyTorch 1.13 (OpenBLAS)"
                                                              : "PyTorch 1.13 (Debian's default BLAS)";
  const bool with_torch = !r.torch_blas.empty();
  // Series order: ours non-causal, ours causal, then (with PyTorch) theirs non-causal, theirs causal.
  auto make_series = [&] {
    std::vector<Series> series = {{"mha (ours), non-causal", kOurs, false, false, {}},
                                  {"mha (ours), causal", kOurs, true, false, {}}};
    if (with_torch) {
      series.push_back({torch_name + ", non-causal", kTheirs, false, true, {}});
      series.push_back({torch_name + ", causal (boolean mask)", kTheirs, true, true, {}});
    }
    return series;
  };
  Panel forward{"forward (eval mode)", make_series()};
  Panel backward{"forward + backward (train mode)", make_series()};
  std::vector<double> n_ticks, values;
  for (const LayerResult& l : r.layer) {
    if (l.threads != threads) continue;
    Panel& panel = l.pass == "fwd" ? forward : backward;
    const int ours = l.causal ? 1 : 0;
    if (l.mha.ok()) add_point(panel.series[ours], double(l.n), l.mha.gflops);
    if (with_torch && l.torch.ok()) add_point(panel.series[ours + 2], double(l.n), l.torch.gflops);
    n_ticks.push_back(double(l.n));
  }
  for (const BigResult& b : r.big) {
    if (b.impl != "mha" || b.threads != threads || !b.run.ok()) continue;
    add_point((b.pass == "fwd" ? forward : backward).series[b.causal ? 1 : 0], double(b.n), b.run.gflops);
    n_ticks.push_back(double(b.n));
  }
  if (n_ticks.empty()) return;  // nothing measured at this thread count
  std::sort(n_ticks.begin(), n_ticks.end());
  n_ticks.erase(std::unique(n_ticks.begin(), n_ticks.end()), n_ticks.end());

  std::vector<double> roofs;
  for (const Roof& roof : r.roofs)
    if (roof.threads == threads) roofs.push_back(roof.gflops);
  std::sort(roofs.begin(), roofs.end());
  const double roof = roofs.empty() ? 0 : roofs[roofs.size() / 2];

  double top = roof;
  for (const Panel* p : {&forward, &backward})
    for (const Series& s : p->series)
      for (const auto& point : s.points) top = std::max(top, point.second);
  const double y_max = std::ceil(top * 1.08 / tick_step(top * 1.08, 6)) * tick_step(top * 1.08, 6);

  // Layout: title, subtitle; two panels side by side; legend; notes.
  const int panel_w = (kWidth - 3 * kMargin) / 2;
  const int plot_w = panel_w - kYLabelBand - 10;
  const std::vector<std::string> notes = {
      "Effective GFLOP/s = (projection FLOPs + attention FLOPs, causal attention counted half) / best time:",
      "the same count for both implementations, so higher is faster. PyTorch computes every L x S logit also",
      "when causal (then masks them) and gets no credit for the masked half. Each point: a process of its own",
      "that times only that shape. A missing PyTorch point: skipped (estimated memory over the limit).",
  };
  const int legend_entries = static_cast<int>(forward.series.size()) + 1;  // the series and the roof
  const int legend_y = kPanelTop + kPlotHeight + kXLabelBand + 16;
  const int notes_y = legend_y + legend_entries * kLineHeight + 12;
  const int height = notes_y + static_cast<int>(notes.size()) * kLineHeight + kMargin;
  Canvas canvas(kWidth, height, kBackground);

  canvas.text(kMargin, kMargin,
              fmt::format("{}: the whole multi-head attention layer, {} thread{}",
                          with_torch ? "mha vs PyTorch" : "mha", threads, threads == 1 ? "" : "s"),
              kInk, kTitleScale);
  canvas.text(kMargin, kMargin + 12 * kTitleScale + 4,
              fmt::format("d_model 512, h 8, d 64, B 1, self-attention, float32.  {} ({}), {}", r.machine.cpu_model,
                          r.machine.cpu_family_model, r.machine.date.substr(0, 10)),
              kInk);

  const double n_min = n_ticks.front() / 1.5, n_max = n_ticks.back() * 1.5;
  for (int i = 0; i < 2; ++i) {
    const Axes ax{kMargin + i * (panel_w + kMargin) + kYLabelBand, kPanelTop, plot_w, kPlotHeight, n_min, n_max, y_max};
    draw_panel(canvas, ax, i == 0 ? forward : backward, n_ticks, roof);
  }

  // Legend: one line-and-marker sample per series, then the roof.
  const std::vector<Series>& entries = forward.series;
  for (std::size_t i = 0; i < entries.size() + 1; ++i) {
    const int x = kMargin + kYLabelBand;
    const int y = legend_y + static_cast<int>(i) * kLineHeight + kGlyphHeight / 2;
    if (i < entries.size()) {
      const Series& s = entries[i];
      canvas.line(x, y, x + 44, y, kLineThickness, s.colour, s.dashed ? kDash : 0);
      marker(canvas, x + 22, y, s);
      canvas.text(x + 56, y - kGlyphHeight / 2, s.label, kInk);
    } else {
      canvas.line(x, y, x + 44, y, 2, kRoof, kDash);
      canvas.text(x + 56, y - kGlyphHeight / 2,
                  fmt::format("roof: oneDNN sgemm {0}^3 at {1} thread{2} (median of this run's roofs)", kRoofSize,
                              threads, threads == 1 ? "" : "s"),
                  kInk);
    }
  }

  for (std::size_t i = 0; i < notes.size(); ++i)
    canvas.text(kMargin, notes_y + static_cast<int>(i) * kLineHeight, notes[i], kInk);

  canvas.save_png(path);
}

}  // namespace mha_cli::bench
