// The demo's learning curve as an SVG: training loss (left axis) and held-out exact-match accuracy
// (right axis, 0-100%) against the training step.
#pragma once

#include <filesystem>
#include <vector>

#include "transformer/training.hpp"  // transformer::CurvePoint

namespace mha_cli {

// Throws std::runtime_error when the file cannot be written.
void write_learning_curve_svg(const std::filesystem::path& path, const std::vector<transformer::CurvePoint>& curve,
                              const std::string& title);

}  // namespace mha_cli
