// `mha bench --decode`: a decode step over a paged KV cache beside the machine's read bandwidth, in one
// run (issues 13 and 33's benchmark; results in docs/PERFORMANCE.md).
//
//   bandwidth   a streaming SIMD sum of a buffer 8x the last-level cache, best of several passes, at each
//               thread count (read_bandwidth.hpp): once at the start, then again just before and just after
//               each group of rows (one dtype, batch and context), since on a shared machine it moves by
//               2x within minutes; a row is compared with the better of its group's two
//   loaded      at the start, the same buffer read with four multiply-adds per loaded vector (the float32
//               kernel's least arithmetic at h / h_kv = 4): what a core streams while computing that much,
//               the bound of a float32 row where it is below the plain bandwidth (docs/PERFORMANCE.md)
//   decode      mha::decode_attention, h 32, h_kv 8, d_k = d_v 128, one new query per sequence, for each
//               context length (tokens per sequence) and batch (sequences per step), float32, bf16, int8 and
//               float8 e4m3 caches (the quantized ones read their rows' scales too, counted in the bytes)
//               (caches over --max-cache-gib skipped): the median time of a step; the K/V bytes
//               in the cache (what a step must read once) over that time, and that as a % of the read
//               bandwidth at the same thread count; with the query heads of a group packed (each K/V
//               byte read once per group) and per head (read h / h_kv times), at each thread count
//   targets     issue 33's, over the bandwidth rows (caches past this machine's last-level cache, read from
//               sysfs, and of at least 2 GiB): every dtype >= 80% of the read bandwidth; int8 and fp8 steps
//               <= 1/3.2 of float32's and <= 1/1.7 of bf16's at the same batch, context and threads;
//               2 threads over 1 >= 0.9x the read bandwidth's own 2-over-1 ratio beside the rows; then
//               issue 13's packing >= 3x faster than per head, over every row
//
// Legend: h query heads, h_kv key/value heads, d head width, B sequences per step, T tokens per sequence.
#include "bench/bench_decode.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/bench_machine.hpp"
#include "bench/bench_measure.hpp"
#include "bench/read_bandwidth.hpp"
#include "decode/amx_int8.hpp"
#include "decode/decode_params.hpp"
#include "decode/prefetch_level.hpp"
#include "mha/mha.hpp"

namespace mha_cli::bench {
namespace {

using mha::DType;
using mha::PagedKVCache;
using mha::Tensor;
using Mode = mha::detail::DecodeMode;

constexpr std::int64_t kHeads = 32, kDim = 128;
constexpr std::int64_t kTargetKvHeads = 8;  // the shape the issues' targets are stated for (h / h_kv = 4)
constexpr std::int64_t kFillTokens = 1024;  // the cache is filled by appending blocks of this many tokens

// A block of tokens x h_kv x d values in [-1, 1) from a 64-bit LCG (cheap: the cache holds gigabytes).
Tensor fill_block(std::uint64_t seed, DType dtype, std::int64_t kv_heads) {
  Tensor t(DType::Float32, {kFillTokens, kv_heads, kDim});
  float* x = t.data_as<float>();
  std::uint64_t state = seed * 0x9e3779b97f4a7c15ULL + 1;
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    state = state * 6364136223846793005ULL + 1442695040888963407ULL;
    x[i] = static_cast<float>(static_cast<double>(state >> 11) * 0x1.0p-52 - 1.0);
  }
  return dtype == DType::Float32 ? std::move(t) : Tensor::copy_of(t, dtype);
}

// What a cache holds: float32 or bfloat16 rows, or float32 rows quantized to int8 / float8 e4m3 with a
// float32 scale per (token, kv head) row, which the decode reads too.
struct CacheKind {
  const char* name;
  DType dtype;  // of the queries and results (float32 for the quantized caches)
  mha::KVStorage storage;
  std::int64_t bytes_per_row(std::int64_t d) const {  // one (token, kv head) row of keys or of values
    return storage == mha::KVStorage::Native ? d * static_cast<std::int64_t>(mha::dtype_size(dtype)) : d + 4;
  }
};
constexpr CacheKind kCacheKinds[] = {{"f32", DType::Float32, mha::KVStorage::Native},
                                     {"bf16", DType::BFloat16, mha::KVStorage::Native},
                                     {"int8", DType::Float32, mha::KVStorage::Int8},
                                     {"fp8", DType::Float32, mha::KVStorage::Float8E4M3}};

// B sequences of T tokens each.
struct DecodeCache {
  PagedKVCache cache;
  std::vector<PagedKVCache::SequenceId> ids;
};

DecodeCache make_cache(const CacheKind& kind, std::int64_t B, std::int64_t T, std::int64_t page_size,
                       std::int64_t kv_heads) {
  const DType dtype = kind.dtype;
  DecodeCache c{PagedKVCache({.num_kv_heads = kv_heads,
                              .head_dim = kDim,
                              .page_size = page_size,
                              .capacity_tokens = B * ((T + page_size - 1) / page_size * page_size),
                              .dtype = dtype,
                              .storage = kind.storage}),
                {}};
  const Tensor blocks[2] = {fill_block(1, dtype, kv_heads), fill_block(2, dtype, kv_heads)};
  for (std::int64_t s = 0; s < B; ++s) {
    c.ids.push_back(c.cache.add_sequence());
    for (std::int64_t t = 0, k = s; t < T; t += kFillTokens, ++k) {
      const std::int64_t n = std::min(kFillTokens, T - t);
      const mha::TensorView block = blocks[k % 2].view();
      const mha::TensorView part(block.data(), dtype, {n, kv_heads, kDim}, block.strides());
      c.cache.append(c.ids.back(), part, part);
    }
  }
  return c;
}

std::string context_name(std::int64_t T) { return T % 1024 == 0 ? fmt::format("{}k", T / 1024) : fmt::format("{}", T); }

struct Row {
  std::string dtype;
  std::int64_t batch = 0, context = 0, cache_bytes = 0;
  int threads = 0;
  Timing packed, per_head;
  double bandwidth_before = 0, bandwidth_after = 0;  // bytes/s at this thread count, around the row's group
  double steal_fraction = 0;                         // of the group's CPU time, taken by the hypervisor for others
  double rate(const Timing& t) const { return static_cast<double>(cache_bytes) / t.median_s; }
  double bandwidth() const { return std::max(bandwidth_before, bandwidth_after); }  // the better of the two
  // Before and after differed by more than 15%: the machine's memory was busier at one end.
  bool bandwidth_moved() const { return std::abs(bandwidth_before - bandwidth_after) > 0.15 * bandwidth(); }
};

void print_row(const Row& r, std::int64_t llc) {
  fmt::print(
      "{:>6} {:>5} {:>7} {:>9.0f} {:>4}{} {:>6.1f}{}{} | {:>9.3f} {:>7.1f} {:>5.0f}% | {:>9.3f} {:>7.1f} {:>5.0f}% | "
      "{:>6.2f}x\n",
      r.dtype, r.batch, context_name(r.context), static_cast<double>(r.cache_bytes) / (1 << 20), r.threads,
      r.cache_bytes > llc ? " " : "*", r.bandwidth() * 1e-9, r.bandwidth_moved() ? "!" : " ",
      r.steal_fraction > 0.02 ? "~" : " ", 1e3 * r.packed.median_s, r.rate(r.packed) * 1e-9,
      100 * r.rate(r.packed) / r.bandwidth(), 1e3 * r.per_head.median_s, r.rate(r.per_head) * 1e-9,
      100 * r.rate(r.per_head) / r.bandwidth(), r.per_head.median_s / r.packed.median_s);
}

nlohmann::json row_json(const Row& r) {
  return {{"dtype", r.dtype},
          {"batch", r.batch},
          {"context", r.context},
          {"cache_bytes", r.cache_bytes},
          {"threads", r.threads},
          {"packed_median_s", r.packed.median_s},
          {"packed_min_s", r.packed.min_s},
          {"per_head_median_s", r.per_head.median_s},
          {"per_head_min_s", r.per_head.min_s},
          {"read_bandwidth_bytes_per_s", r.bandwidth()},
          {"read_bandwidth_moved", r.bandwidth_moved()},
          {"read_bandwidth_before_after", {r.bandwidth_before, r.bandwidth_after}},
          {"steal_fraction", r.steal_fraction},
          {"packed_fraction_of_bandwidth", r.rate(r.packed) / r.bandwidth()},
          {"per_head_fraction_of_bandwidth", r.rate(r.per_head) / r.bandwidth()}};
}

// One target's verdict: printed as a line and kept in the JSON. `rows` 0: nothing to judge.
struct TargetLines {
  nlohmann::json json = nlohmann::json::array();
  void add(const std::string& what, int rows, double worst, double goal, const char* unit) {
    if (rows == 0) {
      fmt::print("  {}: no rows (target >= {:.2f}{})\n", what, goal, unit);
      json.push_back({{"target", what}, {"rows", 0}, {"worst", nullptr}, {"goal", goal}, {"met", false}});
      return;
    }
    const bool met = worst >= goal;
    fmt::print("  {}: {} rows, worst {:.2f}{} (target >= {:.2f}{}): {}\n", what, rows, worst, unit, goal, unit,
               met ? "met" : "NOT met");
    json.push_back({{"target", what}, {"rows", rows}, {"worst", worst}, {"goal", goal}, {"met", met}});
  }
};

// The row of `dtype` at r's batch, context and thread count, or nullptr.
const Row* same_shape(const std::vector<Row>& rows, const Row& r, const std::string& dtype, int threads) {
  for (const Row& o : rows)
    if (o.dtype == dtype && o.batch == r.batch && o.context == r.context && o.threads == threads) return &o;
  return nullptr;
}

// Issue 33's targets over the bandwidth rows (caches >= big_bytes: past the last-level cache, and at least
// 2 GiB), then issue 13's packing target over every row.
nlohmann::json check_targets(const std::vector<Row>& rows, std::int64_t big_bytes) {
  TargetLines t;
  const std::string big_name = fmt::format("caches >= {} MiB", big_bytes >> 20);
  fmt::print("\nTargets (issue 33), from the packed medians; bandwidth rows: {}\n", big_name);
  for (const CacheKind& kind : kCacheKinds) {  // every dtype >= 80% of the read bandwidth, batch 1 and 8
    double worst = 1e9;
    int n = 0;
    for (const Row& r : rows)
      if (r.dtype == kind.name && r.cache_bytes >= big_bytes)
        worst = std::min(worst, r.rate(r.packed) / r.bandwidth()), ++n;
    t.add(fmt::format("fraction of the read bandwidth, {} {}", kind.name, big_name), n, worst, 0.8, "");
  }
  // int8 and fp8 steps <= 1/3.2 of float32's and <= 1/1.7 of bf16's: the float step over the quantized one.
  for (const char* quantized : {"int8", "fp8"})
    for (const auto& [reference, goal] : {std::pair{"f32", 3.2}, std::pair{"bf16", 1.7}}) {
      double worst = 1e9;
      int n = 0;
      for (const Row& r : rows) {
        if (r.dtype != quantized || r.cache_bytes < big_bytes) continue;
        if (const Row* o = same_shape(rows, r, reference, r.threads))
          worst = std::min(worst, o->packed.median_s / r.packed.median_s), ++n;
      }
      t.add(fmt::format("{} step over {} step, {} (same batch, context, threads)", reference, quantized, big_name), n,
            worst, goal, "x");
    }
  // 2 threads over 1, as a share of the read bandwidth's own 2-over-1 ratio in the same groups.
  double worst = 1e9, stream_low = 1e9, stream_high = 0;
  int n = 0;
  for (const Row& r : rows) {
    if (r.threads != 2 || r.cache_bytes < big_bytes) continue;
    const Row* one = same_shape(rows, r, r.dtype, 1);
    if (!one) continue;
    const double stream = r.bandwidth() / one->bandwidth();
    worst = std::min(worst, one->packed.median_s / r.packed.median_s / stream), ++n;
    stream_low = std::min(stream_low, stream), stream_high = std::max(stream_high, stream);
  }
  t.add("2 threads over 1, over the read bandwidth's own 2-over-1, " + big_name, n, worst, 0.9, "x");
  if (n > 0) {
    fmt::print("    (the read bandwidth itself, 2 threads over 1, beside those rows: {:.2f}x to {:.2f}x)\n", stream_low,
               stream_high);
    t.json.back()["read_bandwidth_scaling"] = {stream_low, stream_high};
  }
  fmt::print("Target (issue 13):\n");
  double worst_packing = 1e9;
  for (const Row& r : rows) worst_packing = std::min(worst_packing, r.per_head.median_s / r.packed.median_s);
  t.add("packed over per head (h / h_kv = 4)", static_cast<int>(rows.size()), worst_packing, 3.0, "x");
  return t.json;
}

}  // namespace

int run_bench_decode(const BenchOptions& options, const std::string& command) {
  const MachineInfo m = describe_machine();
  const std::int64_t llc = options.llc_mib > 0 ? options.llc_mib << 20 : last_level_cache_bytes();
  // The bandwidth rows (issue 33): caches past the last-level cache and of at least 2 GiB, so that neither
  // the cache nor its page tables fit; with --llc-mib (the tests' small caches), 4x the size set.
  const std::int64_t big = options.llc_mib > 0 ? 4 * llc : std::max<std::int64_t>(llc + 1, std::int64_t{2} << 30);
  fmt::print("mha bench --decode ({})\nmachine: {}, {} CPUs, {}{}; last-level cache {} MiB{}; load average {}\n",
             m.date, cpu_name(m), m.logical_cpus, m.simd, m.virtual_machine ? ", virtual" : "", llc >> 20,
             options.llc_mib > 0 ? " (set by --llc-mib)" : " (sysfs)", load_average());
  fmt::print("bandwidth rows (the targets' rows): caches >= {} MiB\n", big >> 20);
  const std::string prefetch = mha::detail::decode_prefetch_description();
  fmt::print("the kernel prefetches the block ahead into the {}\n", prefetch);
  const std::string int8_products = mha::detail::amx::int8_tiles().description;
  fmt::print("int8 pages' products: {}{}\n", int8_products,
             mha::detail::amx::int8_tiles().tiles
                 ? fmt::format("; calls of fewer than {} query rows per kv head on vectors (h = h_kv with one query)",
                               mha::detail::amx::kMinGroupRows)
                 : "");
  nlohmann::json report = {{"command", command},
                           {"machine", cpu_name(m)},
                           {"date", m.date},
                           {"last_level_cache_bytes", llc},
                           {"bandwidth_rows_min_bytes", big},
                           {"heads", kHeads},
                           {"kv_heads", options.decode_kv_heads},
                           {"head_dim", kDim},
                           {"page_size", options.decode_page_size},
                           {"prefetch_level", prefetch},
                           {"int8_products", int8_products},
                           {"load_start", load_average()}};
  const double run_steal_start = steal_seconds();
  const ReadBandwidthProbe probe(options.bandwidth_mib > 0 ? options.bandwidth_mib << 20 : 8 * llc);
  for (const int threads : options.threads) {
    mha::set_num_threads(threads);
    const ReadBandwidth bw = probe.measure(7);
    fmt::print("read bandwidth, {} thread(s), {} MiB buffer: {:.1f} GB/s (best of 7 passes)\n", threads,
               bw.buffer_bytes >> 20, bw.bytes_per_s * 1e-9);
    const ReadBandwidth loaded = probe.measure(7, ReadBandwidthProbe::Work::FourMultiplyAdds);
    fmt::print("  the same, four multiply-adds per loaded vector (the float32 kernel's least arithmetic at h / h_kv = "
               "4): {:.1f} GB/s ({:.2f} of it)\n",
               loaded.bytes_per_s * 1e-9, loaded.bytes_per_s / bw.bytes_per_s);
    report["read_bandwidth"].push_back({{"threads", threads},
                                        {"bytes_per_s", bw.bytes_per_s},
                                        {"buffer_bytes", bw.buffer_bytes},
                                        {"with_four_multiply_adds_bytes_per_s", loaded.bytes_per_s}});
  }
  // The read bandwidth at each thread count, best of 3 passes (a group's bracket).
  auto bandwidths = [&] {
    std::vector<double> bw;
    for (const int threads : options.threads) {
      mha::set_num_threads(threads);
      bw.push_back(probe.measure(3).bytes_per_s);
    }
    return bw;
  };
  fmt::print("\nDecode step: h {}, h_kv {}, d {}, one query per sequence, pages of {} tokens; time = median of the "
             "steps; GB/s = K/V bytes in the cache / time; * = cache within the last-level cache; bw = the read "
             "bandwidth (GB/s) at the same thread count, the better of just before and just after the row's group, "
             "! where the two differed by more than 15%; ~ where the hypervisor took more than 2% of the group's CPU "
             "time (steal)\n",
             kHeads, options.decode_kv_heads, kDim, options.decode_page_size);
  fmt::print("{:>6} {:>5} {:>7} {:>9} {:>4}  {:>6}   | {:>9} {:>7} {:>6} | {:>9} {:>7} {:>6} | {:>7}\n", "dtype",
             "batch", "context", "cache MiB", "thr", "bw", "packed ms", "GB/s", "of bw", "head ms", "GB/s", "of bw",
             "packing");
  const RepeatPolicy policy{.warmup = 1, .min_reps = 5, .max_reps = 30, .min_time_s = 0.3, .max_time_s = 3.0};
  std::vector<Row> rows;
  for (const CacheKind& kind : kCacheKinds) {
    const DType dtype = kind.dtype;
    for (const std::int64_t B : options.decode_batches) {
      for (const std::int64_t T : options.decode_contexts) {
        const std::int64_t kv_heads = options.decode_kv_heads;
        const std::int64_t bytes = B * T * kv_heads * 2 * kind.bytes_per_row(kDim);  // payload (+ scales)
        if (static_cast<double>(bytes) > options.decode_max_cache_gib * (1 << 30)) {
          fmt::print("{:>6} {:>5} {:>7} {:>9.0f}  skipped: over --max-cache-gib {}\n", kind.name, B, context_name(T),
                     static_cast<double>(bytes) / (1 << 20), options.decode_max_cache_gib);
          continue;
        }
        const DecodeCache c = make_cache(kind, B, T, options.decode_page_size, kv_heads);
        // The queries from a block of 1024 x 8 rows of d: room for 256 sequences (--batches' most) x 32 heads.
        const Tensor q = Tensor::copy_of(
            fill_block(3, DType::Float32, kTargetKvHeads).reshaped({kFillTokens * kTargetKvHeads, kDim}).view(), dtype);
        static_assert(kFillTokens * kTargetKvHeads >= 256 * kHeads, "a query row for every head of every sequence");
        const mha::TensorView q_step(q.data(), dtype, {B, 1, kHeads, kDim});
        const std::vector<double> before = bandwidths();
        const double steal_start = steal_seconds();
        const auto wall_start = std::chrono::steady_clock::now();
        std::vector<Row> group;
        for (std::size_t ti = 0; ti < options.threads.size(); ++ti) {
          mha::set_num_threads(options.threads[ti]);
          Row r{kind.name, B, T, bytes, options.threads[ti], {}, {}};
          auto step = [&](Mode mode) {
            return measure([&] { (void)mha::detail::decode_attention_with_mode(q_step, c.cache, c.ids, {}, mode); },
                           policy);
          };
          r.packed = step(Mode::GroupPacked);
          r.per_head = step(Mode::PerHead);
          group.push_back(r);
        }
        const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
        const double steal = (steal_seconds() - steal_start) / (wall * std::max(m.logical_cpus, 1));
        const std::vector<double> after = bandwidths();
        for (std::size_t ti = 0; ti < group.size(); ++ti) {
          Row& r = group[ti];
          r.bandwidth_before = before[ti], r.bandwidth_after = after[ti];
          r.steal_fraction = steal;
          print_row(r, llc);
          rows.push_back(r);
          report["runs"].push_back(row_json(r));
        }
      }
    }
  }
  if (options.decode_kv_heads == kTargetKvHeads) {
    report["targets"] = check_targets(rows, big);
  } else {  // the targets are stated for h / h_kv = 4
    fmt::print("\nTargets (issues 33 and 13): judged at h_kv {} only (this run: h_kv {})\n", kTargetKvHeads,
               options.decode_kv_heads);
    report["targets"] = nlohmann::json::array();
  }
  report["load_end"] = load_average();
  report["steal_seconds"] = steal_seconds() - run_steal_start;
  fmt::print("load average at the end: {}; CPU time taken by the hypervisor for others (steal) during the run: "
             "{:.1f} s\n",
             load_average(), report["steal_seconds"].get<double>());
  double load = 0;
  for (const std::string& at : {report["load_start"].get<std::string>(), report["load_end"].get<std::string>()})
    load = std::max(load, std::atof(at.c_str()));  // the 1-minute average, first of the three
  if (m.logical_cpus > 0 && load > m.logical_cpus + 0.5)
    fmt::print("warning: the 1-minute load average reached {:.1f} on {} logical CPUs: other work shared the cores "
               "and the memory, so the rates (above all at {} threads) are low and the targets unreliable; repeat on "
               "a quiet machine\n",
               load, m.logical_cpus, options.threads.back());
  std::filesystem::create_directories(options.out_dir);
  const std::filesystem::path path = std::filesystem::path(options.out_dir) / "bench-decode.json";
  std::ofstream(path) << report.dump(2) << "\n";
  fmt::print("\nwrote {}\n", path.string());
  return 0;
}

}  // namespace mha_cli::bench
