// libFuzzer target: the pack file reader (runtime/pack_file.h) on arbitrary
// bytes. Every input must either open, with every matrix's panels inside
// the file and readable through PackFile::take, or raise rwd::FormatError;
// nothing else (no crash, no other exception, no huge allocation:
// libFuzzer's -rss_limit_mb catches those).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "fuzz_support.h"
#include "rewind/error.h"
#include "runtime/kernels.h"
#include "runtime/pack_file.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = rwt::memory_file_with("rewind_fuzz_pack", data, size);
  try {
    const rwd::runtime::PackFile pack = rwd::runtime::PackFile::open(path);
    if (pack.file_bytes() != size) std::abort();
    for (std::size_t i = 0; i < pack.size(); ++i) {
      const auto& e = pack.matrix(i);
      const std::size_t bytes = rwd::runtime::kernels::PackedMatrix::storage_bytes(e.element, e.out, e.in);
      if (e.offset % rwd::runtime::kPackAlignment != 0 || e.offset > size || bytes > size - e.offset) std::abort();
      const rwd::runtime::kernels::PackedMatrix m = pack.take(i, e.key, e.out, e.in);
      if (m.bytes() != bytes) std::abort();
      if (bytes > 0) {
        // The view's last byte lies in the mapping: a read past it faults.
        volatile std::byte sink = m.storage()[bytes - 1];
        (void)sink;
      }
    }
  } catch (const rwd::FormatError&) {
  }
  return 0;
}
