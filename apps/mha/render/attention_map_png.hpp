// Writes an attention map as a PNG heat map: one square cell per weight, white (0) to dark blue (1),
// the title above, the key tokens along the top, the query tokens down the left, a colour bar below.
#pragma once

#include <filesystem>

#include "render/attention_map.hpp"

namespace mha_cli {

// Throws std::runtime_error when the file cannot be written.
void write_attention_map_png(const std::filesystem::path& path, const AttentionMap& map);

}  // namespace mha_cli
