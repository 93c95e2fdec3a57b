// The pieces the binding files of rewind._rewind share (python/bind_*.cc):
// tensors across the boundary (tensors.cc), the budget-counted layer the
// `_Layer` and `_Cache` bindings both hold, and one registration function
// per concept, called by PYBIND11_MODULE (rewind_module.cc).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "pinning.h"
#include "rewind/error.h"
#include "rewind/layer.h"
#include "rewind/tensor.h"

namespace rwd::python {

namespace py = pybind11;

// Throws rwd::InvalidArgument(message).
[[noreturn]] void invalid(const std::string& message);
// True when `obj` is a torch tensor (false when torch is not installed).
bool is_torch(const py::handle& obj);
// A view of a torch tensor or a buffer-protocol object (numpy), in place;
// argument `what` names it in messages. A CUDA tensor gives a view on
// {Cuda, its index}. The caller keeps `obj` alive for as long as the view is
// used. Throws InvalidArgument for an unsupported dtype, a tensor on a device
// other than cpu or cuda, or a misaligned array.
rwd::TensorView input_view(const py::handle& obj, const char* what);
// `v` (a view of layer storage) as a torch tensor (as_torch) or a numpy
// array sharing its memory; a pin keeps that memory allocated while the
// returned object lives. A CUDA view becomes a torch tensor on that device
// (numpy is refused). A view on the guarded test storage, which the host
// cannot read, becomes a host copy (read through the storage): the one
// result that is not zero-copy.
py::object output_view(const rwd::TensorView& v, bool as_torch);

// The device a cache's state lives on (devices.cc), fixed once, by device=
// or by the first tensor it receives, and shared by its layers: the Device,
// the storage its layers allocate from, and the torch stream a CUDA
// storage's copies run on (held so that it outlives the layers).
struct PyDevice {
  rwd::Device device;  // where the storage's memory is
  std::shared_ptr<rwd::Storage> storage;
  py::object stream;  // None on the host
  // The torch device of its tensors ("cpu", "cuda:1"): for the guarded test
  // storage (set_cpu_storage), "cpu", whose tensors it takes and returns.
  std::string name;
  // True when `v`, an input, may go into this device's caches: on it, or
  // host memory for a cpu device kept on the guarded storage.
  bool accepts(const rwd::TensorView& v) const {
    return v.device == device || (v.device.is_host() && device.type == rwd::DeviceType::Guarded);
  }
};
// Which storage "cpu" caches made from now on allocate from: the host's (the
// default) or, for the Python tests under the guarded test storage
// (`_set_cpu_storage("guarded")`), rwd::guarded_storage() through a
// pinning_storage, so that a code path that touches state memory outside the
// storage faults. Caches made before keep theirs.
void set_cpu_storage_guarded(bool guarded);
// The device `spec` names (a str, int or torch.device: what torch.device
// accepts): "cpu" is rwd::host_storage(); "cuda" / "cuda:N" CUDA device N
// (the current one without N) through a pinning_storage over
// rwd::cuda_storage(N, torch.cuda.current_stream(N)). Throws InvalidArgument,
// naming what was asked and what is allowed, for any other device, or cuda
// without the backend or the device.
std::shared_ptr<PyDevice> resolve_device(const py::handle& spec);
// The device of a tensor (`what` in messages): its torch device, cpu for a
// numpy array. Throws as resolve_device.
std::shared_ptr<PyDevice> device_of(const py::handle& tensor, const char* what);
// Throws InvalidArgument, naming both devices, unless `device` accepts `v`.
void check_device(const rwd::TensorView& v, const PyDevice& device, const char* what);
// "cpu", "cpu, cuda:0" ...: the devices this build and machine accept.
std::string allowed_devices();
// A list, tuple, torch tensor or numpy array of integers as a vector.
std::vector<std::int64_t> index_list(const py::handle& obj);

// Runs fn() with the aligned allocations it makes counted against `budget`;
// a refusal by a budget becomes a CapacityError that names the budget and
// `who` ("layer 3", "reorder_cache"): the library reported it as a failed
// allocation and changed nothing.
template <typename Fn>
decltype(auto) with_budget_for(const std::shared_ptr<Budget>& budget, const std::string& who, Fn&& fn) {
  BudgetScope scope(budget);
  try {
    return fn();
  } catch (const rwd::CapacityError&) {
    if (!scope.refused()) throw;
    const Budget* b = scope.refused_by();
    throw rwd::CapacityError("memory budget of " + std::to_string(b->limit()) + " bytes: " + who + " needs " +
                             std::to_string(scope.refused_bytes()) + " more bytes while " +
                             std::to_string(b->reserved()) +
                             " are reserved; nothing was changed (set_memory_budget raises the cap)");
  }
}

// with_budget_for, naming layer `index` (-1: "the layer").
template <typename Fn>
decltype(auto) with_budget(const std::shared_ptr<Budget>& budget, int index, Fn&& fn) {
  return with_budget_for(budget, index >= 0 ? "layer " + std::to_string(index) : std::string("the layer"),
                         std::forward<Fn>(fn));
}

// One rwd::Layer, how its results are returned (torch or numpy, fixed by the
// first input it received) and the budget its buffers count against.
class PyLayer {
 public:
  // `options.storage` is replaced by the device's.
  PyLayer(const std::string& kind, rwd::LayerOptions options, int index, bool as_torch, std::shared_ptr<Budget> budget,
          std::shared_ptr<PyDevice> device)
      : budget_(std::move(budget)), device_(std::move(device)),
        layer_(with_budget(budget_, index,
                           [&] {
                             options.storage = device_->storage;
                             return rwd::Layer(rwd::parse_layer_kind(kind), options, index);
                           })),
        as_torch_(as_torch) {}

  // Takes a ready-made layer (a clone) on `device` whose buffers were allocated under `budget`.
  PyLayer(rwd::Layer&& layer, bool as_torch, std::shared_ptr<Budget> budget, std::shared_ptr<PyDevice> device)
      : budget_(std::move(budget)), device_(std::move(device)), layer_(std::move(layer)), as_torch_(as_torch) {}

  const std::shared_ptr<PyDevice>& device() const { return device_; }
  // A view of an input tensor (input_view) that is on this layer's device;
  // throws InvalidArgument naming both devices otherwise, before anything
  // changes.
  rwd::TensorView input(const py::handle& obj, const char* what) const {
    rwd::TensorView v = input_view(obj, what);
    check_device(v, *device_, what);
    return v;
  }

  // The layer; throws StateError while it is lent to a whole-cache
  // operation (only Python code run in the middle of one, a warning
  // handler, can see that).
  rwd::Layer& layer() {
    check_here();
    return layer_;
  }
  const rwd::Layer& layer() const {
    check_here();
    return layer_;
  }
  // Lends the layer to a whole-cache operation (bind_cache.cc) until
  // give_back returns it.
  rwd::Layer lend() {
    check_here();
    lent_ = true;
    return std::move(layer_);
  }
  void give_back(rwd::Layer&& layer) noexcept {
    layer_ = std::move(layer);
    lent_ = false;
  }
  const std::shared_ptr<Budget>& budget() const { return budget_; }
  // Counts this layer's later allocations in `budget` (those made so far
  // stay counted where they were).
  void set_budget(std::shared_ptr<Budget> budget) { budget_ = std::move(budget); }
  py::object out(const rwd::TensorView& v) const { return output_view(v, as_torch_); }
  bool as_torch() const { return as_torch_; }
  // Runs a call that may allocate with this layer's budget.
  template <typename Fn>
  decltype(auto) guarded(Fn&& fn) {
    return with_budget(budget_, layer().index(), std::forward<Fn>(fn));
  }

 private:
  void check_here() const {
    if (lent_)
      throw rwd::StateError("this layer is in the middle of a whole-cache operation of its cache; use it after");
  }
  std::shared_ptr<Budget> budget_;
  std::shared_ptr<PyDevice> device_;
  rwd::Layer layer_;
  bool as_torch_;
  bool lent_ = false;
};

// Registration of each concept on the module (bind_layer.cc, bind_cache.cc,
// bind_runtime.cc).
void bind_budget(py::module_& m);
void bind_devices(py::module_& m);
void bind_layer(py::module_& m);
void bind_cache(py::module_& m);
void bind_runtime(py::module_& m);

}  // namespace rwd::python
