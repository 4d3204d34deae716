// Bytes in and out of the file-format code: a ByteSource (memory or a file) that readers pull
// ranges from, and a ByteSink (memory or a file) that writers push bytes to. Readers take ranges only
// after checking them against size(), so a file is never read wholesale and nothing is allocated on a
// length the file merely claims; read() checks its range again and fails cleanly on a short read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mha::io {

// Throws mha::Error("<name>: <problem>"): every message of the readers and writers names the file.
[[noreturn]] void fail(const std::string& name, const std::string& problem);

// `text` quoted for an error message: non-printable bytes as \xNN, cut after `max` bytes with "...".
// Names inside hostile files can hold anything, and messages must stay readable.
std::string printable(std::string_view text, std::size_t max = 80);

class ByteSource {
 public:
  virtual ~ByteSource() = default;
  const std::string& name() const { return name_; }
  std::uint64_t size() const { return size_; }
  // Copies bytes [offset, offset + n) to `dst`; throws mha::Error when the range is not inside the
  // source or the bytes cannot be read.
  void read(std::uint64_t offset, void* dst, std::size_t n) const;

 protected:
  ByteSource(std::string name, std::uint64_t size) : name_(std::move(name)), size_(size) {}

 private:
  virtual void read_checked(std::uint64_t offset, void* dst, std::size_t n) const = 0;
  std::string name_;
  std::uint64_t size_;
};

// What the source's first bytes say it is, for an error about a file of the wrong kind: "a NumPy .npy
// file", "a safetensors file", "a zip archive (PyTorch's torch.save writes one)", "a Python pickle
// (older torch.save files are one)", "a PNG image", "text"; empty when nothing is recognised.
std::string apparent_kind(const ByteSource& source);

class MemorySource final : public ByteSource {
 public:
  MemorySource(std::span<const std::byte> bytes, std::string name);

 private:
  void read_checked(std::uint64_t offset, void* dst, std::size_t n) const override;
  std::span<const std::byte> bytes_;
};

// A regular file, opened for reading; its size is taken once, at opening.
class FileSource final : public ByteSource {
 public:
  explicit FileSource(const std::string& path);
  ~FileSource() override;
  FileSource(const FileSource&) = delete;
  FileSource& operator=(const FileSource&) = delete;

 private:
  FileSource(const std::string& path, std::pair<std::FILE*, std::uint64_t> opened);
  void read_checked(std::uint64_t offset, void* dst, std::size_t n) const override;
  std::FILE* file_;
};

class ByteSink {
 public:
  virtual ~ByteSink() = default;
  virtual void write(const void* data, std::size_t n) = 0;
};

class VectorSink final : public ByteSink {
 public:
  void write(const void* data, std::size_t n) override;
  std::vector<std::byte> bytes;
};

// Writes a new file beside the target and renames it over the target on commit(), so that a failed
// write never leaves a truncated file under the real name and a reader sees the old file or the whole
// new one. The target is `path`, or when `path` is a symbolic link, the file at the end of its chain of
// links (the link stays, its target gets the new contents). A target that exists and is not a regular
// file (a directory, FIFO, device or socket) is refused before anything is written. The new file is
// "<target>.partial.<pid>.<n>", created exclusively (never through a link); without commit() it is removed.
class FileSink final : public ByteSink {
 public:
  explicit FileSink(std::string path);
  ~FileSink() override;
  FileSink(const FileSink&) = delete;
  FileSink& operator=(const FileSink&) = delete;
  void write(const void* data, std::size_t n) override;
  void commit();

 private:
  std::string path_, target_, partial_;
  std::FILE* file_ = nullptr;
};

}  // namespace mha::io
