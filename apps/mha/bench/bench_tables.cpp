// Fixed-width text tables of the benchmark's results. Times (the best call) in milliseconds (seconds past 10 s),
// rates in GFLOP/s, memory as the peak resident set (RSS) of the process after its first call.
#include "bench/bench_tables.hpp"

#include <algorithm>
#include <cstdio>

#include <fmt/core.h>

#include "attention/query_block.hpp"
#include "bench/bench_grid.hpp"
#include "bench/bench_measure.hpp"

namespace mha_cli::bench {
namespace {

std::string format_time(double seconds) {
  return seconds >= 10 ? fmt::format("{:.1f} s", seconds) : fmt::format("{:.1f} ms", seconds * 1e3);
}

std::string yes_no(bool b) { return b ? "yes" : "no"; }

constexpr double kNoisySpread = 1.15;  // a group's roof changed more than this much: mark it

// The roof's GFLOP/s, marked '*' when the machine's load changed during its group.
std::string roof_cell(const Roof& roof) {
  return fmt::format("{:.1f}{}", roof.gflops, roof.spread > kNoisySpread ? "*" : " ");
}

std::string percent(double fraction) { return fmt::format("{:.1f}%", 100 * fraction); }

// A process run's cells: time, GFLOP/s, peak RSS (extra over the baseline), or its status.
struct RunCells {
  std::string time, rate, memory;
};
RunCells run_cells(const ProcessRun& run) {
  if (!run.ok()) return {"-", "-", "-"};
  return {format_time(run.timing.min_s), fmt::format("{:.1f}", run.gflops),
          fmt::format("{} (+{})", format_bytes(run.peak_rss_first_bytes),
                      format_bytes(run.peak_rss_first_bytes - run.baseline_rss_bytes))};
}

void flush() { std::fflush(stdout); }  // rows appear as they are measured, also through a pipe

}  // namespace

std::string format_bytes(std::int64_t bytes) {
  const double mib = static_cast<double>(bytes) / (1024.0 * 1024.0);
  return mib >= 1024 ? fmt::format("{:.2f} GiB", mib / 1024) : fmt::format("{:.0f} MiB", mib);
}

void print_machine(const BenchResults& r) {
  const MachineInfo& m = r.machine;
  fmt::print("mha bench, {}\n", m.date);
  fmt::print("machine: {} ({}, {:.0f} MHz{}, {}{}), {} logical CPUs, {} memory, {}\n", m.cpu_model, m.cpu_family_model,
             m.cpu_mhz, m.measured_ghz > 0 ? fmt::format(" reported, runs at {:.2f} GHz", m.measured_ghz) : "", m.simd,
             m.virtual_machine ? ", virtual machine" : "", m.logical_cpus, format_bytes(m.memory_bytes), m.kernel);
  fmt::print("software: mha {} (source tree {}), oneDNN {} (JIT for {}), {}\n", m.mha_version, r.source_revision,
             m.onednn_version, m.onednn_isa, m.compiler);
  fmt::print("fused kernel: query blocks of {}\n", mha::detail::query_block_description());
  fmt::print("command: {}\n", r.command);
  fmt::print("load average (1, 5, 15 min) at the start: {}\n", r.load_start);
  flush();
}

void print_roof_note() {
  fmt::print("\nroof = oneDNN sgemm {0}x{0}x{0} GFLOP/s at the same thread count, measured just before and just after\n"
             "each group of measurements; the better of the two. '*': the two differed by more than {1:.0f}%: the\n"
             "machine's load changed during the group, so its ratios are less certain. Times are the best of\n"
             "repeated calls (one warm-up call first; bench.json also has medians). The machine is shared:\n"
             "compare ratios measured in this run, not times across runs.\n",
             kRoofSize, 100 * (kNoisySpread - 1));
  flush();
}

void print_core_header(std::int64_t heads, std::int64_t d) {
  fmt::print("\n== Attention core, Kernel::Flash: q, k, v [1, {}, N, {}] float32; FLOPs 4*h*N^2*d forward, 2.5x "
             "backward, half when causal\n",
             heads, d);
  fmt::print("   tile1: one thread's GFLOP/s on the forward's tile products alone (dnnl_sgemm {0}x{1}x{2} and\n"
             "   {0}x{2}x{1}, M x N x K, no softmax): the ceiling of each thread's share of the kernel\n",
             tile_rows(), kTileKeys, kTileWidth);
  fmt::print("{:>7} {:>6} {:>6} {:>7} {:>6} | {:>10} {:>7} {:>6} | {:>10} {:>7} {:>6}\n", "threads", "N", "causal",
             "roof", "tile1", "fwd time", "GFLOP/s", "%roof", "bwd time", "GFLOP/s", "%roof");
  flush();
}

void print_core_row(const CoreResult& c) {
  fmt::print("{:>7} {:>6} {:>6} {:>7} {:>6.1f} | {:>10} {:>7.1f} {:>6} | {:>10} {:>7.1f} {:>6}\n", c.threads, c.n,
             yes_no(c.causal), roof_cell(c.roof), c.tile.gflops, format_time(c.forward.timing.min_s), c.forward.gflops,
             percent(c.forward.roof_fraction), format_time(c.backward.timing.min_s), c.backward.gflops,
             percent(c.backward.roof_fraction));
  flush();
}

void print_scaling(const ScalingResult& s) {
  fmt::print("\n== Threads at B*h = 1: the core on q, k, v [1, 1, {}, {}], non-causal\n", s.n, s.d);
  fmt::print("{:>7} {:>7} | {:>10} {:>7} {:>6} | {:>10} {:>7} {:>6}\n", "threads", "roof", "fwd time", "GFLOP/s",
             "%roof", "bwd time", "GFLOP/s", "%roof");
  for (std::size_t i = 0; i < s.threads.size(); ++i) {
    fmt::print("{:>7} {:>7} | {:>10} {:>7.1f} {:>6} | {:>10} {:>7.1f} {:>6}\n", s.threads[i], roof_cell(s.roofs[i]),
               format_time(s.forward[i].timing.min_s), s.forward[i].gflops, percent(s.forward[i].roof_fraction),
               format_time(s.backward[i].timing.min_s), s.backward[i].gflops, percent(s.backward[i].roof_fraction));
  }
  if (s.threads.size() >= 2) {
    fmt::print("speed-up {} threads / {} thread: forward {:.2f}x, backward {:.2f}x (the roof: {:.2f}x)\n",
               s.threads.back(), s.threads.front(), s.forward_speedup, s.backward_speedup, s.roof_speedup);
  }
  flush();
}

void print_layout_header() {
  fmt::print("\n== Head layout: the core (h = 8, d = 64, non-causal) on contiguous heads [1, h, N, d] against the\n"
             "   layer's layout [1, N, h, d] (a head's rows h*d floats apart), back to back\n");
  fmt::print("{:>7} {:>6} {:>7} | {:>24} | {:>24} | {:>24}\n", "threads", "N", "roof", "contiguous fwd / bwd",
             "interleaved fwd / bwd", "interleaved slowdown");
  flush();
}

void print_layout_row(const LayoutResult& l) {
  auto pair = [](const KernelRate& f, const KernelRate& b) {
    return fmt::format("{:.1f} / {:.1f} GFLOP/s", f.gflops, b.gflops);
  };
  fmt::print("{:>7} {:>6} {:>7} | {:>24} | {:>24} | {:>24}\n", l.threads, l.n, roof_cell(l.roof),
             pair(l.contiguous_forward, l.contiguous_backward), pair(l.interleaved_forward, l.interleaved_backward),
             fmt::format("{:.2f}x / {:.2f}x", l.interleaved_forward.timing.min_s / l.contiguous_forward.timing.min_s,
                         l.interleaved_backward.timing.min_s / l.contiguous_backward.timing.min_s));
  flush();
}

void print_causal(const std::vector<CausalResult>& rows) {
  if (rows.empty()) return;
  fmt::print("\n== Causal against non-causal (the core, h = 8, d = 64): non-causal time / causal time\n");
  fmt::print("{:>7} {:>6} | {:>8} {:>8}\n", "threads", "N", "forward", "backward");
  for (const CausalResult& c : rows) {
    fmt::print("{:>7} {:>6} | {:>7.2f}x {:>7.2f}x\n", c.threads, c.n, c.forward_speedup, c.backward_speedup);
  }
  flush();
}

void print_layer_header(const std::string& torch_label) {
  fmt::print("\n== Whole layer: mha::MultiHeadAttention against {}\n"
             "   d_model 512, h 8, batch_first, B 1, self-attention; each shape timed in its own process.\n"
             "   fwd: eval mode, need_weights false (torch: under no_grad). fwdbwd: train mode, forward + backward\n"
             "   (gradients of the input and every parameter). GFLOP/s: projections + attention (causal half) over\n"
             "   the time, the same count for both. RSS: peak resident set after the first call (+ over the\n"
             "   process's baseline: program, inputs, parameters).\n",
             torch_label);
  fmt::print("{:>7} {:>6} {:>6} {:>6} {:>7} | {:>10} {:>7} {:>20} | {:>10} {:>7} {:>22} | {:>8} {:>6}\n", "threads",
             "N", "causal", "pass", "roof", "mha time", "GFLOP/s", "mha RSS", "torch time", "GFLOP/s", "torch RSS",
             "speed-up", "mem");
  flush();
}

void print_layer_row(const LayerResult& l) {
  const RunCells ours = run_cells(l.mha), theirs = run_cells(l.torch);
  fmt::print("{:>7} {:>6} {:>6} {:>6} {:>7} | {:>10} {:>7} {:>20} | {:>10} {:>7} {:>22} | {:>8} {:>6}\n", l.threads,
             l.n, yes_no(l.causal), l.pass, roof_cell(l.roof), ours.time, ours.rate, ours.memory, theirs.time,
             theirs.rate, theirs.memory, l.speedup ? fmt::format("{:.2f}x", *l.speedup) : "-",
             l.memory_ratio ? fmt::format("{:.3f}", *l.memory_ratio) : "-");
  if (!l.mha.ok()) fmt::print("        mha: {}\n", l.mha.status);
  if (!l.torch.ok() && l.torch.status != kNoTorchStatus) fmt::print("        torch: {}\n", l.torch.status);
  flush();
}

void print_blas_peer(const BlasPeer& peer) {
  if (peer.status != "ok") {
    fmt::print("\n== {}\n   {}\n", peer.label, peer.status);
    flush();
    return;
  }
  print_layer_header(peer.label);
}

namespace {

// A short time for the grid's cells: microseconds to seconds.
std::string grid_time_cell(const GridTime& t) {
  if (!t.ok()) return "-";
  const double s = t.timing.min_s;
  return s < 1e-3 ? fmt::format("{:.1f} us", s * 1e6)
         : s < 1  ? fmt::format("{:.2f} ms", s * 1e3)
                  : fmt::format("{:.2f} s", s);
}

std::string ratio_cell(const std::optional<double>& r) { return r ? fmt::format("{:.2f}x", *r) : "-"; }

}  // namespace

void print_grid_header(const std::string& torch_label, const RepeatPolicy& p) {
  fmt::print(
      "\n== Grid of small and mid shapes: mha::MultiHeadAttention against {}\n"
      "   self-attention, batch_first, float32, h = E / 64 (d = 64); each implementation runs the whole grid in\n"
      "   one process per thread count. fwd: eval mode, need_weights false (torch: under no_grad). train: train\n"
      "   mode, forward + backward (gradients of the input and every parameter). Times: the best of at least {}\n"
      "   calls and {} s after {} warm-up calls. ratio: torch time / mha time (above 1: ours is faster).\n"
      "   A thread count's rows appear once both its processes are done (minutes for the whole grid).\n",
      torch_label, p.min_reps, p.min_time_s, p.warmup);
  fmt::print("{:>4} {:>5} {:>5} {:>3} {:>7} | {:>10} {:>10} {:>6} | {:>10} {:>11} {:>6}\n", "B", "N", "E", "h",
             "threads", "mha fwd", "torch fwd", "ratio", "mha train", "torch train", "ratio");
  flush();
}

void print_grid_row(const GridRow& r) {
  fmt::print("{:>4} {:>5} {:>5} {:>3} {:>7} | {:>10} {:>10} {:>6} | {:>10} {:>11} {:>6}\n", r.batch, r.n, r.d_model,
             r.heads, r.threads, grid_time_cell(r.mha_forward), grid_time_cell(r.torch_forward),
             ratio_cell(r.forward_speedup), grid_time_cell(r.mha_train), grid_time_cell(r.torch_train),
             ratio_cell(r.train_speedup));
  flush();
}

void print_grid_threads(const std::vector<GridRow>& rows) {
  const std::vector<GridThreadRatio> ratios = grid_thread_ratios(rows);
  if (ratios.empty()) return;
  const auto worst =
      std::min_element(ratios.begin(), ratios.end(), [](const auto& a, const auto& b) { return a.ratio < b.ratio; });
  const auto slower = std::count_if(ratios.begin(), ratios.end(), [](const auto& r) { return r.ratio < 1; });
  fmt::print("ours, {} threads against {}: {} of {} cells (shape and pass) slower with more threads; worst {:.2f}x "
             "({} at B {}, N {}, E {})\n",
             worst->last->threads, worst->first->threads, slower, ratios.size(), worst->ratio, worst->pass,
             worst->first->batch, worst->first->n, worst->first->d_model);
  flush();
}

void print_big_header() {
  fmt::print(
      "\n== Long sequence, ours alone, each in its own process, one call each (core: q, k, v [1, 8, N, 64];\n"
      "   mha: the layer, E 512; fwd: eval mode; fwdbwd: train mode, forward + backward, the training step whose\n"
      "   peak RSS the memory target reads). GFLOP/s: the attention core's FLOPs (forward, or forward and\n"
      "   backward) over the time; the layer's time includes its projections.\n");
  fmt::print("{:>5} {:>6} {:>7} {:>6} {:>7} {:>7} | {:>10} {:>7} {:>6} | {:>20}\n", "impl", "pass", "threads", "N",
             "causal", "roof", "time", "GFLOP/s", "%roof", "peak RSS");
  flush();
}

void print_big_row(const BigResult& b) {
  if (!b.run.ok()) {
    fmt::print("{:>5} {:>6} {:>7} {:>6} {:>7} {:>7} | {}\n", b.impl, b.pass, b.threads, b.n, yes_no(b.causal),
               roof_cell(b.roof), b.run.status);
  } else {
    fmt::print("{:>5} {:>6} {:>7} {:>6} {:>7} {:>7} | {:>10} {:>7.1f} {:>6} | {:>20}\n", b.impl, b.pass, b.threads, b.n,
               yes_no(b.causal), roof_cell(b.roof), format_time(b.run.timing.min_s), b.attention_gflops,
               percent(b.roof_fraction), run_cells(b.run).memory);
  }
  flush();
}

void print_targets(const std::vector<TargetResult>& targets, const std::string& smoke_run) {
  fmt::print("\n== Targets{}\n", smoke_run.empty() ? "" : " (" + smoke_run + ")");
  std::size_t unmeasured = 0;
  for (const TargetResult& t : targets) {
    if (!t.met) {  // bench.json has it, with what it needs; the terminal shows only what was judged
      ++unmeasured;
      continue;
    }
    fmt::print("[{:>6}] {}\n         measured: {}\n", *t.met ? "MET" : "MISSED", t.name, t.measured);
    if (!t.margin.empty()) fmt::print("         {}\n", t.margin);
  }
  if (unmeasured > 0)
    fmt::print("{} of {} targets not measured in this run (sizes, threads or parts it did not run; bench.json "
               "says what each needs)\n",
               unmeasured, targets.size());
  flush();
}

}  // namespace mha_cli::bench
