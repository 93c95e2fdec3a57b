// The guarded test backend: state memory the host cannot touch except inside
// this file's copy calls. Every allocation is its own mapping of whole
// pages, PROT_NONE at rest; a copy opens the mappings it touches for read
// and write, copies, and closes them again, under one lock (so two
// threads' copies cannot reopen each other's pages). A cache code path that
// dereferences state memory itself then faults where it happens.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "aligned_memory.h"
#include "rewind/error.h"
#include "rewind/tensor.h"
#include "storage_backends.h"
#include "tensor_copy.h"

namespace rwd::detail {
namespace {

std::size_t page_size() {
  static const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

[[noreturn]] void guarded_fault(const char* what, const void* p) {
  std::fprintf(stderr, "rewind guarded storage: %s %p is not inside any guarded allocation\n", what, p);
  std::abort();
}

class GuardedStorage final : public Storage {
 public:
  Device device() const override { return {DeviceType::Guarded, 0}; }

  void* allocate(std::size_t bytes) override {
    if (bytes > kMaxBufferBytes) {
      throw CapacityError("an allocation of " + std::to_string(bytes) + " bytes exceeds the limit of 2^48 bytes");
    }
    if (const std::size_t physical = physical_memory_bytes(); physical != 0 && bytes > physical) {
      throw CapacityError("an allocation of " + std::to_string(bytes) + " bytes exceeds this machine's " +
                          std::to_string(physical) + " bytes of memory; nothing was allocated");
    }
    const std::size_t mapped = (bytes + page_size() - 1) / page_size() * page_size();
    void* p = mmap(nullptr, mapped, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      throw CapacityError("the guarded storage could not map " + std::to_string(mapped) +
                          " bytes; nothing was changed");
    }
    std::lock_guard<std::mutex> lock(mutex_);
    mappings_[reinterpret_cast<std::uintptr_t>(p)] = mapped;
    return p;
  }

  void deallocate(void* p, std::size_t) noexcept override {
    if (p == nullptr) return;
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = mappings_.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == mappings_.end()) guarded_fault("freeing", p);
    munmap(p, it->second);
    mappings_.erase(it);
  }

  void copy(void* dst, bool dst_on_device, const void* src, bool src_on_device, std::size_t bytes) noexcept override {
    if (bytes == 0) return;
    std::lock_guard<std::mutex> lock(mutex_);
    Opened opened(*this);
    if (dst_on_device) opened.open(dst);
    if (src_on_device) opened.open(src);
    std::memmove(dst, src, bytes);
  }

  void fill_zero(void* dst, std::size_t bytes) noexcept override {
    if (bytes == 0) return;
    std::lock_guard<std::mutex> lock(mutex_);
    Opened opened(*this);
    opened.open(dst);
    std::memset(dst, 0, bytes);
  }

  void copy_strided(const TensorView& src, const TensorView& dst) noexcept override {
    for (int d = 0; d < src.rank; ++d)
      if (src.shape[static_cast<std::size_t>(d)] == 0) return;  // an empty view may point anywhere
    std::lock_guard<std::mutex> lock(mutex_);
    Opened opened(*this);
    if (!dst.device.is_host()) opened.open(dst.data);
    if (!src.device.is_host()) opened.open(src.data);
    host_copy_strided(src, dst);
  }

  void synchronize() noexcept override {}

 private:
  // The mappings opened for one copy, closed again when it ends. A view's
  // first element and all of it lie in one allocation, so opening the
  // mapping that holds its data pointer opens every byte it may touch.
  class Opened {
   public:
    explicit Opened(GuardedStorage& s) : s_(s) {}
    ~Opened() {
      for (int i = 0; i < count_; ++i)
        mprotect(open_[static_cast<std::size_t>(i)].first, open_[static_cast<std::size_t>(i)].second, PROT_NONE);
    }
    Opened(const Opened&) = delete;
    Opened& operator=(const Opened&) = delete;
    void open(const void* p) {
      const auto addr = reinterpret_cast<std::uintptr_t>(p);
      auto it = s_.mappings_.upper_bound(addr);
      if (it == s_.mappings_.begin()) guarded_fault("copying at", p);
      --it;
      if (addr >= it->first + it->second) guarded_fault("copying at", p);
      void* base = reinterpret_cast<void*>(it->first);
      for (int i = 0; i < count_; ++i)
        if (open_[static_cast<std::size_t>(i)].first == base) return;
      mprotect(base, it->second, PROT_READ | PROT_WRITE);
      open_[static_cast<std::size_t>(count_++)] = {base, it->second};
    }

   private:
    GuardedStorage& s_;
    std::array<std::pair<void*, std::size_t>, 2> open_{};
    int count_ = 0;
  };

  std::mutex mutex_;
  std::map<std::uintptr_t, std::size_t> mappings_;  // base -> mapped bytes
};

}  // namespace

std::shared_ptr<Storage> make_guarded_storage() { return std::make_shared<GuardedStorage>(); }

}  // namespace rwd::detail
