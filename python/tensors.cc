// Tensors across the Python boundary without copies: inputs read in place
// from torch tensors (data_ptr / strides, on cpu or cuda) or numpy arrays
// (buffer protocol); results returned as torch tensors through DLPack (on
// the view's device) or as numpy arrays whose base holds a pin (pinning.cc),
// so a returned view can go stale but never dangles.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "module.h"

namespace rwd::python {
namespace {

// ---- DLPack (the ABI of dlpack.h v0.x that torch 1.13 reads) -------------
struct DLDevice {
  std::int32_t device_type;
  std::int32_t device_id;
};
struct DLDataType {
  std::uint8_t code;
  std::uint8_t bits;
  std::uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  std::int32_t ndim;
  DLDataType dtype;
  std::int64_t* shape;
  std::int64_t* strides;
  std::uint64_t byte_offset;
};
struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};
constexpr std::int32_t kDLCPU = 1;
constexpr std::int32_t kDLCUDA = 2;
constexpr std::uint8_t kDLFloat = 2;
constexpr std::uint8_t kDLBfloat = 4;

// One exported view: the DLPack header, its shape and strides, and the pin.
struct ExportedView {
  DLManagedTensor managed{};
  std::int64_t shape[rwd::kMaxRank]{};
  std::int64_t strides[rwd::kMaxRank]{};
  void* pinned_block = nullptr;
};

void delete_exported(DLManagedTensor* self) {
  auto* view = static_cast<ExportedView*>(self->manager_ctx);
  rwd::python::unpin(view->pinned_block);  // no Python call: torch may free without the GIL
  delete view;
}

// The Python modules the conversions need, imported once.
struct Frameworks {
  py::object from_dlpack;  // torch.utils.dlpack.from_dlpack
  py::object torch_tensor_type;
  py::object torch_float32, torch_float16, torch_bfloat16, torch_empty;
  py::object numpy;
  bool has_torch = false;
};

Frameworks& frameworks() {
  static Frameworks* f = [] {
    auto* fw = new Frameworks;  // leaked: must outlive the interpreter's module teardown order
    try {
      py::module_ torch = py::module_::import("torch");
      fw->from_dlpack = py::module_::import("torch.utils.dlpack").attr("from_dlpack");
      fw->torch_tensor_type = torch.attr("Tensor");
      fw->torch_float32 = torch.attr("float32");
      fw->torch_float16 = torch.attr("float16");
      fw->torch_bfloat16 = torch.attr("bfloat16");
      fw->torch_empty = torch.attr("empty");
      fw->has_torch = true;
    } catch (const py::error_already_set&) {
      fw->has_torch = false;
    }
    fw->numpy = py::module_::import("numpy");
    return fw;
  }();
  return *f;
}

}  // namespace

[[noreturn]] void invalid(const std::string& message) { throw rwd::InvalidArgument(message); }

bool is_torch(const py::handle& obj) {
  Frameworks& fw = frameworks();
  return fw.has_torch && py::isinstance(obj, fw.torch_tensor_type);
}

namespace {
// Refuses an element address that is not a multiple of the element size:
// the kernels read whole floats, which such an address does not hold.
void check_aligned(const void* data, std::size_t element_bytes, const char* what, const char* copy) {
  const auto address = reinterpret_cast<std::uintptr_t>(data);
  if (element_bytes > 1 && address % element_bytes != 0) {
    char hex[32];
    std::snprintf(hex, sizeof hex, "0x%llx", static_cast<unsigned long long>(address));
    invalid(std::string(what) + ": the array is misaligned (its data at " + hex + " is not a multiple of its " +
            std::to_string(element_bytes) + "-byte elements); an aligned copy is accepted: " + copy);
  }
}
}  // namespace

// A view of a torch tensor or a buffer-protocol object (numpy), in place.
// The caller keeps `obj` alive for as long as the view is used.
rwd::TensorView input_view(const py::handle& obj, const char* what) {
  rwd::TensorView v;
  if (is_torch(obj)) {
    Frameworks& fw = frameworks();
    py::object device = obj.attr("device");
    const std::string type = py::str(device.attr("type"));
    if (type == "cuda") {
      v.device = {rwd::DeviceType::Cuda, device.attr("index").cast<int>()};
    } else if (type != "cpu") {
      invalid(std::string(what) + ": a tensor on " + std::string(py::str(device)) +
              "; rewind keeps cache state on cpu or cuda (allowed: " + allowed_devices() + ")");
    }
    py::object dt = obj.attr("dtype");
    if (dt.is(fw.torch_float32))
      v.dtype = rwd::DType::F32;
    else if (dt.is(fw.torch_float16))
      v.dtype = rwd::DType::F16;
    else if (dt.is(fw.torch_bfloat16))
      v.dtype = rwd::DType::BF16;
    else
      invalid(std::string(what) + ": dtype " + std::string(py::str(dt)) +
              " is not supported (float32, float16, bfloat16)");
    // A lazily negated view stores the values un-negated; reading its memory
    // would give the wrong sign.
    if (py::hasattr(obj, "is_neg") && obj.attr("is_neg")().cast<bool>()) {
      invalid(std::string(what) + ": a lazily negated tensor (torch._neg_view); pass t.resolve_neg()");
    }
    auto shape = obj.attr("shape").cast<std::vector<std::int64_t>>();
    auto strides = obj.attr("stride")().cast<std::vector<std::int64_t>>();
    if (shape.size() > static_cast<std::size_t>(rwd::kMaxRank)) {
      invalid(std::string(what) + ": rank " + std::to_string(shape.size()) + " is above rewind's 4");
    }
    v.rank = static_cast<int>(shape.size());
    for (std::size_t i = 0; i < static_cast<std::size_t>(rwd::kMaxRank); ++i) {
      v.shape[i] = i < shape.size() ? shape[i] : 1;
      v.strides[i] = i < shape.size() ? strides[i] : 0;
    }
    v.data = reinterpret_cast<void*>(obj.attr("data_ptr")().cast<std::uintptr_t>());
    check_aligned(v.data, rwd::dtype_size(v.dtype), what, "t.clone()");
    return v;
  }
  if (!PyObject_CheckBuffer(obj.ptr())) {
    invalid(std::string(what) + ": expected a torch tensor or a numpy array, got " +
            std::string(py::str(py::type::handle_of(obj).attr("__name__"))));
  }
  py::buffer_info info = py::reinterpret_borrow<py::buffer>(obj).request();
  // numpy writes a misaligned array's format with an explicit byte order
  // ("=f"), and a standard-size one may say "<f": the same element type.
  std::string format = info.format;
  const bool little = std::endian::native == std::endian::little;
  if (format.size() == 2 && (format[0] == '@' || format[0] == '=' || (little && format[0] == '<'))) format.erase(0, 1);
  if (format == py::format_descriptor<float>::format())
    v.dtype = rwd::DType::F32;
  else if (format == "e")
    v.dtype = rwd::DType::F16;
  else if (format.size() == 2 && (format[0] == '>' || format[0] == '!' || format[0] == '<') &&
           (format[1] == 'f' || format[1] == 'e')) {
    invalid(std::string(what) + ": buffer format '" + info.format +
            "' has the other byte order than this machine's; "
            "pass a native-order copy (a.astype(a.dtype.newbyteorder('=')))");
  } else {
    invalid(std::string(what) + ": buffer format '" + info.format + "' is not supported (float32, float16)");
  }
  // np.ascontiguousarray returns an array that is already contiguous as it
  // is, misaligned: only a copy moves the data.
  check_aligned(info.ptr, static_cast<std::size_t>(info.itemsize), what,
                "a.copy() (np.ascontiguousarray keeps a contiguous array where it is)");
  if (info.ndim > rwd::kMaxRank)
    invalid(std::string(what) + ": rank " + std::to_string(info.ndim) + " is above rewind's 4");
  v.rank = static_cast<int>(info.ndim);
  for (std::size_t i = 0; i < static_cast<std::size_t>(rwd::kMaxRank); ++i) {
    const bool used = i < static_cast<std::size_t>(info.ndim);
    v.shape[i] = used ? info.shape[i] : 1;
    if (used && info.strides[i] % info.itemsize != 0) invalid(std::string(what) + ": strides must be whole elements");
    v.strides[i] = used ? info.strides[i] / info.itemsize : 0;
  }
  v.data = info.ptr;
  return v;
}

namespace {

// The torch dtype of `dtype`.
py::object torch_dtype(const Frameworks& fw, rwd::DType dtype) {
  return dtype == rwd::DType::F32 ? fw.torch_float32 : dtype == rwd::DType::F16 ? fw.torch_float16 : fw.torch_bfloat16;
}

// The numpy dtype of `dtype`; numpy has no bfloat16.
py::dtype numpy_dtype(rwd::DType dtype) {
  if (dtype == rwd::DType::BF16) {
    invalid("numpy has no bfloat16: this layer holds bfloat16 values, pass torch tensors to read them");
  }
  return dtype == rwd::DType::F32 ? py::dtype("float32") : py::dtype("float16");
}

}  // namespace

// Returns `v` (a view of layer storage) as a torch tensor (as_torch) or a
// numpy array, sharing its memory. The pin keeps that memory allocated for
// as long as the returned object lives.
py::object output_view(const rwd::TensorView& v, bool as_torch) {
  Frameworks& fw = frameworks();
  std::int64_t numel = 1;
  for (int i = 0; i < v.rank; ++i) numel *= v.shape[static_cast<std::size_t>(i)];
  std::vector<std::int64_t> shape(v.shape.begin(), v.shape.begin() + v.rank);
  if (v.device.type == rwd::DeviceType::Guarded) {
    // The host cannot read these pages: a fresh host tensor or array, filled through the storage.
    py::object out = as_torch ? fw.torch_empty(py::cast(shape), py::arg("dtype") = torch_dtype(fw, v.dtype))
                              : py::object(py::array(numpy_dtype(v.dtype), shape));
    if (numel > 0) rwd::copy_tensor(v, input_view(out, "a host copy of guarded state"));
    return out;
  }
  const bool cuda = v.device.type == rwd::DeviceType::Cuda;
  if (cuda && !as_torch) {
    invalid("this layer's state is on " + v.device.describe() +
            ": numpy cannot view device memory; pass torch "
            "tensors (on that device) to read it");
  }
  if (as_torch) {
    py::object dt = torch_dtype(fw, v.dtype);
    if (numel == 0) {
      return fw.torch_empty(py::cast(shape), py::arg("dtype") = dt, py::arg("device") = v.device.describe());
    }
    auto view = std::make_unique<ExportedView>();
    view->pinned_block = rwd::python::pin(v.data);
    for (int i = 0; i < v.rank; ++i) {
      view->shape[i] = v.shape[static_cast<std::size_t>(i)];
      view->strides[i] = v.strides[static_cast<std::size_t>(i)];
    }
    DLTensor& t = view->managed.dl_tensor;
    t.data = v.data;
    // A device view is pinned through the pinning_storage its cache's
    // layers allocate from (devices.cc): the same registry as host buffers.
    t.device = cuda ? DLDevice{kDLCUDA, v.device.index} : DLDevice{kDLCPU, 0};
    t.ndim = v.rank;
    t.dtype = {v.dtype == rwd::DType::BF16 ? kDLBfloat : kDLFloat,
               static_cast<std::uint8_t>(rwd::dtype_size(v.dtype) * 8), 1};
    t.shape = view->shape;
    t.strides = view->strides;
    t.byte_offset = 0;
    view->managed.manager_ctx = view.get();
    view->managed.deleter = delete_exported;
    DLManagedTensor* managed = &view->managed;
    // Capsule protocol: a consumer renames it "used_dltensor" and owns the
    // tensor; an unconsumed capsule deletes it itself.
    PyObject* capsule = PyCapsule_New(managed, "dltensor", [](PyObject* cap) {
      if (PyCapsule_IsValid(cap, "dltensor")) {
        auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(cap, "dltensor"));
        if (m != nullptr && m->deleter != nullptr) m->deleter(m);
      }
    });
    if (capsule == nullptr) {
      rwd::python::unpin(view->pinned_block);
      throw py::error_already_set();
    }
    view.release();
    py::object cap = py::reinterpret_steal<py::object>(capsule);
    return fw.from_dlpack(cap);
  }
  py::dtype dt = numpy_dtype(v.dtype);
  std::vector<std::int64_t> byte_strides;
  for (int i = 0; i < v.rank; ++i) {
    byte_strides.push_back(v.strides[static_cast<std::size_t>(i)] *
                           static_cast<std::int64_t>(rwd::dtype_size(v.dtype)));
  }
  if (numel == 0) return py::array(dt, shape);
  void* block = rwd::python::pin(v.data);
  py::capsule base(block, [](void* b) { rwd::python::unpin(b); });
  return py::array(dt, shape, byte_strides, v.data, base);
}

std::vector<std::int64_t> index_list(const py::handle& obj) {
  // A list, a tuple, a torch tensor or a numpy array of integers.
  if (is_torch(obj)) return obj.attr("tolist")().cast<std::vector<std::int64_t>>();
  if (py::hasattr(obj, "tolist")) return obj.attr("tolist")().cast<std::vector<std::int64_t>>();
  return obj.cast<std::vector<std::int64_t>>();
}

}  // namespace rwd::python
