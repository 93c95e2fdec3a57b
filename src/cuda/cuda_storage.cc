// The CUDA backend of rewind/storage.h: device allocations and the copies
// the cache's core asks for, on the stream the caller gave. Copies between
// a host view and a device view with different strides go through one
// contiguous staging buffer on each side and the strided-copy kernel, so
// each update costs a fixed number of runtime calls whatever its shape.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "cuda/strided_copy.h"
#include "rewind/cuda_storage.h"
#include "rewind/error.h"
#include "rewind/tensor.h"
#include "storage_backends.h"
#include "tensor_copy.h"

namespace rwd {
namespace {

// Copies run inside noexcept steps (an apply after every allocation has
// succeeded): a failing runtime call there is a device fault, not a
// refusal, and nothing consistent can be left behind.
void check(cudaError_t err, const char* what) noexcept {
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "rewind CUDA storage: %s failed: %s\n", what, cudaGetErrorString(err));
  std::abort();
}

// Makes `device` current for a scope, restoring the caller's.
class DeviceScope {
 public:
  explicit DeviceScope(int device) noexcept : device_(device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device_) check(cudaSetDevice(device_), "cudaSetDevice");
  }
  ~DeviceScope() {
    if (previous_ >= 0 && previous_ != device_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int device_;
  int previous_ = -1;
};

detail::StridedCopyArgs args_of(const TensorView& src, const TensorView& dst) {
  detail::StridedCopyArgs a{};
  a.numel = 1;
  for (int d = 0; d < 4; ++d) {
    const bool used = d < src.rank;
    a.shape[d] = used ? src.shape[static_cast<std::size_t>(d)] : 1;
    a.src_strides[d] = used ? src.strides[static_cast<std::size_t>(d)] : 0;
    a.dst_strides[d] = used ? dst.strides[static_cast<std::size_t>(d)] : 0;
    a.numel *= a.shape[d];
  }
  a.element_bytes = static_cast<int>(dtype_size(src.dtype));
  return a;
}

// A contiguous view of `v`'s shape at `data`, on `device`.
TensorView contiguous_like(const TensorView& v, void* data, Device device) {
  TensorView out = v;
  out.data = data;
  out.device = device;
  std::int64_t stride = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    out.strides[static_cast<std::size_t>(d)] = stride;
    stride *= v.shape[static_cast<std::size_t>(d)];
  }
  return out;
}

class CudaStorage final : public Storage {
 public:
  CudaStorage(int device, cudaStream_t stream) : device_(device), stream_(stream) {}

  Device device() const override { return {DeviceType::Cuda, device_}; }

  void* allocate(std::size_t bytes) override {
    DeviceScope scope(device_);
    void* p = nullptr;
    if (const cudaError_t err = cudaMalloc(&p, bytes); err != cudaSuccess) {
      cudaGetLastError();  // clears the error: a refused allocation is not a fault
      throw CapacityError("CUDA device " + std::to_string(device_) + " could not allocate " + std::to_string(bytes) +
                          " bytes (" + cudaGetErrorString(err) + "); nothing was changed");
    }
    return p;
  }

  void deallocate(void* p, std::size_t) noexcept override {
    DeviceScope scope(device_);
    check(cudaFree(p), "cudaFree");  // waits for the work queued on it
  }

  void copy(void* dst, bool dst_on_device, const void* src, bool src_on_device, std::size_t bytes) noexcept override {
    if (bytes == 0 || dst == src) return;
    DeviceScope scope(device_);
    const auto d = reinterpret_cast<std::uintptr_t>(dst), s = reinterpret_cast<std::uintptr_t>(src);
    if (dst_on_device && src_on_device && d < s + bytes && s < d + bytes) {
      // cudaMemcpy leaves overlapping ranges undefined: through a staging copy.
      void* staging = nullptr;
      check(cudaMallocAsync(&staging, bytes, stream_), "cudaMallocAsync");
      check(cudaMemcpyAsync(staging, src, bytes, cudaMemcpyDeviceToDevice, stream_), "cudaMemcpyAsync");
      check(cudaMemcpyAsync(dst, staging, bytes, cudaMemcpyDeviceToDevice, stream_), "cudaMemcpyAsync");
      check(cudaFreeAsync(staging, stream_), "cudaFreeAsync");
      return;
    }
    check(cudaMemcpyAsync(dst, src, bytes, kind(dst_on_device, src_on_device), stream_), "cudaMemcpyAsync");
    // A host destination is read as soon as this returns.
    if (!dst_on_device) check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

  void fill_zero(void* dst, std::size_t bytes) noexcept override {
    if (bytes == 0) return;
    DeviceScope scope(device_);
    check(cudaMemsetAsync(dst, 0, bytes, stream_), "cudaMemsetAsync");
  }

  void copy_strided(const TensorView& src, const TensorView& dst) noexcept override {
    std::int64_t numel = 1;
    for (int d = 0; d < src.rank; ++d) numel *= src.shape[static_cast<std::size_t>(d)];
    if (numel == 0) return;
    DeviceScope scope(device_);
    const auto bytes = static_cast<std::size_t>(numel) * dtype_size(src.dtype);
    const bool src_dev = !src.device.is_host(), dst_dev = !dst.device.is_host();
    if (src.is_contiguous() && dst.is_contiguous()) {
      copy(dst.data, dst_dev, src.data, src_dev, bytes);
      return;
    }
    if (src_dev && dst_dev) {
      kernel(src, dst);
      return;
    }
    try {
      if (!src_dev) {
        // Host to device: pack on the host, one transfer, scatter on the device.
        Tensor packed(src.dtype, src.shape.data(), src.rank);
        detail::host_copy_strided(src, packed.view());
        if (dst.is_contiguous()) {
          copy(dst.data, true, packed.view().data, false, bytes);
          return;
        }
        void* staging = nullptr;
        check(cudaMallocAsync(&staging, bytes, stream_), "cudaMallocAsync");
        // From pageable memory the call returns once `packed` has been read.
        check(cudaMemcpyAsync(staging, packed.view().data, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync");
        kernel(contiguous_like(src, staging, device()), dst);
        check(cudaFreeAsync(staging, stream_), "cudaFreeAsync");
        return;
      }
      // Device to host: gather on the device, one transfer, scatter on the host.
      Tensor packed(src.dtype, src.shape.data(), src.rank);
      if (src.is_contiguous()) {
        copy(packed.view().data, false, src.data, true, bytes);
      } else {
        void* staging = nullptr;
        check(cudaMallocAsync(&staging, bytes, stream_), "cudaMallocAsync");
        kernel(src, contiguous_like(src, staging, device()));
        copy(packed.view().data, false, staging, true, bytes);
        check(cudaFreeAsync(staging, stream_), "cudaFreeAsync");
      }
      detail::host_copy_strided(packed.view(), dst);
    } catch (const Error& e) {
      std::fprintf(stderr, "rewind CUDA storage: no host memory to stage a copy: %s\n", e.what());
      std::abort();
    }
  }

  void synchronize() noexcept override {
    DeviceScope scope(device_);
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

 private:
  static cudaMemcpyKind kind(bool dst_on_device, bool src_on_device) {
    if (dst_on_device) return src_on_device ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice;
    return src_on_device ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost;
  }
  void kernel(const TensorView& src, const TensorView& dst) noexcept {
    check(static_cast<cudaError_t>(detail::launch_strided_copy(src.data, dst.data, args_of(src, dst), stream_)),
          "the strided-copy kernel");
  }

  int device_;
  cudaStream_t stream_;
};

}  // namespace

bool cuda_built() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::shared_ptr<Storage> cuda_storage(int device, void* stream) {
  const int n = cuda_device_count();
  if (device < 0 || device >= n) {
    throw InvalidArgument("cuda_storage(" + std::to_string(device) + "): the device must be in [0, " +
                          std::to_string(n) + ") (the CUDA runtime sees " + std::to_string(n) + " devices)");
  }
  return std::make_shared<CudaStorage>(device, static_cast<cudaStream_t>(stream));
}

namespace detail {

Storage* cuda_default_storage(int index) {
  static std::mutex mutex;
  static std::map<int, std::shared_ptr<Storage>> storages;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = storages.find(index);
  if (it != storages.end()) return it->second.get();
  if (index < 0 || index >= cuda_device_count()) return nullptr;
  return storages.emplace(index, std::make_shared<CudaStorage>(index, nullptr)).first->second.get();
}

}  // namespace detail
}  // namespace rwd
