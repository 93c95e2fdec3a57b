// Library-internal: the two implementations behind rwd::crc32c
// (rewind/checksum.h), exposed so tests can check that they agree.
#pragma once

#include <cstddef>
#include <cstdint>

namespace rwd::detail {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, initial value and
// final XOR 0xFFFFFFFF) of `size` bytes at `data`, continuing from `crc`
// (what a previous call over the preceding bytes returned; 0 to start).
// Table-driven, slicing by 8 bytes: any host.
std::uint32_t crc32c_portable(const std::byte* data, std::size_t size, std::uint32_t crc);

// True when this CPU has the SSE4.2 crc32 instruction (x86-64 only).
bool crc32c_hardware_available();

// The same function with the SSE4.2 crc32 instruction.
// REQUIRES: crc32c_hardware_available().
std::uint32_t crc32c_hardware(const std::byte* data, std::size_t size, std::uint32_t crc);

}  // namespace rwd::detail
