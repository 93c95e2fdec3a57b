// rewind/checksum.h: the checksum of rewind's snapshot format.
//
// Every part of a serialized snapshot (docs/snapshot-format.md) carries a
// CRC-32C; this is the function that computes it, for readers and writers
// of the format outside rewind.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace rwd {

// CRC-32C (Castagnoli; the checksum of every snapshot part) of `bytes`,
// continuing from `crc`: the value a previous call over the bytes before
// returned, 0 to start. crc32c("123456789") == 0xE3069283. Uses the SSE4.2
// crc32 instruction where the CPU has it, a table otherwise (same results).
std::uint32_t crc32c(std::span<const std::byte> bytes, std::uint32_t crc = 0);

}  // namespace rwd
