// Byte-level builders for the file-format tests: safetensors and .npy files assembled by hand, so a
// test states exactly which bytes a reader gets (including bytes no writer would produce).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

#include <unistd.h>

namespace mha_test {

using Bytes = std::vector<std::byte>;

inline Bytes raw(std::string_view text) {
  Bytes b(text.size());
  if (!text.empty()) std::memcpy(b.data(), text.data(), text.size());
  return b;
}

inline Bytes cat(std::initializer_list<Bytes> parts) {
  Bytes out;
  for (const Bytes& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

template <class T>
Bytes le(T value) {  // little-endian on the little-endian machines the library builds on
  Bytes b(sizeof value);
  std::memcpy(b.data(), &value, sizeof value);
  return b;
}

inline Bytes zeros(std::size_t n) { return Bytes(n, std::byte{0}); }

template <class T>
Bytes elements(std::initializer_list<T> values) {
  Bytes out;
  for (T v : values) {
    const Bytes b = le(v);
    out.insert(out.end(), b.begin(), b.end());
  }
  return out;
}

// A safetensors file: the 8-byte header length, `header` as given (no padding added), `buffer`.
inline Bytes safetensors_bytes(std::string_view header, const Bytes& buffer = {}) {
  return cat({le<std::uint64_t>(header.size()), raw(header), buffer});
}

// A .npy file of format version major.minor: magic, version, header length (2 bytes for 1.x,
// 4 otherwise), `header` followed by a newline, then `data`.
inline Bytes npy_bytes(std::string_view header, const Bytes& data, int major = 1, int minor = 0) {
  const std::string text = std::string(header) + "\n";
  const Bytes length = major == 1 ? le<std::uint16_t>(static_cast<std::uint16_t>(text.size()))
                                  : le<std::uint32_t>(static_cast<std::uint32_t>(text.size()));
  return cat({raw("\x93NUMPY"), Bytes{std::byte(major), std::byte(minor)}, length, raw(text), data});
}

inline std::string to_string(const Bytes& b) { return std::string(reinterpret_cast<const char*>(b.data()), b.size()); }

inline void write_file(const std::filesystem::path& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

inline Bytes read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return raw(text);
}

// A fresh, empty directory for one test's files, removed when the test ends.
class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    path_ = std::filesystem::temp_directory_path() /
            ("mha_io_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  static int& counter() {
    static int n = 0;
    return n;
  }
  std::filesystem::path path_;
};

}  // namespace mha_test
