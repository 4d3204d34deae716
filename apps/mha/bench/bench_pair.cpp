// Two calls timed alternately (bench_pair.hpp).
#include "bench/bench_pair.hpp"

#include <algorithm>
#include <cstdio>
#include <vector>

namespace mha_cli::bench {
namespace {

const RepeatPolicy kOneCall{.warmup = 0, .min_reps = 1, .max_reps = 1, .min_time_s = 0, .max_time_s = 0};

Timing timing_of(std::vector<double> times) {
  std::sort(times.begin(), times.end());
  const std::size_t n = times.size();
  return {times.front(), n % 2 == 1 ? times[n / 2] : 0.5 * (times[n / 2 - 1] + times[n / 2]), static_cast<int>(n)};
}

}  // namespace

Pair time_pair(const std::function<void()>& base, const std::function<void()>& variant, int repeats) {
  const double warm = std::max(measure(base, kOneCall).min_s, measure(variant, kOneCall).min_s);
  const int reps = repeats > 0 ? repeats : warm > 1.0 ? 3 : 7;
  std::vector<double> a, b;
  for (int i = 0; i < reps; ++i) {
    a.push_back(measure(base, kOneCall).min_s);
    b.push_back(measure(variant, kOneCall).min_s);
  }
  return {timing_of(a), timing_of(b), a, b};
}

nlohmann::json pair_json(const Pair& p, const std::string& base, const std::string& variant) {
  return {{base + "_median_s", p.base.median_s},
          {base + "_min_s", p.base.min_s},
          {variant + "_median_s", p.variant.median_s},
          {variant + "_min_s", p.variant.min_s},
          {"reps", p.base.reps},
          {base + "_calls_s", p.base_calls_s},
          {variant + "_calls_s", p.variant_calls_s}};
}

const char* pass_label(Pass pass) { return pass == Pass::Forward ? "fwd" : "fwd+bwd"; }

void flush_rows() { std::fflush(stdout); }

}  // namespace mha_cli::bench
