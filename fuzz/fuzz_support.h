// What the fuzz targets share: the reader that turns input bytes into
// choices, path counters (REWIND_FUZZ_STATS=1 prints how often each path
// ran when the process ends, docs/reliability.md), and an in-memory file
// for the readers that open a path.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <sys/mman.h>
#include <unistd.h>

namespace rwt {

// Reads the fuzzer's bytes as choices; past the end it reads zeros.
class ByteReader {
 public:
  ByteReader(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  bool empty() const { return pos_ >= size_; }
  std::uint8_t next() { return pos_ < size_ ? data_[pos_++] : 0; }
  // REQUIRES lo <= hi.
  std::int64_t range(std::int64_t lo, std::int64_t hi) {
    return lo + static_cast<std::int64_t>(next()) % (hi - lo + 1);
  }
  // Exhausted input reads zeros, which never pick the rare branch.
  bool one_in(int n) { return next() % n == n - 1; }
  template <std::size_t N>
  std::int64_t pick(const std::array<std::int64_t, N>& xs) {
    return xs[next() % N];
  }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

template <std::size_t N>
class FuzzStats {
 public:
  explicit FuzzStats(const char* const (&names)[N]) : names_(names) {}
  FuzzStats(const FuzzStats&) = delete;
  FuzzStats& operator=(const FuzzStats&) = delete;
  ~FuzzStats() {
    if (std::getenv("REWIND_FUZZ_STATS") == nullptr) return;
    for (std::size_t i = 0; i < N; ++i) std::fprintf(stderr, "%12llu  %s\n", counts_[i], names_[i]);
  }
  void count(std::size_t path, unsigned long long by = 1) { counts_[path] += by; }

 private:
  const char* const (&names_)[N];
  std::array<unsigned long long, N> counts_{};
};

// The path of an in-memory file (one per process, named `name`) that now
// holds exactly data[0, size); aborts when it cannot be written.
inline std::string memory_file_with(const char* name, const std::uint8_t* data, std::size_t size) {
  static const int fd = memfd_create(name, 0);
  if (fd < 0 || ftruncate(fd, 0) != 0) std::abort();
  std::size_t written = 0;
  while (written < size) {
    const ssize_t n = pwrite(fd, data + written, size - written, static_cast<off_t>(written));
    if (n <= 0) std::abort();
    written += static_cast<std::size_t>(n);
  }
  return "/proc/self/fd/" + std::to_string(fd);
}

}  // namespace rwt
