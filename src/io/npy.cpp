// NumPy .npy: reading (preamble, a hand-written parser for the header's dict literal, checked data)
// and writing. Format: numpy/lib/format.py (see include/mha/io.hpp).
//
// The header is a Python literal, which NumPy reads with ast.literal_eval. No library here parses
// Python literals, and evaluating one is out of the question, so a small recursive-descent parser
// accepts the one shape of dict NumPy writes: {'descr': str, 'fortran_order': bool, 'shape': tuple}.
#include <cstring>
#include <limits>
#include <string_view>

#include "io/binary_file.hpp"
#include "io/little_endian.hpp"
#include "io/tensor_bytes.hpp"
#include "mha/error.hpp"
#include "mha/io.hpp"

namespace mha {

namespace {

using io::fail;
using io::printable;
using io::StoredType;

constexpr char kMagic[] = "\x93NUMPY";
constexpr std::size_t kMagicBytes = 6;
constexpr std::size_t kVersionEnd = kMagicBytes + 2;  // magic, major, minor
constexpr std::uint64_t kMaxHeaderBytes = 1 << 20;    // headers we accept are < 1 KiB; padding aside
constexpr std::size_t kArrayAlign = 64;               // NumPy's ARRAY_ALIGN: data starts 64-aligned

struct Header {
  StoredType type = StoredType::F32;
  bool fortran_order = false;
  Shape shape;
};

// Parses the header dict; every error message starts with "header: ".
class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& file) : text_(text), file_(file) {}

  Header parse() {
    Header h;
    bool has_descr = false, has_order = false, has_shape = false;
    expect('{', "the header must be a dict literal starting with '{'");
    while (true) {
      skip_space();
      if (peek() == '}') break;
      const std::string key = string_literal("a dict key (a quoted string)");
      skip_space();
      expect(':', "expected ':' after the key " + printable(key));
      skip_space();
      bool* seen = key == "descr"           ? &has_descr
                   : key == "fortran_order" ? &has_order
                   : key == "shape"         ? &has_shape
                                            : nullptr;
      if (!seen) error("unknown key " + printable(key) + " (expected descr, fortran_order, shape)");
      if (*seen) error("duplicate key " + printable(key));
      *seen = true;
      if (key == "descr") h.type = descr();
      else if (key == "fortran_order") h.fortran_order = boolean();
      else h.shape = shape();
      skip_space();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      skip_space();
      if (peek() != '}') error("expected ',' or '}' after the value of " + printable(key) + ", got " + got());
    }
    ++pos_;  // '}'
    skip_space();
    if (pos_ != text_.size()) error("unexpected " + got() + " after the dict (only spaces and a newline may follow)");
    for (auto [present, key] :
         {std::pair{has_descr, "descr"}, std::pair{has_order, "fortran_order"}, std::pair{has_shape, "shape"}})
      if (!present) error("missing key '" + std::string(key) + "'");
    return h;
  }

 private:
  [[noreturn]] void error(const std::string& problem) const { fail(file_, "header: " + problem); }

  char peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  bool at_end() const { return pos_ >= text_.size(); }
  std::string got() const {
    return at_end() ? std::string("the end of the header")
                    : printable(text_.substr(pos_, 1)) + " at byte " + std::to_string(pos_);
  }
  void skip_space() {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r')) ++pos_;
  }
  void expect(char c, const std::string& problem) {
    if (peek() != c || at_end()) error(problem + ", got " + got());
    ++pos_;
  }

  // 'text' or "text": printable ASCII, no escapes (nothing NumPy writes needs them).
  std::string string_literal(const std::string& what) {
    const char quote = peek();
    if (at_end() || (quote != '\'' && quote != '"')) error("expected " + what + ", got " + got());
    const std::size_t start = ++pos_;
    while (!at_end() && peek() != quote) {
      const auto c = static_cast<unsigned char>(peek());
      if (c == '\\') error("escape sequences in strings are not supported");
      if (c == '\n') error("unterminated string");
      if (c < 0x20 || c >= 0x7f) error("unexpected " + got() + " inside a string");
      ++pos_;
    }
    if (at_end()) error("unterminated string");
    return std::string(text_.substr(start, pos_++ - start));
  }

  StoredType descr() {
    if (peek() == '[') error("structured dtypes (a descr list) are not supported");
    const std::string d = string_literal("descr as a quoted string");
    if (d == "<f8") return StoredType::F64;
    if (d == "<f4") return StoredType::F32;
    if (d == "<f2") return StoredType::F16;
    if (d == "|b1") return StoredType::Bool;
    if (!d.empty() && d[0] == '>') error("descr " + printable(d) + " is big-endian, which is not supported");
    error("unsupported descr " + printable(d) + " (supported: '<f8', '<f4', '<f2', '|b1')");
  }

  bool boolean() {
    for (auto [word, value] : {std::pair{std::string_view("True"), true}, std::pair{std::string_view("False"), false}})
      if (text_.substr(pos_, word.size()) == word) {
        pos_ += word.size();
        return value;
      }
    error("fortran_order must be True or False, got " + got());
  }

  // A non-negative integer; a Python 2 'L' suffix is allowed, as NumPy's own reader allows it.
  std::int64_t integer() {
    if (peek() == '-') error("shape has a negative size");
    if (peek() < '0' || peek() > '9') error("shape entries must be integers, got " + got());
    if (peek() == '0' && pos_ + 1 < text_.size() && text_[pos_ + 1] >= '0' && text_[pos_ + 1] <= '9')
      error("shape entries must be integers without leading zeros");
    std::int64_t v = 0;
    while (peek() >= '0' && peek() <= '9' && !at_end()) {
      const int digit = peek() - '0';
      if (v > (std::numeric_limits<std::int64_t>::max() - digit) / 10) error("shape size does not fit 64 bits");
      v = v * 10 + digit;
      ++pos_;
    }
    if (peek() == 'L' || peek() == 'l') ++pos_;
    if (peek() == '.' || peek() == 'e' || peek() == 'E' || peek() == '_' || peek() == 'j')
      error("shape entries must be integers, got " + got());
    return v;
  }

  // (), (n,), (n, m), (n, m, ) ...; a one-element tuple needs its comma, as in Python.
  Shape shape() {
    if (peek() != '(') error("shape must be a tuple, got " + got());
    ++pos_;
    Shape s;
    bool trailing_comma = false;
    while (true) {
      skip_space();
      if (peek() == ')' && !at_end()) break;
      s.push_back(integer());
      skip_space();
      trailing_comma = peek() == ',' && !at_end();
      if (trailing_comma) {
        ++pos_;
        continue;
      }
      if (peek() != ')' || at_end()) error("expected ',' or ')' in shape, got " + got());
    }
    ++pos_;
    if (s.size() == 1 && !trailing_comma) error("shape must be a tuple, got a parenthesised integer");
    return s;
  }

  std::string_view text_;
  const std::string& file_;
  std::size_t pos_ = 0;
};

const char* descr_of(StoredType type) {
  switch (type) {
    case StoredType::F64: return "<f8";
    case StoredType::F32: return "<f4";
    case StoredType::F16: return "<f2";
    case StoredType::Bool: return "|b1";
    case StoredType::BF16: break;
  }
  return "?";
}

Tensor read_from(const io::ByteSource& source) {
  const std::string& file = source.name();
  std::byte preamble[kVersionEnd + 4] = {};
  source.read(0, preamble, std::min<std::uint64_t>(source.size(), sizeof preamble));
  if (source.size() < kMagicBytes || std::memcmp(preamble, kMagic, kMagicBytes) != 0) {
    const std::string kind = io::apparent_kind(source);
    fail(file, "not a .npy file: it does not start with the magic string \\x93NUMPY" +
                   (kind.empty() ? std::string() : "; it appears to be " + kind));
  }
  if (source.size() < kVersionEnd) fail(file, "truncated: the file ends inside the format version");
  const auto major = static_cast<unsigned>(preamble[6]), minor = static_cast<unsigned>(preamble[7]);
  if (!((major == 1 || major == 2 || major == 3) && minor == 0))
    fail(file, "unsupported .npy format version " + std::to_string(major) + "." + std::to_string(minor) +
                   " (supported: 1.0, 2.0, 3.0)");
  const std::size_t length_bytes = major == 1 ? 2 : 4;
  const std::uint64_t header_start = kVersionEnd + length_bytes;
  if (source.size() < header_start) fail(file, "truncated: the file ends inside the header length");
  const std::uint64_t header_length = major == 1 ? io::load_le<std::uint16_t>(preamble + kVersionEnd)
                                                 : io::load_le<std::uint32_t>(preamble + kVersionEnd);
  if (header_length > kMaxHeaderBytes)
    fail(file, "header length " + std::to_string(header_length) + " exceeds the limit of " +
                   std::to_string(kMaxHeaderBytes) + " bytes");
  if (header_length > source.size() - header_start)
    fail(file, "header length " + std::to_string(header_length) + " runs past the end of the file (" +
                   std::to_string(source.size()) + " bytes)");
  std::string text(header_length, '\0');
  source.read(header_start, text.data(), text.size());
  const Header h = HeaderParser(text, file).parse();

  const std::uint64_t data_start = header_start + header_length;
  const std::uint64_t data_bytes = source.size() - data_start;
  const auto needed = io::checked_byte_size(h.shape, io::stored_size(h.type));
  if (!needed) fail(file, "shape " + shape_str(h.shape) + " is too large: its byte size overflows 64 bits");
  if (data_bytes != *needed)
    fail(file, "the data is " + std::to_string(data_bytes) + " bytes, but shape " + shape_str(h.shape) + " of " +
                   descr_of(h.type) + " needs " + std::to_string(*needed) +
                   (data_bytes < *needed ? " (is the file truncated?)" : ""));

  Tensor t = io::read_elements(source, data_start, h.type, h.shape, io::natural_dtype(h.type));
  if (!h.fortran_order || h.shape.size() < 2) return t;
  // Fortran order: the first index varies fastest. View the elements with those strides and copy
  // them into C order.
  Shape strides(h.shape.size());
  std::int64_t stride = 1;
  for (std::size_t i = 0; i < h.shape.size(); ++i) {
    strides[i] = stride;
    stride *= h.shape[i];
  }
  return Tensor::copy_of(TensorView(t.data(), t.dtype(), h.shape, strides));
}

std::string header_text(const TensorView& view) {
  std::string shape = "(";
  for (std::size_t i = 0; i < view.shape().size(); ++i) shape += (i ? ", " : "") + std::to_string(view.shape()[i]);
  shape += view.shape().size() == 1 ? ",)" : ")";
  const char* descr = view.dtype() == DType::Float64 ? "<f8" : view.dtype() == DType::Float32 ? "<f4" : "|b1";
  return std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " + shape + ", }";
}

void write_to(io::ByteSink& sink, const TensorView& view) {
  if (view.dtype() == DType::BFloat16)  // NumPy has no bfloat16: written as float32, which holds it exactly
    return write_to(sink, Tensor::copy_of(view, DType::Float32));
  std::string header = header_text(view);
  // Version 1.0 has a 2-byte header length; use 2.0 (4 bytes) only when the header needs it.
  int major = 1;
  std::size_t preamble = kVersionEnd + 2;
  std::size_t padded = header.size() + 1;  // + the newline
  padded += (kArrayAlign - (preamble + padded) % kArrayAlign) % kArrayAlign;
  if (padded > std::numeric_limits<std::uint16_t>::max()) {
    major = 2;
    preamble = kVersionEnd + 4;
    padded = header.size() + 1;
    padded += (kArrayAlign - (preamble + padded) % kArrayAlign) % kArrayAlign;
  }
  header.append(padded - header.size() - 1, ' ');
  header += '\n';

  std::byte bytes[kVersionEnd + 4];
  std::memcpy(bytes, kMagic, kMagicBytes);
  bytes[6] = static_cast<std::byte>(major);
  bytes[7] = std::byte{0};
  if (major == 1) io::store_le<std::uint16_t>(bytes + kVersionEnd, static_cast<std::uint16_t>(header.size()));
  else io::store_le<std::uint32_t>(bytes + kVersionEnd, static_cast<std::uint32_t>(header.size()));
  sink.write(bytes, preamble);
  sink.write(header.data(), header.size());
  io::write_c_order(sink, view);
}

}  // namespace

Tensor read_npy(const std::string& path) { return read_from(io::FileSource(path)); }

Tensor parse_npy(std::span<const std::byte> bytes, const std::string& name) {
  return read_from(io::MemorySource(bytes, name));
}

void write_npy(const std::string& path, const TensorView& tensor) {
  io::FileSink sink(path);
  write_to(sink, tensor);
  sink.commit();
}

std::vector<std::byte> serialize_npy(const TensorView& tensor) {
  io::VectorSink sink;
  write_to(sink, tensor);
  return std::move(sink.bytes);
}

}  // namespace mha
