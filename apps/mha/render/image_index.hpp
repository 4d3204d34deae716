// A static HTML page that shows a set of images with captions (the demo's index.html).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace mha_cli {

struct IndexEntry {
  std::string file;     // relative to the page, e.g. "head0_previous_token.png"
  std::string caption;  // plain text
};

// Writes `path`: a title, the `intro` paragraphs (plain text), then each image with its caption.
// Throws std::runtime_error when the file cannot be written.
void write_image_index(const std::filesystem::path& path, const std::string& title,
                       const std::vector<std::string>& intro, const std::vector<IndexEntry>& entries);

}  // namespace mha_cli
