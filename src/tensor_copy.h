// Copies of views into tensors of their own, for the library's own use
// (snapshots, trees, the prefix cache, inputs that alias the cache).
#pragma once

#include "rewind/tensor.h"

namespace rwd::detail {

// The strided host copy behind every backend's copy_strided for host memory
// (memmove runs; overlapping views only when they are the same view).
void host_copy_strided(const TensorView& src, const TensorView& dst) noexcept;

// The storage that copies between src and dst: null when both are host
// memory. Throws InvalidArgument (naming `what`) for two different devices.
Storage* storage_of_pair(const TensorView& src, const TensorView& dst, const char* what);

// The library's copy of views, asynchronous on a device (ordered on its
// storage's stream): what copy_tensor does without the wait. Throws
// InvalidArgument for mismatched layouts (naming `what`) or two devices.
void copy_view(const TensorView& src, const TensorView& dst, const char* what = "copy_tensor");

// A new contiguous host tensor holding `v`'s elements. Throws what Tensor's
// constructor throws (CapacityError when the bytes cannot be allocated).
inline Tensor copy_of(const TensorView& v) {
  Tensor out(v.dtype, v.shape.data(), v.rank);
  copy_tensor(v, out.view());  // waits: the host reads it next
  return out;
}

// True for a tensor that exists: a default-constructed one has neither a
// shape nor data; one of zero rows has a shape but no data.
inline bool present(const Tensor& t) { return t.view().data != nullptr || t.view().rank != 0; }

}  // namespace rwd::detail
