// `mha ring-check` (ring_check.hpp): seeded inputs, ring attention forward and backward on every rank,
// the shards gathered on rank 0 and compared with the single-process kernel there.
//
// The rule (as the tests': tests/distributed/ring_attention_test.cpp): against the float64 reference
// on rank 0, float32 results may err by at most 4 x the single-process float32 kernel's error plus
// 1e-5 x the largest magnitude; float64 results by 1e-12 x the largest magnitude.
#include "distributed/ring_check.hpp"

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <fmt/core.h>

#include "distributed/mpi_session.hpp"
#include "mha/distributed.hpp"

namespace mha_cli {
namespace {

using mha::DType;
using mha::Tensor;
using mha::distributed::Layout;

Tensor seeded(DType dtype, const mha::Shape& shape, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> normal;
  Tensor t(DType::Float64, shape);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data_as<double>()[i] = normal(gen);
  return Tensor::copy_of(t, dtype);
}

struct Results {
  Tensor out, lse, dq, dk, dv;
};

// The worst |got - want| where want is finite (non-finite values must match), and the largest |want|.
std::pair<double, double> error_and_magnitude(const Tensor& got, const Tensor& want) {
  const Tensor g = Tensor::copy_of(got, DType::Float64), w = Tensor::copy_of(want, DType::Float64);
  double error = 0, magnitude = 1;
  for (std::int64_t i = 0; i < w.numel(); ++i) {
    const double a = g.data_as<double>()[i], b = w.data_as<double>()[i];
    if (!std::isfinite(b)) error = std::max(error, (std::isnan(b) ? std::isnan(a) : a == b) ? 0.0 : HUGE_VAL);
    else
      error = std::max(error, std::isfinite(a) ? std::fabs(a - b) : HUGE_VAL),
      magnitude = std::max(magnitude, std::fabs(b));
  }
  return {error, magnitude};
}

Results single_process(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout, bool causal,
                       mha::Kernel kernel) {
  mha::AttentionOptions o;
  o.causal = causal;
  o.need_lse = true;
  o.kernel = kernel;
  mha::AttentionResult r = mha::scaled_dot_product_attention(q, k, v, o);
  mha::AttentionGradients g = mha::scaled_dot_product_attention_backward(dout, q, k, v, r.out, r.lse, o);
  return {std::move(r.out), std::move(r.lse), std::move(g.dq), std::move(g.dk), std::move(g.dv)};
}

// Rank 0: the table and the verdict (worst error / allowed, last).
int report(const RingCheckOptions& o, int ranks, const Results& ring, const Tensor& q, const Tensor& k, const Tensor& v,
           const Tensor& dout) {
  const bool f64 = o.dtype == "float64";
  auto as64 = [](const Tensor& t) { return Tensor::copy_of(t, DType::Float64); };
  const Results ref = single_process(as64(q), as64(k), as64(v), as64(dout), o.causal, mha::Kernel::Reference);
  const Results one = single_process(q, k, v, dout, o.causal, mha::Kernel::Flash);
  fmt::print("ring-check: {} ranks, N {}, B {}, h {}, d {}, {}{}, {}, seed {}\n", ranks, o.n, o.batch, o.heads, o.dim,
             o.causal ? "causal, " : "", o.layout, o.dtype, o.seed);
  fmt::print("  {:<4} {:>12} {:>12} {:>8}\n", "", "worst error", "allowed", "ratio");
  const std::pair<const char*, const Tensor Results::*> fields[] = {
      {"out", &Results::out}, {"lse", &Results::lse}, {"dq", &Results::dq}, {"dk", &Results::dk}, {"dv", &Results::dv}};
  double worst = 0;
  for (const auto& [name, field] : fields) {
    const auto [error, magnitude] = error_and_magnitude(ring.*field, ref.*field);
    const double allowed =
        f64 ? 1e-12 * magnitude : 4 * error_and_magnitude(one.*field, ref.*field).first + 1e-5 * magnitude;
    worst = std::max(worst, error / allowed);
    fmt::print("  {:<4} {:>12.3e} {:>12.3e} {:>8.3f}\n", name, error, allowed, error / allowed);
  }
  fmt::print("worst error / allowed: {:.3f} ({})\n", worst, worst <= 1 ? "within the rule" : "OUTSIDE the rule");
  return worst <= 1 ? 0 : 1;
}

// Ranks given different problems would report the difference as a numerical failure: they must agree
// first. --threads may differ (machines of different sizes): it does not change the problem.
void agree_on_the_problem(const RingCheckOptions& o) {
  agree_on_arguments(
      "ring-check", {fmt::format("--n {}", o.n), fmt::format("--batch {}", o.batch), fmt::format("--heads {}", o.heads),
                     fmt::format("--dim {}", o.dim), o.causal ? "--causal" : "no --causal", "--layout " + o.layout,
                     "--dtype " + o.dtype, fmt::format("--seed {}", o.seed)});
}

int check(const RingCheckOptions& o, const MpiSession& mpi) {
  agree_on_the_problem(o);
  mha::set_num_threads(o.threads);
  const Layout layout = o.layout == "contiguous" ? Layout::Contiguous : Layout::Zigzag;
  const DType dtype = o.dtype == "float64" ? DType::Float64 : DType::Float32;
  // Every rank draws the whole problem from the seed and keeps its shard (rank 0 keeps the whole too).
  const Tensor q = seeded(dtype, {o.batch, o.heads, o.n, o.dim}, o.seed);
  const Tensor k = seeded(dtype, {o.batch, o.heads, o.n, o.dim}, o.seed + 1);
  const Tensor v = seeded(dtype, {o.batch, o.heads, o.n, o.dim}, o.seed + 2);
  const Tensor dout = seeded(dtype, {o.batch, o.heads, o.n, o.dim}, o.seed + 3);
  auto shard = [&](const Tensor& t) { return mha::distributed::shard_sequence(t, 2, mpi.size(), mpi.rank(), layout); };
  const Tensor q_r = shard(q), k_r = shard(k), v_r = shard(v), dout_r = shard(dout);
  mha::distributed::RingOptions options;
  options.causal = o.causal;
  options.layout = layout;
  mha::distributed::RingResult f = mha::distributed::ring_attention(q_r, k_r, v_r, MPI_COMM_WORLD, options);
  mha::AttentionGradients g =
      mha::distributed::ring_attention_backward(dout_r, q_r, k_r, v_r, f.out, f.lse, MPI_COMM_WORLD, options);
  Results ring{gather_sequence(f.out, 2, layout), gather_sequence(f.lse, 2, layout), gather_sequence(g.dq, 2, layout),
               gather_sequence(g.dk, 2, layout), gather_sequence(g.dv, 2, layout)};
  int status = mpi.rank() == 0 ? report(o, mpi.size(), ring, q, k, v, dout) : 0;
  MPI_Bcast(&status, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return status;
}

}  // namespace

int run_ring_check(const RingCheckOptions& o) {
  MpiSession mpi;
  return mpi.run([&] { return check(o, mpi); });
}

}  // namespace mha_cli
