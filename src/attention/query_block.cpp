// The fused kernels' query block height (query_block.hpp): the L2 read once, through sysconf.
#include "attention/query_block.hpp"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>

#include "attention/flash_config.hpp"

namespace mha::detail {

std::int64_t choose_query_block_rows(std::int64_t l2_bytes, const std::optional<std::string>& request) {
  if (request == "128") return flash::kBlockQShort;
  if (request == "256") return flash::kBlockQTall;
  return l2_bytes >= kTallBlockMinL2Bytes ? flash::kBlockQTall : flash::kBlockQShort;
}

namespace {

// A core's L2 in bytes as the C library reads it (CPUID on x86), 0 where it cannot.
std::int64_t l2_bytes_per_core() {
#ifdef _SC_LEVEL2_CACHE_SIZE
  const long bytes = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return bytes > 0 ? bytes : 0;
#else
  return 0;
#endif
}

struct QueryBlockChoice {
  std::int64_t rows;
  std::string description;
};

const QueryBlockChoice& query_block_choice() {
  static const QueryBlockChoice choice = [] {
    const char* value = std::getenv(kQueryBlockVariable);
    const std::optional<std::string> request = value && *value ? std::optional<std::string>(value) : std::nullopt;
    const bool forced = request == "128" || request == "256";
    if (request && !forced)
      std::fprintf(stderr, "mha: %s=\"%s\" is not 128 or 256: ignored (chosen by the L2's size)\n", kQueryBlockVariable,
                   request->c_str());
    const std::int64_t l2 = l2_bytes_per_core(), rows = choose_query_block_rows(l2, request);
    const std::string why = forced   ? std::string("forced by ") + kQueryBlockVariable + "=" + *request
                            : l2 > 0 ? "chosen for a " + std::to_string(l2 >> 10) + " KiB L2 per core"
                                     : std::string("chosen for an L2 of unknown size");
    return QueryBlockChoice{rows, std::to_string(rows) + " query rows (" + why + ")"};
  }();
  return choice;
}

}  // namespace

std::int64_t query_block_rows() { return query_block_choice().rows; }

std::string query_block_description() { return query_block_choice().description; }

}  // namespace mha::detail
