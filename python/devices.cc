// Devices across the Python boundary: which device a `device=` argument or a
// tensor names, the storage a cache's layers allocate from there, and the
// check that an update's tensors are on the cache's device.
//
// "cpu" is rwd::host_storage(), whatever the build's default_storage() is
// (a guarded test build must not change what Python gets), unless the tests
// asked for the guarded storage (set_cpu_storage_guarded). CUDA device N is
// rwd::cuda_storage(N, stream) with stream = torch's current stream on N when
// the device is fixed, wrapped in a pinning_storage (pinning.cc) so that a
// returned tensor keeps the device buffer it views allocated.
#include <pybind11/pybind11.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "module.h"
#include "rewind/cuda_storage.h"

namespace rwd::python {
namespace {

std::atomic<bool> cpu_guarded{false};

bool has_torch() {
  static const bool present = [] {
    try {
      py::module_::import("torch");
      return true;
    } catch (const py::error_already_set&) {
      return false;
    }
  }();
  return present;
}

// Why CUDA cannot be used here, or empty when it can.
std::string cuda_unavailable() {
  if (!rwd::cuda_built()) return "this build of rewind has no CUDA backend (CMake did not find the CUDA toolkit)";
  if (rwd::cuda_device_count() == 0) return "rewind has its CUDA backend, but the CUDA runtime sees no device";
  return {};
}

// (type, index) of a torch.device-like spec; index -1 when not given.
std::pair<std::string, int> parse_spec(const py::handle& spec) {
  const std::string asked = py::repr(spec);
  if (has_torch()) {
    py::object torch_device = py::module_::import("torch").attr("device");
    py::object d;
    try {
      d = py::isinstance(spec, torch_device) ? py::reinterpret_borrow<py::object>(spec) : torch_device(spec);
    } catch (const py::error_already_set& e) {
      invalid("device=" + asked + " is not a device (torch.device says: " + std::string(e.what()) +
              "); allowed: " + allowed_devices());
    }
    const py::object index = d.attr("index");
    return {py::str(d.attr("type")), index.is_none() ? -1 : index.cast<int>()};
  }
  // Without torch (numpy inputs): the strings torch.device accepts.
  if (!py::isinstance<py::str>(spec)) invalid("device=" + asked + " is not a device; allowed: " + allowed_devices());
  const std::string s = spec.cast<std::string>();
  const std::size_t colon = s.find(':');
  if (colon == std::string::npos) return {s, -1};
  try {
    std::size_t used = 0;
    const int index = std::stoi(s.substr(colon + 1), &used);
    if (used == s.size() - colon - 1 && index >= 0) return {s.substr(0, colon), index};
  } catch (const std::exception&) {
  }
  invalid("device=" + asked + " is not a device; allowed: " + allowed_devices());
}

std::shared_ptr<PyDevice> make_device(const std::string& type, int index, const std::string& asked) {
  auto out = std::make_shared<PyDevice>();
  out->stream = py::none();
  if (type == "cpu") {
    out->name = "cpu";
    if (cpu_guarded.load()) {
      // Not the host storage, so its allocations are counted and pinnable only through the wrap.
      out->storage = pinning_storage(rwd::guarded_storage());
      out->device = out->storage->device();
    } else {
      out->device = {};
      out->storage = rwd::host_storage();
    }
    return out;
  }
  if (type != "cuda") {
    invalid(asked + ": rewind keeps cache state on cpu or cuda, not on " + type + "; allowed: " + allowed_devices());
  }
  if (const std::string why = cuda_unavailable(); !why.empty()) {
    invalid(asked + " asks for CUDA, but " + why + "; allowed: " + allowed_devices());
  }
  py::object torch_cuda;
  if (has_torch()) {
    torch_cuda = py::module_::import("torch.cuda");
    if (!torch_cuda.attr("is_available")().cast<bool>()) {
      invalid(asked +
              " asks for CUDA, but this torch has no CUDA support (torch.cuda.is_available() is False); "
              "allowed: cpu");
    }
    if (index < 0) index = torch_cuda.attr("current_device")().cast<int>();
  } else if (index < 0) {
    index = 0;
  }
  if (index >= rwd::cuda_device_count()) {
    invalid(asked + " asks for CUDA device " + std::to_string(index) + ", but " +
            std::to_string(rwd::cuda_device_count()) + " are visible; allowed: " + allowed_devices());
  }
  void* stream = nullptr;
  if (torch_cuda) {
    out->stream = torch_cuda.attr("current_stream")(index);
    stream = reinterpret_cast<void*>(out->stream.attr("cuda_stream").cast<std::uintptr_t>());
  }
  out->storage = pinning_storage(rwd::cuda_storage(index, stream));
  out->device = out->storage->device();
  out->name = out->device.describe();
  return out;
}

}  // namespace

std::string allowed_devices() {
  if (!cuda_unavailable().empty()) return "cpu";
  const int n = rwd::cuda_device_count();
  return n == 1 ? "cpu, cuda:0" : "cpu, cuda:0 .. cuda:" + std::to_string(n - 1);
}

std::shared_ptr<PyDevice> resolve_device(const py::handle& spec) {
  if (py::isinstance<PyDevice>(spec)) return spec.cast<std::shared_ptr<PyDevice>>();
  const auto [type, index] = parse_spec(spec);
  return make_device(type, index, "device=" + std::string(py::repr(spec)));
}

std::shared_ptr<PyDevice> device_of(const py::handle& tensor, const char* what) {
  if (!is_torch(tensor)) return make_device("cpu", 0, what);
  py::object d = tensor.attr("device");
  const py::object index = d.attr("index");
  return make_device(py::str(d.attr("type")), index.is_none() ? -1 : index.cast<int>(),
                     std::string(what) + " (a tensor on " + std::string(py::str(d)) + ")");
}

void set_cpu_storage_guarded(bool guarded) { cpu_guarded.store(guarded); }

void check_device(const rwd::TensorView& v, const PyDevice& device, const char* what) {
  if (device.accepts(v)) return;
  const std::string on = v.device.is_host() ? std::string("cpu") : v.device.describe();
  invalid(std::string(what) + " is on " + on + ", but this cache is on " + device.name +
          " (fixed by its device= or its first update; a cache keeps one device); move it with .to(\"" + device.name +
          "\") or use a cache on " + on + "; nothing was changed");
}

void bind_devices(py::module_& m) {
  m.def("cuda_built", &rwd::cuda_built, "True when this build of rewind has the CUDA storage backend.");
  m.def(
      "_set_cpu_storage",
      [](const std::string& kind) {
        if (kind != "host" && kind != "guarded") invalid("_set_cpu_storage(\"" + kind + "\"): allowed: host, guarded");
        set_cpu_storage_guarded(kind == "guarded");
      },
      py::arg("kind"),
      "For the tests: cpu caches made from now on keep their state on the host (\"host\", the default) or on the "
      "guarded test storage (\"guarded\": pages the host cannot touch outside rewind's copies; results are host "
      "copies instead of views). Caches made before keep theirs.");
  m.def("cuda_device_count", &rwd::cuda_device_count,
        "CUDA devices rewind's CUDA runtime sees (0 without the backend, a driver or a GPU).");
  py::class_<PyDevice, std::shared_ptr<PyDevice>>(
      m, "_Device",
      "The device a cache's state lives on, shared by its layers: cpu (host memory) or cuda:N (device memory, "
      "copies on the torch stream current on N when it was made).")
      .def(py::init([](py::object spec) { return resolve_device(spec); }), py::arg("device"),
           "What torch.device(device) names; raises InvalidArgument for a device rewind cannot use here.")
      .def_static(
          "of", [](py::object t, const std::string& what) { return device_of(t, what.c_str()); }, py::arg("tensor"),
          py::arg("what") = "tensor", "The device of a tensor (cpu for a numpy array).")
      .def_property_readonly("name", [](const PyDevice& d) { return d.name; })
      .def_property_readonly("type",
                             [](const PyDevice& d) { return d.device.type == rwd::DeviceType::Cuda ? "cuda" : "cpu"; })
      .def_property_readonly("index", [](const PyDevice& d) { return d.device.index; })
      .def_property_readonly(
          "storage", [](const PyDevice& d) { return d.device.type == rwd::DeviceType::Guarded ? "guarded" : d.name; },
          "Where the state is: the device's name, or \"guarded\" for a cpu device on the guarded test storage.")
      .def(
          "check",
          [](const PyDevice& d, py::object t, const std::string& what) {
            check_device(input_view(t, what.c_str()), d, what.c_str());
          },
          py::arg("tensor"), py::arg("what") = "tensor",
          "Raises InvalidArgument naming both devices unless `tensor` is on this device.")
      .def("__repr__", [](const PyDevice& d) { return "rewind._Device('" + d.name + "')"; })
      .def(
          "__deepcopy__", [](std::shared_ptr<PyDevice> d, py::dict) { return d; }, py::arg("memo"),
          "The same device (immutable; its storage is shared).")
      .def(py::pickle([](const PyDevice& d) { return py::make_tuple(d.name); },
                      [](const py::tuple& t) {
                        if (t.size() != 1) invalid("_Device state: expected (name,)");
                        return resolve_device(t[0]);
                      }));
}

}  // namespace rwd::python
