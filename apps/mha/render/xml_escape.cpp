// xml_escape (xml_escape.hpp).
#include "render/xml_escape.hpp"

#include <string>

namespace mha_cli {

// &, <, > and " as XML (and HTML) entities.
std::string xml_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      default: out += c;
    }
  }
  return out;
}

}  // namespace mha_cli
