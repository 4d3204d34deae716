// The choice of the bfloat16 product path from what was measured and requested (bf16_path.hpp).
#include "bf16_path.hpp"

#include <algorithm>
#include <cctype>
#include <cstdio>

namespace mha::detail {

namespace {

std::string lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return std::tolower(c); });
  return text;
}

std::string gflops(double rate) {
  char text[32];
  std::snprintf(text, sizeof text, "%.0f", rate);
  return text;
}

std::string onednn_name(const Bf16PathFacts& facts) { return "oneDNN matmul " + facts.onednn_implementation; }

constexpr const char* kSgemmName = "sgemm over widened operands";

// "MHA_BF16_GEMM=value".
std::string setting(const Bf16PathFacts& facts) { return std::string(kBf16PathVariable) + "=" + *facts.request; }

// The choice between the two measured paths, for a native oneDNN bf16 matmul.
Bf16PathChoice choose_by_rates(const Bf16PathFacts& facts) {
  if (!facts.rates)
    return {Bf16Path::WidenedSgemm,
            std::string(kSgemmName) + " (" + onednn_name(facts) + " failed when it was measured at first use)"};
  const double onednn = facts.rates->onednn_gflops, sgemm = facts.rates->sgemm_gflops;
  if (sgemm > kSgemmMustBeFasterBy * onednn)
    return {Bf16Path::WidenedSgemm, std::string(kSgemmName) + " (chosen: " + gflops(sgemm) + " vs " +
                                        onednn_name(facts) + "'s " + gflops(onednn) +
                                        " GFLOP/s, measured at first use)"};
  const std::string close =
      onednn < sgemm ? ", sgemm not " + gflops(100 * (kSgemmMustBeFasterBy - 1)) + "% faster" : "";
  return {Bf16Path::OneDnnMatmul, onednn_name(facts) + " (chosen: " + gflops(onednn) + " vs sgemm's " + gflops(sgemm) +
                                      " GFLOP/s, measured at first use" + close + ")"};
}

}  // namespace

Bf16PathRequest parse_bf16_path_request(const std::optional<std::string>& value) {
  if (!value || value->empty()) return Bf16PathRequest::Auto;
  const std::string name = lower(*value);
  if (name == "auto") return Bf16PathRequest::Auto;
  if (name == "onednn") return Bf16PathRequest::OneDnnMatmul;
  if (name == "sgemm") return Bf16PathRequest::WidenedSgemm;
  return Bf16PathRequest::Invalid;
}

bool bf16_path_needs_rates(bool onednn_native, const std::optional<std::string>& request) {
  const Bf16PathRequest r = parse_bf16_path_request(request);
  return onednn_native && (r == Bf16PathRequest::Auto || r == Bf16PathRequest::Invalid);
}

Bf16PathChoice choose_bf16_path(const Bf16PathFacts& facts) {
  const Bf16PathRequest request = parse_bf16_path_request(facts.request);
  if (request == Bf16PathRequest::WidenedSgemm)
    return {Bf16Path::WidenedSgemm, std::string(kSgemmName) + " (forced by " + setting(facts) + ")"};
  if (!facts.onednn_native) {
    const std::string why = request == Bf16PathRequest::OneDnnMatmul
                                ? setting(facts) + ", but oneDNN has no bf16 matmul on this CPU's own instructions"
                                : "no bf16 instructions";
    return {Bf16Path::WidenedSgemm,
            std::string(kSgemmName) + " (" + why + "; oneDNN's bf16 matmul here: " + facts.onednn_implementation + ")"};
  }
  if (request == Bf16PathRequest::OneDnnMatmul)
    return {Bf16Path::OneDnnMatmul, onednn_name(facts) + " (forced by " + setting(facts) + ")"};
  Bf16PathChoice choice = choose_by_rates(facts);
  if (request == Bf16PathRequest::Invalid)  // said inside the parentheses
    choice.description.insert(choice.description.size() - 1,
                              "; " + setting(facts) + " ignored: not onednn, sgemm or auto");
  return choice;
}

}  // namespace mha::detail
