// The thread count of the library's OpenMP regions.
#include <omp.h>

#include "mha/attention.hpp"
#include "mha/error.hpp"

namespace mha {

void set_num_threads(int threads) {
  if (threads < 1) throw Error("threads: expected a positive thread count, got " + std::to_string(threads));
  omp_set_num_threads(threads);
}

int num_threads() { return omp_get_max_threads(); }

}  // namespace mha
