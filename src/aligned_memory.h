// Library-internal memory helpers: the one aligned allocator of rewind
// (Tensor and the cache's buffers both use it) and overflow-checked size
// arithmetic for every extent a user supplies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace rwd::detail {

// No single buffer may exceed this many bytes (256 TiB): far beyond any
// machine, small enough that every product below it fits in 64 bits.
inline constexpr std::uint64_t kMaxBufferBytes = std::uint64_t{1} << 48;
// No sequence may exceed this many tokens; positions stay far from overflow.
inline constexpr std::int64_t kMaxTokens = std::int64_t{1} << 40;
// True when a sequence at `length` cannot take q more tokens.
inline bool passes_token_limit(std::int64_t length, std::int64_t q) {
  return q > kMaxTokens || length > kMaxTokens - q;
}
// A window or chunk longer than any sequence acts like a window of this
// size (it never evicts), so W - 1 + R cannot overflow.
inline constexpr std::int64_t kMaxWindow = kMaxTokens + 1;
// No batch may have more rows (the row lists of batch operations stay small).
inline constexpr std::int64_t kMaxBatch = std::int64_t{1} << 24;

// a * b for sizes, or CapacityError "<what> needs more than 2^48 bytes"
// when the product passes kMaxBufferBytes (negative factors count as huge).
std::size_t checked_mul(std::int64_t a, std::int64_t b, const std::string& what);
std::size_t checked_mul(std::size_t a, std::size_t b, const std::string& what);

struct AlignedFree {
  void operator()(std::byte* p) const noexcept;
};
using AlignedBytes = std::unique_ptr<std::byte, AlignedFree>;

// `bytes` of 64-byte aligned memory (rounded up to a multiple of 64; null
// for 0). Throws CapacityError (never std::bad_alloc) when the system
// refuses, bytes > kMaxBufferBytes or bytes > physical_memory_bytes().
AlignedBytes aligned_allocate(std::size_t bytes);
// The machine's physical memory (0 when unknown). No buffer larger than it
// is attempted: an overcommitting system may grant the address space and
// fail only when the pages are touched, and sanitizers abort instead of
// returning null.
std::size_t physical_memory_bytes();

// Debug aid (REWIND_DEBUG_VIEWS under AddressSanitizer): marks memory that
// no valid view may read. Inline no-ops otherwise (they sit on the update path).
#if defined(REWIND_DEBUG_VIEWS)
void poison(const void* p, std::size_t bytes) noexcept;
void unpoison(const void* p, std::size_t bytes) noexcept;
#else
inline void poison(const void*, std::size_t) noexcept {}
inline void unpoison(const void*, std::size_t) noexcept {}
#endif

}  // namespace rwd::detail
