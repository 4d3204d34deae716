// `mha bench --variants`: packed against padded (bench_variants_packed.hpp).
//
// Legend: n sequences, L_i their lengths, total = sum L_i, h heads, d head width.
#include "bench/bench_variants_packed.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "bench/bench_measure.hpp"
#include "bench/bench_runs.hpp"
#include "bench/bench_workloads.hpp"
#include "mha/mha.hpp"

namespace mha_cli::bench {
namespace {

using mha::Tensor;

constexpr std::int64_t kShortest = 64;      // the lengths' lower end (the upper one when that is smaller)
constexpr std::uint64_t kLengthsSeed = 31;  // the number

// n lengths from a log-uniform law over [lo, hi] (most sequences short, a few long, as in a batch of documents),
// drawn with splitmix64 from a fixed seed: std's distributions differ between standard libraries, this does not.
std::vector<std::int64_t> draw_lengths(std::int64_t n, std::int64_t lo, std::int64_t hi) {
  std::uint64_t state = kLengthsSeed;
  std::vector<std::int64_t> lengths;
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    const double u = static_cast<double>((z ^ (z >> 31)) >> 11) * 0x1.0p-53;  // [0, 1)
    const double length = static_cast<double>(lo) * std::pow(static_cast<double>(hi) / static_cast<double>(lo), u);
    lengths.push_back(std::clamp<std::int64_t>(std::llround(length), lo, hi));
  }
  return lengths;
}

// The logits the fused forward computes for one sequence of `rows` query rows, causal, with key_length keys
// (scaled_dot_product_attention's key_lengths): each block of tile_rows() query rows (query_block.hpp)
// takes its products over the keys up to its last row's causal bound and the key length (masks.hpp's
// key_range_end), counted as a whole tile even where the diagonal crosses it (the kernel computes such a
// tile in row bands, masks.hpp's tile_row_bands, a little less; the count is the same model for both sides).
double forward_tile_logits(std::int64_t rows, std::int64_t key_length) {
  double logits = 0;
  for (std::int64_t i0 = 0, height = tile_rows(); i0 < rows; i0 += height) {
    const std::int64_t block = std::min(height, rows - i0);
    logits += static_cast<double>(block) * static_cast<double>(std::min(key_length, i0 + block));
  }
  return logits;
}

struct PackedBatch {
  std::vector<std::int64_t> lengths;  // L_i
  std::vector<std::int32_t> cu;       // [n + 1] prefix sums
  std::int64_t total = 0, max_length = 0;
  Tensor q, k, v, dout;  // [total, h, d]
  // The padded batch, stored [n, max_L, h, d] (the packed rows' own layout, padded) and viewed as
  // [n, h, max_L, d]: the two sides differ in padding only. Rows past L_i are padding, masked by key_lengths.
  Tensor pq, pk, pv, pdout;
  mha::TensorView pq_view, pk_view, pv_view, pdout_view;
  double flop_ratio = 0;  // r = sum L_i^2 / (n max_L^2)
  double tile_ratio = 0;  // r_tiles: the logits the packed forward computes over those the padded one does

  PackedBatch(std::int64_t n, std::int64_t longest) : lengths(draw_lengths(n, std::min(kShortest, longest), longest)) {
    cu.push_back(0);
    double squares = 0, packed_logits = 0, padded_logits = 0;
    for (const std::int64_t L : lengths) {
      cu.push_back(static_cast<std::int32_t>(cu.back() + L));
      max_length = std::max(max_length, L);
      squares += static_cast<double>(L) * static_cast<double>(L);
    }
    total = cu.back();
    for (const std::int64_t L : lengths) {
      packed_logits += forward_tile_logits(L, L);
      padded_logits += forward_tile_logits(max_length, L);  // a padded row i >= L_i still sees the L_i keys
    }
    flop_ratio = squares / (static_cast<double>(n) * static_cast<double>(max_length) * static_cast<double>(max_length));
    tile_ratio = packed_logits / padded_logits;
    q = random_tensor({total, kHeads, kHeadWidth}, 1), k = random_tensor({total, kHeads, kHeadWidth}, 2);
    v = random_tensor({total, kHeads, kHeadWidth}, 3), dout = random_tensor({total, kHeads, kHeadWidth}, 4);
    const mha::Shape storage{n, max_length, kHeads, kHeadWidth}, shape{n, kHeads, max_length, kHeadWidth};
    const mha::Shape strides{max_length * kHeads * kHeadWidth, kHeadWidth, kHeads * kHeadWidth, 1};
    auto make = [&](unsigned seed, Tensor& t, mha::TensorView& view) {
      t = random_tensor(storage, seed);
      view = mha::TensorView(t.data(), mha::DType::Float32, shape, strides);
    };
    make(5, pq, pq_view), make(6, pk, pk_view), make(7, pv, pv_view), make(8, pdout, pdout_view);
  }

  void packed(Pass pass) const {
    mha::AttentionOptions o;
    o.causal = true;
    o.need_lse = pass == Pass::ForwardBackward;
    const mha::VarlenResult r = mha::varlen_attention(q, k, v, cu, cu, o);
    if (pass == Pass::ForwardBackward) (void)mha::varlen_attention_backward(dout, q, k, v, r.out, r.lse, cu, cu, o);
  }

  // with_lengths: key_lengths mask the padding (the kernel then skips the keys past each length); without, every
  // logit of the padded causal squares is computed, the work the FLOP ratio r counts for a padded batch.
  void padded(Pass pass, bool with_lengths) const {
    mha::AttentionOptions o;
    o.causal = true;
    if (with_lengths) o.key_lengths = lengths;
    o.need_lse = pass == Pass::ForwardBackward;
    const mha::AttentionResult r = mha::scaled_dot_product_attention(pq_view, pk_view, pv_view, o);
    if (pass == Pass::ForwardBackward)
      (void)mha::scaled_dot_product_attention_backward(pdout_view, pq_view, pk_view, pv_view, r.out, r.lse, o);
  }
};

void print_packed_header(const BenchOptions& o, const PackedBatch& batch) {
  fmt::print("\n== Packed against padded: {} sequences, h {}, d {}, float32, causal; lengths log-uniform over [{}, {}] "
             "(seed {}):\n  {}\n  total {}, max_L {}; r = sum L_i^2 / (n max_L^2) = {:.4f}; r_tiles = the logits the "
             "packed forward computes / those the padded one computes = {:.4f} (the padded kernel skips the keys past "
             "each length; both counted as whole {}-row tiles across the diagonal)\n",
             o.variants_sequences, kHeads, kHeadWidth, std::min(kShortest, o.variants_n), o.variants_n, kLengthsSeed,
             fmt::join(batch.lengths, " "), batch.total, batch.max_length, batch.flop_ratio, batch.tile_ratio,
             tile_rows());
  fmt::print("packed: mha::varlen_attention(_backward) on [total, h, d], one sequence after another; padded: "
             "scaled_dot_product_attention(_backward) on [n, max_L, h, d] viewed as [n, h, max_L, d], key_lengths; "
             "dense: the same without key_lengths (every padded logit, the work r counts); GFLOP/s: the packed "
             "batch's own FLOPs (sum 2 h d L_i^2 forward, 3.5x that for fwd+bwd); medians, ms (each of padded and "
             "dense timed alternately with packed)\n");
  fmt::print("{:>4} {:>8} | {:>10} {:>10} {:>10} {:>8} | {:>16} {:>17} {:>18}\n", "thr", "pass", "dense ms",
             "padded ms", "packed ms", "GFLOP/s", "packed/(dense r)", "packed/(padded r)", "packed/(padded rt)");
}

}  // namespace

std::vector<PackedRow> run_packed(const BenchOptions& o, nlohmann::json& report) {
  const PackedBatch batch(o.variants_sequences, o.variants_n);
  print_packed_header(o, batch);
  double forward_flops = 0;  // the packed batch's own: 4 h d L_i^2 / 2 each, causal
  for (const std::int64_t L : batch.lengths) forward_flops += attention_forward_flops(1, kHeads, L, kHeadWidth, true);
  std::vector<PackedRow> rows;
  for (const int threads : o.threads) {
    mha::set_num_threads(threads);
    for (const Pass pass : {Pass::Forward, Pass::ForwardBackward}) {
      auto packed = [&] { batch.packed(pass); };
      const PackedRow r{threads, pass, time_pair([&] { batch.padded(pass, true); }, packed, o.variants_repeats),
                        time_pair([&] { batch.padded(pass, false); }, packed, o.variants_repeats)};
      const double flops = pass == Pass::Forward ? forward_flops : (1 + kBackwardFlopsRatio) * forward_flops;
      const double gflops = flops / r.times.variant.median_s * 1e-9;
      fmt::print("{:>4} {:>8} | {:>10.2f} {:>10.2f} {:>10.2f} {:>8.0f} | {:>15.3f}x {:>16.3f}x {:>17.3f}x\n", threads,
                 pass_label(pass), 1e3 * r.dense.base.median_s, 1e3 * r.times.base.median_s,
                 1e3 * r.times.variant.median_s, gflops, r.dense_scaled(batch.flop_ratio), r.scaled(batch.flop_ratio),
                 r.scaled(batch.tile_ratio));
      flush_rows();
      nlohmann::json row = pair_json(r.times, "padded", "packed");
      row["dense"] = pair_json(r.dense, "dense", "packed");
      row.update({{"threads", threads},
                  {"pass", pass_name(pass)},
                  {"packed_gflops", gflops},
                  {"packed_over_dense_times_r", r.dense_scaled(batch.flop_ratio)},
                  {"packed_over_padded_times_r", r.scaled(batch.flop_ratio)},
                  {"packed_over_padded_times_r_of_mins", r.times.min_ratio() / batch.flop_ratio},
                  {"packed_over_padded_times_r_tiles", r.scaled(batch.tile_ratio)}});
      report["packed"]["rows"].push_back(row);
      rows.push_back(r);
    }
  }
  // Each sequence is one call, parallel inside over its heads and query blocks, with a barrier at its end: a
  // short sequence gives the threads few work items. Where that costs, packed scales worse than padded.
  for (std::size_t i = 2; i < rows.size(); ++i) {
    const PackedRow &one = rows[i % 2], &many = rows[i];
    fmt::print("  {} threads over {}, {}: packed {:.2f}x, padded {:.2f}x\n", many.threads, one.threads,
               pass_label(many.pass), one.times.variant.median_s / many.times.variant.median_s,
               one.times.base.median_s / many.times.base.median_s);
  }
  report["packed"].update({{"sequences", o.variants_sequences},
                           {"heads", kHeads},
                           {"head_dim", kHeadWidth},
                           {"causal", true},
                           {"lengths_seed", kLengthsSeed},
                           {"lengths", batch.lengths},
                           {"total", batch.total},
                           {"max_length", batch.max_length},
                           {"flop_ratio", batch.flop_ratio},
                           {"tile_ratio", batch.tile_ratio},
                           {"query_block_rows", tile_rows()}});
  flush_rows();
  return rows;
}

}  // namespace mha_cli::bench
