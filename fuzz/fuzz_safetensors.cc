// libFuzzer target: the safetensors reader on arbitrary bytes. Every input
// must either open, with every entry's bytes inside the file, or raise
// rwd::FormatError; nothing else (no crash, no other exception, no huge
// allocation: libFuzzer's -rss_limit_mb catches those).
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "rewind/error.h"
#include "runtime/safetensors.h"

namespace {

// An in-memory file the reader can open by path.
int memory_file() {
  static const int fd = memfd_create("rewind_fuzz_safetensors", 0);
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const int fd = memory_file();
  if (fd < 0 || ftruncate(fd, 0) != 0) std::abort();
  std::size_t written = 0;
  while (written < size) {
    const ssize_t n = pwrite(fd, data + written, size - written, static_cast<off_t>(written));
    if (n <= 0) std::abort();
    written += static_cast<std::size_t>(n);
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  try {
    const auto file = rwd::runtime::SafetensorsFile::open(path);
    const auto* begin = reinterpret_cast<const std::byte*>(data);
    for (const auto& e : file.entries()) {
      // The reader's data pointers are into its own mapping; check the
      // offsets it derived against the input size through nbytes and numel.
      if (e.nbytes != static_cast<std::size_t>(e.numel()) * rwd::dtype_size(e.dtype)) std::abort();
      if (e.nbytes > size) std::abort();
      volatile std::byte sink{};
      if (e.nbytes > 0) sink = e.data[e.nbytes - 1];  // ASan flags a read outside the mapping
      (void)sink;
      (void)begin;
    }
  } catch (const rwd::FormatError&) {
  }
  return 0;
}
