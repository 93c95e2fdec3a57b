// The `_Layer` binding: one rwd::Layer per object (the transformers-shaped
// classes in python/rewind/ combine them), its zero-copy recurrent update,
// copies (deepcopy, pickle) and the memory budgets its buffers count in.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "module.h"

namespace rwd::python {
namespace {

// A zero-copy recurrent update (rwd::RecurrentUpdate) that keeps its layer alive.
// On the guarded test storage a slot cannot be handed out as a view (the host
// cannot write those pages): next(t) is then a host copy, kept, and written
// into its slot at commit, in order of t, which is what writing the views in
// place would have left (slots may coincide when not recording).
class PyRecurrentUpdate {
 public:
  PyRecurrentUpdate(py::object owner, PyLayer& layer, std::int64_t q, int state)
      : owner_(std::move(owner)), layer_(&layer),
        update_(layer.guarded([&] { return layer.layer().begin_recurrent_update(q, state); })) {}
  std::int64_t num_tokens() const { return update_.num_tokens(); }
  py::object previous() const { return layer_->out(update_.previous()); }
  py::object next(std::int64_t t) {
    const rwd::TensorView slot = update_.next(t);
    if (slot.device.type != rwd::DeviceType::Guarded) return layer_->out(slot);
    auto it = staged_.find(t);
    if (it == staged_.end()) it = staged_.emplace(t, layer_->out(slot)).first;
    return it->second;
  }
  void commit() {
    // Read every staged copy before writing any slot, so that a refused one changes nothing.
    std::vector<std::pair<std::int64_t, rwd::TensorView>> staged;
    for (const auto& [t, obj] : staged_) staged.emplace_back(t, input_view(obj, "a recurrent update's slot"));
    for (const auto& [t, v] : staged) rwd::copy_tensor(v, update_.next(t));
    layer_->guarded([&] { update_.commit(); });
    staged_.clear();
  }

 private:
  py::object owner_;  // the Python _Layer: the handle must not outlive it
  PyLayer* layer_;
  rwd::RecurrentUpdate update_;
  std::map<std::int64_t, py::object> staged_;  // guarded storage only
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
                                     o.conv_channels, o.recurrent_shapes,
                                     std::string(rwd::dtype_name(o.recurrent_dtype)));
  py::object attention = py::none();
  if (layer.has_attention()) {
    const rwd::PositionRange r = layer.stored_range();
    const rwd::KeyValueView kv = layer.keys_values();
    attention = py::make_tuple(r.first, tensor_state(kv.keys), tensor_state(kv.values));
  }
  py::list convs, recurrents;
  for (std::size_t s = 0; s < o.conv_channels.size(); ++s)
    convs.append(tensor_state(layer.get_conv_state(static_cast<int>(s))));
  for (std::size_t s = 0; s < o.recurrent_shapes.size(); ++s) {
    recurrents.append(tensor_state(layer.get_recurrent_state(static_cast<int>(s))));
  }
  py::object budget = l.budget() ? py::cast(l.budget()) : py::none();
  return py::make_tuple(1, std::string(rwd::layer_kind_name(layer.kind())), options, layer.batch_size(),
                        layer.get_seq_length(), layer.is_recording() ? layer.recording_capacity() : std::int64_t{-1},
                        l.as_torch(), layer.index(), budget, attention, convs, recurrents, l.device()->name);
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
  // 13 entries: the device's name last; a 12-entry state (older module) is on the host.
  if ((st.size() != 12 && st.size() != 13) || st[0].cast<int>() != 1)
    invalid("_Layer state: not a version-1 layer state");
  std::shared_ptr<PyDevice> device = resolve_device(st.size() == 13 ? st[12] : py::str("cpu"));
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
      st[7].cast<int>(), st[6].cast<bool>(), budget, std::move(device));
  if (L < 0) invalid("_Layer state: negative length");
  out->guarded([&] { replay(out->layer(), L, st[9], st[10].cast<py::list>(), st[11].cast<py::list>()); });
  if (R >= 0) out->guarded([&] { out->layer().activate_past_recording(R); });
  return out;
}

std::shared_ptr<Budget> deepcopied_budget(const std::shared_ptr<Budget>& b, py::dict memo) {
  if (!b) return nullptr;
  return py::module_::import("copy").attr("deepcopy")(py::cast(b), memo).cast<std::shared_ptr<Budget>>();
}

}  // namespace

void bind_budget(py::module_& m) {
  m.def(
      "pin_stats",
      [] {
        auto s = rwd::python::pin_stats();
        py::dict d;
        d["pinned_blocks"] = s.pinned_blocks;
        d["zombie_blocks"] = s.zombie_blocks;
        d["zombie_bytes"] = s.zombie_bytes;
        return d;
      },
      "Buffers that returned tensors keep alive: pinned, and of those freed by the cache (zombies, with bytes).");

  m.def(
      "input_data_ptr", [](py::object t) { return reinterpret_cast<std::uintptr_t>(input_view(t, "tensor").data); },
      py::arg("tensor"), "Address of the first element of a tensor or array as rewind reads it (tests).");

  // ---- _Layer ----
  py::class_<Budget, std::shared_ptr<Budget>>(
      m, "_Budget",
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
      .def(
          "__deepcopy__",
          [](const Budget& b, py::dict memo) {
            auto out = std::make_shared<Budget>();
            out->set_limit(b.limit());
            out->set_parent(deepcopied_budget(b.parent(), memo));
            return out;
          },
          py::arg("memo"), "A budget with the same cap and a copy of the parent; nothing reserved yet.")
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
}

namespace {

using LayerClass = py::class_<PyLayer, std::shared_ptr<PyLayer>>;

void def_layer_updates(LayerClass& c);
void def_layer_whole(LayerClass& c);

}  // namespace

void bind_layer(py::module_& m) {
  LayerClass c(m, "_Layer",
               "One rwd::Layer on one device (device=: cpu or cuda:N). Results are views of its storage (torch "
               "tensors or numpy arrays, as the first input, on its device), valid until the next mutation of this "
               "layer; a stale view stays readable.");
  c.def(
       py::init([](const std::string& kind, const std::string& dtype, std::int64_t batch_size,
                   std::int64_t num_kv_heads, std::int64_t key_dim, std::int64_t value_dim, std::int64_t sliding_window,
                   std::int64_t chunk_size, std::int64_t static_capacity, std::vector<std::int64_t> side_dims,
                   std::int64_t conv_kernel_size, std::vector<std::int64_t> conv_channels,
                   std::vector<std::vector<std::int64_t>> recurrent_shapes, const std::string& recurrent_dtype,
                   int index, bool as_torch, std::shared_ptr<Budget> budget, py::object device) {
         std::shared_ptr<PyDevice> dev = resolve_device(device.is_none() ? py::str("cpu") : device);
         return std::make_shared<PyLayer>(
             kind,
             make_options(dtype, batch_size, num_kv_heads, key_dim, value_dim, sliding_window, chunk_size,
                          static_capacity, std::move(side_dims), conv_kernel_size, std::move(conv_channels),
                          std::move(recurrent_shapes), recurrent_dtype),
             index, as_torch, std::move(budget), std::move(dev));
       }),
       py::arg("kind"), py::arg("dtype") = "f32", py::arg("batch_size") = 1, py::arg("num_kv_heads") = 0,
       py::arg("key_dim") = 0, py::arg("value_dim") = 0, py::arg("sliding_window") = 0, py::arg("chunk_size") = 0,
       py::arg("static_capacity") = 0, py::arg("side_dims") = std::vector<std::int64_t>{},
       py::arg("conv_kernel_size") = 0, py::arg("conv_channels") = std::vector<std::int64_t>{},
       py::arg("recurrent_shapes") = std::vector<std::vector<std::int64_t>>{}, py::arg("recurrent_dtype") = "f32",
       py::arg("index") = -1, py::arg("as_torch") = true, py::arg("budget") = nullptr, py::arg("device") = py::none())
      .def_property_readonly(
          "device", [](const PyLayer& l) { return l.device(); },
          "The _Device its state is on (None given: cpu, host memory); updates must be on it.")
      .def_property_readonly("kind",
                             [](const PyLayer& l) { return std::string(rwd::layer_kind_name(l.layer().kind())); })
      .def_property_readonly("as_torch", &PyLayer::as_torch)
      .def(
          "set_index", [](PyLayer& l, int i) { l.layer().set_index(i); }, py::arg("index"))
      .def("get_seq_length", [](const PyLayer& l) { return l.layer().get_seq_length(); })
      .def("batch_size", [](const PyLayer& l) { return l.layer().batch_size(); })
      .def(
          "get_mask_sizes",
          [](const PyLayer& l, std::int64_t q) {
            auto s = l.layer().get_mask_sizes(q);
            return py::make_tuple(s.kv_length, s.kv_offset);
          },
          py::arg("query_length"));
  def_layer_updates(c);
  def_layer_whole(c);
}

namespace {

// The per-part updates and what they hold.
void def_layer_updates(LayerClass& c) {
  c.def(
       "update",
       [](PyLayer& l, py::object k, py::object v) {
         rwd::TensorView kv = l.input(k, "key_states"), vv = l.input(v, "value_states");
         rwd::KeyValueView r = l.guarded([&] { return l.layer().update(kv, vv); });
         return py::make_tuple(l.out(r.keys), l.out(r.values));
       },
       py::arg("key_states"), py::arg("value_states"))
      .def(
          "update_side",
          [](PyLayer& l, py::object rows, int side) {
            rwd::TensorView in = l.input(rows, "side rows");
            return l.out(l.guarded([&] { return l.layer().update_side(in, side); }));
          },
          py::arg("rows"), py::arg("side") = 0)
      .def("keys_values",
           [](const PyLayer& l) {
             rwd::KeyValueView r = l.layer().keys_values();
             return py::make_tuple(l.out(r.keys), l.out(r.values));
           })
      .def(
          "side", [](const PyLayer& l, int s) { return l.out(l.layer().side(s)); }, py::arg("side") = 0)
      .def("stored_range",
           [](const PyLayer& l) {
             auto r = l.layer().stored_range();
             return py::make_tuple(r.first, r.end);
           })
      .def(
          "update_conv_state",
          [](PyLayer& l, py::object x, int state) {
            rwd::TensorView in = l.input(x, "conv_states");
            return l.out(l.guarded([&] { return l.layer().update_conv_state(in, state); }));
          },
          py::arg("x"), py::arg("state") = 0)
      .def(
          "get_conv_state", [](const PyLayer& l, int s) { return l.out(l.layer().get_conv_state(s)); },
          py::arg("state") = 0)
      .def(
          "conv_inputs", [](const PyLayer& l, int s) { return l.out(l.layer().conv_inputs(s)); }, py::arg("state") = 0)
      .def(
          "conv_range",
          [](const PyLayer& l, int s) {
            auto r = l.layer().conv_range(s);
            return py::make_tuple(r.first, r.end);
          },
          py::arg("state") = 0)
      .def(
          "begin_recurrent_update",
          [](py::object self, std::int64_t q, int state) {
            PyLayer& l = self.cast<PyLayer&>();
            return std::make_unique<PyRecurrentUpdate>(self, l, q, state);
          },
          py::arg("q"), py::arg("state") = 0)
      .def(
          "update_recurrent_state",
          [](PyLayer& l, py::object s, int state) {
            rwd::TensorView in = l.input(s, "recurrent_states");
            l.guarded([&] { l.layer().update_recurrent_state(in, state); });
          },
          py::arg("new_state"), py::arg("state") = 0)
      .def(
          "update_recurrent_state_final",
          [](PyLayer& l, py::object final_state, std::int64_t q, int state) {
            rwd::TensorView in = l.input(final_state, "recurrent_states");
            l.guarded([&] { l.layer().update_recurrent_state_final(in, q, state); });
          },
          py::arg("final_state"), py::arg("q"), py::arg("state") = 0,
          "rwd::Layer::update_recurrent_state_final: q tokens given only the state after the last; crops into "
          "them raise RollbackError.")
      .def(
          "get_recurrent_state", [](const PyLayer& l, int s) { return l.out(l.layer().get_recurrent_state(s)); },
          py::arg("state") = 0)
      .def(
          "recurrent_snapshot",
          [](const PyLayer& l, int s, std::int64_t pos) { return l.out(l.layer().recurrent_snapshot(s, pos)); },
          py::arg("state"), py::arg("pos"))
      .def("has_previous_state", [](const PyLayer& l) { return l.layer().has_previous_state(); });
}

// This part's own rollback, recording, batch operations and copies (a
// cache's go through _Cache, bind_cache.cc).
void def_layer_whole(LayerClass& c) {
  c.def(
       "crop", [](PyLayer& l, std::int64_t n) { l.guarded([&] { l.layer().crop(n); }); }, py::arg("n"))
      .def(
          "check_crop", [](const PyLayer& l, std::int64_t n) { l.layer().check_crop(n); }, py::arg("n"))
      .def("max_rollback", [](const PyLayer& l) { return l.layer().max_rollback(); })
      .def(
          "activate_past_recording",
          [](PyLayer& l, std::int64_t r) { l.guarded([&] { l.layer().activate_past_recording(r); }); },
          py::arg("max_tokens"))
      .def("deactivate_past_recording", [](PyLayer& l) { l.guarded([&] { l.layer().deactivate_past_recording(); }); })
      .def("is_recording", [](const PyLayer& l) { return l.layer().is_recording(); })
      .def("recording_capacity", [](const PyLayer& l) { return l.layer().recording_capacity(); })
      .def(
          "batch_select_indices",
          [](PyLayer& l, py::object idx) {
            auto v = index_list(idx);
            l.guarded([&] { l.layer().batch_select_indices(v); });
          },
          py::arg("indices"))
      .def(
          "batch_repeat_interleave",
          [](PyLayer& l, std::int64_t r) { l.guarded([&] { l.layer().batch_repeat_interleave(r); }); },
          py::arg("repeats"))
      .def(
          "reorder_cache",
          [](PyLayer& l, py::object idx) {
            auto v = index_list(idx);
            l.guarded([&] { l.layer().reorder_cache(v); });
          },
          py::arg("beam_idx"))
      .def("reset", [](PyLayer& l) { l.guarded([&] { l.layer().reset(); }); })
      .def("shrink_to_fit", [](PyLayer& l) { l.guarded([&] { l.layer().shrink_to_fit(); }); })
      .def("memory",
           [](const PyLayer& l) {
             auto mem = l.layer().memory();
             py::dict d;
             d["kind"] = mem.kind;
             d["bytes_reserved"] = mem.bytes_reserved;
             d["bytes_used"] = mem.bytes_used;
             return d;
           })
      .def(
          "retention_bytes",
          [](const PyLayer& l, std::int64_t r) {
            auto b = l.layer().retention_bytes(r);
            return py::make_tuple(b.bounded, b.per_token);
          },
          py::arg("R"))
      .def(
          "__deepcopy__",
          [](const PyLayer& l, py::dict memo) {
            std::shared_ptr<Budget> budget = deepcopied_budget(l.budget(), memo);
            rwd::Layer copy = with_budget(budget, l.layer().index(), [&] { return l.layer().clone(); });
            return std::make_shared<PyLayer>(std::move(copy), l.as_torch(), std::move(budget), l.device());
          },
          py::arg("memo"), "An independent copy (rwd::Layer::clone): every part, rollback history and recording.")
      .def(
          "_set_budget", [](PyLayer& l, std::shared_ptr<Budget> b) { l.set_budget(std::move(b)); }, py::arg("budget"),
          "Counts this layer's later allocations in `budget` (its cache's); those made so far stay where they were.")
      .def(py::pickle([](const PyLayer& l) { return layer_state(l); },
                      [](const py::tuple& st) { return layer_from_state(st); }),
           "Pickles what the layer needs to continue from its length (no rollback history: recording restarts "
           "there).");
}

}  // namespace

}  // namespace rwd::python
