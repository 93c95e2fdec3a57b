// Helpers for the store tests: self-describing values a reader can verify
// whole, temporary directories and forked worker processes.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "rewind/store.h"

namespace rwd::store_test {

inline std::vector<std::byte> bytes_of(const std::string& s) {
  std::vector<std::byte> out(s.size());
  std::memcpy(out.data(), s.data(), s.size());
  return out;
}

inline std::vector<std::byte> filled(std::size_t n, unsigned char c) { return std::vector<std::byte>(n, std::byte{c}); }

// The round trip every store's test starts with, on an empty `store`: "k"
// missing, then holding `text`, then an empty value put under "empty".
inline void expect_round_trip(BlobStore& store, const std::string& text) {
  EXPECT_FALSE(store.get("k").has_value());
  EXPECT_FALSE(store.contains("k"));
  EXPECT_TRUE(store.put("k", bytes_of(text)));
  EXPECT_TRUE(store.contains("k"));
  EXPECT_EQ(store.get("k"), bytes_of(text));
  EXPECT_TRUE(store.put("empty", {}));
}

inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Payload byte i of the value made from `seed`.
inline std::byte pattern_byte(std::uint64_t seed, std::size_t i) {
  return static_cast<std::byte>(splitmix64(seed ^ (static_cast<std::uint64_t>(i) * 0x100000001b3ULL)) >> 56);
}

// A value of `size` >= 16 bytes that says what it must be: its seed and its
// size in the first 16 bytes (little-endian), then pattern_byte(seed, i).
inline std::vector<std::byte> seeded_value(std::uint64_t seed, std::size_t size) {
  if (size < 16) throw std::invalid_argument("seeded_value: size below 16");
  std::vector<std::byte> v(size);
  for (int b = 0; b < 8; ++b) {
    v[static_cast<std::size_t>(b)] = static_cast<std::byte>(seed >> (8 * b));
    v[static_cast<std::size_t>(8 + b)] = static_cast<std::byte>(static_cast<std::uint64_t>(size) >> (8 * b));
  }
  for (std::size_t i = 16; i < size; ++i) v[i] = pattern_byte(seed, i);
  return v;
}

// Empty when `v` is a whole seeded_value, else what is wrong with it.
inline std::string check_seeded_value(std::span<const std::byte> v) {
  if (v.size() < 16) return "value of " + std::to_string(v.size()) + " bytes is shorter than its header";
  std::uint64_t seed = 0;
  std::uint64_t size = 0;
  for (int b = 0; b < 8; ++b) {
    seed |= std::to_integer<std::uint64_t>(v[static_cast<std::size_t>(b)]) << (8 * b);
    size |= std::to_integer<std::uint64_t>(v[static_cast<std::size_t>(8 + b)]) << (8 * b);
  }
  if (size != v.size()) {
    return "value of seed " + std::to_string(seed) + " has " + std::to_string(v.size()) + " bytes, its header says " +
           std::to_string(size);
  }
  for (std::size_t i = 16; i < v.size(); ++i) {
    if (v[i] != pattern_byte(seed, i)) {
      return "value of seed " + std::to_string(seed) + " differs at byte " + std::to_string(i) + " of " +
             std::to_string(v.size());
    }
  }
  return "";
}

// A fresh directory under the system's temporary directory, removed with
// its contents at the end of the scope.
class TempDir {
 public:
  TempDir() {
    std::string templ = (std::filesystem::temp_directory_path() / "rewind-store-XXXXXX").string();
    if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp: " + std::string(std::strerror(errno)));
    path_ = templ;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    std::filesystem::permissions(path_, std::filesystem::perms::owner_all, std::filesystem::perm_options::add, ec);
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// What a directory may hold under a key's name that is not a value a store
// wrote: each must be a refused or rejected value for its readers, never a
// blocked, huge or failed read.
enum class Junk { kHugeSparse, kFifo, kSocket, kLinkToZero, kLinkToNull, kDirectory, kForeignBytes, kEmpty };
inline constexpr Junk kEveryJunk[] = {Junk::kHugeSparse, Junk::kFifo,      Junk::kSocket,       Junk::kLinkToZero,
                                      Junk::kLinkToNull, Junk::kDirectory, Junk::kForeignBytes, Junk::kEmpty};

inline const char* junk_name(Junk j) {
  switch (j) {
    case Junk::kHugeSparse: return "a 100 GiB sparse file";
    case Junk::kFifo: return "a FIFO";
    case Junk::kSocket: return "a socket";
    case Junk::kLinkToZero: return "a symbolic link to /dev/zero";
    case Junk::kLinkToNull: return "a symbolic link to /dev/null";
    case Junk::kDirectory: return "a directory";
    case Junk::kForeignBytes: return "a file of foreign bytes";
    case Junk::kEmpty: return "an empty file";
  }
  return "?";
}

// Replaces whatever is at `path` by `junk` (no real disk use: the huge file
// is sparse). Throws std::runtime_error when the system refuses.
inline void make_junk(const std::string& path, Junk junk, std::uint64_t seed = 0) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  const auto fail = [&](const char* what) {
    throw std::runtime_error(std::string(what) + " " + path + ": " + std::strerror(errno));
  };
  switch (junk) {
    case Junk::kHugeSparse: {
      const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd < 0) fail("open");
      const int rc = ::ftruncate(fd, off_t{100} << 30);
      ::close(fd);
      if (rc != 0) fail("ftruncate");
      break;
    }
    case Junk::kFifo:
      if (::mkfifo(path.c_str(), 0644) != 0) fail("mkfifo");
      break;
    case Junk::kSocket: {
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      if (path.size() >= sizeof addr.sun_path) throw std::runtime_error("socket path too long: " + path);
      std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
      const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) fail("socket");
      const int rc = ::bind(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
      ::close(fd);  // the name stays, nobody listens
      if (rc != 0) fail("bind");
      break;
    }
    case Junk::kLinkToZero:
      if (::symlink("/dev/zero", path.c_str()) != 0) fail("symlink");
      break;
    case Junk::kLinkToNull:
      if (::symlink("/dev/null", path.c_str()) != 0) fail("symlink");
      break;
    case Junk::kDirectory:
      if (::mkdir(path.c_str(), 0755) != 0) fail("mkdir");
      break;
    case Junk::kForeignBytes:
    case Junk::kEmpty: {
      const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (fd < 0) fail("open");
      std::vector<unsigned char> bytes(junk == Junk::kEmpty ? 0 : 100 + seed % 5000);
      for (std::size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>(splitmix64(seed + i) >> 56);
      const ssize_t n = bytes.empty() ? 0 : ::write(fd, bytes.data(), bytes.size());
      ::close(fd);
      if (n != static_cast<ssize_t>(bytes.size())) fail("write");
      break;
    }
  }
}

// The names in `dir`, sorted.
inline std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// Runs `work(i)` in `n` forked processes at once; returns the failures they
// reported (empty: all passed). `work` returns an empty string on success;
// an exception or a crash counts as a failure too.
inline std::vector<std::string> run_processes(int n, const std::function<std::string(int)>& work) {
  struct Child {
    pid_t pid;
    int read_fd;
  };
  std::vector<Child> children;
  for (int i = 0; i < n; ++i) {
    int fds[2];
    if (::pipe(fds) != 0) throw std::runtime_error("pipe: " + std::string(std::strerror(errno)));
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork: " + std::string(std::strerror(errno)));
    if (pid == 0) {
      ::close(fds[0]);
      std::string failure;
      try {
        failure = work(i);
      } catch (const std::exception& e) {
        failure = std::string("exception: ") + e.what();
      }
      failure = failure.substr(0, 2000);
      if (!failure.empty()) {
        [[maybe_unused]] const ssize_t w = ::write(fds[1], failure.data(), failure.size());
      }
      // _exit: the child must not run the parent's destructors or gtest's
      // exit handlers.
      ::_exit(failure.empty() ? 0 : 1);
    }
    ::close(fds[1]);
    children.push_back({pid, fds[0]});
  }
  std::vector<std::string> failures;
  for (std::size_t i = 0; i < children.size(); ++i) {
    std::string text;
    char buf[512];
    ssize_t got = 0;
    while ((got = ::read(children[i].read_fd, buf, sizeof buf)) > 0) text.append(buf, static_cast<std::size_t>(got));
    ::close(children[i].read_fd);
    int status = 0;
    ::waitpid(children[i].pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      failures.push_back("process " + std::to_string(i) + " (status " + std::to_string(status) + "): " + text);
    }
  }
  return failures;
}

// A readable span of 2^32 + 1 bytes that costs no memory (untouched
// anonymous pages), to hand a store a value just over its limit.
class OversizeSpan {
 public:
  static constexpr std::size_t kBytes = (std::size_t{1} << 32) + 1;
  OversizeSpan() {
    void* p = ::mmap(nullptr, kBytes, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap of 2^32 + 1 bytes: " + std::string(std::strerror(errno)));
    data_ = static_cast<const std::byte*>(p);
  }
  OversizeSpan(const OversizeSpan&) = delete;
  OversizeSpan& operator=(const OversizeSpan&) = delete;
  ~OversizeSpan() { ::munmap(const_cast<std::byte*>(data_), kBytes); }
  std::span<const std::byte> span() const { return {data_, kBytes}; }

 private:
  const std::byte* data_ = nullptr;
};

// One process of a race on one store: 300 steps over keys key0..key7,
// process p putting on the steps of its parity and getting on the others,
// values of 16 bytes to 256 KiB that carry their seed and size. Returns ""
// when every value read was whole and at least one was read, else what went
// wrong.
inline std::string race_on_eight_keys(BlobStore& store, int p, std::uint64_t seed) {
  std::uint64_t state = seed + static_cast<std::uint64_t>(p);
  int reads = 0;
  for (int i = 0; i < 300; ++i) {
    state = splitmix64(state);
    const std::string key = "key" + std::to_string(state % 8);
    if (i % 2 == p % 2) {
      if (!store.put(key, seeded_value(state, 16 + state % (256 * 1024)))) return "put refused " + key;
    } else if (auto v = store.get(key)) {
      ++reads;
      const std::string bad = check_seeded_value(*v);
      if (!bad.empty()) return "get " + key + ": " + bad;
    }
  }
  return reads > 0 ? "" : "no value was ever read";
}

}  // namespace rwd::store_test
