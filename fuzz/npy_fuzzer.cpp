// libFuzzer target: mha::parse_npy on arbitrary bytes (see fuzz/run.sh).
//
// Every input must be either refused with mha::Error or accepted; an accepted array must hold no
// more data than the input (times 2: '<f2' widens to float32) and must survive serialize -> parse
// unchanged. Anything else (a crash, a sanitizer report, a leak, an allocation over
// -malloc_limit_mb, another exception) is a finding.
#include <cstddef>
#include <cstdint>
#include <span>

#include "fuzz_common.hpp"
#include "mha/error.hpp"
#include "mha/io.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  mha::Tensor tensor;
  try {
    tensor = mha::parse_npy(bytes, "fuzz");
  } catch (const mha::Error&) {
    return 0;
  }
  if (tensor.nbytes() > 2 * size) mha_fuzz::violated("more data than the input holds");
  const mha::Tensor again = mha::parse_npy(mha::serialize_npy(tensor), "fuzz round trip");
  if (!mha_fuzz::same(again, tensor)) mha_fuzz::violated("round trip changed the array");
  return 0;
}
