// The `_Cache` binding: rwd::Cache's whole-cache transaction over the
// layers the Python objects own.
//
// A transformers-shaped layer (python/rewind/cache_utils.py) owns one
// `_Layer` per part, created lazily from the first tensor that part
// receives, so no rwd::Cache can be built up front. A `_Cache` names those
// parts; each whole-cache call lends their rwd::Layers to one rwd::Cache
// (Cache::adopt), runs the Cache's operation, which checks every part before
// it changes any, and takes them back (Cache::release_layers), whatever the
// operation did. The rules and messages are therefore the C++ cache's.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "module.h"
#include "rewind/cache.h"
#include "rewind/encoder_decoder_cache.h"

namespace rwd::python {
namespace {

using Parts = std::vector<std::shared_ptr<PyLayer>>;

// The parts' layers, lent to one rwd::Cache for as long as this lives.
// Python code run in between (only a warning handler, during a positive
// crop) that reaches a part gets StateError (PyLayer::layer).
class Lent {
 public:
  explicit Lent(const Parts& parts) : parts_(parts) {
    std::vector<rwd::Layer> layers;
    layers.reserve(parts.size());
    try {
      for (const auto& p : parts) layers.push_back(p->lend());
    } catch (...) {  // a part already lent (a handler's nested call): give back what was taken
      for (std::size_t i = 0; i < layers.size(); ++i) parts[i]->give_back(std::move(layers[i]));
      throw;
    }
    cache_ = rwd::Cache::adopt(std::move(layers));  // parts is not empty: adopt cannot throw
  }
  ~Lent() {
    // No forward is ever opened on this cache, so release_layers cannot throw.
    std::vector<rwd::Layer> back = cache_->release_layers();
    for (std::size_t i = 0; i < back.size(); ++i) parts_[i]->give_back(std::move(back[i]));
  }
  Lent(const Lent&) = delete;
  Lent& operator=(const Lent&) = delete;
  rwd::Cache& cache() { return *cache_; }

 private:
  const Parts& parts_;
  std::optional<rwd::Cache> cache_;
};

// A list of parts that one cache can adopt: each part once, and not null.
Parts checked_parts(Parts parts) {
  std::set<const PyLayer*> seen;
  for (const auto& p : parts) {
    if (!p) invalid("_Cache: a part is None");
    if (!seen.insert(p.get()).second) invalid("_Cache: a part is listed twice");
  }
  return parts;
}

// What a Python cache hands to the C++ one: its parts and the budget their
// allocations count in (None: none).
class PyCache {
 public:
  PyCache(Parts parts, std::shared_ptr<Budget> budget)
      : parts_(checked_parts(std::move(parts))), budget_(std::move(budget)) {}

  bool empty() const { return parts_.empty(); }
  const Parts& parts() const { return parts_; }
  const std::shared_ptr<Budget>& budget() const { return budget_; }

  // Runs fn(cache) over the lent parts under the budget; `what` names the
  // operation in a budget's refusal. A cache without parts (every layer
  // still lazy or stateless) has nothing to change: fn is not run.
  template <typename Fn>
  void run(const std::string& what, Fn&& fn) {
    if (parts_.empty()) return;
    with_budget_for(budget_, what, [&] {
      Lent lent(parts_);
      fn(lent.cache());
    });
  }

 private:
  Parts parts_;
  std::shared_ptr<Budget> budget_;
};

// Both parts of an encoder-decoder cache lent to one rwd::EncoderDecoderCache
// for both(pair): its batch operations and reset check both parts before
// either changes. When one part has no state yet, the other alone is the
// transaction: one(cache) on it.
template <typename Both, typename One>
void run_both(PyCache& self, PyCache& cross, const std::string& what, Both&& both, One&& one) {
  if (self.empty() || cross.empty()) {
    (self.empty() ? cross : self).run(what, one);
    return;
  }
  with_budget_for(self.budget(), what, [&] {
    Lent a(self.parts()), b(cross.parts());
    rwd::EncoderDecoderCache pair(std::move(a.cache()), std::move(b.cache()));
    // Back into the lent caches before they give their layers back.
    struct Back {
      rwd::EncoderDecoderCache& pair;
      Lent& a;
      Lent& b;
      ~Back() {
        a.cache() = std::move(pair.self_attention_cache());
        b.cache() = std::move(pair.cross_attention_cache());
      }
    } back{pair, a, b};
    both(pair);
  });
}

void bind_cache_class(py::module_& m) {
  py::class_<PyCache, std::shared_ptr<PyCache>>(
      m, "_Cache",
      "rwd::Cache over the given parts (_Layer objects, in order): each whole-cache call lends them to one C++ "
      "cache, which checks every part before it changes any, and takes them back. Results and errors are the C++ "
      "cache's; a cache without parts changes nothing.")
      .def(py::init<Parts, std::shared_ptr<Budget>>(), py::arg("parts"), py::arg("budget") = nullptr)
      .def(
          "crop",
          [](PyCache& c, std::int64_t n) {
            c.run("crop(" + std::to_string(n) + ")", [&](rwd::Cache& x) { x.crop(n); });
          },
          py::arg("n"), "Cache::crop: every part or none.")
      .def(
          "check_crop",
          [](PyCache& c, std::int64_t n) { c.run("check_crop", [&](rwd::Cache& x) { x.check_crop(n); }); },
          py::arg("n"), "Raises what crop(n) would raise; changes nothing.")
      .def(
          "max_rollback",
          [](PyCache& c) {
            std::int64_t out = 0;
            c.run("max_rollback", [&](rwd::Cache& x) { out = x.max_rollback(); });
            return out;
          },
          "Cache::max_rollback (0 without parts).")
      .def(
          "activate_past_recording",
          [](PyCache& c, std::int64_t r) {
            c.run("activate_past_recording(" + std::to_string(r) + ")",
                  [&](rwd::Cache& x) { x.activate_past_recording(r); });
          },
          py::arg("max_tokens"), "Cache::activate_past_recording: every part or none.")
      .def(
          "deactivate_past_recording",
          [](PyCache& c) { c.run("deactivate_past_recording", [](rwd::Cache& x) { x.deactivate_past_recording(); }); },
          "Cache::deactivate_past_recording: every part or none.")
      .def(
          "batch_select_indices",
          [](PyCache& c, py::object idx) {
            const auto v = index_list(idx);
            c.run("batch_select_indices", [&](rwd::Cache& x) { x.batch_select_indices(v); });
          },
          py::arg("indices"), "Cache::batch_select_indices: every part or none.")
      .def(
          "batch_repeat_interleave",
          [](PyCache& c, std::int64_t r) {
            c.run("batch_repeat_interleave", [&](rwd::Cache& x) { x.batch_repeat_interleave(r); });
          },
          py::arg("repeats"), "Cache::batch_repeat_interleave: every part or none.")
      .def(
          "reorder_cache",
          [](PyCache& c, py::object idx) {
            const auto v = index_list(idx);
            c.run("reorder_cache", [&](rwd::Cache& x) { x.reorder_cache(v); });
          },
          py::arg("beam_idx"), "Cache::reorder_cache: every part or none.")
      .def(
          "reset", [](PyCache& c) { c.run("reset", [](rwd::Cache& x) { x.reset(); }); },
          "Cache::reset: every part back to new, or none.")
      .def(
          "shrink_to_fit", [](PyCache& c) { c.run("shrink_to_fit", [](rwd::Cache& x) { x.shrink_to_fit(); }); },
          "Cache::shrink_to_fit (best effort; changes no content).");
}

void bind_encoder_decoder(py::module_& m) {
  m.def(
      "_encoder_decoder_batch_select_indices",
      [](PyCache& self, PyCache& cross, py::object idx) {
        const auto v = index_list(idx);
        run_both(
            self, cross, "batch_select_indices", [&](rwd::EncoderDecoderCache& x) { x.batch_select_indices(v); },
            [&](rwd::Cache& x) { x.batch_select_indices(v); });
      },
      py::arg("self_attention"), py::arg("cross_attention"), py::arg("indices"),
      "EncoderDecoderCache::batch_select_indices over both parts' _Cache: both or neither.");
  m.def(
      "_encoder_decoder_batch_repeat_interleave",
      [](PyCache& self, PyCache& cross, std::int64_t r) {
        run_both(
            self, cross, "batch_repeat_interleave", [&](rwd::EncoderDecoderCache& x) { x.batch_repeat_interleave(r); },
            [&](rwd::Cache& x) { x.batch_repeat_interleave(r); });
      },
      py::arg("self_attention"), py::arg("cross_attention"), py::arg("repeats"),
      "EncoderDecoderCache::batch_repeat_interleave: both or neither.");
  m.def(
      "_encoder_decoder_reorder_cache",
      [](PyCache& self, PyCache& cross, py::object idx) {
        const auto v = index_list(idx);
        run_both(
            self, cross, "reorder_cache", [&](rwd::EncoderDecoderCache& x) { x.reorder_cache(v); },
            [&](rwd::Cache& x) { x.reorder_cache(v); });
      },
      py::arg("self_attention"), py::arg("cross_attention"), py::arg("beam_idx"),
      "EncoderDecoderCache::reorder_cache: both or neither.");
  m.def(
      "_encoder_decoder_reset",
      [](PyCache& self, PyCache& cross) {
        run_both(
            self, cross, "reset", [](rwd::EncoderDecoderCache& x) { x.reset(); }, [](rwd::Cache& x) { x.reset(); });
      },
      py::arg("self_attention"), py::arg("cross_attention"), "EncoderDecoderCache::reset: both or neither.");
}

}  // namespace

void bind_cache(py::module_& m) {
  bind_cache_class(m);
  bind_encoder_decoder(m);
}

}  // namespace rwd::python
