// The thread count of the library's OpenMP regions (the calling thread's; see attention.hpp).
#include <omp.h>

#include <algorithm>
#include <string>
#include <thread>

#include "mha/attention.hpp"
#include "mha/error.hpp"

namespace mha {

void set_num_threads(int threads) {
  if (threads < 1) throw Error("threads: expected a positive thread count, got " + std::to_string(threads));
  if (threads > max_num_threads())
    throw Error("threads: " + std::to_string(threads) + " is more than this machine's bound: at most " +
                std::to_string(max_num_threads()) + " (max(64, 4 x " +
                std::to_string(std::thread::hardware_concurrency()) + " cores))");
  omp_set_num_threads(threads);
}

int num_threads() { return omp_get_max_threads(); }

int max_num_threads() {
  static const int bound = std::max(64, 4 * static_cast<int>(std::thread::hardware_concurrency()));
  return bound;
}

}  // namespace mha
