// Writes an attention map as an SVG: the same picture as the PNG, with real (selectable) text and a
// tooltip giving each cell's exact weight.
#pragma once

#include <filesystem>

#include "render/attention_map.hpp"

namespace mha_cli {

// Throws std::runtime_error when the file cannot be written.
void write_attention_map_svg(const std::filesystem::path& path, const AttentionMap& map);

}  // namespace mha_cli
