#include "rewind/tensor.h"

#include <cstdlib>
#include <new>
#include <sstream>

#include "aligned_memory.h"
#include "rewind/error.h"
#include "tensor_copy.h"

namespace rwd {
namespace {

void set_shape(TensorView& v, std::initializer_list<std::int64_t> shape) {
  if (shape.size() > kMaxRank) {
    throw InvalidArgument("tensor rank " + std::to_string(shape.size()) + " exceeds the maximum of 4");
  }
  v.rank = static_cast<int>(shape.size());
  v.shape.fill(1);
  v.strides.fill(0);
  std::size_t i = 0;
  for (std::int64_t extent : shape) {
    if (extent < 0) throw InvalidArgument("tensor extent " + std::to_string(extent) + " is negative");
    v.shape[i++] = extent;
  }
}

constexpr std::int64_t kMaxElements = std::int64_t{1} << 62;

// Product of the extents, or InvalidArgument when it passes 2^62.
std::int64_t checked_numel(const TensorView& v) {
  std::int64_t n = 1;
  for (int d = 0; d < v.rank; ++d) {
    const std::int64_t e = v.shape[static_cast<std::size_t>(d)];
    if (e != 0 && n > kMaxElements / e) {
      throw InvalidArgument("tensor " + v.describe() + " has more than 2^62 elements");
    }
    n *= e;
  }
  return n;
}

void set_contiguous_strides(TensorView& v) {
  checked_numel(v);
  std::int64_t stride = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.strides[static_cast<std::size_t>(d)] = stride;
    stride *= v.shape[static_cast<std::size_t>(d)];
  }
}

}  // namespace

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  set_shape(v, shape);
  set_contiguous_strides(v);
  return v;
}

TensorView TensorView::strided(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                               std::initializer_list<std::int64_t> strides) {
  if (shape.size() != strides.size()) {
    throw InvalidArgument("tensor view has " + std::to_string(shape.size()) + " extents but " +
                          std::to_string(strides.size()) + " strides");
  }
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  set_shape(v, shape);
  std::size_t i = 0;
  for (std::int64_t s : strides) v.strides[i++] = s;
  return v;
}

std::int64_t TensorView::numel() const { return checked_numel(*this); }

TensorView TensorView::slice(int dim, std::int64_t start, std::int64_t length) const {
  if (dim < 0 || dim >= rank) {
    throw IndexError("slice(" + std::to_string(dim) + ", ...) of " + describe() + ": dimension outside [0, " +
                     std::to_string(rank) + ")");
  }
  const std::int64_t extent = size(dim);
  if (start < 0 || length < 0 || start > extent || length > extent - start) {
    throw IndexError("slice(" + std::to_string(dim) + ", " + std::to_string(start) + ", " + std::to_string(length) +
                     ") of " + describe() + ": the range must lie within [0, " + std::to_string(extent) + ")");
  }
  TensorView out = *this;
  out.shape[static_cast<std::size_t>(dim)] = length;
  if (length > 0 && start > 0)
    out.data = ptr(dim == 0 ? start : 0, dim == 1 ? start : 0, dim == 2 ? start : 0, dim == 3 ? start : 0);
  return out;
}

bool TensorView::is_contiguous() const {
  std::int64_t expected = 1;
  for (int d = rank - 1; d >= 0; --d) {
    const auto i = static_cast<std::size_t>(d);
    if (shape[i] != 1 && strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

std::string TensorView::describe() const {
  std::ostringstream out;
  out << '[';
  for (int d = 0; d < rank; ++d) out << (d ? ", " : "") << shape[static_cast<std::size_t>(d)];
  out << "] " << dtype_name(dtype);
  if (!device.is_host()) out << " on " << device.describe();
  return out.str();
}

namespace {

void check_same_layout(const TensorView& a, const TensorView& b, const char* what) {
  if (a.rank != b.rank || a.dtype != b.dtype || a.shape != b.shape) {
    throw InvalidArgument(std::string(what) + ": tensors differ: " + a.describe() + " vs " + b.describe());
  }
}

// Calls fn(pa, pb) with byte pointers to each pair of corresponding elements'
// innermost rows of `row` elements (the last dimension).
template <typename Fn>
void for_each_row(const TensorView& a, const TensorView& b, Fn&& fn) {
  std::array<std::int64_t, 3> outer{1, 1, 1};
  for (int d = 0; d + 1 < a.rank; ++d) outer[static_cast<std::size_t>(d)] = a.shape[static_cast<std::size_t>(d)];
  for (std::int64_t i = 0; i < outer[0]; ++i)
    for (std::int64_t j = 0; j < outer[1]; ++j)
      for (std::int64_t k = 0; k < outer[2]; ++k)
        if (!fn(a.ptr(i, j, k, 0), b.ptr(i, j, k, 0))) return;
}

}  // namespace

namespace {

struct CopyDim {
  std::int64_t extent, src_stride, dst_stride;  // strides in elements
};

// Fixed-size memcpy compiles to one load and one store, without the
// aliasing and alignment assumptions a typed pointer would make.
template <std::size_t kBytes>
void copy_elements(const std::byte* src, std::byte* dst, std::int64_t n, std::int64_t src_stride,
                   std::int64_t dst_stride) {
  const auto sb = src_stride * static_cast<std::int64_t>(kBytes);
  const auto db = dst_stride * static_cast<std::int64_t>(kBytes);
  for (std::int64_t e = 0; e < n; ++e) std::memcpy(dst + e * db, src + e * sb, kBytes);
}

}  // namespace

namespace detail {

void host_copy_strided(const TensorView& src, const TensorView& dst) noexcept {
  for (int d = 0; d < src.rank; ++d)
    if (src.shape[static_cast<std::size_t>(d)] == 0) return;
  const auto es = static_cast<std::int64_t>(dtype_size(src.dtype));
  std::array<CopyDim, kMaxRank> dims{};
  int count = 0;
  for (int d = 0; d < src.rank; ++d) {
    const auto i = static_cast<std::size_t>(d);
    if (src.shape[i] > 1) dims[static_cast<std::size_t>(count++)] = {src.shape[i], src.strides[i], dst.strides[i]};
  }
  auto take = [&](int i) {
    const CopyDim d = dims[static_cast<std::size_t>(i)];
    for (int j = i; j + 1 < count; ++j) dims[static_cast<std::size_t>(j)] = dims[static_cast<std::size_t>(j + 1)];
    --count;
    return d;
  };
  // The innermost loop: a run contiguous in both views, grown by every
  // dimension that continues it in both (e.g. heads x head_dim of one
  // token), copied with memcpy. Without one (a transposing copy such as
  // [B, C, q] time-major into the cache's token-major rows), an element loop
  // along the destination's densest dimension.
  std::int64_t run = 1;
  for (int i = 0; i < count; ++i) {
    if (dims[static_cast<std::size_t>(i)].src_stride == 1 && dims[static_cast<std::size_t>(i)].dst_stride == 1) {
      run = take(i).extent;
      for (bool grown = true; grown;) {
        grown = false;
        for (int j = 0; j < count; ++j) {
          const CopyDim& d = dims[static_cast<std::size_t>(j)];
          if (d.src_stride == run && d.dst_stride == run) {
            run *= take(j).extent;
            grown = true;
            break;
          }
        }
      }
      break;
    }
  }
  CopyDim inner{1, 0, 0};
  if (run == 1 && count > 0) {
    int best = 0;
    for (int i = 1; i < count; ++i)
      if (std::abs(dims[static_cast<std::size_t>(i)].dst_stride) <
          std::abs(dims[static_cast<std::size_t>(best)].dst_stride))
        best = i;
    inner = take(best);
  }
  const auto* s0 = static_cast<const std::byte*>(src.data);
  auto* d0 = static_cast<std::byte*>(dst.data);
  std::array<std::int64_t, kMaxRank> index{};
  while (true) {
    std::int64_t so = 0, dof = 0;
    for (int i = 0; i < count; ++i) {
      so += index[static_cast<std::size_t>(i)] * dims[static_cast<std::size_t>(i)].src_stride;
      dof += index[static_cast<std::size_t>(i)] * dims[static_cast<std::size_t>(i)].dst_stride;
    }
    const std::byte* ps = s0 + so * es;
    std::byte* pd = d0 + dof * es;
    if (run > 1 || inner.extent == 1) {
      std::memmove(pd, ps, static_cast<std::size_t>(run * es));
    } else if (es == 4) {
      copy_elements<4>(ps, pd, inner.extent, inner.src_stride, inner.dst_stride);
    } else {
      copy_elements<2>(ps, pd, inner.extent, inner.src_stride, inner.dst_stride);
    }
    int d = count - 1;
    for (; d >= 0; --d) {
      auto& i = index[static_cast<std::size_t>(d)];
      if (++i < dims[static_cast<std::size_t>(d)].extent) break;
      i = 0;
    }
    if (d < 0) break;
  }
}

Storage* storage_of_pair(const TensorView& src, const TensorView& dst, const char* what) {
  if (src.device.is_host() && dst.device.is_host()) return nullptr;
  if (!src.device.is_host() && !dst.device.is_host() && src.device != dst.device) {
    throw InvalidArgument(std::string(what) + ": a copy from " + src.device.describe() + " to " +
                          dst.device.describe() + " is not supported (one side must be the host or both one device)");
  }
  return &storage_for(src.device.is_host() ? dst.device : src.device);
}

void copy_view(const TensorView& src, const TensorView& dst, const char* what) {
  check_same_layout(src, dst, what);
  // Every backend's copy returns at once for an empty view.
  if (src.device.is_host() && dst.device.is_host()) {
    host_copy_strided(src, dst);
  } else {
    storage_of_pair(src, dst, what)->copy_strided(src, dst);
  }
}

}  // namespace detail

void copy_tensor(const TensorView& src, const TensorView& dst) {
  check_same_layout(src, dst, "copy_tensor");
  src.numel();  // throws InvalidArgument past 2^62 elements (a broadcast view may describe that many)
  detail::copy_view(src, dst, "copy_tensor");
  if (!src.device.is_host() || !dst.device.is_host())
    storage_for(src.device.is_host() ? dst.device : src.device).synchronize();
}

float TensorView::get_on_device(const void* p) const {
  std::array<std::byte, 4> bytes{};
  Storage& s = storage_for(device);
  s.copy(bytes.data(), false, p, true, dtype_size(dtype));
  s.synchronize();
  return load_as_f32(bytes.data(), dtype);
}

void TensorView::set_on_device(void* p, float v) const {
  std::array<std::byte, 4> bytes{};
  store_from_f32(bytes.data(), dtype, v);
  Storage& s = storage_for(device);
  s.copy(p, true, bytes.data(), false, dtype_size(dtype));
  s.synchronize();
}

bool bitwise_equal(const TensorView& a, const TensorView& b) {
  if (a.rank != b.rank || a.dtype != b.dtype || a.shape != b.shape) return false;
  if (a.numel() == 0) return true;
  if (!a.device.is_host() || !b.device.is_host()) {
    const Tensor ha = detail::copy_of(a), hb = detail::copy_of(b);
    return bitwise_equal(ha.view(), hb.view());
  }
  const int last = a.rank == 0 ? 0 : a.rank - 1;
  const auto li = static_cast<std::size_t>(last);
  const std::int64_t n = a.rank == 0 ? 1 : a.shape[li];
  const auto es = static_cast<std::int64_t>(dtype_size(a.dtype));
  bool equal = true;
  for_each_row(a, b, [&](void* pa, void* pb) {
    for (std::int64_t e = 0; e < n && equal; ++e) {
      equal = std::memcmp(static_cast<const std::byte*>(pa) + e * a.strides[li] * es,
                          static_cast<const std::byte*>(pb) + e * b.strides[li] * es,
                          static_cast<std::size_t>(es)) == 0;
    }
    return equal;
  });
  return equal;
}

void Tensor::Free::operator()(std::byte* p) const noexcept { detail::AlignedFree()(p); }

Tensor::Tensor(DType dtype, std::initializer_list<std::int64_t> shape) {
  set_shape(view_, shape);
  view_.dtype = dtype;
  set_contiguous_strides(view_);
  const std::size_t bytes = detail::checked_mul(view_.numel(), static_cast<std::int64_t>(dtype_size(dtype)),
                                                "tensor " + view_.describe());
  storage_.reset(detail::aligned_allocate(bytes).release());
  if (bytes > 0) std::memset(storage_.get(), 0, (bytes + 63) / 64 * 64);
  view_.data = storage_.get();
}

Tensor::Tensor(DType dtype, const std::int64_t* shape, int rank) {
  if (rank < 0 || rank > kMaxRank) throw InvalidArgument("tensor rank " + std::to_string(rank) + " is outside 0..4");
  switch (rank) {
    case 0: *this = Tensor(dtype, {}); break;
    case 1: *this = Tensor(dtype, {shape[0]}); break;
    case 2: *this = Tensor(dtype, {shape[0], shape[1]}); break;
    case 3: *this = Tensor(dtype, {shape[0], shape[1], shape[2]}); break;
    default: *this = Tensor(dtype, {shape[0], shape[1], shape[2], shape[3]}); break;
  }
}

}  // namespace rwd
