// rewind._rewind: the C++ core of the Python module.
//
// Each concept registers itself (module.h): layers (bind_layer.cc), the
// whole-cache transaction over them (bind_cache.cc), the runtime
// (bind_runtime.cc); tensors cross the boundary without copies
// (tensors.cc). This file holds the exception hierarchy and the warning
// handler.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>

#include <memory>
#include <string>

#include "module.h"
#include "rewind/error.h"
#include "rewind/warnings.h"

namespace py = pybind11;

namespace {

// rewind.Error and subclasses that are also the builtin transformers raises
// in the same situation. Messages are the C++ ones.
void bind_errors(py::module_& m) {
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
  py::object RollbackError = make_exc(
      "RollbackError", py::make_tuple(Error, builtins.attr("RuntimeError"), builtins.attr("ValueError")),
      "A crop the layer cannot perform exactly (too deep, not recording, positive crop it cannot do). "
      "Also a RuntimeError (transformers >= 5.15) and a ValueError (older transformers).");
  py::object StateError = make_exc(
      "StateError", py::make_tuple(Error, builtins.attr("RuntimeError"), builtins.attr("ValueError")),
      "The operation is not valid in the current state or for this layer kind. Also a RuntimeError "
      "and a ValueError (transformers raises ValueError for methods a layer kind lacks).");
  py::object FormatError = make_exc("FormatError", py::make_tuple(Error, builtins.attr("ValueError")),
                                    "A model file or configuration is malformed.");
  py::object StoreError = make_exc("StoreError", py::make_tuple(Error, builtins.attr("RuntimeError")),
                                   "A snapshot store cannot be reached or read.");
  // Leaked references: the translator runs for the life of the process.
  static PyObject* exc[8] = {Error.release().ptr(),         InvalidArgument.release().ptr(), IndexErr.release().ptr(),
                             CapacityError.release().ptr(), RollbackError.release().ptr(),   StateError.release().ptr(),
                             FormatError.release().ptr(),   StoreError.release().ptr()};
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
}

void bind_warnings(py::module_& m) {
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
  m.def(
      "set_warning_handler", [](py::object handler) { install_warning_handler(std::move(handler)); },
      py::arg("handler"),
      "Routes rewind's one-time warnings (deprecated positive crop) to `handler(message)`; None restores stderr.");
  py::module_::import("atexit").attr("register")(py::cpp_function([] { install_warning_handler(py::none()); }));
  m.def("reset_one_time_warnings", &rwd::reset_one_time_warnings, "Lets one-time warnings fire again (tests).");
}

}  // namespace

PYBIND11_MODULE(_rewind, mod) {
  py::module_& m = mod;
  m.doc() = "rewind's C++ core: layers with exact rollback, zero-copy tensor views, the reference runtime.";
  bind_errors(m);
  bind_warnings(m);
  rwd::python::bind_budget(m);
  rwd::python::bind_devices(m);
  rwd::python::bind_layer(m);
  rwd::python::bind_cache(m);
  rwd::python::bind_runtime(m);
}
