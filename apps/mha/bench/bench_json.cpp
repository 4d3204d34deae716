// bench.json: every figure of a run, the machine and the versions. Times in seconds, memory in bytes,
// rates in GFLOP/s (from the best call, min_s), fractions of the roof in [0, 1].
#include <nlohmann/json.hpp>

#include "attention/query_block.hpp"
#include "bench/bench_results.hpp"

namespace mha_cli::bench {
namespace {

using nlohmann::json;

template <class T>
json optional_json(const std::optional<T>& value) {
  return value ? json(*value) : json(nullptr);
}

}  // namespace

// nlohmann::json finds these through argument-dependent lookup.
void to_json(json& j, const Timing& t) { j = {{"min_s", t.min_s}, {"median_s", t.median_s}, {"reps", t.reps}}; }

void to_json(json& j, const Roof& r) {
  j = {{"threads", r.threads},
       {"gflops", r.gflops},
       {"timing", r.timing},
       {"spread", r.spread},
       {"sgemm_size", kRoofSize}};
}

void to_json(json& j, const TileRate& t) {
  j = {{"gflops", t.gflops},
       {"timing", t.timing},
       {"shapes", "one thread: S[64,128] = Q[64,64] K^T, acc[64,64] += S V[128,64], over 4096 keys"}};
}

void to_json(json& j, const KernelRate& k) {
  j = {{"timing", k.timing}, {"gflop", k.gflop}, {"gflops", k.gflops}, {"roof_fraction", k.roof_fraction}};
}

void to_json(json& j, const CoreResult& c) {
  j = {{"threads", c.threads},
       {"n", c.n},
       {"heads", c.heads},
       {"d", c.d},
       {"causal", c.causal},
       {"roof", c.roof},
       {"tile_sgemm_1thread", c.tile},
       {"forward", c.forward},
       {"backward", c.backward}};
}

void to_json(json& j, const ProcessRun& p) {
  j = {{"status", p.status}};
  if (!p.ok()) return;
  j.update({{"timing", p.timing},
            {"gflops", p.gflops},
            {"baseline_rss_bytes", p.baseline_rss_bytes},
            {"peak_rss_first_bytes", p.peak_rss_first_bytes},
            {"peak_rss_bytes", p.peak_rss_bytes}});
  if (!p.blas_library.empty()) j["blas_library"] = p.blas_library;
}

void to_json(json& j, const LayerResult& l) {
  j = {{"threads", l.threads},
       {"n", l.n},
       {"causal", l.causal},
       {"pass", l.pass},
       {"gflop", l.gflop},
       {"roof", l.roof},
       {"mha", l.mha},
       {"torch", l.torch},
       {"speedup", optional_json(l.speedup)},
       {"memory_ratio", optional_json(l.memory_ratio)}};
}

void to_json(json& j, const ScalingResult& s) {
  j = {{"n", s.n},
       {"heads", 1},
       {"d", s.d},
       {"threads", s.threads},
       {"roofs", s.roofs},
       {"forward", s.forward},
       {"backward", s.backward},
       {"forward_speedup", s.forward_speedup},
       {"backward_speedup", s.backward_speedup},
       {"roof_speedup", s.roof_speedup}};
}

void to_json(json& j, const LayoutResult& l) {
  j = {{"threads", l.threads},
       {"n", l.n},
       {"roof", l.roof},
       {"contiguous", {{"forward", l.contiguous_forward}, {"backward", l.contiguous_backward}}},
       {"interleaved", {{"forward", l.interleaved_forward}, {"backward", l.interleaved_backward}}}};
}

void to_json(json& j, const CausalResult& c) {
  j = {{"threads", c.threads},
       {"n", c.n},
       {"forward_speedup", c.forward_speedup},
       {"backward_speedup", c.backward_speedup}};
}

void to_json(json& j, const BigResult& b) {
  j = {{"impl", b.impl},
       {"pass", b.pass},
       {"n", b.n},
       {"causal", b.causal},
       {"threads", b.threads},
       {"roof", b.roof},
       {"run", b.run},
       {"attention_gflop", b.attention_gflop},
       {"attention_gflops", b.attention_gflops},
       {"roof_fraction", b.roof_fraction}};
}

void to_json(json& j, const BlasPeer& p) {
  j = {{"blas", p.blas}, {"label", p.label}, {"status", p.status}, {"layer", p.layer}};
}

void to_json(json& j, const RepeatPolicy& p) {
  j = {{"warmup", p.warmup},
       {"min_reps", p.min_reps},
       {"max_reps", p.max_reps},
       {"min_time_s", p.min_time_s},
       {"max_time_s", p.max_time_s}};
}

void to_json(json& j, const GridTime& t) {
  j = {{"status", t.status}};
  if (t.ok()) j["timing"] = t.timing;
}

void to_json(json& j, const GridRow& r) {
  j = {{"batch", r.batch},
       {"n", r.n},
       {"d_model", r.d_model},
       {"heads", r.heads},
       {"threads", r.threads},
       {"mha", {{"forward", r.mha_forward}, {"train", r.mha_train}}},
       {"torch", {{"forward", r.torch_forward}, {"train", r.torch_train}}},
       {"forward_speedup", optional_json(r.forward_speedup)},
       {"train_speedup", optional_json(r.train_speedup)}};
}

void to_json(json& j, const TargetResult& t) {
  j = {{"name", t.name}, {"measured", t.measured}, {"met", optional_json(t.met)}, {"margin", t.margin}};
}

void to_json(json& j, const MachineInfo& m) {
  j = {{"cpu_model", m.cpu_model},
       {"cpu_family_model", m.cpu_family_model},
       {"cpu_mhz", m.cpu_mhz},
       {"measured_ghz", m.measured_ghz},
       {"logical_cpus", m.logical_cpus},
       {"simd", m.simd},
       {"virtual_machine", m.virtual_machine},
       {"memory_bytes", m.memory_bytes},
       {"kernel", m.kernel}};
}

json to_json(const BenchResults& r) {
  return {
      {"date", r.machine.date},
      {"command", r.command},
      {"machine", r.machine},
      {"load_average", {{"start", r.load_start}, {"end", r.load_end}}},
      {"versions",
       {{"mha", r.machine.mha_version},
        {"source_revision", r.source_revision},
        {"onednn", r.machine.onednn_version},
        {"onednn_isa", r.machine.onednn_isa},
        {"compiler", r.machine.compiler},
        {"torch", r.torch_version},
        {"python", r.python_version},
        {"torch_blas", r.torch_blas}}},
      {"query_block", mha::detail::query_block_description()},
      {"flop_counts",
       "attention forward 4*B*h*L*S*d, backward 2.5x that, causal half; projections 2*B*N*E*(4*E) forward, "
       "3x that forward+backward"},
      {"roofs", r.roofs},
      {"core", r.core},
      {"layer", r.layer},
      {"torch_blas_peers", r.torch_blas_peers},
      {"scaling", optional_json(r.scaling)},
      {"layout", r.layout},
      {"causal", r.causal},
      {"big", r.big},
      {"grid",
       {{"status", r.grid_status.empty() ? "not run" : r.grid_status},
        {"shapes", "self-attention, batch_first, float32, h = E / 64 unless given; each implementation's grid in one "
                   "process per thread count; forward: eval mode; train: forward + backward in train mode; "
                   "speedups: torch time / mha time (best calls)"},
        {"policy", r.grid_status == "ok" ? json(r.grid_policy) : json(nullptr)},
        {"rows", r.grid}}},
      {"targets", r.targets},
  };
}

}  // namespace mha_cli::bench
