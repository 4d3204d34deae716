// MPI for the commands that run under mpirun (ring-check, bench-ring): initialised for the command's
// run and finalised after it; the ranks' agreement on their arguments; and the gathering of every
// rank's shard of a sequence onto rank 0.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <exception>
#include <string>
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
  // is reported by rank 0 alone, and every rank returns 1 once it is written (mpirun ends the job at the
  // first rank that exits non-zero, which was at times before rank 0 had written it); any other failure
  // ends the whole job with MPI_Abort after naming it, so no rank waits for a message that will never come.
  template <class Body>
  int run(Body&& body) {
    try {
      return body();
    } catch (const mha::Error& e) {
      report_agreed_error(e.what());
      return 1;
    } catch (const std::exception& e) {
      abort_job(e.what());
    }
  }

 private:
  [[noreturn]] void abort_job(const char* what) const;
  void report_agreed_error(const char* what) const;  // rank 0 writes it; then every rank meets at a barrier

  int rank_ = 0, size_ = 1;
};

// Compares every rank's arguments (each as it reads on the command line, e.g. "--n 300", "no --causal";
// the same list on every rank) with rank 0's. Collective. Ranks given different ones (`mpirun -np 1 mha
// ring-check --n 300 : -np 1 mha ring-check --n 301`) would run different problems as one, or wait
// for messages that never come: every rank throws the same mha::Error, naming the first such rank and
// the argument, before any other message is exchanged.
void agree_on_arguments(const std::string& command, const std::vector<std::string>& arguments);

// Every rank's `local` ([..., n_r along dim, ...], contiguous, float32 or float64) joined on rank 0 in
// sequence order by the layout; an undefined tensor on the other ranks. Collective.
mha::Tensor gather_sequence(const mha::Tensor& local, std::int64_t dim, mha::distributed::Layout layout);

}  // namespace mha_cli
