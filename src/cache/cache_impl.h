// Cache::Impl: the cache's state behind its public face. Shared by cache.cc
// and tree.cc.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "aligned_memory.h"
#include "cache/layer_impl.h"
#include "cache/tree_state.h"
#include "rewind/cache.h"

namespace rwd {

// The cache's state behind its public face: the budget, the layers (which
// must die before the budget: they release their bytes into it), and the
// open forward's handle, if any.
struct Cache::Impl {
  std::unique_ptr<detail::MemoryBudget> budget;  // null until a budget is set
  std::vector<Layer> layers;
  Forward* open = nullptr;                  // the handle of the open forward
  std::unique_ptr<detail::TreeState> tree;  // the open tree (begin_tree)
  TreeForward* tree_handle = nullptr;
  // The open tree's serial (0: none) and the last one issued: a tree's
  // slot handles compare them to tell whether their tree is still open.
  std::uint64_t open_tree = 0;
  std::uint64_t trees_opened = 0;
  std::vector<Layer::Impl::ForwardPlan> forward_plans;  // begin_forward's scratch (capacity reused)

  ~Impl() {
    if (open) open->cache_ = nullptr;  // the handle outlives us: make it inert
    if (tree_handle) tree_handle->cache_ = nullptr;
  }
  // A forward or a tree is open: whole-cache changes must wait.
  bool busy() const { return open != nullptr || tree != nullptr; }

  Layer::Impl& layer_impl(std::size_t i) { return *layers[i].impl_; }
  const Layer::Impl& layer_impl(std::size_t i) const { return *layers[i].impl_; }

  void check_index(int layer_idx) const {
    if (layer_idx < 0 || layer_idx >= static_cast<int>(layers.size())) {
      throw IndexError("layer index " + std::to_string(layer_idx) + " is outside [0, " + std::to_string(layers.size()) +
                       ")");
    }
  }

  // Whole-cache operations need the stateful layers in step: a forward that
  // stopped halfway leaves some layers ahead, and cropping "the last k
  // tokens" would then remove real tokens from the layers behind.
  // `operation` names the call in messages; it is built only when one is
  // thrown (crop and begin_forward run every decode step).
  template <typename Name>
  void check_whole(Name&& operation) const {
    if (!busy() && in_step()) return;
    check_whole_slow(std::string(operation()));
  }
  void check_whole(const char* operation) const {
    check_whole([operation] { return std::string(operation); });
  }
  bool in_step() const {
    bool any = false;
    std::int64_t L = 0;
    for (const auto& l : layers) {
      const Layer::Impl& impl = *l.impl_;
      if (impl.stateless()) continue;
      if (!impl.in_step() || (any && impl.length() != L)) return false;
      L = impl.length();
      any = true;
    }
    return true;
  }
  // Called when a forward is open or the layers are out of step.
  [[noreturn]] void check_whole_slow(const std::string& operation) const {
    if (open) {
      throw StateError(operation + " while a forward of " + std::to_string(open->num_tokens()) +
                       " tokens is open (begin_forward); commit() or abandon() it first");
    }
    if (tree) {
      throw StateError(operation + " while a tree of " + std::to_string(tree->parents.size()) +
                       " nodes is open (begin_tree); commit(leaf) or abandon() it first");
    }
    std::string lengths;
    for (std::size_t i = 0; i < layers.size(); ++i) {
      const Layer::Impl& impl = *layers[i].impl_;
      if (impl.stateless()) continue;
      // An adopted layer keeps its own index (several may share one).
      const int index = impl.index >= 0 ? impl.index : static_cast<int>(i);
      lengths += (lengths.empty() ? "" : ", ") + std::string("layer ") + std::to_string(index) + ": " +
                 std::to_string(impl.length()) + (impl.in_step() ? "" : " (its parts differ)");
    }
    throw StateError(operation + " needs every stateful layer at the same length, but they are out of step (" +
                     lengths +
                     "): a forward stopped halfway. Nothing was changed; reset() the cache, or make forwards "
                     "all-or-nothing with begin_forward");
  }

  // Two phases that make whole-cache changes transactional: build every
  // layer's new state (may throw), then swap them all in (cannot fail).
  using RowsFor = std::function<std::vector<std::int64_t>(const Layer::Impl&)>;
  std::vector<std::unique_ptr<Layer::Impl>> prepare_gather(const char* operation, const RowsFor& rows_for,
                                                           bool check_step = true) const {
    if (check_step) check_whole(operation);
    std::vector<std::unique_ptr<Layer::Impl>> next;
    next.reserve(layers.size());
    for (const auto& l : layers) {
      const std::vector<std::int64_t> rows = rows_for(*l.impl_);
      l.impl_->check_batch_rows(rows, operation);
      next.push_back(l.impl_->gathered(rows));
    }
    return next;
  }
  // The old layers die as the new ones commit, so only the new ones count
  // against the budget: otherwise a cache near its cap (the usual state after
  // a budget refused a forward) could never reset. The new layers are built
  // uncapped (a layer's construction may briefly hold two copies of a
  // buffer) and refused afterwards if what they keep passes the cap.
  std::vector<std::unique_ptr<Layer::Impl>> prepare_reset() const {
    if (busy()) check_whole("reset");
    struct Uncapped {
      detail::MemoryBudget* b;
      std::size_t limit;
      explicit Uncapped(detail::MemoryBudget* budget) : b(budget), limit(budget ? budget->limit : 0) {
        if (b) b->limit = 0;
      }
      ~Uncapped() {
        if (b) b->limit = limit;
      }
      Uncapped(const Uncapped&) = delete;
      Uncapped& operator=(const Uncapped&) = delete;
    } uncapped(budget.get());
    const std::size_t old_bytes = budget ? budget->reserved : 0;
    std::vector<std::unique_ptr<Layer::Impl>> next;
    next.reserve(layers.size());
    for (const auto& l : layers) next.push_back(l.impl_->fresh());
    if (budget && uncapped.limit != 0 && budget->reserved - old_bytes > uncapped.limit) {
      throw detail::BudgetExceeded("reset: memory budget exceeded: a new cache reserves " +
                                   std::to_string(budget->reserved - old_bytes) + " bytes, more than the budget's " +
                                   std::to_string(uncapped.limit) + "; nothing was changed");
    }
    return next;
  }
  void commit_layers(std::vector<std::unique_ptr<Layer::Impl>> next) noexcept {
    for (std::size_t i = 0; i < layers.size(); ++i) layers[i].impl_ = std::move(next[i]);
  }
  // Prepares every layer's recording change (may throw), then commits all.
  void set_recording(bool on, std::int64_t max_tokens) {
    check_whole([&] {
      return on ? "activate_past_recording(" + std::to_string(max_tokens) + ")"
                : std::string("deactivate_past_recording");
    });
    std::vector<Layer::Impl::RecordingPlan> plans;
    plans.reserve(layers.size());
    for (const auto& l : layers) plans.push_back(l.impl_->prepare_recording(on, max_tokens));
    for (std::size_t i = 0; i < layers.size(); ++i)
      layers[i].impl_->commit_recording(on, max_tokens, std::move(plans[i]));
  }

  // Length of the first stateful layer (0 when none has state).
  std::int64_t length() const {
    for (const auto& l : layers)
      if (!l.is_stateless()) return l.get_seq_length();
    return 0;
  }

  // Cache::begin_forward (also what a tree's commit uses; `caller` then
  // names that call in messages).
  Forward begin_forward(std::int64_t q, const char* caller = nullptr) {
    auto operation = [q, caller] { return caller ? std::string(caller) : "begin_forward(" + std::to_string(q) + ")"; };
    if (q < 1 || q > detail::kMaxTokens) throw InvalidArgument(operation() + " needs a token count in [1, 2^40]");
    check_whole(operation);
    if (detail::passes_token_limit(length(), q)) {
      throw CapacityError(operation() + " at length " + std::to_string(length()) +
                          " passes the limit of 2^40 tokens per sequence; nothing was changed");
    }
    // Plans allocate only where a layer lacks room; the decode path (room
    // left from earlier growth) allocates nothing here.
    forward_plans.clear();
    try {
      for (const auto& l : layers) forward_plans.push_back(l.impl_->plan_forward(q, caller ? caller : "begin_forward"));
    } catch (...) {
      forward_plans.clear();  // the layers planned so far give their room (and budget) back
      throw;
    }
    for (std::size_t i = 0; i < layers.size(); ++i) layer_impl(i).open_forward(q, std::move(forward_plans[i]));
    forward_plans.clear();
    Forward handle(this, q, length());
    open = &handle;
    return handle;
  }

  void abandon_forward() noexcept {
    for (auto& l : layers) l.impl_->abandon_forward();
    if (open) open->cache_ = nullptr;
    open = nullptr;
  }
};

}  // namespace rwd
