// Copies of views into tensors of their own, for the library's own use
// (snapshots, trees, the prefix cache, inputs that alias the cache).
#pragma once

#include "rewind/tensor.h"

namespace rwd::detail {

// A new contiguous tensor holding `v`'s elements. Throws what Tensor's
// constructor throws (CapacityError when the bytes cannot be allocated).
inline Tensor copy_of(const TensorView& v) {
  Tensor out(v.dtype, v.shape.data(), v.rank);
  copy_tensor(v, out.view());
  return out;
}

// True for a tensor that exists: a default-constructed one has neither a
// shape nor data; one of zero rows has a shape but no data.
inline bool present(const Tensor& t) { return t.view().data != nullptr || t.view().rank != 0; }

}  // namespace rwd::detail
