#include "rewind/storage.h"

#include <cstring>

#include "aligned_memory.h"
#include "rewind/cuda_storage.h"
#include "rewind/error.h"
#include "rewind/tensor.h"
#include "storage_backends.h"
#include "tensor_copy.h"

namespace rwd {

std::string Device::describe() const {
  switch (type) {
    case DeviceType::Host: return "cpu";
    case DeviceType::Guarded: return "guarded";
    case DeviceType::Cuda: return "cuda:" + std::to_string(index);
  }
  return "unknown device";
}

namespace {

// Host memory: the library's aligned allocator and memmove.
class HostStorage final : public Storage {
 public:
  Device device() const override { return {}; }
  void* allocate(std::size_t bytes) override { return detail::aligned_allocate(bytes).release(); }
  void deallocate(void* p, std::size_t) noexcept override { detail::AlignedFree()(static_cast<std::byte*>(p)); }
  void copy(void* dst, bool, const void* src, bool, std::size_t bytes) noexcept override {
    if (bytes != 0) std::memmove(dst, src, bytes);
  }
  void fill_zero(void* dst, std::size_t bytes) noexcept override {
    if (bytes != 0) std::memset(dst, 0, bytes);
  }
  void copy_strided(const TensorView& src, const TensorView& dst) noexcept override {
    detail::host_copy_strided(src, dst);
  }
  void synchronize() noexcept override {}
};

}  // namespace

std::shared_ptr<Storage> host_storage() {
  static const std::shared_ptr<Storage> host = std::make_shared<HostStorage>();
  return host;
}

std::shared_ptr<Storage> guarded_storage() {
  static const std::shared_ptr<Storage> guarded = detail::make_guarded_storage();
  return guarded;
}

std::shared_ptr<Storage> default_storage() {
#if defined(REWIND_CUDA_DEFAULT_STORAGE)
  // The device check's build: every suite's caches on CUDA device 0.
  static const std::shared_ptr<Storage> cuda = cuda_storage(0);
  return cuda;
#elif defined(REWIND_GUARDED_STORAGE)
  return guarded_storage();
#else
  return host_storage();
#endif
}

Storage& storage_for(Device device) {
  switch (device.type) {
    case DeviceType::Host: return *host_storage();
    case DeviceType::Guarded: return *guarded_storage();
    case DeviceType::Cuda:
      if (Storage* s = detail::cuda_default_storage(device.index)) return *s;
      throw InvalidArgument("a view on " + device.describe() +
                            " was given, but this build of rewind has no CUDA backend (built without the CUDA "
                            "toolkit); allowed: cpu, guarded");
  }
  throw InvalidArgument("unknown device type " + std::to_string(static_cast<int>(device.type)));
}

}  // namespace rwd

#if !defined(REWIND_WITH_CUDA)
// Without the CUDA toolkit there is no CUDA backend: a CUDA view or storage
// is refused with a message saying so.
namespace rwd {

bool cuda_built() { return false; }
int cuda_device_count() { return 0; }
std::shared_ptr<Storage> cuda_storage(int device, void*) {
  throw InvalidArgument("cuda_storage(" + std::to_string(device) +
                        "): this build of rewind has no CUDA backend (CMake did not find the CUDA toolkit)");
}

Storage* detail::cuda_default_storage(int) { return nullptr; }

}  // namespace rwd
#endif
