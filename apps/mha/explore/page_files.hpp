// The page of `mha explore` (page/index.html, page/explore.js, page/explore.css), compiled into the
// binary: CMake turns the files into page_files.cpp at build time (embed_page.cmake), so the server
// needs no files and no network at run time.
#pragma once

#include <span>
#include <string_view>

namespace mha_cli::explore {

struct PageFile {
  std::string_view path;          // "/", "/explore.js", "/explore.css"
  std::string_view content_type;  // "text/html", "text/javascript", "text/css" (all UTF-8)
  std::string_view body;
};

std::span<const PageFile> page_files();

}  // namespace mha_cli::explore
