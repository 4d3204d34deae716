// Prints the best Highway target this machine runs among those the library's kernels are compiled for
// by default, as Highway's bit for it (hwy/targets.h): what the sanitizer build compiles its kernels for
// (cmake/SanitizerBuild.cmake). "Generated" matters: a CPU may support a target the default build does
// not compile (AVX3_DL, on an Ice Lake, Zen 4 or Sapphire Rapids), and dispatch never picks that one.
#include <cstdio>

#include "hwy/targets.h"

int main() {
  const auto targets = hwy::SupportedAndGeneratedTargets();  // this TU's HWY_TARGETS: the library's too
  long long best = 0;
  for (const auto target : targets) best = best == 0 || target < best ? target : best;  // lower bits: better
  std::printf("%lld", best);
  return 0;
}
