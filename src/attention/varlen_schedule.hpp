// How varlen_attention spreads a packed batch's sequences over the threads (mha/varlen.hpp).
//
// One call per sequence would leave the threads idle on a pack of short sequences: each call opens its own
// parallel region over its heads and query blocks (a barrier at its end), and a call below
// kMinParallelFlops (parallel.hpp) runs on one thread. So the sequences are split by their share of the
// work, w_i = L_i S_i:
//
//   - a long sequence (w_i > W / (4 threads), W = sum w_i) runs alone, parallel inside its own call, as
//     before: it has query blocks enough for every thread, and run among the others it would finish last;
//   - the others run whole, one thread each, many at a time: a dynamic loop over them, longest first (so
//     the last to start are the shortest, and the threads finish together).
//
// Results do not depend on this split: each call computes the same bits whichever thread runs it and
// however many threads it has (attention_core.hpp), the sequences write disjoint rows, and whatever is
// summed over sequences (d sinks) is summed by the caller in sequence order afterwards.
//
// Legend: n sequences, L_i / S_i the query / key rows of sequence i.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <numeric>
#include <vector>

#include "mha/varlen.hpp"

namespace mha::detail {

// Calls run(i) once for every sequence i with queries (L_i > 0), on the threads as the file's comment says.
// An exception from a call made inside the parallel loop is rethrown here, after the loop (the first one
// caught; the other calls still run).
template <class Run>
void for_each_sequence(const CuSeqlens& cu_q, const CuSeqlens& cu_k, Run&& run) {
  const std::int64_t n = cu_q.size() - 1;
  const int threads = omp_get_max_threads();
  std::vector<double> work(static_cast<std::size_t>(std::max<std::int64_t>(n, 0)));
  for (std::int64_t i = 0; i < n; ++i)
    work[static_cast<std::size_t>(i)] = static_cast<double>(cu_q[i + 1] - cu_q[i]) *
                                        static_cast<double>(std::max<std::int64_t>(cu_k[i + 1] - cu_k[i], 1));
  const double total = std::accumulate(work.begin(), work.end(), 0.0);
  std::vector<std::int64_t> shared;  // the sequences run one thread each
  for (std::int64_t i = 0; i < n; ++i) {
    if (cu_q[i + 1] == cu_q[i]) continue;  // L_i = 0: nothing to compute
    if (threads == 1 || work[static_cast<std::size_t>(i)] * 4.0 * threads > total) run(i);
    else shared.push_back(i);
  }
  std::stable_sort(shared.begin(), shared.end(), [&](std::int64_t a, std::int64_t b) {
    return work[static_cast<std::size_t>(a)] > work[static_cast<std::size_t>(b)];
  });
  std::exception_ptr error;
#pragma omp parallel for schedule(dynamic, 1)
  for (std::size_t s = 0; s < shared.size(); ++s) {
    omp_set_num_threads(1);  // this thread's own regions (the call's) get one thread: it runs the call alone
    try {
      run(shared[s]);
    } catch (...) {
#pragma omp critical(mha_varlen_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace mha::detail
