// The performance targets of the project, checked against one run's results.
#pragma once

#include <vector>

#include "bench/bench_results.hpp"

namespace mha_cli::bench {

// Threshold constants are in bench_targets.cpp, next to the check that uses each.
std::vector<TargetResult> evaluate_targets(const BenchResults& results);

}  // namespace mha_cli::bench
