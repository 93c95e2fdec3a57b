// rewind/tensor.h: a non-owning strided view and a small owning tensor.
//
// TensorView describes memory it does not own: a data pointer, an element
// type, up to four dimensions and a stride (in elements) per dimension. The
// cache takes its inputs as views and returns views into its own storage; a
// returned view stays valid until the next call that mutates the same layer.
// A view names the Device its bytes are on (rewind/storage.h): host unless
// it came from a cache whose storage is a device; only a host view may be
// read in place. Tensor owns a 64-byte aligned, contiguous, zero-initialised buffer.
//
// Conventions: "REQUIRES: x" is the caller's duty and is not checked;
// "Throws E when x" is checked.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

#include "rewind/dtype.h"
#include "rewind/storage.h"

namespace rwd {

inline constexpr int kMaxRank = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::F32;
  int rank = 0;
  std::array<std::int64_t, kMaxRank> shape{};    // unused dims are 1
  std::array<std::int64_t, kMaxRank> strides{};  // in elements; unused dims 0
  Device device{};                               // where `data` points

  // A contiguous (row-major) view of `shape`. Throws InvalidArgument for
  // more than 4 extents, a negative extent, or more than 2^62 elements.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape);

  // A view with explicit strides (in elements; 0 broadcasts, negative runs
  // backwards). Throws InvalidArgument when shape.size() != strides.size(),
  // for more than 4 extents or a negative extent.
  static TensorView strided(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                            std::initializer_list<std::int64_t> strides);

  // REQUIRES: 0 <= dim < 4 (not checked: hot path).
  std::int64_t size(int dim) const { return shape[static_cast<std::size_t>(dim)]; }
  std::int64_t stride(int dim) const { return strides[static_cast<std::size_t>(dim)]; }
  // Number of elements (product of the extents; 1 for rank 0). Throws
  // InvalidArgument when the product passes 2^62 (a broadcast view may
  // describe that many).
  std::int64_t numel() const;
  // The sub-range [start, start + length) of dimension `dim`, same strides.
  // Throws IndexError unless 0 <= dim < rank and 0 <= start <= start +
  // length <= size(dim).
  TensorView slice(int dim, std::int64_t start, std::int64_t length) const;
  // True when the strides are the row-major strides of the shape (extents of
  // 1 may carry any stride).
  bool is_contiguous() const;

  // Address of an element. REQUIRES: rank indices, each within its extent
  // (not checked: this is the hot path).
  void* ptr(std::int64_t i0 = 0, std::int64_t i1 = 0, std::int64_t i2 = 0, std::int64_t i3 = 0) const {
    std::int64_t off = i0 * strides[0] + i1 * strides[1] + i2 * strides[2] + i3 * strides[3];
    return static_cast<std::byte*>(data) + off * static_cast<std::int64_t>(dtype_size(dtype));
  }
  // Element read / write converted through f32 (for tests and slow paths;
  // on a device, one synchronous copy through storage_for(device) each).
  float get(std::int64_t i0 = 0, std::int64_t i1 = 0, std::int64_t i2 = 0, std::int64_t i3 = 0) const {
    if (!device.is_host()) return get_on_device(ptr(i0, i1, i2, i3));
    return load_as_f32(ptr(i0, i1, i2, i3), dtype);
  }
  void set(float v, std::int64_t i0 = 0, std::int64_t i1 = 0, std::int64_t i2 = 0, std::int64_t i3 = 0) const {
    if (!device.is_host()) return set_on_device(ptr(i0, i1, i2, i3), v);
    store_from_f32(ptr(i0, i1, i2, i3), dtype, v);
  }

  // "[2, 8, 5, 64] f16" ("... on cuda:0" off the host), for messages.
  std::string describe() const;

 private:
  float get_on_device(const void* p) const;
  void set_on_device(void* p, float v) const;
};

// Copies every element of `src` into `dst` bit for bit, whatever their
// strides and devices (host to device, device to host, within a device, through
// that device's storage; synchronous). Throws InvalidArgument unless both
// have the same rank, shape and dtype, or when they are on two different
// non-host devices. REQUIRES: `dst` does not overlap `src` unless both are
// the same view.
void copy_tensor(const TensorView& src, const TensorView& dst);

// True when both views have the same shape and dtype and every element has
// identical bits (device views are read through their storage).
bool bitwise_equal(const TensorView& a, const TensorView& b);

// Owns a contiguous, 64-byte aligned, zero-filled buffer. Move-only.
class Tensor {
 public:
  Tensor() = default;
  // Throws InvalidArgument for negative extents, rank > 4 or more than 2^62
  // elements, CapacityError when the bytes pass 2^48 or the system cannot
  // allocate them.
  Tensor(DType dtype, std::initializer_list<std::int64_t> shape);
  // Throws as above, and InvalidArgument for a rank outside 0..4.
  // REQUIRES: `shape` points to `rank` extents.
  Tensor(DType dtype, const std::int64_t* shape, int rank);
  Tensor(Tensor&&) noexcept = default;
  Tensor& operator=(Tensor&&) noexcept = default;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }  // NOLINT: views are the currency
  template <typename T>
  T* data() const {
    return static_cast<T*>(view_.data);
  }
  std::int64_t numel() const { return view_.numel(); }
  std::size_t bytes() const { return static_cast<std::size_t>(numel()) * dtype_size(view_.dtype); }

 private:
  struct Free {
    void operator()(std::byte* p) const noexcept;
  };
  std::unique_ptr<std::byte, Free> storage_;  // from the library's one aligned allocator
  TensorView view_;
};

}  // namespace rwd
