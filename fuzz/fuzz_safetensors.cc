// libFuzzer target: the safetensors reader on arbitrary bytes. Every input
// must either open, with every entry's bytes inside the file, or raise
// rwd::FormatError; nothing else (no crash, no other exception, no huge
// allocation: libFuzzer's -rss_limit_mb catches those).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fuzz_support.h"
#include "rewind/error.h"
#include "runtime/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = rwt::memory_file_with("rewind_fuzz_safetensors", data, size);
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
