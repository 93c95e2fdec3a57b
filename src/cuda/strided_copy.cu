#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/strided_copy.h"

namespace rwd::detail {
namespace {

template <typename Element>
__global__ void strided_copy(const Element* src, Element* dst, StridedCopyArgs a) {
  const std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.numel; i += step) {
    std::int64_t rest = i, s = 0, d = 0;
    for (int dim = 3; dim >= 0; --dim) {
      const std::int64_t index = rest % a.shape[dim];
      rest /= a.shape[dim];
      s += index * a.src_strides[dim];
      d += index * a.dst_strides[dim];
    }
    dst[d] = src[s];
  }
}

}  // namespace

int launch_strided_copy(const void* src, void* dst, const StridedCopyArgs& args, void* stream) {
  if (args.numel == 0) return 0;
  constexpr int kThreads = 256;
  const std::int64_t wanted = (args.numel + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(wanted < 65535 ? wanted : 65535);
  auto s = static_cast<cudaStream_t>(stream);
  if (args.element_bytes == 4) {
    strided_copy<<<blocks, kThreads, 0, s>>>(static_cast<const std::uint32_t*>(src), static_cast<std::uint32_t*>(dst),
                                             args);
  } else {
    strided_copy<<<blocks, kThreads, 0, s>>>(static_cast<const std::uint16_t*>(src), static_cast<std::uint16_t*>(dst),
                                             args);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace rwd::detail
