// A static HTML page listing images with captions.
#include "render/image_index.hpp"

#include <fstream>
#include <stdexcept>

#include <fmt/core.h>

#include "render/xml_escape.hpp"

namespace mha_cli {

void write_image_index(const std::filesystem::path& path, const std::string& title,
                       const std::vector<std::string>& intro, const std::vector<IndexEntry>& entries) {
  std::string html = fmt::format("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{0}</title>\n"
                                 "<style>body{{font-family:sans-serif;max-width:70em;margin:2em auto;padding:0 1em}}"
                                 "figure{{display:inline-block;vertical-align:top;margin:1em}}"
                                 "figcaption{{max-width:36em}}img{{image-rendering:pixelated}}</style></head>\n"
                                 "<body>\n<h1>{0}</h1>\n",
                                 xml_escape(title));
  for (const std::string& paragraph : intro) html += fmt::format("<p>{}</p>\n", xml_escape(paragraph));
  for (const IndexEntry& entry : entries) {
    html += fmt::format("<figure><img src=\"{0}\" alt=\"{0}\"><figcaption>{1}</figcaption></figure>\n",
                        xml_escape(entry.file), xml_escape(entry.caption));
  }
  html += "</body></html>\n";

  std::ofstream file(path, std::ios::binary);
  file << html;
  if (!file.flush()) throw std::runtime_error("cannot write " + path.string());
}

}  // namespace mha_cli
