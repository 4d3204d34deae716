// MpiSession and gather_sequence (mpi_session.hpp).
#include "distributed/mpi_session.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "mha/error.hpp"
#include "render/terminal_text.hpp"

namespace mha_cli {

MpiSession::MpiSession() {
  MPI_Init(nullptr, nullptr);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size_);
}

MpiSession::~MpiSession() { MPI_Finalize(); }

void MpiSession::abort_job(const char* what) const {
  std::fprintf(stderr, "mha: error on rank %d: %s\n", rank_, what);
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();  // MPI_Abort does not return
}

void MpiSession::report_agreed_error(const char* what) const {
  if (rank_ == 0) {
    std::fprintf(stderr, "mha: error: %s\n", terminal_safe(what).c_str());
    std::fflush(stderr);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

namespace {

// The arguments in `bytes` (each followed by a NUL, as agree_on_arguments sends them).
std::vector<std::string> split_arguments(const char* bytes, int count) {
  std::vector<std::string> out;
  for (int i = 0; i < count;) {
    out.emplace_back(bytes + i);
    i += static_cast<int>(out.back().size()) + 1;
  }
  return out;
}

}  // namespace

void agree_on_arguments(const std::string& command, const std::vector<std::string>& arguments) {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  std::string mine;
  for (const std::string& a : arguments) mine += a + '\0';
  const int bytes = static_cast<int>(mine.size());
  std::vector<int> counts(static_cast<std::size_t>(size)), offsets(static_cast<std::size_t>(size));
  MPI_Allgather(&bytes, 1, MPI_INT, counts.data(), 1, MPI_INT, MPI_COMM_WORLD);
  int total = 0;
  for (int r = 0; r < size; ++r)
    offsets[static_cast<std::size_t>(r)] = total, total += counts[static_cast<std::size_t>(r)];
  std::vector<char> all(static_cast<std::size_t>(total));
  MPI_Allgatherv(mine.data(), bytes, MPI_CHAR, all.data(), counts.data(), offsets.data(), MPI_CHAR, MPI_COMM_WORLD);
  // Every rank compares the same lists in the same order: the same error everywhere.
  const std::vector<std::string> first = split_arguments(all.data(), counts[0]);
  for (int r = 1; r < size; ++r) {
    const std::size_t at = static_cast<std::size_t>(r);
    const std::vector<std::string> theirs = split_arguments(all.data() + offsets[at], counts[at]);
    for (std::size_t i = 0; i < std::max(first.size(), theirs.size()); ++i) {
      const std::string a = i < first.size() ? first[i] : "nothing", b = i < theirs.size() ? theirs[i] : "nothing";
      if (a != b)
        throw mha::Error(command + ": rank " + std::to_string(r) + " was given " + b + ", rank 0 " + a +
                         ": every rank must be given the same options");
    }
  }
}

mha::Tensor gather_sequence(const mha::Tensor& local, std::int64_t dim, mha::distributed::Layout layout) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  // Bytes per rank (each shard is sent whole as bytes; rank 0 cuts them back into tensors).
  const int bytes = static_cast<int>(local.nbytes());
  std::vector<int> counts(static_cast<std::size_t>(size)), offsets(static_cast<std::size_t>(size));
  MPI_Gather(&bytes, 1, MPI_INT, counts.data(), 1, MPI_INT, 0, MPI_COMM_WORLD);
  std::vector<std::byte> all;
  if (rank == 0) {
    int total = 0;
    for (int r = 0; r < size; ++r)
      offsets[static_cast<std::size_t>(r)] = total, total += counts[static_cast<std::size_t>(r)];
    all.resize(static_cast<std::size_t>(total));
  }
  MPI_Gatherv(local.data(), bytes, MPI_BYTE, all.data(), counts.data(), offsets.data(), MPI_BYTE, 0, MPI_COMM_WORLD);
  if (rank != 0) return {};
  // Shard r's length along dim, from its byte count and the other dimensions (the same on every rank).
  const std::int64_t row_bytes = local.size(dim) == 0 ? 0 : static_cast<std::int64_t>(local.nbytes()) / local.size(dim);
  std::vector<mha::TensorView> shards;
  for (int r = 0; r < size; ++r) {
    mha::Shape shape = local.shape();
    const std::int64_t per_row = row_bytes > 0 ? row_bytes : 1;
    shape[static_cast<std::size_t>(dim)] = counts[static_cast<std::size_t>(r)] / per_row;
    shards.emplace_back(all.data() + offsets[static_cast<std::size_t>(r)], local.dtype(), shape);
  }
  return mha::distributed::unshard_sequence(shards, dim, layout);
}

}  // namespace mha_cli
