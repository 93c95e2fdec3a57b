// The one CUDA kernel of the storage backend: an element-wise copy between
// two strided views of device memory (rank <= 4, 2- or 4-byte elements).
#pragma once

#include <cstdint>

namespace rwd::detail {

struct StridedCopyArgs {
  std::int64_t shape[4];        // unused dims 1
  std::int64_t src_strides[4];  // in elements
  std::int64_t dst_strides[4];
  std::int64_t numel;
  int element_bytes;  // 2 or 4
};

// Queues the copy on `stream` (a cudaStream_t). Returns the launch's
// cudaError_t as an int (0: success).
int launch_strided_copy(const void* src, void* dst, const StridedCopyArgs& args, void* stream);

}  // namespace rwd::detail
