// A program built against an installed mha::distributed (find_package(mha CONFIG) with MPI): causal
// ring attention over the ranks of MPI_COMM_WORLD, each rank's rows checked against one process.
// Run: mpirun -np 2 ./consumer_ring
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <mha/distributed.hpp>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const std::int64_t B = 1, h = 2, N = 50, d = 8;
  std::vector<float> x(B * h * N * d);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.37f * static_cast<float>(i));
  const mha::TensorView whole(x, {B, h, N, d});  // q = k = v, [B, h, N, d]
  const mha::Tensor mine = mha::distributed::shard_sequence(whole, 2, ranks, rank, mha::distributed::Layout::Zigzag);
  const mha::distributed::RingResult ring =
      mha::distributed::ring_attention(mine, mine, mine, MPI_COMM_WORLD, {{.causal = true}});
  const mha::Tensor want =
      mha::distributed::shard_sequence(mha::scaled_dot_product_attention(whole, whole, whole, {{.causal = true}}).out,
                                       2, ranks, rank, mha::distributed::Layout::Zigzag);
  double worst = 0;
  for (std::int64_t i = 0; i < want.numel(); ++i)
    worst = std::max(worst, static_cast<double>(std::fabs(ring.out.data_as<float>()[i] - want.data_as<float>()[i])));
  double worst_anywhere = 0;
  MPI_Reduce(&worst, &worst_anywhere, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
  if (rank == 0)
    std::printf("consumer_ring: %d ranks, largest difference from one process %.1e\n", ranks, worst_anywhere);
  MPI_Finalize();
  return worst_anywhere < 1e-5 ? 0 : 1;
}
