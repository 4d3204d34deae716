// Two calls timed side by side, for a ratio that a shared machine's changing load should not decide: the
// base call and the variant alternately (base, variant, base, variant, ...), so that whatever else runs
// reaches both alike. Used by `mha bench --variants`.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench_measure.hpp"
#include "bench/bench_workloads.hpp"

namespace mha_cli::bench {

struct Pair {
  Timing base, variant;
  std::vector<double> base_calls_s, variant_calls_s;  // every timed call, in the order they ran
  double ratio() const { return variant.median_s / base.median_s; }
  double min_ratio() const { return variant.min_s / base.min_s; }  // the best calls': a check on the medians
};

// `repeats` timed calls of each after one warm-up call of each; repeats 0: 7, or 3 when a warm-up call took
// over a second (so that a default run with second-long calls stays short).
Pair time_pair(const std::function<void()>& base, const std::function<void()>& variant, int repeats);

// {"<base>_median_s", "<base>_min_s", "<variant>_median_s", "<variant>_min_s", "reps", "<base>_calls_s",
// "<variant>_calls_s"}.
nlohmann::json pair_json(const Pair& p, const std::string& base, const std::string& variant);

// "fwd" or "fwd+bwd", as the tables print a pass.
const char* pass_label(Pass pass);

// Flushes stdout: rows appear as they are measured, also through a pipe.
void flush_rows();

}  // namespace mha_cli::bench
