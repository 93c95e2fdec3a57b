#include "aligned_memory.h"

#include <cstdlib>

#include <unistd.h>

#include "rewind/error.h"

#if defined(REWIND_DEBUG_VIEWS)
#include <sanitizer/asan_interface.h>
#endif

namespace rwd::detail {
namespace {

[[noreturn]] void too_large(const std::string& what) {
  throw CapacityError(what + " needs more than 2^48 bytes; nothing was allocated");
}

}  // namespace

std::size_t checked_mul(std::size_t a, std::size_t b, const std::string& what) {
  if (a != 0 && b > kMaxBufferBytes / a) too_large(what);
  const std::uint64_t product = static_cast<std::uint64_t>(a) * b;
  if (product > kMaxBufferBytes) too_large(what);
  return static_cast<std::size_t>(product);
}

std::size_t checked_mul(std::int64_t a, std::int64_t b, const std::string& what) {
  if (a < 0 || b < 0) too_large(what);
  return checked_mul(static_cast<std::size_t>(a), static_cast<std::size_t>(b), what);
}

void AlignedFree::operator()(std::byte* p) const noexcept { std::free(p); }

std::size_t physical_memory_bytes() {
  static const std::size_t physical = [] {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? static_cast<std::size_t>(pages) * static_cast<std::size_t>(page) : std::size_t{0};
  }();
  return physical;
}

AlignedBytes aligned_allocate(std::size_t bytes) {
  if (bytes == 0) return {};
  if (bytes > kMaxBufferBytes) too_large("an allocation of " + std::to_string(bytes) + " bytes");
  if (const std::size_t physical = physical_memory_bytes(); physical != 0 && bytes > physical) {
    throw CapacityError("an allocation of " + std::to_string(bytes) + " bytes exceeds this machine's " +
                        std::to_string(physical) + " bytes of memory; nothing was allocated");
  }
  const std::size_t rounded = (bytes + 63) / 64 * 64;
  AlignedBytes p(static_cast<std::byte*>(std::aligned_alloc(64, rounded)));
  if (!p) {
    throw CapacityError("the system could not allocate " + std::to_string(rounded) + " bytes; nothing was changed");
  }
  return p;
}

#if defined(REWIND_DEBUG_VIEWS)
void poison(const void* p, std::size_t bytes) noexcept {
  if (p != nullptr && bytes != 0) ASAN_POISON_MEMORY_REGION(p, bytes);
}
void unpoison(const void* p, std::size_t bytes) noexcept {
  if (p != nullptr && bytes != 0) ASAN_UNPOISON_MEMORY_REGION(p, bytes);
}
#endif

}  // namespace rwd::detail
