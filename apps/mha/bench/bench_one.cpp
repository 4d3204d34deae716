// `mha bench-one`: one shape's forward (or forward + backward), timed, with this process's peak RSS.
//
// Legend: B batch, h heads, N = L = S, E = d_model.
#include "bench/bench_one.hpp"

#include <functional>
#include <memory>
#include <stdexcept>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "bench/bench_workloads.hpp"
#include "mha/attention.hpp"

namespace mha_cli {

int run_bench_one(const BenchOneOptions& o) {
  using namespace bench;
  const Pass pass = parse_pass(o.pass);
  mha::set_num_threads(o.threads);
  if (o.d_model % o.heads != 0) throw std::invalid_argument("d_model must be a multiple of heads");

  // Built before the baseline is read: the inputs (and for the layer, the parameters) are not the
  // call's memory.
  std::function<void()> call;
  std::unique_ptr<CoreWorkload> core;
  std::unique_ptr<LayerWorkload> layer;
  if (o.impl == "core") {
    if (o.dtype != "float32")  // the bf16 core is measured by `mha bench --dtype bf16` (bench_bf16.cpp)
      throw std::invalid_argument("--dtype " + o.dtype + ": --impl core runs float32 only; bf16 runs with --impl mha");
    core = std::make_unique<CoreWorkload>(o.batch, o.heads, o.n, o.d_model / o.heads, o.causal,
                                          pass == Pass::ForwardBackward);  // q, k, v [B, h, N, d]
    call = [&] {
      core->forward();
      if (pass == Pass::ForwardBackward) core->backward();
    };
  } else if (o.impl == "mha") {
    const mha::DType dtype = o.dtype == "bf16" ? mha::DType::BFloat16 : mha::DType::Float32;
    layer = std::make_unique<LayerWorkload>(o.batch, o.n, o.d_model, o.heads, o.causal, pass, dtype);  // x [B, N, E]
    call = [&] { layer->run(); };
  } else {
    throw std::invalid_argument("impl: expected mha or core, got " + o.impl);
  }

  const std::int64_t baseline = peak_rss_bytes();
  std::int64_t peak_first = 0;  // the peak after exactly one call
  const Timing timing = measure(
      [&] {
        call();
        if (peak_first == 0) peak_first = peak_rss_bytes();
      },
      o.policy);

  const nlohmann::json out = {
      {"impl", o.impl},
      {"n", o.n},
      {"causal", o.causal},
      {"threads", mha::num_threads()},
      {"pass", o.pass},
      {"dtype", o.dtype},
      {"median_s", timing.median_s},
      {"min_s", timing.min_s},
      {"reps", timing.reps},
      {"baseline_rss_bytes", baseline},
      {"peak_rss_first_bytes", peak_first},
      {"peak_rss_bytes", peak_rss_bytes()},
  };
  fmt::print("{}\n", out.dump());
  return 0;
}

}  // namespace mha_cli
