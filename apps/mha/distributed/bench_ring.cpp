// `mha bench-ring` (bench_ring.hpp). For each N and each of three setups (non-causal; causal in the
// zigzag layout; causal in the contiguous layout, to show the balance zigzag buys) it times, with every
// rank on one thread:
//   T_P  the ring's forward and forward + backward on P ranks (the slowest rank's time),
//   T1   the single-process kernel on the whole sequence on rank 0 alone (the others wait),
// and reports efficiency = T1 / (P x T_P). It also reports what one ring step moves and computes: the
// bytes each rank sends per step (K and V of its block; the backward adds dK and dV) and the time of one
// step's kernel work (this rank's queries against one block, non-causal), so the link bandwidth needed
// to hide the transfers behind the compute can be read off for a real cluster.
#include "distributed/bench_ring.hpp"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <random>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "distributed/mpi_session.hpp"
#include "mha/distributed.hpp"

namespace mha_cli {
namespace {

using mha::DType;
using mha::Tensor;
using mha::distributed::Layout;
using Clock = std::chrono::steady_clock;

Tensor seeded(const mha::Shape& shape, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<float> normal;
  Tensor t(DType::Float32, shape);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = normal(gen);
  return t;
}

// The fastest of `reps` runs (after one warm-up) of body, each timed as the slowest rank's.
template <class Body>
double seconds(int reps, Body&& body) {
  body();
  double best = 1e300;
  for (int i = 0; i < reps; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = Clock::now();
    body();
    double mine = std::chrono::duration<double>(Clock::now() - t0).count(), slowest = 0;
    MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    best = std::min(best, slowest);
  }
  return best;
}

struct Setup {
  const char* name;
  bool causal;
  Layout layout;
};

int bench(const BenchRingOptions& o, const MpiSession& mpi) {
  // Ranks given different sizes or repetitions would time different problems, or wait on each other
  // forever; --out is rank 0's alone.
  std::string sizes;
  for (std::int64_t n : o.sizes) sizes += fmt::format("{}{}", sizes.empty() ? "" : ",", n);
  agree_on_arguments("bench-ring", {"--sizes " + sizes, fmt::format("--heads {}", o.heads),
                                    fmt::format("--dim {}", o.dim), fmt::format("--reps {}", o.reps)});
  mha::set_num_threads(1);
  const int P = mpi.size();
  const Setup setups[] = {{"non-causal", false, Layout::Zigzag},
                          {"causal zigzag", true, Layout::Zigzag},
                          {"causal contiguous", true, Layout::Contiguous}};
  nlohmann::json results = nlohmann::json::array();
  if (mpi.rank() == 0)
    fmt::print("bench-ring: {} ranks x 1 thread against 1 rank x 1 thread; h {}, d {}; fastest of {} runs\n", P,
               o.heads, o.dim, o.reps);
  for (std::int64_t n : o.sizes) {
    const mha::Shape shape{1, o.heads, n, o.dim};
    const Tensor q = seeded(shape, 1), k = seeded(shape, 2), v = seeded(shape, 3), dout = seeded(shape, 4);
    for (const Setup& s : setups) {
      auto shard = [&](const Tensor& t) { return mha::distributed::shard_sequence(t, 2, P, mpi.rank(), s.layout); };
      const Tensor q_r = shard(q), k_r = shard(k), v_r = shard(v), dout_r = shard(dout);
      mha::distributed::RingOptions ro;
      ro.causal = s.causal;
      ro.layout = s.layout;
      const double ring_fwd =
          seconds(o.reps, [&] { mha::distributed::ring_attention(q_r, k_r, v_r, MPI_COMM_WORLD, ro); });
      const double ring_step = seconds(o.reps, [&] {
        const auto f = mha::distributed::ring_attention(q_r, k_r, v_r, MPI_COMM_WORLD, ro);
        mha::distributed::ring_attention_backward(dout_r, q_r, k_r, v_r, f.out, f.lse, MPI_COMM_WORLD, ro);
      });
      // One step's compute: this rank's queries against one block of keys (non-causal), alone.
      const double block = seconds(o.reps, [&] { mha::scaled_dot_product_attention(q_r, k_r, v_r); });
      mha::AttentionOptions single;
      single.causal = s.causal;
      single.need_lse = true;
      double one_fwd = 0, one_step = 0;
      if (mpi.rank() == 0) {  // the others wait at the barrier below
        auto time_alone = [&](auto&& body) {
          body();
          double best = 1e300;
          for (int i = 0; i < o.reps; ++i) {
            const auto t0 = Clock::now();
            body();
            best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
          }
          return best;
        };
        one_fwd = time_alone([&] { mha::scaled_dot_product_attention(q, k, v, single); });
        one_step = time_alone([&] {
          const auto r = mha::scaled_dot_product_attention(q, k, v, single);
          mha::scaled_dot_product_attention_backward(dout, q, k, v, r.out, r.lse, single);
        });
      }
      MPI_Barrier(MPI_COMM_WORLD);
      if (mpi.rank() != 0) continue;
      const double block_bytes = static_cast<double>(k_r.nbytes() + v_r.nbytes());
      const nlohmann::json row = {{"n", n},
                                  {"setup", s.name},
                                  {"ranks", P},
                                  {"ring_forward_s", ring_fwd},
                                  {"ring_forward_backward_s", ring_step},
                                  {"one_rank_forward_s", one_fwd},
                                  {"one_rank_forward_backward_s", one_step},
                                  {"efficiency_forward", one_fwd / (P * ring_fwd)},
                                  {"efficiency_forward_backward", one_step / (P * ring_step)},
                                  {"bytes_per_step_forward", block_bytes},
                                  {"bytes_per_step_backward", 2 * block_bytes},
                                  {"block_compute_s", block}};
      results.push_back(row);
      fmt::print("  N {:>6} {:<18} fwd {:8.3f} s (1 rank {:8.3f} s, efficiency {:5.1f}%)  fwd+bwd {:8.3f} s (1 rank "
                 "{:8.3f} s, efficiency {:5.1f}%)\n",
                 n, s.name, ring_fwd, one_fwd, 100 * one_fwd / (P * ring_fwd), ring_step, one_step,
                 100 * one_step / (P * ring_step));
      if (!s.causal)
        fmt::print("  N {:>6} per step: {:.1f} MiB sent (backward {:.1f} MiB), {:.3f} s of compute: full overlap "
                   "needs {:.2f} Gb/s forward; at 25 Gb/s a step's transfer takes {:.3f} s, at 100 Gb/s {:.3f} s\n",
                   n, block_bytes / 1048576, 2 * block_bytes / 1048576, block, block_bytes * 8 / block / 1e9,
                   block_bytes * 8 / 25e9, block_bytes * 8 / 100e9);
    }
  }
  if (mpi.rank() == 0 && !o.out.empty()) {
    std::ofstream(o.out) << results.dump(2) << "\n";
    fmt::print("  wrote {}\n", o.out);
  }
  return 0;
}

}  // namespace

int run_bench_ring(const BenchRingOptions& o) {
  MpiSession mpi;
  return mpi.run([&] { return bench(o, mpi); });
}

}  // namespace mha_cli
