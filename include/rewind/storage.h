// rewind/storage.h: where a cache's state bytes live, and the only code that
// reads or writes them.
//
// Every byte of cache state (attention rows, side tensors, conv inputs,
// recurrent slots, paged blocks, draft-tree scratch) is allocated from a
// Storage and moved only by its copy calls; the cache's bookkeeping
// (positions, rings, blocks, rollback bounds, transactions) never
// dereferences it. A cache takes its storage from LayerOptions::storage
// (null: default_storage()). Views the cache returns carry the storage's
// Device; a view of device memory is a device pointer with the same shape
// and strides as a host view, valid for as long (docs/semantics.md 17).
//
// Backends: host memory (host_storage(), today's behaviour and speed), a
// guarded test backend (guarded_storage(): pages the host cannot touch
// outside the backend's own copy calls, so a code path that dereferences
// state memory directly faults) and, when built with the CUDA toolkit,
// CUDA device memory (rewind/cuda_storage.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace rwd {

struct TensorView;

enum class DeviceType : std::uint8_t {
  Host,     // ordinary host memory: every view can be read in place
  Guarded,  // host pages kept inaccessible except inside the backend's copies (tests)
  Cuda,     // CUDA device memory of device `index`
};

// Where a view's bytes are.
struct Device {
  DeviceType type = DeviceType::Host;
  int index = 0;  // the CUDA device ordinal; 0 otherwise

  bool is_host() const { return type == DeviceType::Host; }
  bool operator==(const Device&) const = default;
  // "cpu", "guarded", "cuda:1", for messages.
  std::string describe() const;
};

// One place state can live. Implementations are thread-safe for calls on
// distinct allocations; the cache calls them from the thread that owns it.
// In every copy call each pointer is either host memory (ordinary,
// readable in place) or memory of this storage, as its flag says.
class Storage {
 public:
  virtual ~Storage() = default;

  virtual Device device() const = 0;
  // `bytes` (> 0) of memory, aligned to 64 bytes, contents undefined.
  // Throws CapacityError when the device refuses; nothing is allocated then.
  virtual void* allocate(std::size_t bytes) = 0;
  // Frees what allocate returned, with the same size.
  virtual void deallocate(void* p, std::size_t bytes) noexcept = 0;
  // Copies `bytes` from src to dst (ranges may overlap). Cannot fail short
  // of a device fault, which aborts with a message: the cache's apply steps
  // copy after every allocation has succeeded.
  virtual void copy(void* dst, bool dst_on_device, const void* src, bool src_on_device, std::size_t bytes) noexcept = 0;
  // Sets `bytes` at dst (this storage's memory) to zero.
  virtual void fill_zero(void* dst, std::size_t bytes) noexcept = 0;
  // Copies every element of src into dst (same shape and dtype, checked by
  // the caller), whatever their strides; each is host memory or this
  // storage's, as its Device says.
  virtual void copy_strided(const TensorView& src, const TensorView& dst) noexcept = 0;
  // Waits until every copy issued so far is complete (a no-op for host
  // memory); a host read of device results needs it first.
  virtual void synchronize() noexcept = 0;
};

// Ordinary host memory; copies are memcpy / memmove.
std::shared_ptr<Storage> host_storage();
// The guarded test backend: allocations are whole pages mapped PROT_NONE,
// opened only for the duration of the backend's own copy calls (one at a
// time, serialised by a lock). Slow; for proving no code path touches state
// memory directly.
std::shared_ptr<Storage> guarded_storage();
// What a cache uses when LayerOptions::storage is null: host_storage(), or
// guarded_storage() in a build with REWIND_GUARDED_STORAGE=ON, or CUDA
// device 0 with REWIND_CUDA_DEFAULT_STORAGE=ON (the device check's build).
std::shared_ptr<Storage> default_storage();

// The storage that holds views on `device`: host_storage() for the host,
// guarded_storage() for Guarded, the CUDA backend of that device (default
// stream) when built with CUDA. Throws InvalidArgument for a device this
// build has no backend for.
Storage& storage_for(Device device);

}  // namespace rwd
