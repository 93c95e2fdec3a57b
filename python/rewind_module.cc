// rewind._rewind: the C++ core of the Python module.
//
// It exposes one rwd::Layer per `_Layer` object (the transformers-shaped
// classes in python/rewind/ combine them), the runtime (model loading,
// forward, generation) and the exception hierarchy. Tensors cross the
// boundary without copies: inputs are read in place from torch tensors
// (data_ptr / strides) or numpy arrays (buffer protocol); results are views
// of the layer's storage, returned as torch tensors through DLPack or as
// numpy arrays whose base holds a pin. A pin keeps the viewed buffer
// allocated even when the layer moves or frees it (pinning.cc), so a
// returned tensor can go stale but never dangles.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pybind11/functional.h>
#include <pybind11/numpy.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <omp.h>

#include "pinning.h"
#include "rewind/error.h"
#include "rewind/layer.h"
#include "rewind/tensor.h"
#include "rewind/warnings.h"
#include "runtime/generate.h"
#include "runtime/model.h"
#include "runtime/tokenizer.h"

namespace py = pybind11;

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

[[noreturn]] void invalid(const std::string& message) { throw rwd::InvalidArgument(message); }

bool is_torch(const py::handle& obj) {
  Frameworks& fw = frameworks();
  return fw.has_torch && py::isinstance(obj, fw.torch_tensor_type);
}

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

// A view of a torch tensor or a buffer-protocol object (numpy), in place.
// The caller keeps `obj` alive for as long as the view is used.
rwd::TensorView input_view(const py::handle& obj, const char* what) {
  rwd::TensorView v;
  if (is_torch(obj)) {
    Frameworks& fw = frameworks();
    if (std::string(py::str(obj.attr("device").attr("type"))) != "cpu") {
      invalid(std::string(what) + ": rewind keeps its state in CPU memory; got a tensor on device " +
              std::string(py::str(obj.attr("device"))) + " (move it with .cpu())");
    }
    py::object dt = obj.attr("dtype");
    if (dt.is(fw.torch_float32)) v.dtype = rwd::DType::F32;
    else if (dt.is(fw.torch_float16)) v.dtype = rwd::DType::F16;
    else if (dt.is(fw.torch_bfloat16)) v.dtype = rwd::DType::BF16;
    else invalid(std::string(what) + ": dtype " + std::string(py::str(dt)) + " is not supported (float32, float16, bfloat16)");
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
  if (format == py::format_descriptor<float>::format()) v.dtype = rwd::DType::F32;
  else if (format == "e") v.dtype = rwd::DType::F16;
  else if (format.size() == 2 && (format[0] == '>' || format[0] == '!' || format[0] == '<') &&
           (format[1] == 'f' || format[1] == 'e')) {
    invalid(std::string(what) + ": buffer format '" + info.format + "' has the other byte order than this machine's; "
            "pass a native-order copy (a.astype(a.dtype.newbyteorder('=')))");
  } else {
    invalid(std::string(what) + ": buffer format '" + info.format + "' is not supported (float32, float16)");
  }
  // np.ascontiguousarray returns an array that is already contiguous as it
  // is, misaligned: only a copy moves the data.
  check_aligned(info.ptr, static_cast<std::size_t>(info.itemsize), what,
                "a.copy() (np.ascontiguousarray keeps a contiguous array where it is)");
  if (info.ndim > rwd::kMaxRank) invalid(std::string(what) + ": rank " + std::to_string(info.ndim) + " is above rewind's 4");
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

// Returns `v` (a view of layer storage) as a torch tensor (as_torch) or a
// numpy array, sharing its memory. The pin keeps that memory allocated for
// as long as the returned object lives.
py::object output_view(const rwd::TensorView& v, bool as_torch) {
  Frameworks& fw = frameworks();
  std::int64_t numel = 1;
  for (int i = 0; i < v.rank; ++i) numel *= v.shape[static_cast<std::size_t>(i)];
  std::vector<std::int64_t> shape(v.shape.begin(), v.shape.begin() + v.rank);
  if (as_torch) {
    py::object dt = v.dtype == rwd::DType::F32 ? fw.torch_float32 : v.dtype == rwd::DType::F16 ? fw.torch_float16 : fw.torch_bfloat16;
    if (numel == 0) return fw.torch_empty(py::cast(shape), py::arg("dtype") = dt);
    auto view = std::make_unique<ExportedView>();
    view->pinned_block = rwd::python::pin(v.data);
    for (int i = 0; i < v.rank; ++i) {
      view->shape[i] = v.shape[static_cast<std::size_t>(i)];
      view->strides[i] = v.strides[static_cast<std::size_t>(i)];
    }
    DLTensor& t = view->managed.dl_tensor;
    t.data = v.data;
    t.device = {kDLCPU, 0};
    t.ndim = v.rank;
    t.dtype = {v.dtype == rwd::DType::BF16 ? kDLBfloat : kDLFloat, static_cast<std::uint8_t>(rwd::dtype_size(v.dtype) * 8), 1};
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
  if (v.dtype == rwd::DType::BF16) {
    invalid("numpy has no bfloat16: this layer holds bfloat16 values, pass torch tensors to read them");
  }
  py::dtype dt = v.dtype == rwd::DType::F32 ? py::dtype("float32") : py::dtype("float16");
  std::vector<std::int64_t> byte_strides;
  for (int i = 0; i < v.rank; ++i) {
    byte_strides.push_back(v.strides[static_cast<std::size_t>(i)] * static_cast<std::int64_t>(rwd::dtype_size(v.dtype)));
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

// ---- the layer ----------------------------------------------------------------
// One rwd::Layer and how its results are returned (torch or numpy, fixed by
// the first input it received).
using rwd::python::Budget;
using rwd::python::BudgetScope;

// Runs fn() with the aligned allocations it makes counted against `budget`;
// a refusal by a budget becomes a CapacityError that names the budget (the
// library reported it as a failed allocation and changed nothing).
template <typename Fn>
decltype(auto) with_budget(const std::shared_ptr<Budget>& budget, int index, Fn&& fn) {
  BudgetScope scope(budget);
  try {
    return fn();
  } catch (const rwd::CapacityError&) {
    if (!scope.refused()) throw;
    const Budget* b = scope.refused_by();
    throw rwd::CapacityError("memory budget of " + std::to_string(b->limit()) + " bytes: " +
                             (index >= 0 ? "layer " + std::to_string(index) : std::string("the layer")) +
                             " needs " + std::to_string(scope.refused_bytes()) + " more bytes while " +
                             std::to_string(b->reserved()) +
                             " are reserved; nothing was changed (set_memory_budget raises the cap)");
  }
}

// One rwd::Layer, how its results are returned (torch or numpy, fixed by the
// first input it received) and the budget its buffers count against.
class PyLayer {
 public:
  PyLayer(const std::string& kind, const rwd::LayerOptions& options, int index, bool as_torch,
          std::shared_ptr<Budget> budget)
      : budget_(std::move(budget)),
        layer_(with_budget(budget_, index, [&] { return rwd::Layer(rwd::parse_layer_kind(kind), options, index); })),
        as_torch_(as_torch) {}

  // Takes a ready-made layer (a clone) whose buffers were allocated under `budget`.
  PyLayer(rwd::Layer&& layer, bool as_torch, std::shared_ptr<Budget> budget)
      : budget_(std::move(budget)), layer_(std::move(layer)), as_torch_(as_torch) {}

  rwd::Layer& layer() { return layer_; }
  const rwd::Layer& layer() const { return layer_; }
  const std::shared_ptr<Budget>& budget() const { return budget_; }
  py::object out(const rwd::TensorView& v) const { return output_view(v, as_torch_); }
  bool as_torch() const { return as_torch_; }
  // Runs a call that may allocate with this layer's budget.
  template <typename Fn>
  decltype(auto) guarded(Fn&& fn) {
    return with_budget(budget_, layer_.index(), std::forward<Fn>(fn));
  }

 private:
  std::shared_ptr<Budget> budget_;
  rwd::Layer layer_;
  bool as_torch_;
};

// A zero-copy recurrent update (rwd::RecurrentUpdate) that keeps its layer alive.
class PyRecurrentUpdate {
 public:
  PyRecurrentUpdate(py::object owner, PyLayer& layer, std::int64_t q, int state)
      : owner_(std::move(owner)),
        layer_(&layer),
        update_(layer.guarded([&] { return layer.layer().begin_recurrent_update(q, state); })) {}
  std::int64_t num_tokens() const { return update_.num_tokens(); }
  py::object previous() const { return layer_->out(update_.previous()); }
  py::object next(std::int64_t t) const { return layer_->out(update_.next(t)); }
  void commit() {
    layer_->guarded([&] { update_.commit(); });
  }

 private:
  py::object owner_;  // the Python _Layer: the handle must not outlive it
  PyLayer* layer_;
  rwd::RecurrentUpdate update_;
};

rwd::LayerOptions make_options(const std::string& dtype, std::int64_t batch_size, std::int64_t num_kv_heads,
                               std::int64_t key_dim, std::int64_t value_dim, std::int64_t sliding_window,
                               std::int64_t chunk_size, std::int64_t static_capacity,
                               std::vector<std::int64_t> side_dims, std::int64_t conv_kernel_size,
                               std::vector<std::int64_t> conv_channels,
                               std::vector<std::vector<std::int64_t>> recurrent_shapes,
                               const std::string& recurrent_dtype) {
  rwd::LayerOptions o;
  o.dtype = rwd::parse_dtype(dtype);
  o.batch_size = batch_size;
  o.num_kv_heads = num_kv_heads;
  o.key_dim = key_dim;
  o.value_dim = value_dim;
  o.sliding_window = sliding_window;
  o.chunk_size = chunk_size;
  o.static_capacity = static_capacity;
  o.side_dims = std::move(side_dims);
  o.conv_kernel_size = conv_kernel_size;
  o.conv_channels = std::move(conv_channels);
  o.recurrent_shapes = std::move(recurrent_shapes);
  o.recurrent_dtype = rwd::parse_dtype(recurrent_dtype);
  return o;
}

// ---- copies: deepcopy and pickle of a _Layer -------------------------------------

// A contiguous view of `shape` over `data` (row-major; unused dims 1 / 0).
rwd::TensorView contiguous_view(const void* data, rwd::DType dtype, const std::vector<std::int64_t>& shape) {
  rwd::TensorView t;
  t.data = const_cast<void*>(data);  // only ever read: the input of an update
  t.dtype = dtype;
  t.rank = static_cast<int>(shape.size());
  std::int64_t stride = 1;
  for (int i = t.rank - 1; i >= 0; --i) {
    t.shape[static_cast<std::size_t>(i)] = shape[static_cast<std::size_t>(i)];
    t.strides[static_cast<std::size_t>(i)] = stride;
    stride *= shape[static_cast<std::size_t>(i)];
  }
  for (int i = t.rank; i < rwd::kMaxRank; ++i) {
    t.shape[static_cast<std::size_t>(i)] = 1;
    t.strides[static_cast<std::size_t>(i)] = 0;
  }
  return t;
}

// Zeros of `shape` that cost no memory (stride 0): what a replay feeds for
// positions whose values the layer no longer holds.
rwd::TensorView zeros_view(rwd::DType dtype, const std::vector<std::int64_t>& shape) {
  static const std::uint32_t zero[4] = {0, 0, 0, 0};
  rwd::TensorView t = contiguous_view(zero, dtype, shape);
  for (auto& st : t.strides) st = 0;
  return t;
}

std::vector<std::int64_t> shape_of(const rwd::TensorView& v) {
  return std::vector<std::int64_t>(v.shape.begin(), v.shape.begin() + v.rank);
}

// (bytes, shape): `v`'s elements, contiguous in logical order.
py::tuple tensor_state(const rwd::TensorView& v) {
  std::string buf(static_cast<std::size_t>(v.numel()) * rwd::dtype_size(v.dtype), '\0');
  if (!buf.empty()) rwd::copy_tensor(v, contiguous_view(buf.data(), v.dtype, shape_of(v)));
  return py::make_tuple(py::bytes(buf), py::cast(shape_of(v)));
}

// Reads back a (bytes, shape) of tensor_state; `bytes` must outlive the view.
rwd::TensorView tensor_from_state(const py::handle& state, rwd::DType dtype, std::string& bytes) {
  auto t = state.cast<py::tuple>();
  if (t.size() != 2) invalid("_Layer state: a tensor entry must be (bytes, shape)");
  bytes = t[0].cast<std::string>();
  const auto shape = t[1].cast<std::vector<std::int64_t>>();
  if (shape.empty() || shape.size() > static_cast<std::size_t>(rwd::kMaxRank)) invalid("_Layer state: bad tensor rank");
  std::size_t n = rwd::dtype_size(dtype);
  for (std::int64_t e : shape) {
    if (e < 0 || e > (std::int64_t{1} << 40)) invalid("_Layer state: bad tensor extent");
    n *= static_cast<std::size_t>(e);
  }
  if (n != bytes.size()) invalid("_Layer state: tensor bytes do not match its shape");
  return contiguous_view(bytes.data(), dtype, shape);
}

// Positions fed per update when a replay walks over positions it has no
// values for: bounds the rows a sliding or chunked part holds meanwhile.
constexpr std::int64_t kReplayChunk = 1024;

// What __setstate__ needs to rebuild the layer: its kind and options (with
// the current batch size), its length, recording, and what it holds at that
// length: attention rows [first, L), the last K inputs of every conv state,
// S(L) of every recurrent state. Rollback history is not part of it.
py::tuple layer_state(const PyLayer& l) {
  const rwd::Layer& layer = l.layer();
  const rwd::LayerOptions& o = layer.options();
  if (!o.side_dims.empty()) {
    invalid("pickling a layer with side tensors (" + std::string(rwd::layer_kind_name(layer.kind())) +
            ") is not supported; copy.deepcopy copies it");
  }
  py::tuple options = py::make_tuple(std::string(rwd::dtype_name(o.dtype)), o.num_kv_heads, o.key_dim, o.value_dim,
                                     o.sliding_window, o.chunk_size, o.static_capacity, o.conv_kernel_size,
                                     o.conv_channels, o.recurrent_shapes, std::string(rwd::dtype_name(o.recurrent_dtype)));
  py::object attention = py::none();
  if (layer.has_attention()) {
    const rwd::PositionRange r = layer.stored_range();
    const rwd::KeyValueView kv = layer.keys_values();
    attention = py::make_tuple(r.first, tensor_state(kv.keys), tensor_state(kv.values));
  }
  py::list convs, recurrents;
  for (std::size_t s = 0; s < o.conv_channels.size(); ++s) convs.append(tensor_state(layer.get_conv_state(static_cast<int>(s))));
  for (std::size_t s = 0; s < o.recurrent_shapes.size(); ++s) {
    recurrents.append(tensor_state(layer.get_recurrent_state(static_cast<int>(s))));
  }
  py::object budget = l.budget() ? py::cast(l.budget()) : py::none();
  return py::make_tuple(1, std::string(rwd::layer_kind_name(layer.kind())), options, layer.batch_size(),
                        layer.get_seq_length(), layer.is_recording() ? layer.recording_capacity() : std::int64_t{-1},
                        l.as_torch(), layer.index(), budget, attention, convs, recurrents);
}

// Feeds `layer`, new and not recording, up to length L with the values of
// layer_state: zeros (stride 0) for the positions it no longer holds, then
// the held ones. Reading the result back gives layer_state's tensors.
void replay(rwd::Layer& layer, std::int64_t L, const py::object& attention, const py::list& convs,
            const py::list& recurrents) {
  const rwd::LayerOptions& o = layer.options();
  const std::int64_t B = layer.batch_size();
  if (layer.has_attention()) {
    if (attention.is_none()) invalid("_Layer state: the attention rows are missing");
    auto a = attention.cast<py::tuple>();
    const auto first = a[0].cast<std::int64_t>();
    std::string kb, vb;
    rwd::TensorView keys = tensor_from_state(a[1], o.dtype, kb), values = tensor_from_state(a[2], o.dtype, vb);
    if (first < 0 || first > L || keys.rank != 4 || keys.size(2) != L - first || values.rank != 4 ||
        values.size(2) != L - first) {
      invalid("_Layer state: attention rows do not match the length");
    }
    for (std::int64_t p = 0; p < first; p += kReplayChunk) {
      const std::int64_t q = std::min(kReplayChunk, first - p);
      layer.update(zeros_view(o.dtype, {B, keys.size(1), q, keys.size(3)}),
                   zeros_view(o.dtype, {B, values.size(1), q, values.size(3)}));
    }
    if (L > first) layer.update(keys, values);
  }
  if (convs.size() != o.conv_channels.size() || recurrents.size() != o.recurrent_shapes.size()) {
    invalid("_Layer state: the number of conv / recurrent states does not match the options");
  }
  for (std::size_t s = 0; s < convs.size(); ++s) {
    std::string bytes;
    rwd::TensorView window = tensor_from_state(convs[s], o.dtype, bytes);  // [B, C, K]
    const std::int64_t K = window.rank == 3 ? window.size(2) : 0;
    if (K != o.conv_kernel_size) invalid("_Layer state: a conv window does not match the kernel size");
    const std::int64_t held = std::min(L, K);
    for (std::int64_t p = 0; p < L - held; p += kReplayChunk) {
      const std::int64_t q = std::min(kReplayChunk, L - held - p);
      layer.update_conv_state(zeros_view(o.dtype, {B, window.size(1), q}), static_cast<int>(s));
    }
    if (held > 0) layer.update_conv_state(window.slice(2, K - held, held), static_cast<int>(s));
  }
  for (std::size_t s = 0; s < recurrents.size(); ++s) {
    std::string bytes;
    rwd::TensorView state = tensor_from_state(recurrents[s], o.recurrent_dtype, bytes);
    if (L == 0) continue;
    // Not recording: next(1) .. next(L) are one slot, so this costs one state.
    rwd::RecurrentUpdate u = layer.begin_recurrent_update(L, static_cast<int>(s));
    rwd::copy_tensor(state, u.next(L));
    u.commit();
  }
}

std::shared_ptr<PyLayer> layer_from_state(const py::tuple& st) {
  if (st.size() != 12 || st[0].cast<int>() != 1) invalid("_Layer state: not a version-1 layer state");
  auto o = st[2].cast<py::tuple>();
  if (o.size() != 11) invalid("_Layer state: bad options");
  const auto L = st[4].cast<std::int64_t>();
  const auto R = st[5].cast<std::int64_t>();
  std::shared_ptr<Budget> budget = st[8].is_none() ? nullptr : st[8].cast<std::shared_ptr<Budget>>();
  auto out = std::make_shared<PyLayer>(
      st[1].cast<std::string>(),
      make_options(o[0].cast<std::string>(), st[3].cast<std::int64_t>(), o[1].cast<std::int64_t>(),
                   o[2].cast<std::int64_t>(), o[3].cast<std::int64_t>(), o[4].cast<std::int64_t>(),
                   o[5].cast<std::int64_t>(), o[6].cast<std::int64_t>(), {}, o[7].cast<std::int64_t>(),
                   o[8].cast<std::vector<std::int64_t>>(), o[9].cast<std::vector<std::vector<std::int64_t>>>(),
                   o[10].cast<std::string>()),
      st[7].cast<int>(), st[6].cast<bool>(), budget);
  if (L < 0) invalid("_Layer state: negative length");
  out->guarded([&] { replay(out->layer(), L, st[9], st[10].cast<py::list>(), st[11].cast<py::list>()); });
  if (R >= 0) out->guarded([&] { out->layer().activate_past_recording(R); });
  return out;
}

std::shared_ptr<Budget> deepcopied_budget(const std::shared_ptr<Budget>& b, py::dict memo) {
  if (!b) return nullptr;
  return py::module_::import("copy").attr("deepcopy")(py::cast(b), memo).cast<std::shared_ptr<Budget>>();
}

// ---- runtime ----------------------------------------------------------------------
struct PyModel {
  rwd::runtime::Model model;
  // The directory's tokenizer.json, or the byte-level scheme without one.
  rwd::runtime::Tokenizer tokenizer;
};

struct PyModelCache {
  std::shared_ptr<PyModel> model;  // the cache's layers follow this model's shapes
  rwd::Cache cache;
  // Set while a forward runs without the GIL: every other use of the cache
  // (which holds the GIL throughout) is refused instead of racing with it.
  bool busy = false;
  rwd::Cache& use() {
    if (busy) throw rwd::StateError("this cache is in use by a forward running in another thread");
    return cache;
  }
};

std::string type_name_of(const py::handle& obj) { return py::str(py::type::handle_of(obj).attr("__name__")); }

// The token ids in `obj` (argument `what`; `accepted` lists what the caller
// takes): a list or tuple of ints, or a 1-D integer numpy array or torch
// tensor. Anything else is a TypeError naming what was given, before
// pybind11's cast could answer "Unable to cast Python instance".
std::vector<std::int64_t> token_list(const py::handle& obj, const std::string& what, const std::string& accepted) {
  auto refuse = [&](const std::string& given) {
    throw py::type_error(what + " must be " + accepted + "; got " + given);
  };
  if (py::isinstance<py::bytes>(obj) || PyByteArray_Check(obj.ptr())) {
    refuse(type_name_of(obj) + " (decode it to a str, or pass its token ids)");
  }
  if (py::isinstance<py::str>(obj)) refuse("str (text goes through Model.encode; this call takes token ids)");
  if (is_torch(obj) || py::hasattr(obj, "dtype")) {
    // A torch tensor or a numpy array: integer elements, one dimension.
    const std::string dtype = py::str(obj.attr("dtype"));
    const bool integer = is_torch(obj) ? !obj.attr("is_floating_point")().cast<bool>() &&
                                             !obj.attr("is_complex")().cast<bool>() && dtype != "torch.bool"
                                       : std::string(py::str(obj.attr("dtype").attr("kind"))).find_first_of("iu") == 0;
    if (!integer) refuse(type_name_of(obj) + " of dtype " + dtype);
    const auto ndim = obj.attr("ndim").cast<std::int64_t>();
    if (ndim != 1) refuse(type_name_of(obj) + " with " + std::to_string(ndim) + " dimensions (one is accepted)");
    return obj.attr("tolist")().cast<std::vector<std::int64_t>>();
  }
  if (!py::isinstance<py::list>(obj) && !py::isinstance<py::tuple>(obj)) refuse(type_name_of(obj));
  std::vector<std::int64_t> out;
  std::size_t i = 0;
  for (py::handle item : obj) {
    // Python ints and numpy integer scalars (both have __index__); a float does not.
    if (!PyIndex_Check(item.ptr()) || py::isinstance<py::float_>(item)) {
      refuse(type_name_of(obj) + " whose element " + std::to_string(i) + " is " + type_name_of(item) + " " +
             std::string(py::repr(item)));
    }
    py::int_ value = py::reinterpret_steal<py::int_>(PyNumber_Index(item.ptr()));
    if (!value) throw py::error_already_set();
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
    if (overflow != 0) invalid("token " + std::string(py::str(value)) + " is outside [0, 2^31)");
    out.push_back(v);
    ++i;
  }
  return out;
}

// What generate and generate_batch take as a prompt (Model.generate encodes a str first).
constexpr const char* kPromptAccepted =
    "a str (text) or a list of ints (token ids) / a 1-D integer numpy array or torch tensor";

// A model call's token ids: what token_list takes.
std::vector<std::int32_t> tokens_of(const py::handle& obj, const std::string& what = "tokens",
                                    const std::string& accepted =
                                        "a list of ints (token ids) or a 1-D integer numpy array / torch tensor") {
  std::vector<std::int64_t> wide = token_list(obj, what, accepted);
  std::vector<std::int32_t> out;
  out.reserve(wide.size());
  for (std::int64_t t : wide) {
    if (t < 0 || t > 0x7fffffff) invalid("token " + std::to_string(t) + " is outside [0, 2^31)");
    out.push_back(static_cast<std::int32_t>(t));
  }
  return out;
}

rwd::runtime::SamplingParams sampling_of(float temperature, std::int64_t top_k, float top_p, std::uint64_t seed) {
  rwd::runtime::SamplingParams s;
  s.temperature = temperature;
  s.top_k = top_k;
  s.top_p = top_p;
  s.seed = seed;
  rwd::runtime::validate(s);
  return s;
}

py::dict stats_dict(const rwd::runtime::GenerationStats& s) {
  py::dict d;
  d["new_tokens"] = s.new_tokens;
  d["prompt_tokens"] = s.prompt_tokens;
  d["seconds"] = s.seconds;
  d["time_to_first_token"] = s.time_to_first_token;
  d["forwards"] = s.forwards;
  d["rounds"] = s.rounds;
  d["drafted"] = s.drafted;
  d["accepted"] = s.accepted;
  d["drafted_at"] = s.drafted_at;
  d["accepted_at"] = s.accepted_at;
  d["rollbacks"] = s.rollbacks;
  d["cache_seconds"] = s.cache_seconds;
  d["peak_cache_bytes"] = s.peak_cache_bytes;
  d["tokens_per_second"] = s.tokens_per_second();
  d["decode_tokens_per_second"] = s.decode_tokens_per_second();
  d["acceptance_rate"] = s.acceptance_rate();
  if (s.seed) d["seed"] = *s.seed;
  else d["seed"] = py::none();
  return d;
}

// Logits [n, vocab] (or [vocab]) as a numpy array that owns its memory.
py::array_t<float> logits_array(std::vector<float>&& logits, std::int64_t n, std::int64_t vocab, bool all_logits) {
  auto* owned = new std::vector<float>(std::move(logits));
  py::capsule base(owned, [](void* p) { delete static_cast<std::vector<float>*>(p); });
  if (all_logits) {
    return py::array_t<float>({n, vocab}, {vocab * static_cast<std::int64_t>(sizeof(float)), static_cast<std::int64_t>(sizeof(float))},
                              owned->data(), base);
  }
  return py::array_t<float>({vocab}, {static_cast<std::int64_t>(sizeof(float))}, owned->data(), base);
}

}  // namespace

PYBIND11_MODULE(_rewind, mod) {
  py::module_& m = mod;
  m.doc() = "rewind's C++ core: layers with exact rollback, zero-copy tensor views, the reference runtime.";

  // ---- exceptions: rewind.Error and subclasses that are also the builtin
  // transformers raises in the same situation. Messages are the C++ ones.
  py::object builtins = py::module_::import("builtins");
  auto make_exc = [&](const char* name, py::tuple bases, const char* doc) {
    py::dict ns;
    ns["__doc__"] = doc;
    ns["__module__"] = "rewind";
    py::object cls = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(&PyType_Type))(name, bases, ns);
    m.attr(name) = cls;
    return cls;
  };
  py::object Error = make_exc("Error", py::make_tuple(builtins.attr("Exception")),
                              "Base of every exception rewind raises (rwd::Error).");
  py::object InvalidArgument = make_exc("InvalidArgument", py::make_tuple(Error, builtins.attr("ValueError")),
                                        "A tensor or option has the wrong rank, shape, dtype, batch or value.");
  py::object IndexErr = make_exc("IndexError", py::make_tuple(Error, builtins.attr("IndexError")),
                                 "A layer, state or side-tensor index is out of range.");
  py::object CapacityError = make_exc("CapacityError", py::make_tuple(Error, builtins.attr("RuntimeError")),
                                      "A static layer, the memory budget or the system cannot hold what was asked.");
  py::object RollbackError =
      make_exc("RollbackError", py::make_tuple(Error, builtins.attr("RuntimeError"), builtins.attr("ValueError")),
               "A crop the layer cannot perform exactly (too deep, not recording, positive crop it cannot do). "
               "Also a RuntimeError (transformers >= 5.15) and a ValueError (older transformers).");
  py::object StateError =
      make_exc("StateError", py::make_tuple(Error, builtins.attr("RuntimeError"), builtins.attr("ValueError")),
               "The operation is not valid in the current state or for this layer kind. Also a RuntimeError "
               "and a ValueError (transformers raises ValueError for methods a layer kind lacks).");
  py::object FormatError = make_exc("FormatError", py::make_tuple(Error, builtins.attr("ValueError")),
                                    "A model file or configuration is malformed.");
  py::object StoreError = make_exc("StoreError", py::make_tuple(Error, builtins.attr("RuntimeError")),
                                   "A snapshot store cannot be reached or read.");
  // Leaked references: the translator runs for the life of the process.
  static PyObject* exc[8] = {Error.release().ptr(), InvalidArgument.release().ptr(), IndexErr.release().ptr(),
                             CapacityError.release().ptr(), RollbackError.release().ptr(), StateError.release().ptr(),
                             FormatError.release().ptr(), StoreError.release().ptr()};
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const rwd::InvalidArgument& e) {
      PyErr_SetString(exc[1], e.what());
    } catch (const rwd::IndexError& e) {
      PyErr_SetString(exc[2], e.what());
    } catch (const rwd::CapacityError& e) {
      PyErr_SetString(exc[3], e.what());
    } catch (const rwd::RollbackError& e) {
      PyErr_SetString(exc[4], e.what());
    } catch (const rwd::StateError& e) {
      PyErr_SetString(exc[5], e.what());
    } catch (const rwd::FormatError& e) {
      PyErr_SetString(exc[6], e.what());
    } catch (const rwd::StoreError& e) {
      PyErr_SetString(exc[7], e.what());
    } catch (const rwd::Error& e) {
      PyErr_SetString(exc[0], e.what());
    }
  });

  // rewind keeps the handler in a C++ static that outlives the interpreter,
  // so the Python callable in it is dropped while Python still runs: the
  // atexit hook below uninstalls it, and one destroyed later all the same
  // (installed by a later atexit callback) is leaked, since decref'ing it
  // with no interpreter aborts. rwd::set_warning_handler is called without
  // the GIL: a thread emitting a warning holds rewind's warning lock while
  // its handler waits for the GIL.
  static void (*const install_warning_handler)(py::object) = [](py::object handler) {
    rwd::WarningHandler next;
    if (!handler.is_none()) {
      std::shared_ptr<py::object> shared(new py::object(std::move(handler)), [](py::object* h) {
        if (Py_IsInitialized()) {
          py::gil_scoped_acquire gil;
          delete h;
        } else {
          h->release();  // leaked: no interpreter to release it in
          delete h;
        }
      });
      next = [shared](const std::string& message) {
        py::gil_scoped_acquire gil;
        try {
          (*shared)(message);
        } catch (const py::error_already_set&) {
          // A failing handler must not turn a successful crop into an error.
        }
      };
    }
    rwd::WarningHandler previous;
    {
      py::gil_scoped_release nogil;
      previous = rwd::set_warning_handler(std::move(next));
    }
    // `previous`, and the Python callable it may hold, go here, with the GIL.
  };
  m.def("set_warning_handler", [](py::object handler) { install_warning_handler(std::move(handler)); },
        py::arg("handler"), "Routes rewind's one-time warnings (deprecated positive crop) to `handler(message)`; None restores stderr.");
  py::module_::import("atexit").attr("register")(py::cpp_function([] { install_warning_handler(py::none()); }));
  m.def("reset_one_time_warnings", &rwd::reset_one_time_warnings, "Lets one-time warnings fire again (tests).");

  m.def("pin_stats", [] {
    auto s = rwd::python::pin_stats();
    py::dict d;
    d["pinned_blocks"] = s.pinned_blocks;
    d["zombie_blocks"] = s.zombie_blocks;
    d["zombie_bytes"] = s.zombie_bytes;
    return d;
  }, "Buffers that returned tensors keep alive: pinned, and of those freed by the cache (zombies, with bytes).");

  m.def("input_data_ptr", [](py::object t) {
    return reinterpret_cast<std::uintptr_t>(input_view(t, "tensor").data);
  }, py::arg("tensor"), "Address of the first element of a tensor or array as rewind reads it (tests).");

  // ---- _Layer ----
  py::class_<Budget, std::shared_ptr<Budget>>(m, "_Budget",
      "Bytes of rewind buffers allocated for a layer or a cache, with an optional cap. A layer's budget may have "
      "its cache's as parent: allocations count in both, and one that would pass either cap is refused with a "
      "CapacityError that changes nothing.")
      .def(py::init<>())
      .def_property_readonly("limit", &Budget::limit, "The cap in bytes (0: none).")
      .def_property_readonly("reserved", &Budget::reserved, "Bytes of buffers allocated and not yet freed by rewind.")
      .def("set_limit", &Budget::set_limit, py::arg("bytes"),
           "Sets the cap; raises CapacityError, keeping the old one, when more are reserved already.")
      .def("set_parent", &Budget::set_parent, py::arg("parent"),
           "Counts this budget's bytes (now and later) in `parent` too (None: in no other).")
      .def("__deepcopy__", [](const Budget& b, py::dict memo) {
        auto out = std::make_shared<Budget>();
        out->set_limit(b.limit());
        out->set_parent(deepcopied_budget(b.parent(), memo));
        return out;
      }, py::arg("memo"), "A budget with the same cap and a copy of the parent; nothing reserved yet.")
      .def(py::pickle(
          [](const Budget& b) { return py::make_tuple(b.limit(), b.parent() ? py::cast(b.parent()) : py::none()); },
          [](const py::tuple& t) {
            if (t.size() != 2) invalid("_Budget state: expected (limit, parent)");
            auto out = std::make_shared<Budget>();
            out->set_limit(t[0].cast<std::size_t>());
            if (!t[1].is_none()) out->set_parent(t[1].cast<std::shared_ptr<Budget>>());
            return out;
          }));

  py::class_<PyRecurrentUpdate>(m, "RecurrentUpdate",
                                "Zero-copy recurrent update: read previous() = S(L), write next(t) = S(L+t) for "
                                "t = 1..q in place, then commit(). Dropping it uncommitted changes nothing.")
      .def_property_readonly("num_tokens", &PyRecurrentUpdate::num_tokens)
      .def("previous", &PyRecurrentUpdate::previous, "S(L), a view of the cache's slot.")
      .def("next", &PyRecurrentUpdate::next, py::arg("t"), "The slot for S(L+t), 1 <= t <= q, to write in place.")
      .def("commit", &PyRecurrentUpdate::commit, "Advances the state by q tokens.");

  py::class_<PyLayer, std::shared_ptr<PyLayer>>(m, "_Layer",
                                                "One rwd::Layer. Results are views of its storage (torch tensors "
                                                "or numpy arrays, as the first input), valid until the next "
                                                "mutation of this layer; a stale view stays readable.")
      .def(py::init([](const std::string& kind, const std::string& dtype, std::int64_t batch_size,
                       std::int64_t num_kv_heads, std::int64_t key_dim, std::int64_t value_dim,
                       std::int64_t sliding_window, std::int64_t chunk_size, std::int64_t static_capacity,
                       std::vector<std::int64_t> side_dims, std::int64_t conv_kernel_size,
                       std::vector<std::int64_t> conv_channels, std::vector<std::vector<std::int64_t>> recurrent_shapes,
                       const std::string& recurrent_dtype, int index, bool as_torch, std::shared_ptr<Budget> budget) {
             return std::make_shared<PyLayer>(
                 kind,
                 make_options(dtype, batch_size, num_kv_heads, key_dim, value_dim, sliding_window, chunk_size,
                              static_capacity, std::move(side_dims), conv_kernel_size, std::move(conv_channels),
                              std::move(recurrent_shapes), recurrent_dtype),
                 index, as_torch, std::move(budget));
           }),
           py::arg("kind"), py::arg("dtype") = "f32", py::arg("batch_size") = 1, py::arg("num_kv_heads") = 0,
           py::arg("key_dim") = 0, py::arg("value_dim") = 0, py::arg("sliding_window") = 0, py::arg("chunk_size") = 0,
           py::arg("static_capacity") = 0, py::arg("side_dims") = std::vector<std::int64_t>{},
           py::arg("conv_kernel_size") = 0, py::arg("conv_channels") = std::vector<std::int64_t>{},
           py::arg("recurrent_shapes") = std::vector<std::vector<std::int64_t>>{}, py::arg("recurrent_dtype") = "f32",
           py::arg("index") = -1, py::arg("as_torch") = true, py::arg("budget") = nullptr)
      .def_property_readonly("kind", [](const PyLayer& l) { return std::string(rwd::layer_kind_name(l.layer().kind())); })
      .def_property_readonly("as_torch", &PyLayer::as_torch)
      .def("set_index", [](PyLayer& l, int i) { l.layer().set_index(i); }, py::arg("index"))
      .def("get_seq_length", [](const PyLayer& l) { return l.layer().get_seq_length(); })
      .def("batch_size", [](const PyLayer& l) { return l.layer().batch_size(); })
      .def("get_mask_sizes", [](const PyLayer& l, std::int64_t q) {
        auto s = l.layer().get_mask_sizes(q);
        return py::make_tuple(s.kv_length, s.kv_offset);
      }, py::arg("query_length"))
      .def("update", [](PyLayer& l, py::object k, py::object v) {
        rwd::TensorView kv = input_view(k, "key_states"), vv = input_view(v, "value_states");
        rwd::KeyValueView r = l.guarded([&] { return l.layer().update(kv, vv); });
        return py::make_tuple(l.out(r.keys), l.out(r.values));
      }, py::arg("key_states"), py::arg("value_states"))
      .def("update_side", [](PyLayer& l, py::object rows, int side) {
        rwd::TensorView in = input_view(rows, "side rows");
        return l.out(l.guarded([&] { return l.layer().update_side(in, side); }));
      }, py::arg("rows"), py::arg("side") = 0)
      .def("keys_values", [](const PyLayer& l) {
        rwd::KeyValueView r = l.layer().keys_values();
        return py::make_tuple(l.out(r.keys), l.out(r.values));
      })
      .def("side", [](const PyLayer& l, int s) { return l.out(l.layer().side(s)); }, py::arg("side") = 0)
      .def("stored_range", [](const PyLayer& l) {
        auto r = l.layer().stored_range();
        return py::make_tuple(r.first, r.end);
      })
      .def("update_conv_state", [](PyLayer& l, py::object x, int state) {
        rwd::TensorView in = input_view(x, "conv_states");
        return l.out(l.guarded([&] { return l.layer().update_conv_state(in, state); }));
      }, py::arg("x"), py::arg("state") = 0)
      .def("get_conv_state", [](const PyLayer& l, int s) { return l.out(l.layer().get_conv_state(s)); }, py::arg("state") = 0)
      .def("conv_inputs", [](const PyLayer& l, int s) { return l.out(l.layer().conv_inputs(s)); }, py::arg("state") = 0)
      .def("conv_range", [](const PyLayer& l, int s) {
        auto r = l.layer().conv_range(s);
        return py::make_tuple(r.first, r.end);
      }, py::arg("state") = 0)
      .def("begin_recurrent_update", [](py::object self, std::int64_t q, int state) {
        PyLayer& l = self.cast<PyLayer&>();
        return std::make_unique<PyRecurrentUpdate>(self, l, q, state);
      }, py::arg("q"), py::arg("state") = 0)
      .def("update_recurrent_state", [](PyLayer& l, py::object s, int state) {
        rwd::TensorView in = input_view(s, "recurrent_states");
        l.guarded([&] { l.layer().update_recurrent_state(in, state); });
      }, py::arg("new_state"), py::arg("state") = 0)
      .def("write_final_recurrent_state", [](PyLayer& l, py::object final_state, std::int64_t q, int state) {
        rwd::TensorView src = input_view(final_state, "recurrent_states");
        rwd::RecurrentUpdate u = l.guarded([&] { return l.layer().begin_recurrent_update(q, state); });
        rwd::TensorView last = u.next(q);
        rwd::copy_tensor(src, last);
        // The states between are unknown: every slot gets the final one so
        // that nothing uninitialised is ever read; the Python layer refuses
        // crops that would land on them.
        for (std::int64_t t = 1; t < q; ++t) {
          rwd::TensorView slot = u.next(t);
          if (slot.data != last.data) rwd::copy_tensor(src, slot);
        }
        l.guarded([&] { u.commit(); });
      }, py::arg("final_state"), py::arg("q"), py::arg("state") = 0)
      .def("get_recurrent_state", [](const PyLayer& l, int s) { return l.out(l.layer().get_recurrent_state(s)); }, py::arg("state") = 0)
      .def("recurrent_snapshot", [](const PyLayer& l, int s, std::int64_t pos) {
        return l.out(l.layer().recurrent_snapshot(s, pos));
      }, py::arg("state"), py::arg("pos"))
      .def("has_previous_state", [](const PyLayer& l) { return l.layer().has_previous_state(); })
      .def("crop", [](PyLayer& l, std::int64_t n) { l.guarded([&] { l.layer().crop(n); }); }, py::arg("n"))
      .def("check_crop", [](const PyLayer& l, std::int64_t n) { l.layer().check_crop(n); }, py::arg("n"))
      .def("max_rollback", [](const PyLayer& l) { return l.layer().max_rollback(); })
      .def("activate_past_recording", [](PyLayer& l, std::int64_t r) { l.guarded([&] { l.layer().activate_past_recording(r); }); }, py::arg("max_tokens"))
      .def("deactivate_past_recording", [](PyLayer& l) { l.guarded([&] { l.layer().deactivate_past_recording(); }); })
      .def("is_recording", [](const PyLayer& l) { return l.layer().is_recording(); })
      .def("recording_capacity", [](const PyLayer& l) { return l.layer().recording_capacity(); })
      .def("batch_select_indices", [](PyLayer& l, py::object idx) {
        auto v = index_list(idx);
        l.guarded([&] { l.layer().batch_select_indices(v); });
      }, py::arg("indices"))
      .def("batch_repeat_interleave", [](PyLayer& l, std::int64_t r) { l.guarded([&] { l.layer().batch_repeat_interleave(r); }); }, py::arg("repeats"))
      .def("reorder_cache", [](PyLayer& l, py::object idx) {
        auto v = index_list(idx);
        l.guarded([&] { l.layer().reorder_cache(v); });
      }, py::arg("beam_idx"))
      .def("reset", [](PyLayer& l) { l.guarded([&] { l.layer().reset(); }); })
      .def("shrink_to_fit", [](PyLayer& l) { l.guarded([&] { l.layer().shrink_to_fit(); }); })
      .def("memory", [](const PyLayer& l) {
        auto mem = l.layer().memory();
        py::dict d;
        d["kind"] = mem.kind;
        d["bytes_reserved"] = mem.bytes_reserved;
        d["bytes_used"] = mem.bytes_used;
        return d;
      })
      .def("retention_bytes", [](const PyLayer& l, std::int64_t r) {
        auto b = l.layer().retention_bytes(r);
        return py::make_tuple(b.bounded, b.per_token);
      }, py::arg("R"))
      .def("__deepcopy__", [](const PyLayer& l, py::dict memo) {
        std::shared_ptr<Budget> budget = deepcopied_budget(l.budget(), memo);
        rwd::Layer copy = with_budget(budget, l.layer().index(), [&] { return l.layer().clone(); });
        return std::make_shared<PyLayer>(std::move(copy), l.as_torch(), std::move(budget));
      }, py::arg("memo"), "An independent copy (rwd::Layer::clone): every part, rollback history and recording.")
      .def("_clone", [](const PyLayer& l) {
        rwd::Layer copy = with_budget(l.budget(), l.layer().index(), [&] { return l.layer().clone(); });
        return std::make_shared<PyLayer>(std::move(copy), l.as_torch(), l.budget());
      }, "A copy counted in this layer's own budget: the backup of a change made all or nothing.")
      .def("_swap", [](PyLayer& a, PyLayer& b) {
        if (a.budget() != b.budget()) invalid("_swap: the two layers count in different budgets");
        std::swap(a.layer(), b.layer());
      }, py::arg("other"), "Exchanges the two layers' states (cannot fail): puts a _clone backup back.")
      .def(py::pickle([](const PyLayer& l) { return layer_state(l); },
                      [](const py::tuple& st) { return layer_from_state(st); }),
           "Pickles what the layer needs to continue from its length (no rollback history: recording restarts "
           "there).");

  // ---- runtime ----
  py::class_<PyModelCache, std::shared_ptr<PyModelCache>>(m, "ModelCache",
      "A model's own rewind cache (rwd::Cache with the model's layer shapes), for Model.forward.")
      .def("get_seq_length", [](PyModelCache& c) { return c.use().get_seq_length(); }, "Tokens in the cache.")
      .def("crop", [](PyModelCache& c, std::int64_t n) { c.use().crop(n); }, py::arg("n"),
           "Transactional crop of every layer (negative: remove that many tokens).")
      .def("check_crop", [](PyModelCache& c, std::int64_t n) { c.use().check_crop(n); }, py::arg("n"),
           "Raises what crop(n) would raise; changes nothing.")
      .def("max_rollback", [](PyModelCache& c) { return c.use().max_rollback(); },
           "Largest k for which crop(-k) is exact now.")
      .def("activate_past_recording", [](PyModelCache& c, std::int64_t r) { c.use().activate_past_recording(r); }, py::arg("max_tokens"),
           "Keeps enough history in every layer to remove up to max_tokens tokens exactly.")
      .def("reset", [](PyModelCache& c) { c.use().reset(); }, "Back to empty; recording stays.")
      .def("memory", [](PyModelCache& c) {
        auto mem = c.use().memory();
        py::dict d;
        d["bytes_reserved"] = mem.bytes_reserved;
        d["bytes_used"] = mem.bytes_used;
        return d;
      }, "Bytes reserved and used by the cache.")
      .def("set_memory_budget", [](PyModelCache& c, std::size_t b) { c.use().set_memory_budget(b); }, py::arg("bytes"),
           "Caps the bytes the cache may reserve (0: no cap); an operation that would pass it raises CapacityError "
           "and changes nothing.");

  py::class_<PyModel, std::shared_ptr<PyModel>>(m, "Model", "The reference runtime's hybrid decoder (runtime/model.h).")
      .def_static("load", [](const std::string& dir) {
        std::shared_ptr<PyModel> loaded;
        {
          py::gil_scoped_release nogil;
          rwd::runtime::Model model = rwd::runtime::Model::load(dir);
          rwd::runtime::Tokenizer tokenizer = rwd::runtime::tokenizer_for_model(dir, model.config());
          loaded = std::make_shared<PyModel>(PyModel{std::move(model), std::move(tokenizer)});
        }
        return loaded;
      }, py::arg("directory"),
      "Loads DIR/config.json, DIR/model.safetensors (or its shards) and DIR/tokenizer.json when present.")
      .def_property_readonly("vocab_size", [](const PyModel& self) { return self.model.vocab_size(); })
      .def_property_readonly("parameter_count", [](const PyModel& self) { return self.model.parameter_count(); })
      .def_property_readonly("layer_types", [](const PyModel& self) {
        std::vector<std::string> names;
        for (rwd::LayerKind k : self.model.config().layer_types) names.emplace_back(rwd::layer_kind_name(k));
        return names;
      })
      .def("make_cache", [](std::shared_ptr<PyModel> self) {
        return std::make_shared<PyModelCache>(PyModelCache{self, self->model.make_cache()});
      }, "An empty cache for one sequence.")
      .def_property_readonly("tokenizer", [](const PyModel& self) { return self.tokenizer.describe(); })
      .def("encode", [](const PyModel& self, const std::string& text) {
        return self.tokenizer.encode(text, true);
      }, py::arg("text"),
      "The text's tokens with the model's tokenizer, BOS / template tokens first (byte-level: BOS + bytes).")
      .def("decode", [](const PyModel& self, py::object tokens) {
        auto t = tokens_of(tokens, "decode: tokens");
        return py::bytes(self.tokenizer.decode(t, true));
      }, py::arg("tokens"), "The bytes of the tokens with the model's tokenizer (special tokens skipped).")
      .def("forward", [](const PyModel& self, py::object tokens, PyModelCache& cache, bool all_logits) {
        if (cache.model.get() != &self) invalid("forward: the cache was made by another model");
        auto t = tokens_of(tokens, "forward: tokens");
        std::vector<float> logits;
        rwd::Cache& c = cache.use();
        cache.busy = true;
        try {
          py::gil_scoped_release nogil;
          self.model.forward(t, c, logits, all_logits);
        } catch (...) {
          cache.busy = false;
          throw;
        }
        cache.busy = false;
        return logits_array(std::move(logits), static_cast<std::int64_t>(t.size()), self.model.vocab_size(), all_logits);
      }, py::arg("tokens"), py::arg("cache"), py::arg("all_logits") = true,
         "Runs tokens at positions [L, L+n), appends them to `cache`, returns float32 logits [n, vocab] "
         "(or [vocab] for the last token when all_logits is False).")
      .def("generate", [](const PyModel& self, py::object prompt, std::int64_t max_new_tokens, float temperature,
                          std::int64_t top_k, float top_p, std::uint64_t seed, bool stop_at_eos,
                          std::shared_ptr<PyModel> draft, std::int64_t num_draft, std::int64_t lookup,
                          bool adaptive, std::int64_t max_prefill_rows) {
        auto p = tokens_of(prompt, "generate: the prompt", kPromptAccepted);
        if (p.empty()) invalid("generate: the prompt is empty");
        rwd::runtime::GenerationOptions o;
        o.max_new_tokens = max_new_tokens;
        o.max_prefill_rows = max_prefill_rows;
        o.stop_at_eos = stop_at_eos;
        o.sampling = sampling_of(temperature, top_k, top_p, seed);
        if (draft && lookup > 0) invalid("generate: give a draft model or prompt lookup, not both");
        rwd::runtime::GenerationStats stats;
        std::vector<std::int32_t> out;
        if (!draft && lookup == 0) {
          py::gil_scoped_release nogil;
          out = rwd::runtime::generate(self.model, p, o, &stats);
        } else {
          rwd::runtime::check_num_draft(num_draft, "num_draft");
          if (lookup < 0) invalid("generate: lookup must be >= 0");
          rwd::runtime::SpeculativeOptions spec;
          spec.num_draft = num_draft;
          spec.adaptive = adaptive;
          py::gil_scoped_release nogil;
          if (draft) {
            if (draft->model.vocab_size() != self.model.vocab_size()) {
              throw rwd::InvalidArgument("generate: the draft's vocabulary (" + std::to_string(draft->model.vocab_size()) +
                                         ") differs from the target's (" + std::to_string(self.model.vocab_size()) + ")");
            }
            rwd::runtime::SamplingParams ds = o.sampling;
            rwd::runtime::ModelDraft source(draft->model, ds, num_draft, max_prefill_rows);
            out = rwd::runtime::speculative_generate(self.model, source, p, o, spec, &stats);
          } else {
            rwd::runtime::LookupDraft source(lookup);
            out = rwd::runtime::speculative_generate(self.model, source, p, o, spec, &stats);
          }
        }
        return py::make_tuple(out, stats_dict(stats));
      }, py::arg("prompt"), py::arg("max_new_tokens") = 128, py::arg("temperature") = 0.0f, py::arg("top_k") = 0,
         py::arg("top_p") = 1.0f, py::arg("seed") = 0, py::arg("stop_at_eos") = true, py::arg("draft") = nullptr,
         py::arg("num_draft") = 4, py::arg("lookup") = 0, py::arg("adaptive") = false,
         py::arg("max_prefill_rows") = rwd::runtime::kDefaultMaxPrefillRows,
         "Greedy (temperature 0) or sampled generation; speculative with `draft` (a Model) or prompt lookup "
         "(`lookup` = max n-gram). A prompt goes in forwards of at most `max_prefill_rows` tokens (the same "
         "output; bounded memory). Returns (new_tokens, stats).")
      .def("generate_batch", [](const PyModel& self, py::object prompts, std::int64_t max_new_tokens,
                                float temperature, std::int64_t top_k, float top_p, std::uint64_t seed,
                                bool stop_at_eos, std::shared_ptr<PyModel> draft, std::int64_t num_draft,
                                std::int64_t lookup, bool adaptive, std::int64_t max_batch, std::int64_t max_prefill_rows) {
        std::vector<std::vector<std::int32_t>> ps;
        if (py::isinstance<py::str>(prompts) || py::isinstance<py::bytes>(prompts)) {
          throw py::type_error("generate_batch: prompts must be a list of prompts (each " + std::string(kPromptAccepted) +
                               "); got " + type_name_of(prompts));
        }
        std::size_t index = 0;
        for (py::handle p : prompts) {
          ps.push_back(tokens_of(p, "generate_batch: prompt " + std::to_string(index++), kPromptAccepted));
        }
        rwd::runtime::GenerationOptions o;
        o.max_new_tokens = max_new_tokens;
        o.max_prefill_rows = max_prefill_rows;
        o.stop_at_eos = stop_at_eos;
        o.sampling = sampling_of(temperature, top_k, top_p, seed);
        if (max_batch < 0) invalid("generate_batch: max_batch must be >= 0");
        o.max_batch = max_batch;
        if (draft && lookup > 0) invalid("generate_batch: give a draft model or prompt lookup, not both");
        if (lookup < 0) invalid("generate_batch: lookup must be >= 0");
        rwd::runtime::BatchGenerationStats stats;
        std::vector<std::vector<std::int32_t>> out;
        if (!draft && lookup == 0) {
          py::gil_scoped_release nogil;
          out = rwd::runtime::generate_batch(self.model, ps, o, &stats);
        } else {
          rwd::runtime::check_num_draft(num_draft, "num_draft");
          if (draft && draft->model.vocab_size() != self.model.vocab_size()) {
            invalid("generate_batch: the draft's vocabulary (" + std::to_string(draft->model.vocab_size()) +
                    ") differs from the target's (" + std::to_string(self.model.vocab_size()) + ")");
          }
          rwd::runtime::SpeculativeOptions spec;
          spec.num_draft = num_draft;
          spec.adaptive = adaptive;
          py::gil_scoped_release nogil;
          std::unique_ptr<rwd::runtime::BatchDraftSource> sources;
          if (draft) {
            sources =
                std::make_unique<rwd::runtime::BatchedModelDraft>(draft->model, o.sampling, num_draft, max_prefill_rows);
          } else {
            std::vector<std::unique_ptr<rwd::runtime::DraftSource>> each;
            for (std::size_t i = 0; i < ps.size(); ++i) each.push_back(std::make_unique<rwd::runtime::LookupDraft>(lookup));
            sources = std::make_unique<rwd::runtime::PerSequenceDrafts>(std::move(each));
          }
          out = rwd::runtime::speculative_generate_batch(self.model, *sources, ps, o, spec, &stats);
        }
        py::dict d;
        py::list per;
        for (const auto& s1 : stats.sequences) per.append(stats_dict(s1));
        d["sequences"] = per;
        d["new_tokens"] = stats.new_tokens;
        d["forwards"] = stats.forwards;
        d["seconds"] = stats.seconds;
        d["tokens_per_second"] = stats.tokens_per_second();
        return py::make_tuple(out, d);
      }, py::arg("prompts"), py::arg("max_new_tokens") = 128, py::arg("temperature") = 0.0f, py::arg("top_k") = 0,
         py::arg("top_p") = 1.0f, py::arg("seed") = 0, py::arg("stop_at_eos") = true, py::arg("draft") = nullptr,
         py::arg("num_draft") = 4, py::arg("lookup") = 0, py::arg("adaptive") = false, py::arg("max_batch") = 0,
         py::arg("max_prefill_rows") = rwd::runtime::kDefaultMaxPrefillRows,
         "Batched generation of many prompts in one SequenceCache (the CLI's --prompts / --max-batch); sequence i "
         "samples with seed + i; joining prompts share at most `max_prefill_rows` prompt tokens a forward. "
         "Returns (list of new tokens per prompt, stats).");

  m.def("set_num_threads", [](int n) {
    if (n < 1 || n > 1024) invalid("set_num_threads: n must be in [1, 1024], got " + std::to_string(n));
    omp_set_num_threads(n);
  }, py::arg("n"), "OpenMP threads of the runtime's forwards (the CLI's --threads). The process shares OpenMP "
                   "with torch, so this also sets torch's intra-op OpenMP threads.");
  m.def("get_num_threads", [] { return omp_get_max_threads(); });
}
