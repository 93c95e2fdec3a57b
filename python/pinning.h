// Pins on the aligned buffers of rewind's layers (see pinning.cc).
#pragma once

#include <cstddef>
#include <cstdint>

namespace rwd::python {

// Pins the aligned block that contains `address` and returns its start, to
// pass to unpin(); null when no live block contains it (then nothing is
// pinned). While pinned, a block the library frees stays allocated.
void* pin(const void* address);
// Drops one pin; frees the block when the library already released it and
// this was the last pin. Safe from any thread, without the GIL.
void unpin(void* block) noexcept;

struct PinStats {
  std::int64_t pinned_blocks = 0;  // blocks at least one tensor views
  std::int64_t zombie_blocks = 0;  // of those, blocks the library already freed
  std::size_t zombie_bytes = 0;
};
PinStats pin_stats();

}  // namespace rwd::python
