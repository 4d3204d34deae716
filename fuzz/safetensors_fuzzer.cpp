// libFuzzer target: mha::parse_safetensors on arbitrary bytes (see fuzz/run.sh).
//
// Every input must be either refused with mha::Error or accepted; an accepted file must hold no more
// tensor data than the input (times 2: F16 / BF16 widen to float32), must parse again with float64
// as the compute dtype, and must survive serialize -> parse unchanged. Anything else (a crash, a
// sanitizer report, a leak, an allocation over -malloc_limit_mb, another exception) is a finding.
#include <cstddef>
#include <cstdint>
#include <span>

#include "fuzz_common.hpp"
#include "mha/error.hpp"
#include "mha/io.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  mha::SafetensorsFile file;
  try {
    file = mha::parse_safetensors(bytes, "fuzz");
  } catch (const mha::Error&) {
    try {
      mha::parse_safetensors(bytes, "fuzz", mha::DType::Float64);
    } catch (const mha::Error&) {
      return 0;
    }
    mha_fuzz::violated("refused with the natural dtypes, accepted as float64");
  }

  std::size_t total = 0;
  std::map<std::string, mha::TensorView> views;
  for (const auto& [name, tensor] : file.tensors) {
    total += tensor.nbytes();
    views.emplace(name, tensor.view());
  }
  if (total > 2 * size) mha_fuzz::violated("more tensor data than the input holds");

  const auto as_f64 = mha::parse_safetensors(bytes, "fuzz", mha::DType::Float64);
  if (as_f64.tensors.size() != file.tensors.size()) mha_fuzz::violated("float64 parse differs");

  const std::vector<std::byte> again_bytes = mha::serialize_safetensors(views, file.metadata);
  const auto again = mha::parse_safetensors(again_bytes, "fuzz round trip");
  if (again.metadata != file.metadata || again.tensors.size() != file.tensors.size())
    mha_fuzz::violated("round trip changed the metadata or the tensor names");
  for (const auto& [name, tensor] : file.tensors) {
    const auto it = again.tensors.find(name);
    if (it == again.tensors.end() || !mha_fuzz::same(it->second, tensor))
      mha_fuzz::violated("round trip changed a tensor");
  }
  return 0;
}
