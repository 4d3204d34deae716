// ByteSource and ByteSink: the only code of the file formats that touches files.
#include "io/binary_file.hpp"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <system_error>

#include "mha/error.hpp"

namespace mha::io {

void fail(const std::string& name, const std::string& problem) { throw Error(name + ": " + problem); }

std::string printable(std::string_view text, std::size_t max) {
  static const char kHex[] = "0123456789abcdef";
  std::string out = "'";
  for (std::size_t i = 0; i < text.size() && i < max; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\' && c != '\'') {
      out += static_cast<char>(c);
    } else {
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  if (text.size() > max) out += "...";
  return out + "'";
}

// ---- sources -------------------------------------------------------------------------------------

void ByteSource::read(std::uint64_t offset, void* dst, std::size_t n) const {
  if (offset > size_ || n > size_ - offset)
    fail(name_, "read of " + std::to_string(n) + " bytes at offset " + std::to_string(offset) + " is outside the " +
                    std::to_string(size_) + " bytes of the file");
  if (n != 0) read_checked(offset, dst, n);
}

MemorySource::MemorySource(std::span<const std::byte> bytes, std::string name)
    : ByteSource(std::move(name), bytes.size()), bytes_(bytes) {}

void MemorySource::read_checked(std::uint64_t offset, void* dst, std::size_t n) const {
  std::memcpy(dst, bytes_.data() + offset, n);
}

namespace {

// Opens `path` for reading and returns it with its size; refuses what is not a regular file (a
// directory, a pipe, /dev/zero), whose size would be meaningless.
std::pair<std::FILE*, std::uint64_t> open_regular_file(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec) fail(path, "cannot open: " + ec.message());
  if (!std::filesystem::is_regular_file(status)) fail(path, "cannot open: not a regular file");
  std::FILE* file = std::fopen(path.c_str(), "rb");
  if (!file) fail(path, std::string("cannot open: ") + std::strerror(errno));
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) {
    std::fclose(file);
    fail(path, "cannot read its size: " + ec.message());
  }
  return {file, size};
}

}  // namespace

FileSource::FileSource(const std::string& path) : FileSource(path, open_regular_file(path)) {}

FileSource::FileSource(const std::string& path, std::pair<std::FILE*, std::uint64_t> opened)
    : ByteSource(path, opened.second), file_(opened.first) {}

FileSource::~FileSource() {
  if (file_) std::fclose(file_);
}

void FileSource::read_checked(std::uint64_t offset, void* dst, std::size_t n) const {
  if (offset > static_cast<std::uint64_t>(std::numeric_limits<off_t>::max()) ||
      fseeko(file_, static_cast<off_t>(offset), SEEK_SET) != 0)
    fail(name(), std::string("cannot seek: ") + std::strerror(errno));
  if (std::fread(dst, 1, n, file_) != n)
    fail(name(), "read " + std::to_string(n) + " bytes at offset " + std::to_string(offset) +
                     " failed: the file is shorter than when it was opened, or unreadable");
}

// ---- sinks ---------------------------------------------------------------------------------------

void VectorSink::write(const void* data, std::size_t n) {
  const auto* p = static_cast<const std::byte*>(data);
  bytes.insert(bytes.end(), p, p + n);
}

FileSink::FileSink(std::string path) : path_(std::move(path)), partial_(path_ + ".partial") {
  file_ = std::fopen(partial_.c_str(), "wb");
  if (!file_) fail(path_, std::string("cannot write ") + partial_ + ": " + std::strerror(errno));
}

FileSink::~FileSink() {
  if (file_) {
    std::fclose(file_);
    std::remove(partial_.c_str());
  }
}

void FileSink::write(const void* data, std::size_t n) {
  if (n != 0 && std::fwrite(data, 1, n, file_) != n) fail(path_, std::string("write failed: ") + std::strerror(errno));
}

void FileSink::commit() {
  std::FILE* file = file_;
  file_ = nullptr;
  const bool flushed = std::fflush(file) == 0;
  const int flush_errno = errno;
  const bool closed = std::fclose(file) == 0;
  if (!flushed || !closed) {
    std::remove(partial_.c_str());
    fail(path_, std::string("write failed: ") + std::strerror(flushed ? errno : flush_errno));
  }
  if (std::rename(partial_.c_str(), path_.c_str()) != 0) {
    const int rename_errno = errno;
    std::remove(partial_.c_str());
    fail(path_, std::string("cannot rename ") + partial_ + " to it: " + std::strerror(rename_errno));
  }
}

}  // namespace mha::io
