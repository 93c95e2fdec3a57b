// An owning contiguous tensor in a cache's storage: the draft-tree scratch
// (the nodes' inputs, conv windows, recurrent slots) lives where the layer's
// own state lives, so the views a tree hands out are on the cache's device.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <utility>

#include "cache/position_buffer.h"
#include "rewind/tensor.h"
#include "tensor_copy.h"

namespace rwd::detail {

class StateTensor {
 public:
  StateTensor() = default;
  // A zero-filled tensor of `shape` (`rank` extents) in `storage`; counted
  // against no budget (tree scratch is transient). Throws CapacityError.
  StateTensor(std::shared_ptr<Storage> storage, DType dtype, const std::int64_t* shape, int rank) {
    std::array<std::int64_t, kMaxRank> extents{1, 1, 1, 1};
    for (int d = 0; d < rank; ++d) extents[static_cast<std::size_t>(d)] = shape[d];
    view_ = TensorView::contiguous(nullptr, dtype, {extents[0], extents[1], extents[2], extents[3]});
    view_.rank = rank;
    for (int d = rank; d < kMaxRank; ++d) view_.strides[static_cast<std::size_t>(d)] = 0;
    const std::size_t bytes = checked_mul(view_.numel(), static_cast<std::int64_t>(dtype_size(dtype)), "tree scratch");
    buffer_ = AlignedBuffer(bytes, std::move(storage), nullptr);
    if (bytes != 0) storage_zero(*buffer_.storage(), buffer_.data(), bytes);
    view_.data = buffer_.data();
    view_.device = buffer_.device();
  }
  StateTensor(std::shared_ptr<Storage> storage, DType dtype, std::initializer_list<std::int64_t> shape)
      : StateTensor(std::move(storage), dtype, shape.begin(), static_cast<int>(shape.size())) {}

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }  // NOLINT: views are the currency

 private:
  AlignedBuffer buffer_;
  TensorView view_;
};

// A contiguous copy of `v` in `storage`.
inline StateTensor state_copy_of(const std::shared_ptr<Storage>& storage, const TensorView& v) {
  StateTensor out(storage, v.dtype, v.shape.data(), v.rank);
  copy_view(v, out.view());
  return out;
}

}  // namespace rwd::detail
