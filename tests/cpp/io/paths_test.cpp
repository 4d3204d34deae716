// Hostile paths for the writers and readers (mha/io.hpp): a symbolic link is written through to its
// target, which is replaced and the link kept; a path holding anything but a regular file (FIFO,
// directory, socket, character device) is refused and left as it was; a path with a NUL byte, or an
// empty one, is refused rather than cut; a stale "<path>.partial" link is never written through.
// Each case runs through every writer: write_npy, write_safetensors and save_safetensors.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "support/io_bytes.hpp"
#include "support/test_util.hpp"

namespace mha_test {
namespace {

namespace fs = std::filesystem;

struct Writer {
  const char* name;
  std::function<void(const std::string& path)> write;
  std::function<bool(const std::string& path)> wrote;  // true when `path` holds what write() wrote
};

const Tensor& sample() {
  static const Tensor t = make_tensor(DType::Float32, {2, 3}, {1, 2, 3, 4, 5, 6});
  return t;
}

const mha::MultiHeadAttention& layer() {
  static const mha::MultiHeadAttention l = [] {
    mha::MultiHeadAttentionConfig c;
    c.d_model = 4;
    c.num_heads = 2;
    return mha::MultiHeadAttention(c, 7);
  }();
  return l;
}

std::vector<Writer> writers() {
  return {
      {"write_npy", [](const std::string& p) { mha::write_npy(p, sample()); },
       [](const std::string& p) { return static_cast<bool>(bitwise_equal(mha::read_npy(p), sample())); }},
      {"write_safetensors",
       [](const std::string& p) {
         mha::write_safetensors(p, {{"t", sample()}});
       },
       [](const std::string& p) {
         return static_cast<bool>(bitwise_equal(mha::read_safetensors(p).tensors.at("t"), sample()));
       }},
      {"save_safetensors", [](const std::string& p) { mha::save_safetensors(layer(), p); },
       [](const std::string& p) {
         return static_cast<bool>(bitwise_equal(mha::load_multi_head_attention(p).parameter("in_proj_weight"),
                                                layer().parameter("in_proj_weight")));
       }},
  };
}

// The names in `dir`, so a test can check that no partial file was left behind.
std::set<std::string> names_in(const fs::path& dir) {
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.insert(entry.path().filename().string());
  return names;
}

// Runs `call`, which must throw mha::Error whose message contains every one of `parts`.
void expect_error(const std::function<void()>& call, const std::vector<std::string>& parts, const std::string& what) {
  try {
    call();
    ADD_FAILURE() << what << ": no error";
  } catch (const mha::Error& e) {
    for (const auto& part : parts)
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << what << ": " << e.what();
  }
}

TEST(IoPaths, SymbolicLinksAreWrittenThroughToTheirTarget) {
  for (const Writer& w : writers()) {
    SCOPED_TRACE(w.name);
    TempDir dir("symlink");
    fs::create_directory(dir.path() / "sub");
    write_file(dir.path() / "sub/target", raw("old contents"));
    fs::create_symlink("sub/target", dir.path() / "relative");            // relative to the link's directory
    fs::create_symlink(dir.path() / "relative", dir.path() / "chained");  // absolute, to another link
    fs::create_symlink("sub/not_yet", dir.path() / "dangling");           // the target is created
    for (const char* link : {"relative", "chained", "dangling"}) {
      w.write(dir / link);
      EXPECT_TRUE(fs::is_symlink(dir.path() / link)) << link << " was replaced";
    }
    EXPECT_TRUE(w.wrote(dir / "sub/target"));
    EXPECT_TRUE(w.wrote(dir / "sub/not_yet"));
    EXPECT_EQ(names_in(dir.path()), (std::set<std::string>{"sub", "relative", "chained", "dangling"}));
    EXPECT_EQ(names_in(dir.path() / "sub"), (std::set<std::string>{"target", "not_yet"}));
  }
}

TEST(IoPaths, RegularFilesAreReplacedAndNoPartialFileIsLeft) {
  for (const Writer& w : writers()) {
    SCOPED_TRACE(w.name);
    TempDir dir("regular");
    write_file(dir.path() / "out", raw("old contents"));
    w.write(dir / "out");
    EXPECT_TRUE(w.wrote(dir / "out"));
    EXPECT_EQ(names_in(dir.path()), (std::set<std::string>{"out"}));
  }
}

// A stale "<path>.partial" that is a link to another file must not be written through (the writer
// used to open exactly that name, following the link and overwriting the file it points to).
TEST(IoPaths, AStalePartialLinkIsNotFollowed) {
  for (const Writer& w : writers()) {
    SCOPED_TRACE(w.name);
    TempDir dir("partial_link");
    write_file(dir.path() / "victim", raw("keep me"));
    fs::create_symlink(dir.path() / "victim", dir.path() / "out.partial");
    w.write(dir / "out");
    EXPECT_TRUE(w.wrote(dir / "out"));
    EXPECT_EQ(to_string(read_file(dir.path() / "victim")), "keep me");
    EXPECT_TRUE(fs::is_symlink(dir.path() / "out.partial"));
  }
}

// Creates a Unix-domain socket file at `path`; returns false where that is not possible.
bool make_socket_file(const std::string& path) {
  sockaddr_un address{};
  if (path.size() >= sizeof address.sun_path) return false;
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  if (fd < 0) return false;
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, path.c_str(), path.size() + 1);
  const bool bound = ::bind(fd, reinterpret_cast<const sockaddr*>(&address), sizeof address) == 0;
  ::close(fd);  // the socket file stays
  return bound;
}

TEST(IoPaths, WhatIsNotARegularFileIsRefusedAndLeftAsItWas) {
  for (const Writer& w : writers()) {
    SCOPED_TRACE(w.name);
    TempDir dir("special");
    ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0600), 0);
    fs::create_directory(dir.path() / "directory");
    fs::create_symlink("fifo", dir.path() / "link_to_fifo");
    expect_error([&] { w.write(dir / "fifo"); }, {dir / "fifo", "is a FIFO", "not a regular file"}, "fifo");
    expect_error([&] { w.write(dir / "directory"); }, {dir / "directory", "is a directory"}, "directory");
    expect_error([&] { w.write(dir / "link_to_fifo"); }, {dir / "link_to_fifo", "links to", "a FIFO"}, "link");
    EXPECT_TRUE(fs::is_fifo(dir.path() / "fifo"));
    EXPECT_TRUE(fs::is_directory(dir.path() / "directory"));
    EXPECT_TRUE(fs::is_symlink(dir.path() / "link_to_fifo"));
    if (make_socket_file(dir / "socket")) {
      expect_error([&] { w.write(dir / "socket"); }, {dir / "socket", "is a socket"}, "socket");
      EXPECT_TRUE(fs::is_socket(dir.path() / "socket"));
    }
    EXPECT_EQ(names_in(dir.path()).size(), fs::exists(dir.path() / "socket") ? 4u : 3u) << "a partial file was left";
  }
}

// A character device like /dev/null (major 1, minor 3), made in a temporary directory: only root can.
TEST(IoPaths, ACharacterDeviceIsRefusedAndLeftAsItWas) {
  if (::geteuid() != 0) GTEST_SKIP() << "mknod of a character device needs root";
  for (const Writer& w : writers()) {
    SCOPED_TRACE(w.name);
    TempDir dir("device");
    const std::string device = dir / "null_like";
    ASSERT_EQ(::mknod(device.c_str(), S_IFCHR | 0666, makedev(1, 3)), 0) << std::strerror(errno);
    expect_error([&] { w.write(device); }, {device, "is a character device"}, "device");
    struct stat st {};
    ASSERT_EQ(::lstat(device.c_str(), &st), 0);
    EXPECT_TRUE(S_ISCHR(st.st_mode));
    EXPECT_EQ(st.st_rdev, makedev(1, 3));
  }
}

TEST(IoPaths, APathWithANulByteIsRefusedNotCut) {
  TempDir dir("nul");
  const std::string path = dir / std::string("zz\0.out", 7);
  const std::string shown = "zz\\x00.out";
  for (const Writer& w : writers()) expect_error([&] { w.write(path); }, {shown, "NUL"}, w.name);
  EXPECT_TRUE(names_in(dir.path()).empty()) << "wrote " << *names_in(dir.path()).begin();

  write_file(dir.path() / "zz", raw("exists"));  // what a cut path would read
  expect_error([&] { mha::read_npy(path); }, {shown, "NUL"}, "read_npy");
  expect_error([&] { mha::read_safetensors(path); }, {shown, "NUL"}, "read_safetensors");
  expect_error([&] { mha::load_multi_head_attention(path); }, {shown, "NUL"}, "load_multi_head_attention");
}

TEST(IoPaths, AnEmptyPathIsRefused) {
  for (const Writer& w : writers()) expect_error([&] { w.write(""); }, {"empty"}, w.name);
  expect_error([] { mha::read_npy(""); }, {"empty"}, "read_npy");
}

}  // namespace
}  // namespace mha_test
