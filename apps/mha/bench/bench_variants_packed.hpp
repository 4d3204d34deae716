// `mha bench --variants`, its first part: a packed batch of variable-length sequences through
// mha::varlen_attention against the same sequences padded to the longest through scaled_dot_product_attention,
// with key_lengths and without (every padded logit computed), bench_variants.cpp says what the mode prints.
//
// Legend: n sequences, L_i their lengths, total = sum L_i, h heads, d head width.
#pragma once

#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench.hpp"
#include "bench/bench_pair.hpp"

namespace mha_cli::bench {

struct PackedRow {
  int threads = 0;
  Pass pass = Pass::Forward;
  Pair times;  // base: padded with key_lengths (its kernel skips the keys past each length), variant: packed
  Pair dense;  // base: padded computing every logit of the causal [max_L, max_L] squares, variant: packed
  // packed / (padded x ratio): the packed time over the padded time scaled by a work ratio
  double scaled(double ratio) const { return times.variant.median_s / (times.base.median_s * ratio); }
  double dense_scaled(double ratio) const { return dense.variant.median_s / (dense.base.median_s * ratio); }
};

// Times both at each of options.threads, forward and forward+backward, printing the table as it goes; fills
// report["packed"] (the lengths, r = "flop_ratio", r_tiles = "tile_ratio", the rows).
std::vector<PackedRow> run_packed(const BenchOptions& options, nlohmann::json& report);

}  // namespace mha_cli::bench
