// Keeps cache memory alive while Python tensors view it.
//
// rewind's layers move their buffers when they grow or shrink, and free them
// when a layer is destroyed. A Python tensor returned by the module points
// into those buffers, and Python code may keep it as long as it likes, so a
// plain view could read freed memory. The module is linked with
// `-Wl,--wrap=aligned_alloc -Wl,--wrap=free` (python/CMakeLists.txt): every
// aligned buffer of the library and the runtime linked into the module is
// recorded here, and a buffer that a returned tensor still views is not
// handed back to the system when the library frees it: it becomes a zombie,
// released when the last tensor viewing it goes. The library itself is not
// changed; only this module's link is.
#include "pinning.h"

#include <cstdlib>
#include <map>
#include <mutex>

extern "C" {
void* __real_aligned_alloc(std::size_t alignment, std::size_t size);
void __real_free(void* p);
void* __wrap_aligned_alloc(std::size_t alignment, std::size_t size);
void __wrap_free(void* p);
}

namespace rwd::python {
namespace {

struct Block {
  std::size_t size = 0;
  std::int64_t pins = 0;
  bool freed = false;  // the library released it while pinned
};

// Blocks by start address. Intentionally leaked: frees may arrive during
// static destruction, after a function-local static would be gone.
struct Registry {
  std::mutex mutex;
  std::map<std::uintptr_t, Block> blocks;
};

Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

}  // namespace

void* pin(const void* address) {
  if (address == nullptr) return nullptr;
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  const auto a = reinterpret_cast<std::uintptr_t>(address);
  auto it = r.blocks.upper_bound(a);
  if (it == r.blocks.begin()) return nullptr;
  --it;
  if (a >= it->first + it->second.size || it->second.freed) return nullptr;
  ++it->second.pins;
  return reinterpret_cast<void*>(it->first);
}

void unpin(void* block) noexcept {
  if (block == nullptr) return;
  Registry& r = registry();
  void* release = nullptr;
  {
    std::lock_guard lock(r.mutex);
    auto it = r.blocks.find(reinterpret_cast<std::uintptr_t>(block));
    if (it == r.blocks.end()) return;
    if (--it->second.pins == 0 && it->second.freed) {
      r.blocks.erase(it);
      release = block;
    }
  }
  if (release != nullptr) __real_free(release);
}

PinStats pin_stats() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  PinStats s;
  for (const auto& [start, block] : r.blocks) {
    (void)start;
    if (block.pins > 0) ++s.pinned_blocks;
    if (block.freed) {
      ++s.zombie_blocks;
      s.zombie_bytes += block.size;
    }
  }
  return s;
}

}  // namespace rwd::python

extern "C" void* __wrap_aligned_alloc(std::size_t alignment, std::size_t size) {
  void* p = __real_aligned_alloc(alignment, size);
  if (p != nullptr) {
    auto& r = rwd::python::registry();
    std::lock_guard lock(r.mutex);
    r.blocks[reinterpret_cast<std::uintptr_t>(p)] = rwd::python::Block{size, 0, false};
  }
  return p;
}

extern "C" void __wrap_free(void* p) {
  if (p == nullptr) return;
  auto& r = rwd::python::registry();
  {
    std::lock_guard lock(r.mutex);
    auto it = r.blocks.find(reinterpret_cast<std::uintptr_t>(p));
    if (it != r.blocks.end()) {
      if (it->second.pins > 0) {
        it->second.freed = true;  // released by unpin() when its last view goes
        return;
      }
      r.blocks.erase(it);
    }
  }
  __real_free(p);
}
