// `mha bench --dtype bf16`: bfloat16 attention beside its own roof, our float32, and PyTorch 1.13 in
// bfloat16 and float32, in one run (issue 12's benchmark; results in docs/PERFORMANCE.md).
//
//   roof        oneDNN's bf16 matmul C [2048, 2048] = A B (one primitive, every thread), with the
//               implementation oneDNN picked (brg:avx512_core_amx_bf16 on AMX, brg:avx512_core_bf16
//               with AVX512-BF16, another name where the CPU has neither), or sgemm's 2048^3 where that is
//               faster (the library's bf16 products may run on either); beside it the path the
//               library's bf16 products took in this process and why (MHA_BF16_GEMM, or the rates
//               measured at first use: src/bf16_path.hpp)
//   core        scaled_dot_product_attention, B 1, h 8, N = L = S, d 64 and 128, forward and backward,
//               GFLOP/s and % of the roof; float32 beside it; on one thread also the rate of the
//               forward's two tile products alone, and so the share of the softmax's work
//   layer       MultiHeadAttention E 512, h 8, B 1: forward (eval) and training step (forward +
//               backward), ours in bf16 and float32, PyTorch's nn.MultiheadAttention in bf16 and
//               float32 (its float32 products on oneDNN through the preloaded sgemm_), same threads; at the last
//               thread count also the training step's extra memory, each in a process of its own
//
// Legend: B batch, h heads, N = L = S, d head width, E = d_model.
#include "bench/bench_bf16.hpp"

#include <fmt/format.h>
#include <oneapi/dnnl/dnnl.hpp>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "attention/attention_core.hpp"
#include "bench/bench_machine.hpp"
#include "bench/bench_measure.hpp"
#include "bench/bench_runs.hpp"
#include "bench/bench_workloads.hpp"
#include "gemm.hpp"
#include "mha/mha.hpp"

namespace mha_cli::bench {

namespace {

using mha::DType;
using mha::Tensor;

// The bf16 roof at the current thread count: the best GFLOP/s of one 2048^3 matmul primitive.
struct Bf16Roof {
  double gflops = 0;
  std::string implementation;
};

Bf16Roof measure_onednn_bf16_roof(const RepeatPolicy& policy) {
  using dnnl::memory;
  const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  const memory::dim n = kRoofSize;
  const memory::desc a({n, n}, memory::data_type::bf16, memory::format_tag::ab);
  const memory::desc c({n, n}, memory::data_type::f32, memory::format_tag::ab);
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a, a, c), engine);
  const dnnl::matmul matmul(pd);
  const memory A(a, engine), B(a, engine), C(c, engine);
  for (auto* m : {&A, &B}) {  // ones: every product is exact and finite
    auto* bits = static_cast<std::uint16_t*>(m->get_data_handle());
    for (memory::dim i = 0; i < n * n; ++i) bits[i] = 0x3f80;
  }
  const Timing t = measure(
      [&] {
        matmul.execute(stream, {{DNNL_ARG_SRC, A}, {DNNL_ARG_WEIGHTS, B}, {DNNL_ARG_DST, C}});
        stream.wait();
      },
      policy);
  return {2.0 * n * n * n / t.min_s * 1e-9, pd.impl_info_str()};
}

Bf16Roof measure_bf16_roof(const RepeatPolicy& policy) {
  try {
    return measure_onednn_bf16_roof(policy);
  } catch (const dnnl::error&) {  // AVX2: oneDNN 2.6 has no bf16 matmul at all
    return {0.0, "none: oneDNN has no bf16 matmul on this CPU"};
  }
}

// The roof of bf16 products on this machine: the faster of oneDNN's bf16 matmul and sgemm over widened operands
// (the float32 roof), since the library's bf16 products take either path (src/bf16_path.hpp). Without it a
// bf16 run on the sgemm path reads above 100% of a bf16 matmul slower than sgemm.
Bf16Roof bf16_products_roof(const Bf16Roof& matmul, const Roof& sgemm) {
  if (matmul.gflops >= sgemm.gflops) return matmul;
  return {sgemm.gflops, fmt::format("oneDNN sgemm over widened operands, faster here than the bf16 matmul {} at {:.0f}",
                                    matmul.implementation, matmul.gflops)};
}

// The rate of the fused forward's two products alone, in bfloat16 through the kernel's own entry
// (gemm_tile), on one thread: one block of tile_rows() queries streams N keys past, S = Q K_blk^T
// [tile_rows(), kTileKeys] (K = d) and acc += P V_blk [tile_rows(), d] (K = kTileKeys), without the softmax
// and the rounding of P between them. The kernel's time beyond these products is the softmax's
// element-wise work (exp, max, sum, the bfloat16 rounding of P) and the tiles' bookkeeping.
double bf16_tile_products_gflops(std::int64_t d, const RepeatPolicy& policy) {
  using mha::bfloat16;
  namespace gemm = mha::detail;
  constexpr std::int64_t keys = 4096, block = kTileKeys;
  const std::int64_t rows = tile_rows();
  std::vector<bfloat16> q(rows * d, bfloat16(0.5f)), k(keys * d, bfloat16(0.25f)), v(keys * d, bfloat16(-0.5f));
  std::vector<bfloat16> p(rows * block, bfloat16(0.125f));
  std::vector<float> s(rows * block), acc(rows * d, 0.0f);
  mha::set_num_threads(1);  // the caller sets its thread count again
  const Timing t = measure(
      [&] {
        for (std::int64_t j0 = 0; j0 < keys; j0 += block) {
          gemm::gemm_tile(rows, block, d, gemm::plain(q.data(), d), gemm::transposed(&k[j0 * d], d),
                          gemm::overwrite(s.data(), block), 0.125f);
          gemm::gemm_tile(rows, d, block, gemm::plain(p.data(), block), gemm::plain(&v[j0 * d], d),
                          gemm::accumulate_into(acc.data(), d));
        }
      },
      policy);
  return 2.0 * (2.0 * rows * static_cast<double>(keys) * d) / t.min_s * 1e-9;
}

// The core's forward and backward times at [1, h, N, d] in `dtype`.
struct CoreTimes {
  Timing forward, backward;
};

CoreTimes time_core(DType dtype, std::int64_t N, std::int64_t d, const RepeatPolicy& policy) {
  const mha::Shape shape{1, kHeads, N, d};
  const Tensor q = Tensor::copy_of(random_tensor(shape, 1), dtype), k = Tensor::copy_of(random_tensor(shape, 2), dtype);
  const Tensor v = Tensor::copy_of(random_tensor(shape, 3), dtype),
               dout = Tensor::copy_of(random_tensor(shape, 4), dtype);
  mha::AttentionOptions o;
  o.need_lse = true;
  mha::AttentionResult r;
  CoreTimes t;
  t.forward = measure([&] { r = mha::scaled_dot_product_attention(q, k, v, o); }, policy);
  t.backward =
      measure([&] { (void)mha::scaled_dot_product_attention_backward(dout, q, k, v, r.out, r.lse, o); }, policy);
  return t;
}

// The layer's forward (eval) and training step in `dtype`: E 512, h 8, B 1, self-attention, as
// `mha bench` times it (LayerWorkload: need_weights off, as torch_mha.py calls PyTorch's).
CoreTimes time_layer(DType dtype, std::int64_t N, const RepeatPolicy& policy) {
  LayerWorkload forward(1, N, kDModel, kHeads, false, Pass::Forward, dtype);
  LayerWorkload step(1, N, kDModel, kHeads, false, Pass::ForwardBackward, dtype);
  return {measure([&] { forward.run(); }, policy), measure([&] { step.run(); }, policy)};
}

// PyTorch's layer in `dtype` ("float32" or "bfloat16"): its best time, and what its first call added to
// its process's peak resident set; zeros and a reason in `error` when it did not run.
struct TorchRun {
  double seconds = 0;
  double extra_mib = 0;
};

TorchRun torch_layer(const BenchOptions& options, std::int64_t N, int threads, Pass pass, const std::string& dtype,
                     const RepeatPolicy& policy, std::string& error) {
  if (const auto why = blas_unavailable("onednn")) {  // else PyTorch's float32 would run on netlib's BLAS, 40x slower
    error = *why;
    return {};
  }
  BenchResults unused;
  const TorchRunner runner{options, unused};
  std::vector<std::string> args = {
      "--n",       std::to_string(N),       "--pass",  pass_name(pass),       "--dtype", dtype,
      "--d-model", std::to_string(kDModel), "--heads", std::to_string(kHeads)};
  for (std::string& a : policy_args(policy)) args.push_back(std::move(a));
  const std::vector<nlohmann::json> lines = runner.run_lines(args, threads, "onednn", error);
  if (lines.empty()) return {};
  const nlohmann::json& r = lines.back();
  const double extra = r.value("peak_rss_first_bytes", 0.0) - r.value("baseline_rss_bytes", 0.0);
  return {r.value("min_s", 0.0), extra / (1 << 20)};
}

// What the first training step of our layer in `dtype` ("float32" or "bf16") adds to the peak resident
// set of a process of its own (`mha bench-one`), in MiB; 0 when it did not run.
double our_step_extra_mib(std::int64_t N, int threads, const std::string& dtype) {
  const RepeatPolicy one_call{0, 1, 1, 0.0, 0.0};
  const ProcessRun run = run_ours("mha", N, false, threads, Pass::ForwardBackward, one_call, 0.0, dtype);
  return run.ok() ? static_cast<double>(run.peak_rss_first_bytes - run.baseline_rss_bytes) / (1 << 20) : 0.0;
}

// A PyTorch time in ms, or "not run" (--no-torch, or its process failed: the error is printed below).
std::string torch_ms(double seconds) { return seconds > 0 ? fmt::format("{:.1f} ms", 1e3 * seconds) : "not run"; }
std::string torch_mib(double mib) { return mib > 0 ? fmt::format("{:.0f} MiB", mib) : "not run"; }

std::string percent(double part, double whole) { return whole > 0 ? fmt::format("{:.1f}%", 100 * part / whole) : "-"; }
std::string ratio(double slow_s, double fast_s) {
  return slow_s > 0 && fast_s > 0 ? fmt::format("{:.2f}x", slow_s / fast_s) : "-";
}

// The layer at N: forward and training step, ours in bf16 and float32, PyTorch in both; with
// `memory`, also the training step's extra memory of each, in processes of their own.
void bench_layer(const BenchOptions& options, std::int64_t N, int threads, bool memory, const RepeatPolicy& policy,
                 nlohmann::json& report) {
  const CoreTimes bf = time_layer(DType::BFloat16, N, policy), f32 = time_layer(DType::Float32, N, policy);
  std::string error;
  TorchRun torch[2][2];  // [dtype: bf16, float32][pass: fwd, fwdbwd]
  if (options.torch)
    for (int t = 0; t < 2; ++t)
      for (int p = 0; p < 2; ++p)
        torch[t][p] = torch_layer(options, N, threads, p ? Pass::ForwardBackward : Pass::Forward,
                                  t ? "float32" : "bfloat16", policy, error);
  fmt::print("  layer N {}: forward bf16 {:.1f} ms, float32 {:.1f} ms (bf16 {} as fast), PyTorch bf16 {} ({}), "
             "PyTorch float32 {} ({})\n",
             N, 1e3 * bf.forward.min_s, 1e3 * f32.forward.min_s, ratio(f32.forward.min_s, bf.forward.min_s),
             torch_ms(torch[0][0].seconds), ratio(torch[0][0].seconds, bf.forward.min_s), torch_ms(torch[1][0].seconds),
             ratio(torch[1][0].seconds, bf.forward.min_s));
  fmt::print("  layer N {}: training step bf16 {:.1f} ms, float32 {:.1f} ms ({}), PyTorch bf16 {} ({}), "
             "PyTorch float32 {} ({})\n",
             N, 1e3 * bf.backward.min_s, 1e3 * f32.backward.min_s, ratio(f32.backward.min_s, bf.backward.min_s),
             torch_ms(torch[0][1].seconds), ratio(torch[0][1].seconds, bf.backward.min_s),
             torch_ms(torch[1][1].seconds), ratio(torch[1][1].seconds, bf.backward.min_s));
  if (!error.empty()) fmt::print("  PyTorch: {}\n", error);
  nlohmann::json row = {{"what", "layer"},
                        {"threads", threads},
                        {"n", N},
                        {"bf16_forward_s", bf.forward.min_s},
                        {"bf16_step_s", bf.backward.min_s},
                        {"f32_forward_s", f32.forward.min_s},
                        {"f32_step_s", f32.backward.min_s},
                        {"torch_bf16_forward_s", torch[0][0].seconds},
                        {"torch_bf16_step_s", torch[0][1].seconds},
                        {"torch_f32_forward_s", torch[1][0].seconds},
                        {"torch_f32_step_s", torch[1][1].seconds}};
  if (memory) {
    const double ours_bf16 = our_step_extra_mib(N, threads, "bf16"),
                 ours_f32 = our_step_extra_mib(N, threads, "float32");
    fmt::print("  layer N {}: the training step's extra memory (peak resident set after its first call minus before "
               "it, own process): ours bf16 {:.0f} MiB, float32 {:.0f} MiB; PyTorch bf16 {}, float32 {}\n",
               N, ours_bf16, ours_f32, torch_mib(torch[0][1].extra_mib), torch_mib(torch[1][1].extra_mib));
    row["step_extra_mib"] = {{"ours_bf16", ours_bf16},
                             {"ours_f32", ours_f32},
                             {"torch_bf16", torch[0][1].extra_mib},
                             {"torch_f32", torch[1][1].extra_mib}};
  }
  report["runs"].push_back(row);
}

}  // namespace

int run_bench_bf16(const BenchOptions& options, const std::string& command) {
  const MachineInfo m = describe_machine();
  fmt::print(
      "mha bench --dtype bf16 ({})\nmachine: {}, {} CPUs, {}; oneDNN {} ({}); fused kernel: query blocks of {}\n",
      m.date, cpu_name(m), m.logical_cpus, m.simd, m.onednn_version, m.onednn_isa,
      mha::detail::query_block_description());
  const RepeatPolicy policy{1, 3, 20, 1.0, 6.0};
  const std::vector<std::int64_t> sizes = options.quick ? std::vector<std::int64_t>{1024} : options.sizes;
  nlohmann::json report = {{"command", command},
                           {"machine", cpu_name(m)},
                           {"onednn_isa", m.onednn_isa},
                           {"bf16_path", mha::detail::bf16_gemm_implementation()},
                           {"bf16_attention", mha::detail::fused_bf16_attention_kernel()},
                           {"query_block", mha::detail::query_block_description()},
                           {"date", m.date},
                           {"runs", nlohmann::json::array()}};
  for (const int threads : options.threads) {
    mha::set_num_threads(threads);
    const Roof roof32 = measure_roof(threads);
    const Bf16Roof roof = bf16_products_roof(measure_bf16_roof(policy), roof32);
    fmt::print("\n{} thread(s): bf16 roof {:.0f} GFLOP/s ({}), float32 roof {:.0f}; the library's bf16 products: {}; "
               "bf16 attention: {}\n",
               threads, roof.gflops, roof.implementation, roof32.gflops, mha::detail::bf16_gemm_implementation(),
               mha::detail::fused_bf16_attention_kernel());
    for (const std::int64_t N : sizes) {
      for (const std::int64_t d : {64, 128}) {
        const double flops = attention_forward_flops(1, kHeads, N, d, false);
        const CoreTimes bf = time_core(DType::BFloat16, N, d, policy), f32 = time_core(DType::Float32, N, d, policy);
        const double fwd = flops / bf.forward.min_s * 1e-9,
                     bwd = kBackwardFlopsRatio * flops / bf.backward.min_s * 1e-9;
        const double tiles = threads == 1 ? bf16_tile_products_gflops(d, policy) : 0.0;
        mha::set_num_threads(threads);
        fmt::print("  core N {} d {}: bf16 forward {:.0f} GFLOP/s ({} of the bf16 roof), backward {:.0f} ({}); "
                   "float32 forward {:.0f}, backward {:.0f}; bf16 vs float32 {} / {}\n",
                   N, d, fwd, percent(fwd, roof.gflops), bwd, percent(bwd, roof.gflops),
                   flops / f32.forward.min_s * 1e-9, kBackwardFlopsRatio * flops / f32.backward.min_s * 1e-9,
                   ratio(f32.forward.min_s, bf.forward.min_s), ratio(f32.backward.min_s, bf.backward.min_s));
        if (tiles > 0)
          fmt::print("    its two products alone (one thread, no softmax): {:.0f} GFLOP/s, so the softmax's "
                     "element-wise work and the tiles' bookkeeping take {:.0f}% of the forward's time\n",
                     tiles, 100.0 * (1.0 - fwd / tiles));
        report["runs"].push_back({{"what", "core"},
                                  {"tile_products_gflops", tiles},
                                  {"threads", threads},
                                  {"n", N},
                                  {"d", d},
                                  {"bf16_roof_gflops", roof.gflops},
                                  {"bf16_forward_s", bf.forward.min_s},
                                  {"bf16_backward_s", bf.backward.min_s},
                                  {"f32_forward_s", f32.forward.min_s},
                                  {"f32_backward_s", f32.backward.min_s},
                                  {"forward_flops", flops}});
      }
      bench_layer(options, N, threads, threads == options.threads.back(), policy, report);
    }
  }
  report["peak_rss_bytes"] = peak_rss_bytes();
  fmt::print("\npeak resident set of this process: {:.0f} MiB (the largest run's working set plus the roof's "
             "matrices; PyTorch runs in processes of its own)\n",
             static_cast<double>(peak_rss_bytes()) / (1 << 20));
  std::filesystem::create_directories(options.out_dir);
  const std::filesystem::path path = std::filesystem::path(options.out_dir) / "bench-bf16.json";
  std::ofstream(path) << report.dump(2) << "\n";
  fmt::print("wrote {}\n", path.string());
  return 0;
}

}  // namespace mha_cli::bench
