// Prints the best Highway target this machine runs, as Highway's bit for it (hwy/targets.h): what the
// sanitizer build compiles its kernels for (cmake/SanitizerBuild.cmake).
#include <cstdio>

#include "hwy/targets.h"

int main() {
  const auto targets = hwy::SupportedTargets();  // the bits of every target this CPU and OS can run
  const auto best = targets & -targets;          // lower bits are better targets
  std::printf("%lld", static_cast<long long>(best));
  return 0;
}
