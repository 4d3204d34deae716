// Text made safe for the SVG and HTML the command writes.
#pragma once

#include <string>

namespace mha_cli {

// text with &, <, > and " written as entities: safe inside XML and HTML text and attributes.
std::string xml_escape(const std::string& text);

}  // namespace mha_cli
