// The grid of small and mid shapes: its shapes, its two processes per thread count, and its rows.
//
// Legend: B batch, N = L = S, E = d_model, h heads.
#include "bench/bench_grid.hpp"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <map>
#include <stdexcept>
#include <tuple>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "bench/bench_runs.hpp"
#include "bench/bench_tables.hpp"
#include "bench/bench_workloads.hpp"
#include "mha/attention.hpp"
#include "render/terminal_text.hpp"

namespace mha_cli::bench {
namespace {

constexpr std::int64_t kGridBatches[] = {1, 8, 64};
constexpr std::int64_t kGridSizes[] = {16, 64, 256, 512};
constexpr std::int64_t kGridWidths[] = {64, 256, 512};
constexpr std::int64_t kGridHeadWidth = 64;    // d: h = E / d when h is not given
constexpr std::int64_t kMaxGridN = 1 << 22;    // as --sizes
constexpr std::int64_t kMaxGridWidth = 65536;  // B, E and h, as bench-one's

// A decimal integer in [1, hi] without leading zeros (as the number options read them), or why not.
std::int64_t grid_number(const std::string& text, std::int64_t hi, const std::string& what, const std::string& entry) {
  std::int64_t value = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (text.empty() || text[0] == '0' || error != std::errc() || end != text.data() + text.size() || value < 1 ||
      value > hi)
    throw std::invalid_argument(fmt::format(
        "entry \"{}\": {} must be a decimal integer in [1, {}] without leading zeros", terminal_safe(entry), what, hi));
  return value;
}

GridShape parse_entry(const std::string& entry) {
  std::vector<std::string> fields;
  for (std::size_t start = 0;;) {
    const std::size_t colon = entry.find(':', start);
    fields.push_back(entry.substr(start, colon - start));
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  if (fields.size() != 3 && fields.size() != 4)
    throw std::invalid_argument(fmt::format("entry \"{}\": expected B:N:E or B:N:E:h", terminal_safe(entry)));
  GridShape s;
  s.batch = grid_number(fields[0], kMaxGridWidth, "B", entry);
  s.n = grid_number(fields[1], kMaxGridN, "N", entry);
  s.d_model = grid_number(fields[2], kMaxGridWidth, "E", entry);
  if (fields.size() == 4) {
    s.heads = grid_number(fields[3], kMaxGridWidth, "h", entry);
    if (s.d_model % s.heads != 0)
      throw std::invalid_argument(fmt::format("entry \"{}\": E must be a multiple of h", terminal_safe(entry)));
  } else {
    if (s.d_model % kGridHeadWidth != 0)
      throw std::invalid_argument(fmt::format(
          "entry \"{}\": E must be a multiple of 64 (h = E / 64), or give h: B:N:E:h", terminal_safe(entry)));
    s.heads = s.d_model / kGridHeadWidth;
  }
  return s;
}

using ShapeKey = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::string>;  // B N E h pass

ShapeKey key_of(const GridShape& s, const std::string& pass) { return {s.batch, s.n, s.d_model, s.heads, pass}; }

// The times of the JSON lines a grid process printed, by shape and pass.
std::map<ShapeKey, Timing> timings_of(const std::vector<nlohmann::json>& lines, std::string& error) {
  std::map<ShapeKey, Timing> out;
  for (const nlohmann::json& j : lines) {
    try {
      const GridShape s{j.at("batch").get<std::int64_t>(), j.at("n").get<std::int64_t>(),
                        j.at("d_model").get<std::int64_t>(), j.at("heads").get<std::int64_t>()};
      out[key_of(s, j.at("pass").get<std::string>())] = {j.at("min_s").get<double>(), j.at("median_s").get<double>(),
                                                         j.at("reps").get<int>()};
    } catch (const nlohmann::json::exception& e) {
      error = fmt::format("failed: unreadable output ({}): {}", e.what(), j.dump());
    }
  }
  return out;
}

// The time of `shape` and `pass` from `times`, or the process's error (or `missing`) as the status.
GridTime grid_time(const std::map<ShapeKey, Timing>& times, const GridShape& shape, const std::string& pass,
                   const std::string& error, const std::string& missing) {
  GridTime t;
  const auto found = times.find(key_of(shape, pass));
  if (found != times.end()) t.timing = found->second;
  else t.status = error.empty() ? missing : error;
  return t;
}

std::vector<nlohmann::json> run_ours_grid(const std::vector<GridShape>& shapes, int threads, std::string& error) {
  std::vector<std::string> argv = {kSelfExecutable, "bench-grid",           "--shapes", format_grid_shapes(shapes),
                                   "--threads",     std::to_string(threads)};
  for (std::string& a : policy_args(kGridPolicy)) argv.push_back(std::move(a));
  return json_lines(run_process(argv, {}, kOwnTimeoutS), kOwnTimeoutS, error);
}

}  // namespace

std::vector<GridShape> default_grid_shapes() {
  std::vector<GridShape> shapes;
  for (std::int64_t b : kGridBatches)
    for (std::int64_t n : kGridSizes)
      for (std::int64_t e : kGridWidths) shapes.push_back({b, n, e, e / kGridHeadWidth});
  return shapes;
}

std::vector<GridShape> parse_grid_shapes(const std::string& spec) {
  if (spec.empty()) throw std::invalid_argument("expected B:N:E entries, comma-separated; got nothing");
  std::vector<GridShape> shapes;
  for (std::size_t start = 0;;) {
    const std::size_t comma = spec.find(',', start);
    shapes.push_back(parse_entry(spec.substr(start, comma - start)));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return shapes;
}

std::string format_grid_shapes(const std::vector<GridShape>& shapes) {
  std::string out;
  for (const GridShape& s : shapes)
    out += fmt::format("{}{}:{}:{}:{}", out.empty() ? "" : ",", s.batch, s.n, s.d_model, s.heads);
  return out;
}

std::vector<GridThreadRatio> grid_thread_ratios(const std::vector<GridRow>& rows) {
  std::vector<GridThreadRatio> out;
  if (rows.empty()) return out;
  int lo = rows.front().threads, hi = lo;
  for (const GridRow& r : rows) lo = std::min(lo, r.threads), hi = std::max(hi, r.threads);
  if (lo == hi) return out;
  for (const GridRow& a : rows) {
    if (a.threads != lo) continue;
    for (const GridRow& b : rows) {
      if (b.threads != hi || b.batch != a.batch || b.n != a.n || b.d_model != a.d_model || b.heads != a.heads) continue;
      if (a.mha_forward.ok() && b.mha_forward.ok())
        out.push_back({&a, &b, "forward", a.mha_forward.timing.min_s / b.mha_forward.timing.min_s});
      if (a.mha_train.ok() && b.mha_train.ok())
        out.push_back({&a, &b, "training step", a.mha_train.timing.min_s / b.mha_train.timing.min_s});
    }
  }
  return out;
}

void run_grid(BenchResults& results, const std::vector<int>& threads, const BenchOptions& options) {
  const std::vector<GridShape> shapes =
      options.grid_shapes.empty() ? default_grid_shapes() : parse_grid_shapes(options.grid_shapes);
  const TorchRunner torch{options, results};
  results.grid_status = "ok";
  results.grid_policy = kGridPolicy;
  print_grid_header(options.torch ? torch_label(options.torch_blas) : "nothing (--no-torch)", kGridPolicy);
  for (int t : threads) {
    std::string our_error, torch_error;
    const auto start = std::chrono::steady_clock::now();
    const std::map<ShapeKey, Timing> ours = timings_of(run_ours_grid(shapes, t, our_error), our_error);
    const auto ours_done = std::chrono::steady_clock::now();
    // PyTorch's [B*h, N, N] weights: shapes estimated past --torch-memory-limit are left out.
    std::vector<GridShape> torch_shapes;
    for (const GridShape& s : shapes)
      if (torch_memory_estimate_bytes(s.batch * s.heads, s.n, false, Pass::ForwardBackward) <=
          options.torch_memory_limit_gib * (1 << 30))
        torch_shapes.push_back(s);
    std::map<ShapeKey, Timing> theirs;
    if (options.torch && !torch_shapes.empty()) {
      std::vector<std::string> args = {"--shapes", format_grid_shapes(torch_shapes)};
      for (std::string& a : policy_args(kGridPolicy)) args.push_back(std::move(a));
      theirs = timings_of(torch.run_lines(args, t, options.torch_blas, torch_error), torch_error);
    }
    const std::string torch_missing = options.torch ? "skipped: estimated over --torch-memory-limit" : kNoTorchStatus;
    for (const GridShape& s : shapes) {
      GridRow row{s.batch, s.n, s.d_model, s.heads, t, {}, {}, {}, {}, {}, {}};
      row.mha_forward = grid_time(ours, s, "fwd", our_error, "failed: no output for this shape");
      row.mha_train = grid_time(ours, s, "fwdbwd", our_error, "failed: no output for this shape");
      row.torch_forward = grid_time(theirs, s, "fwd", torch_error, torch_missing);
      row.torch_train = grid_time(theirs, s, "fwdbwd", torch_error, torch_missing);
      if (row.mha_forward.ok() && row.torch_forward.ok())
        row.forward_speedup = row.torch_forward.timing.min_s / row.mha_forward.timing.min_s;
      if (row.mha_train.ok() && row.torch_train.ok())
        row.train_speedup = row.torch_train.timing.min_s / row.mha_train.timing.min_s;
      results.grid.push_back(row);
      print_grid_row(row);
    }
    const std::chrono::duration<double> our_s = ours_done - start,
                                        torch_s = std::chrono::steady_clock::now() - ours_done;
    fmt::print("        ({} thread{}: the grid took {:.0f} s in mha's process{})\n", t, t == 1 ? "" : "s",
               our_s.count(), options.torch ? fmt::format(", {:.0f} s in PyTorch's", torch_s.count()) : "");
    if (!our_error.empty()) fmt::print("        mha ({} threads): {}\n", t, our_error);
    if (!torch_error.empty()) fmt::print("        torch ({} threads): {}\n", t, torch_error);
  }
  print_grid_threads(results.grid);
}

}  // namespace mha_cli::bench

namespace mha_cli {

int run_bench_grid(const BenchGridOptions& o) {
  using namespace bench;
  mha::set_num_threads(o.threads);
  for (const GridShape& s : parse_grid_shapes(o.shapes)) {
    for (Pass pass : {Pass::Forward, Pass::ForwardBackward}) {
      LayerWorkload layer(s.batch, s.n, s.d_model, s.heads, false, pass);  // x [B, N, E]
      const Timing timing = measure([&] { layer.run(); }, o.policy);
      const nlohmann::json out = {{"impl", "mha"},           {"batch", s.batch},      {"n", s.n},
                                  {"d_model", s.d_model},    {"heads", s.heads},      {"threads", mha::num_threads()},
                                  {"pass", pass_name(pass)}, {"min_s", timing.min_s}, {"median_s", timing.median_s},
                                  {"reps", timing.reps}};
      fmt::print("{}\n", out.dump());
      std::fflush(stdout);  // a process that dies later still leaves the shapes it timed
    }
  }
  return 0;
}

}  // namespace mha_cli
