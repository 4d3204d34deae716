// ByteSource and ByteSink: the only code of the file formats that touches files.
#include "io/binary_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <system_error>
#include <tuple>

#include "io/little_endian.hpp"
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

// Refuses a path the operating system would not take as it is: an empty one, or one holding a NUL byte
// (every system call would see only the part before it, so "zz\0.npy" would be "zz").
void check_path(const std::string& path) {
  if (path.empty()) fail("''", "the path is empty");
  if (path.find('\0') != std::string::npos)
    fail(printable(path), "the path contains a NUL byte, where the operating system would cut it");
}

// Opens `path` for reading and returns it with its size; refuses what is not a regular file (a
// directory, a pipe, /dev/zero), whose size would be meaningless.
std::pair<std::FILE*, std::uint64_t> open_regular_file(const std::string& path) {
  check_path(path);
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

namespace {

// What a file that is not a regular file is, for the message that refuses to replace it.
std::string kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// The file a write to `path` replaces: `path`, or the end of its chain of symbolic links (a relative
// link target is relative to the link's directory). The end may not exist yet.
std::string follow_links(const std::string& path) {
  constexpr int kMaxLinks = 40;  // Linux's limit for one path (ELOOP)
  std::filesystem::path current = path;
  for (int links = 0; links <= kMaxLinks; ++links) {
    struct stat st {};
    if (::lstat(current.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return current.string();
    std::error_code ec;
    const std::filesystem::path target = std::filesystem::read_symlink(current, ec);
    if (ec) fail(path, "cannot read the symbolic link " + current.string() + ": " + ec.message());
    current = target.is_absolute() ? target : current.parent_path() / target;
  }
  fail(path, "more than " + std::to_string(kMaxLinks) + " symbolic links to follow");
}

// Creates "<target>.partial.<pid>.<n>" exclusively (O_EXCL: an existing file or link of that name is
// never opened) with the permissions a new file gets (0666 less the umask); returns it and its name.
std::pair<std::FILE*, std::string> create_partial(const std::string& path, const std::string& target) {
  static std::atomic<unsigned> counter{0};
  for (int attempt = 0;; ++attempt) {
    std::string name = target + ".partial." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
    const int fd = ::open(name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    const int open_errno = errno;
    if (fd < 0 && open_errno == EEXIST && attempt < 100) continue;  // another writer's: take the next name
    if (fd < 0) fail(path, "cannot write " + name + ": " + std::strerror(open_errno));
    std::FILE* file = ::fdopen(fd, "wb");
    if (!file) {
      const int fdopen_errno = errno;
      ::close(fd);
      std::remove(name.c_str());
      fail(path, "cannot write " + name + ": " + std::strerror(fdopen_errno));
    }
    return {file, std::move(name)};
  }
}

}  // namespace

FileSink::FileSink(std::string path) : path_(std::move(path)) {
  check_path(path_);
  target_ = follow_links(path_);
  struct stat st {};
  if (::lstat(target_.c_str(), &st) == 0 && !S_ISREG(st.st_mode))
    fail(path_, (target_ == path_ ? "is " : "links to " + target_ + ", ") + kind_of(st.st_mode) +
                    ", not a regular file: refusing to replace it");
  std::tie(file_, partial_) = create_partial(path_, target_);
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
  if (std::rename(partial_.c_str(), target_.c_str()) != 0) {
    const int rename_errno = errno;
    std::remove(partial_.c_str());
    fail(path_, std::string("cannot rename ") + partial_ + " to it: " + std::strerror(rename_errno));
  }
}

std::string apparent_kind(const ByteSource& source) {
  unsigned char head[9] = {};
  const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(source.size(), sizeof head));
  source.read(0, head, n);
  auto starts_with = [&](std::string_view magic) {
    return n >= magic.size() && std::memcmp(head, magic.data(), magic.size()) == 0;
  };
  if (starts_with("\x93NUMPY")) return "a NumPy .npy file";
  if (starts_with("PK\x03\x04")) return "a zip archive (PyTorch's torch.save writes one)";
  if (n >= 2 && head[0] == 0x80 && head[1] >= 2 && head[1] <= 5)
    return "a Python pickle (older torch.save files are one)";
  if (starts_with("\x89PNG")) return "a PNG image";
  if (n == sizeof head) {  // an 8-byte little-endian length that fits, then the JSON header's '{'
    const auto length = load_le<std::uint64_t>(reinterpret_cast<const std::byte*>(head));
    if (length <= source.size() - 8 && head[8] == '{') return "a safetensors file";
  }
  if (n > 0 && std::all_of(head, head + n, [](unsigned char c) {
        return c == '\t' || c == '\n' || c == '\r' || (c >= 0x20 && c < 0x7f);
      }))
    return "text";
  return "";
}

}  // namespace mha::io
