// rewind/cuda_storage.h: CUDA device memory as a cache's storage.
//
// Built when CMake finds the CUDA toolkit (REWIND_WITH_CUDA; cuda_built()
// says so at run time); in other builds every function here throws
// InvalidArgument saying so. Copies are issued on the caller's stream,
// asynchronously where the CUDA runtime allows (device to device, host to
// device), so work the caller queues on the same stream after an update sees
// its results; a device-to-host read (snapshot, get(), copy_tensor to the
// host) waits for the stream.
#pragma once

#include <memory>

#include "rewind/storage.h"

namespace rwd {

// True when this build has the CUDA backend.
bool cuda_built();
// Number of CUDA devices the runtime sees (0 without a driver or a GPU, and
// in a build without the backend).
int cuda_device_count();
// Storage on CUDA device `device`, its copies on `stream` (a cudaStream_t;
// null: the legacy default stream). Throws InvalidArgument for a device
// outside [0, cuda_device_count()) or a build without the backend.
// REQUIRES: the stream outlives every cache using the storage.
std::shared_ptr<Storage> cuda_storage(int device = 0, void* stream = nullptr);

}  // namespace rwd
