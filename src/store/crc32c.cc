#include "store/crc32c.h"

#include <array>
#include <bit>
#include <cstring>
#include <span>

#include "rewind/checksum.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace rwd {
namespace detail {
namespace {

static_assert(std::endian::native == std::endian::little || std::endian::native == std::endian::big,
              "crc32c reads 8-byte words as little-endian values; a mixed-endian host needs its own load");

// Bit-reversed Castagnoli polynomial (0x1EDC6F41 reflected), a public fact
// of RFC 3720.
constexpr std::uint32_t kPolynomial = 0x82F63B78u;

// kTables[0] advances the register over one byte; kTables[k] over one byte
// followed by k zero bytes, which lets eight bytes be folded per step with
// eight independent lookups instead of eight dependent ones.
constexpr std::array<std::array<std::uint32_t, 256>, 8> make_tables() {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t r = i;
    for (int b = 0; b < 8; ++b) r = (r >> 1) ^ ((r & 1u) ? kPolynomial : 0u);
    t[0][i] = r;
  }
  for (std::size_t k = 1; k < 8; ++k)
    for (std::size_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xFFu];
  return t;
}
constexpr auto kTables = make_tables();

std::uint64_t load_le64(const std::byte* p) {
  std::uint64_t v;
  std::memcpy(&v, p, 8);
  if constexpr (std::endian::native == std::endian::big) v = __builtin_bswap64(v);
  return v;
}

// The register update without the initial and final inversion: linear in
// (register, data), which the interleaved hardware path relies on.
std::uint32_t portable_raw(const std::byte* p, std::size_t n, std::uint32_t r) {
  for (; n >= 8; n -= 8, p += 8) {
    const std::uint64_t w = load_le64(p) ^ r;
    r = kTables[7][w & 0xFFu] ^ kTables[6][(w >> 8) & 0xFFu] ^ kTables[5][(w >> 16) & 0xFFu] ^
        kTables[4][(w >> 24) & 0xFFu] ^ kTables[3][(w >> 32) & 0xFFu] ^ kTables[2][(w >> 40) & 0xFFu] ^
        kTables[1][(w >> 48) & 0xFFu] ^ kTables[0][w >> 56];
  }
  for (; n > 0; --n, ++p) r = (r >> 8) ^ kTables[0][(r ^ static_cast<std::uint32_t>(*p)) & 0xFFu];
  return r;
}

#if defined(__x86_64__)

// One crc32 instruction has a latency of 3 cycles and a throughput of one
// per cycle, so a single chain runs at a third of the unit's speed. Large
// inputs run as three chains over consecutive blocks of kStripe bytes, then
// the registers are merged: feeding a block B after register r gives
// shift(r) ^ raw(0, B), where shift is the (linear) effect of kStripe zero
// bytes, tabulated per register byte.
constexpr std::size_t kStripe = 4096;

__attribute__((target("sse4.2"))) std::uint32_t hardware_raw(const std::byte* p, std::size_t n, std::uint32_t r) {
  std::uint64_t r64 = r;
  for (; n >= 8; n -= 8, p += 8) r64 = _mm_crc32_u64(r64, load_le64(p));
  r = static_cast<std::uint32_t>(r64);
  for (; n > 0; --n, ++p) r = _mm_crc32_u8(r, static_cast<std::uint8_t>(*p));
  return r;
}

struct StripeShift {
  std::array<std::array<std::uint32_t, 256>, 4> table{};
  StripeShift() {
    static const std::array<std::byte, kStripe> zeros{};
    std::array<std::uint32_t, 32> basis{};
    for (std::size_t bit = 0; bit < 32; ++bit)
      basis[bit] = portable_raw(zeros.data(), zeros.size(), std::uint32_t{1} << bit);
    for (std::size_t byte = 0; byte < 4; ++byte)
      for (std::uint32_t v = 0; v < 256; ++v) {
        std::uint32_t out = 0;
        for (std::size_t b = 0; b < 8; ++b)
          if (v & (1u << b)) out ^= basis[8 * byte + b];
        table[byte][v] = out;
      }
  }
  std::uint32_t operator()(std::uint32_t r) const {
    return table[0][r & 0xFFu] ^ table[1][(r >> 8) & 0xFFu] ^ table[2][(r >> 16) & 0xFFu] ^ table[3][r >> 24];
  }
};

__attribute__((target("sse4.2"))) std::uint32_t hardware_interleaved(const std::byte* p, std::size_t n,
                                                                     std::uint32_t r) {
  static const StripeShift shift;
  for (; n >= 3 * kStripe; n -= 3 * kStripe, p += 3 * kStripe) {
    std::uint64_t a = r, b = 0, c = 0;
    for (std::size_t i = 0; i < kStripe; i += 8) {
      a = _mm_crc32_u64(a, load_le64(p + i));
      b = _mm_crc32_u64(b, load_le64(p + kStripe + i));
      c = _mm_crc32_u64(c, load_le64(p + 2 * kStripe + i));
    }
    r = shift(shift(static_cast<std::uint32_t>(a)) ^ static_cast<std::uint32_t>(b)) ^ static_cast<std::uint32_t>(c);
  }
  return hardware_raw(p, n, r);
}

#endif

}  // namespace

std::uint32_t crc32c_portable(const std::byte* data, std::size_t size, std::uint32_t crc) {
  return ~portable_raw(data, size, ~crc);
}

bool crc32c_hardware_available() {
#if defined(__x86_64__)
  static const bool available = __builtin_cpu_supports("sse4.2");
  return available;
#else
  return false;
#endif
}

std::uint32_t crc32c_hardware(const std::byte* data, std::size_t size, std::uint32_t crc) {
#if defined(__x86_64__)
  return ~hardware_interleaved(data, size, ~crc);
#else
  (void)data;
  (void)size;
  (void)crc;
  __builtin_trap();  // REQUIRES crc32c_hardware_available(), false off x86-64
#endif
}

}  // namespace detail

std::uint32_t crc32c(std::span<const std::byte> bytes, std::uint32_t crc) {
  return detail::crc32c_hardware_available() ? detail::crc32c_hardware(bytes.data(), bytes.size(), crc)
                                             : detail::crc32c_portable(bytes.data(), bytes.size(), crc);
}

}  // namespace rwd
