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
// argument `what` names it in messages. The caller keeps `obj` alive for as
// long as the view is used. Throws InvalidArgument for an unsupported dtype,
// a device tensor or a misaligned array.
rwd::TensorView input_view(const py::handle& obj, const char* what);
// `v` (a view of layer storage) as a torch tensor (as_torch) or a numpy
// array sharing its memory; a pin keeps that memory allocated while the
// returned object lives.
py::object output_view(const rwd::TensorView& v, bool as_torch);
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
  PyLayer(const std::string& kind, const rwd::LayerOptions& options, int index, bool as_torch,
          std::shared_ptr<Budget> budget)
      : budget_(std::move(budget)),
        layer_(with_budget(budget_, index, [&] { return rwd::Layer(rwd::parse_layer_kind(kind), options, index); })),
        as_torch_(as_torch) {}

  // Takes a ready-made layer (a clone) whose buffers were allocated under `budget`.
  PyLayer(rwd::Layer&& layer, bool as_torch, std::shared_ptr<Budget> budget)
      : budget_(std::move(budget)), layer_(std::move(layer)), as_torch_(as_torch) {}

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
  rwd::Layer layer_;
  bool as_torch_;
  bool lent_ = false;
};

// Registration of each concept on the module (bind_layer.cc, bind_cache.cc,
// bind_runtime.cc).
void bind_budget(py::module_& m);
void bind_layer(py::module_& m);
void bind_cache(py::module_& m);
void bind_runtime(py::module_& m);

}  // namespace rwd::python
