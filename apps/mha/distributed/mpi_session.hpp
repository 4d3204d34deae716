// MPI for the commands that run under mpirun (ring-check, bench-ring): initialised for the command's
// run and finalised after it; and the gathering of every rank's shard of a sequence onto rank 0.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <exception>
#include <vector>

#include "mha/distributed.hpp"

namespace mha_cli {

class MpiSession {
 public:
  MpiSession();   // MPI_Init (without mpirun: one rank)
  ~MpiSession();  // MPI_Finalize
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  int rank() const { return rank_; }
  int size() const { return size_; }

  // Runs a command's body: an mha::Error (the same on every rank, by the library's agreement step)
  // is reported by rank 0 alone (rethrown there; the other ranks return 1); any other failure ends the
  // whole job with MPI_Abort after naming it, so no rank waits for a message that will never come.
  template <class Body>
  int run(Body&& body) {
    try {
      return body();
    } catch (const mha::Error&) {
      if (rank_ == 0) throw;
      return 1;
    } catch (const std::exception& e) {
      abort_job(e.what());
    }
  }

 private:
  [[noreturn]] void abort_job(const char* what) const;

  int rank_ = 0, size_ = 1;
};

// Every rank's `local` ([..., n_r along dim, ...], contiguous, float32 or float64) joined on rank 0 in
// sequence order by the layout; an undefined tensor on the other ranks. Collective.
mha::Tensor gather_sequence(const mha::Tensor& local, std::int64_t dim, mha::distributed::Layout layout);

}  // namespace mha_cli
