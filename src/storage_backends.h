// Library-internal constructors of the storage backends (rewind/storage.h).
#pragma once

#include <memory>

#include "rewind/storage.h"

namespace rwd::detail {

// The guarded test backend (guarded_storage.cc).
std::shared_ptr<Storage> make_guarded_storage();
// The CUDA backend of device `index` on its default stream, made on first
// use; null in a build without the CUDA toolkit (cuda_storage.cc).
Storage* cuda_default_storage(int index);

}  // namespace rwd::detail
