// Tree speculation on a Cache (rewind/tree.h): the tree's inputs wait in
// scratch; commit feeds the chosen path to the layers as one chain forward,
// so what the layers hold afterwards is by construction what a chain would
// have left.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "cache/cache_impl.h"
#include "rewind/cache.h"
#include "rewind/tree.h"
#include "tensor_copy.h"

namespace rwd {
namespace {

using detail::TreeState;

constexpr std::int64_t kMaxTreeNodes = 1024;

std::string num(std::int64_t v) { return std::to_string(v); }

void check_node(std::int64_t node, std::int64_t n, const char* what) {
  if (node < 0 || node >= n) {
    throw IndexError(std::string(what) + ": node " + num(node) + " is outside [0, " + num(n) + ")");
  }
}

// The rows of `nodes` along dimension `dim` of `src`, in that order, in `storage`.
detail::StateTensor gathered(const std::shared_ptr<Storage>& storage, const TensorView& src, int dim,
                             std::span<const std::int64_t> nodes) {
  std::array<std::int64_t, kMaxRank> shape = src.shape;
  shape[static_cast<std::size_t>(dim)] = static_cast<std::int64_t>(nodes.size());
  detail::StateTensor out(storage, src.dtype, shape.data(), src.rank);
  for (std::size_t t = 0; t < nodes.size(); ++t)
    detail::copy_view(src.slice(dim, nodes[t], 1), out.view().slice(dim, static_cast<std::int64_t>(t), 1));
  return out;
}

bool same_extents(const TensorView& v, std::initializer_list<std::int64_t> shape, DType dtype) {
  if (v.rank != static_cast<int>(shape.size()) || v.dtype != dtype || v.data == nullptr) return false;
  int d = 0;
  for (std::int64_t e : shape)
    if (v.size(d++) != e) return false;
  return true;
}

std::string extents(std::initializer_list<std::int64_t> shape, DType dtype) {
  std::string out = "[";
  bool first = true;
  for (std::int64_t e : shape) {
    out += (first ? "" : ", ") + num(e);
    first = false;
  }
  return out + "] " + std::string(dtype_name(dtype));
}

}  // namespace

// ---- opening ---------------------------------------------------------------------

TreeForward Cache::begin_tree(std::span<const std::int64_t> parents) {
  Impl& c = state();
  const auto n = static_cast<std::int64_t>(parents.size());
  auto operation = [n] { return "begin_tree(" + num(n) + " nodes)"; };
  c.check_whole(operation);
  if (n < 1 || n > kMaxTreeNodes) throw InvalidArgument(operation() + ": a tree has 1 to 1024 nodes");
  if (parents[0] != -1) {
    throw InvalidArgument(operation() + ": node 0 is the root (the pending token) and must have parent -1, got " +
                          num(parents[0]));
  }
  for (std::size_t i = 0; i < c.layers.size(); ++i) {
    const Layer::Impl& l = c.layer_impl(i);
    if (!l.stateless() && l.batch != 1) {
      throw InvalidArgument(operation() + ": " + l.where() + " has batch_size " + num(l.batch) +
                            "; a tree is one sequence's (batch_size 1)");
    }
  }
  for (std::int64_t i = 1; i < n; ++i) {
    const std::int64_t p = parents[static_cast<std::size_t>(i)];
    if (p < 0 || p >= i) {
      throw InvalidArgument(operation() + ": node " + num(i) + " has parent " + num(p) +
                            "; a node's parent must be an earlier node, in [0, " + num(i) + ")");
    }
  }
  return detail::budgeted(operation, [&] {
    auto t = std::make_unique<TreeState>();
    t->start = c.length();
    t->parents.assign(parents.begin(), parents.end());
    t->depths.assign(static_cast<std::size_t>(n), 0);
    std::int64_t max_depth = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t p = t->parents[static_cast<std::size_t>(i)];
      if (p >= 0) t->depths[static_cast<std::size_t>(i)] = t->depths[static_cast<std::size_t>(p)] + 1;
      max_depth = std::max(max_depth, t->depths[static_cast<std::size_t>(i)]);
    }
    if (detail::passes_token_limit(t->start, max_depth + 1)) {
      // budgeted puts the operation in front (once).
      throw CapacityError("a path of " + num(max_depth + 1) + " tokens at length " + num(t->start) +
                          " passes the limit of 2^40 tokens per sequence; nothing was changed");
    }
    t->layers.resize(c.layers.size());
    for (std::size_t i = 0; i < c.layers.size(); ++i) {
      const Layer::Impl& l = c.layer_impl(i);
      TreeState::LayerTree& lt = t->layers[i];
      lt.sides_done.assign(l.sides.size(), false);
      lt.sides.resize(l.sides.size());
      lt.convs_done.assign(l.convs.size(), false);
      lt.conv_inputs.resize(l.convs.size());
      lt.conv_windows.resize(l.convs.size());
      lt.recurrents_done.assign(l.recurrents.size(), false);
      lt.recurrent_slots.resize(l.recurrents.size());
    }
    TreeForward handle;
    handle.cache_ = &c;
    handle.start_ = t->start;
    handle.parents_ = t->parents;
    handle.depths_ = t->depths;
    c.tree = std::move(t);
    c.tree_handle = &handle;
    c.open_tree = ++c.trees_opened;
    return handle;
  });
}

bool Cache::tree_open() const { return state().tree != nullptr; }

bool TreeForward::is_open_on(const Cache& cache) const { return cache_ != nullptr && cache.impl_.get() == cache_; }

// ---- the per-layer tree updates ------------------------------------------------------

namespace {

struct TreeCall {
  Cache::Impl& cache;
  TreeState& tree;
  Layer::Impl& layer;
  TreeState::LayerTree& scratch;
};

TreeCall tree_call(Cache::Impl* cache, int layer_idx, const char* operation) {
  if (cache == nullptr || !cache->tree) {
    throw StateError(std::string(operation) +
                     ": the tree is not open (committed, abandoned, moved from, or its cache was destroyed)");
  }
  Cache::Impl& c = *cache;
  c.check_index(layer_idx);
  Layer::Impl& l = c.layer_impl(static_cast<std::size_t>(layer_idx));
  return {c, *c.tree, l, c.tree->layers[static_cast<std::size_t>(layer_idx)]};
}

[[noreturn]] void twice(const Layer::Impl& l, const std::string& part, const char* operation) {
  throw StateError(l.where() + ": " + operation + " of its " + part + " was already given in this tree");
}

}  // namespace

TreeKeyValues TreeForward::update(const TensorView& keys, const TensorView& values, int layer_idx) {
  TreeCall t = tree_call(cache_, layer_idx, "TreeForward::update");
  Layer::Impl& l = t.layer;
  if (!l.attention) throw StateError(l.where() + ": TreeForward::update needs an attention layer");
  if (t.scratch.kv_done) twice(l, "keys and values", "TreeForward::update");
  const std::int64_t n = t.tree.size(), H = l.keys.shape.heads;
  const std::int64_t dk = l.keys.shape.width, dv = l.values.shape.width;
  const DType dtype = l.keys.shape.dtype;
  l.check_device(keys, "TreeForward::update keys");
  l.check_device(values, "TreeForward::update values");
  if (!same_extents(keys, {1, H, n, dk}, dtype) || !same_extents(values, {1, H, n, dv}, dtype)) {
    throw InvalidArgument(l.where() + ": TreeForward::update got keys " + keys.describe() + " and values " +
                          values.describe() + "; expected " + extents({1, H, n, dk}, dtype) + " and " +
                          extents({1, H, n, dv}, dtype) + " (N = " + num(n) + " nodes)");
  }
  l.budgeted("TreeForward::update", [&] {
    detail::StateTensor k = detail::state_copy_of(l.storage, keys), v = detail::state_copy_of(l.storage, values);
    std::vector<std::int64_t> first(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i)
      first[static_cast<std::size_t>(i)] = l.keys.rule.visible_first(t.tree.start +
                                                                     t.tree.depths[static_cast<std::size_t>(i)]);
    t.scratch.keys = std::move(k);
    t.scratch.values = std::move(v);
    t.scratch.first_visible = std::move(first);
  });
  t.scratch.kv_done = true;
  const std::int64_t L = t.tree.start;
  const std::int64_t committed_first = l.keys.rule.visible_first(L);
  TreeKeyValues out;
  out.committed = {l.keys.view(committed_first, L - committed_first),
                   l.values.view(committed_first, L - committed_first)};
  out.committed_first = committed_first;
  out.nodes = {t.scratch.keys.view(), t.scratch.values.view()};
  out.first_visible = t.scratch.first_visible;
  return out;
}

TreeRows TreeForward::update_side(const TensorView& rows, int layer_idx, int side) {
  TreeCall t = tree_call(cache_, layer_idx, "TreeForward::update_side");
  Layer::Impl& l = t.layer;
  const detail::TokenTrack& track = l.side(side, "TreeForward::update_side");
  const auto s = static_cast<std::size_t>(side);
  if (t.scratch.sides_done[s]) twice(l, "side tensor " + num(side), "TreeForward::update_side");
  const std::int64_t n = t.tree.size(), D = track.shape.width;
  l.check_device(rows, "TreeForward::update_side rows");
  if (!same_extents(rows, {1, n, D}, track.shape.dtype)) {
    throw InvalidArgument(l.where() + ": TreeForward::update_side(" + num(side) + ") got " + rows.describe() +
                          "; expected " + extents({1, n, D}, track.shape.dtype) + " (N = " + num(n) + " nodes)");
  }
  l.budgeted("TreeForward::update_side", [&] { t.scratch.sides[s] = detail::state_copy_of(l.storage, rows); });
  t.scratch.sides_done[s] = true;
  const std::int64_t L = t.tree.start, first = track.rule.visible_first(L);
  return {track.view(first, L - first), first, t.scratch.sides[s].view()};
}

TensorView TreeForward::update_conv(const TensorView& x, int layer_idx, int state) {
  TreeCall t = tree_call(cache_, layer_idx, "TreeForward::update_conv");
  Layer::Impl& l = t.layer;
  const detail::TokenTrack& track = l.conv(state, "TreeForward::update_conv");
  const auto s = static_cast<std::size_t>(state);
  if (t.scratch.convs_done[s]) twice(l, "conv state " + num(state), "TreeForward::update_conv");
  const std::int64_t n = t.tree.size(), C = track.shape.width, K = track.rule.size;
  const DType dtype = track.shape.dtype;
  l.check_device(x, "TreeForward::update_conv input");
  if (!same_extents(x, {1, C, n}, dtype)) {
    throw InvalidArgument(l.where() + ": TreeForward::update_conv(" + num(state) + ") got " + x.describe() +
                          "; expected " + extents({1, C, n}, dtype) + " (N = " + num(n) + " nodes)");
  }
  const std::size_t es = dtype_size(dtype);
  const auto row_bytes = static_cast<std::size_t>(C) * es;
  l.budgeted("TreeForward::update_conv", [&] {
    // Time-major storage, as the cache keeps conv inputs: one position's C
    // channels are contiguous, so every window column is one row copy.
    detail::StateTensor inputs(l.storage, dtype, {n, C});
    TensorView time_major = TensorView::strided(inputs.view().data, dtype, {1, C, n}, {n * C, 1, C});
    time_major.device = inputs.view().device;
    detail::copy_view(x, time_major);
    detail::StateTensor windows(l.storage, dtype, {n, K, C});
    Storage& storage = *l.storage;
    const std::int64_t L = t.tree.start;
    const auto* in = static_cast<const std::byte*>(inputs.view().data);
    auto* out = static_cast<std::byte*>(windows.view().data);
    for (std::int64_t node = 0; node < n; ++node) {
      // Column K - 1 - j holds position P - j: a node of the path while
      // j <= depth, a committed input (or the zero padding) before that.
      std::int64_t on_path = node;
      const std::int64_t P = L + t.tree.depths[static_cast<std::size_t>(node)];
      for (std::int64_t j = 0; j < K; ++j) {
        std::byte* dst = out + static_cast<std::size_t>((node * K + K - 1 - j)) * row_bytes;
        if (on_path >= 0) {
          detail::storage_move(storage, dst, in + static_cast<std::size_t>(on_path) * row_bytes, row_bytes);
          on_path = t.tree.parents[static_cast<std::size_t>(on_path)];
        } else {
          detail::storage_move(storage, dst, static_cast<const std::byte*>(track.view(P - j, 1).data), row_bytes);
        }
      }
    }
    t.scratch.conv_inputs[s] = std::move(inputs);
    t.scratch.conv_windows[s] = std::move(windows);
  });
  t.scratch.convs_done[s] = true;
  TensorView windows = TensorView::strided(t.scratch.conv_windows[s].view().data, dtype, {n, C, K}, {K * C, 1, C});
  windows.device = t.scratch.conv_windows[s].view().device;
  return windows;
}

TreeRecurrentSlots TreeForward::recurrent_slots(int layer_idx, int state) {
  TreeCall t = tree_call(cache_, layer_idx, "TreeForward::recurrent_slots");
  Layer::Impl& l = t.layer;
  const detail::RecurrentState& r = l.recurrent(state, "TreeForward::recurrent_slots");
  const auto s = static_cast<std::size_t>(state);
  if (t.scratch.recurrents_done[s]) twice(l, "recurrent state " + num(state), "TreeForward::recurrent_slots");
  const std::int64_t n = t.tree.size();
  TreeRecurrentSlots out;
  l.budgeted("TreeForward::recurrent_slots", [&] {
    std::array<std::int64_t, kMaxRank> shape{};
    shape[0] = n;
    for (std::size_t d = 0; d < r.shape.size(); ++d) shape[d + 1] = r.shape[d];
    detail::StateTensor slots(l.storage, r.dtype, shape.data(), static_cast<int>(r.shape.size()) + 1);
    out.slots_.reserve(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) out.slots_.push_back(slots.view().slice(0, i, 1));
    t.scratch.recurrent_slots[s] = std::move(slots);
  });
  t.scratch.recurrents_done[s] = true;
  out.root_ = r.view(r.length);
  out.parents_ = t.tree.parents;
  out.open_tree_ = &t.cache.open_tree;
  out.tree_ = t.cache.open_tree;
  return out;
}

void TreeRecurrentSlots::check_open(const char* operation) const {
  // Checked before the tree's scratch (freed when it ended) is touched.
  if (open_tree_ == nullptr || *open_tree_ != tree_) {
    throw StateError(std::string("TreeRecurrentSlots::") + operation +
                     ": the tree these slots were taken in was committed or abandoned; slots are valid only while "
                     "their tree is open");
  }
}

TensorView TreeRecurrentSlots::previous(std::int64_t node) const {
  check_open("previous");
  check_node(node, num_nodes(), "TreeRecurrentSlots::previous");
  const std::int64_t p = parents_[static_cast<std::size_t>(node)];
  return p < 0 ? root_ : slots_[static_cast<std::size_t>(p)];
}

TensorView TreeRecurrentSlots::next(std::int64_t node) const {
  check_open("next");
  check_node(node, num_nodes(), "TreeRecurrentSlots::next");
  return slots_[static_cast<std::size_t>(node)];
}

// ---- the handle ----------------------------------------------------------------------

TreeForward::TreeForward(TreeForward&& other) noexcept
    : cache_(std::exchange(other.cache_, nullptr)), start_(other.start_), parents_(std::move(other.parents_)),
      depths_(std::move(other.depths_)) {
  if (cache_) cache_->tree_handle = this;
}

TreeForward& TreeForward::operator=(TreeForward&& other) noexcept {
  if (this != &other) {
    abandon();
    cache_ = std::exchange(other.cache_, nullptr);
    start_ = other.start_;
    parents_ = std::move(other.parents_);
    depths_ = std::move(other.depths_);
    if (cache_) cache_->tree_handle = this;
  }
  return *this;
}

TreeForward::~TreeForward() { abandon(); }

std::int64_t TreeForward::parent(std::int64_t node) const {
  check_node(node, num_nodes(), "TreeForward::parent");
  return parents_[static_cast<std::size_t>(node)];
}

std::int64_t TreeForward::depth(std::int64_t node) const {
  check_node(node, num_nodes(), "TreeForward::depth");
  return depths_[static_cast<std::size_t>(node)];
}

std::vector<std::int64_t> TreeForward::path(std::int64_t node) const {
  check_node(node, num_nodes(), "TreeForward::path");
  std::vector<std::int64_t> out;
  for (std::int64_t i = node; i >= 0; i = parents_[static_cast<std::size_t>(i)]) out.push_back(i);
  std::reverse(out.begin(), out.end());
  return out;
}

bool TreeForward::is_ancestor(std::int64_t a, std::int64_t node) const {
  check_node(a, num_nodes(), "TreeForward::is_ancestor");
  check_node(node, num_nodes(), "TreeForward::is_ancestor");
  for (std::int64_t i = node; i >= 0; i = parents_[static_cast<std::size_t>(i)])
    if (i == a) return true;
  return false;
}

void TreeForward::abandon() noexcept {
  if (!cache_) return;
  cache_->tree.reset();
  cache_->tree_handle = nullptr;
  cache_->open_tree = 0;
  cache_ = nullptr;
}

void TreeForward::commit(std::int64_t leaf) {
  if (!cache_) throw StateError("TreeForward::commit: the tree is not open (committed, abandoned or moved from)");
  check_node(leaf, num_nodes(), "TreeForward::commit");
  Cache::Impl& c = *cache_;
  TreeState& t = *c.tree;
  for (std::size_t i = 0; i < c.layers.size(); ++i) {
    const Layer::Impl& l = c.layer_impl(i);
    const TreeState::LayerTree& lt = t.layers[i];
    auto missing = [&](const std::string& part, const char* call) {
      throw StateError("TreeForward::commit: " + l.where() + " did not receive the tree's " + part + " (" + call +
                       "); every stateful layer takes its tree update in every part first");
    };
    if (l.attention && !lt.kv_done) missing("keys and values", "TreeForward::update");
    for (std::size_t s = 0; s < lt.sides_done.size(); ++s)
      if (!lt.sides_done[s]) missing("side tensor " + num(static_cast<std::int64_t>(s)), "TreeForward::update_side");
    for (std::size_t s = 0; s < lt.convs_done.size(); ++s)
      if (!lt.convs_done[s]) missing("conv state " + num(static_cast<std::int64_t>(s)), "TreeForward::update_conv");
    for (std::size_t s = 0; s < lt.recurrents_done.size(); ++s)
      if (!lt.recurrents_done[s])
        missing("recurrent state " + num(static_cast<std::int64_t>(s)), "TreeForward::recurrent_slots");
  }
  const std::vector<std::int64_t> nodes = path(leaf);
  const auto k = static_cast<std::int64_t>(nodes.size());
  // The layers take the path as one chain forward; the tree steps aside
  // meanwhile and comes back if that fails (begin_forward reserves
  // everything first, and an exception abandons the forward).
  const std::string commit_name = "TreeForward::commit(" + num(leaf) + ")";
  std::unique_ptr<TreeState> held = std::move(c.tree);
  c.tree_handle = nullptr;
  try {
    Forward f = c.begin_forward(k, commit_name.c_str());
    for (std::size_t i = 0; i < c.layers.size(); ++i) {
      Layer& layer = c.layers[i];
      const Layer::Impl& l = c.layer_impl(i);
      const TreeState::LayerTree& lt = held->layers[i];
      if (l.attention) {
        const detail::StateTensor keys = gathered(l.storage, lt.keys.view(), 2, nodes),
                                  values = gathered(l.storage, lt.values.view(), 2, nodes);
        layer.update(keys, values);
        for (std::size_t s = 0; s < lt.sides.size(); ++s)
          layer.update_side(gathered(l.storage, lt.sides[s].view(), 1, nodes), static_cast<int>(s));
      }
      for (std::size_t s = 0; s < lt.conv_inputs.size(); ++s) {
        // Rows [k, C] of the path, given as [1, C, k].
        const detail::StateTensor rows = gathered(l.storage, lt.conv_inputs[s].view(), 0, nodes);
        const std::int64_t C = rows.view().size(1);
        TensorView path = TensorView::strided(rows.view().data, rows.view().dtype, {1, C, k}, {k * C, 1, C});
        path.device = rows.view().device;
        layer.update_conv_state(path, static_cast<int>(s));
      }
      for (std::size_t s = 0; s < lt.recurrent_slots.size(); ++s) {
        RecurrentUpdate u = layer.begin_recurrent_update(k, static_cast<int>(s));
        // Without recording every next(t) is one slot: the last copy wins,
        // as the state after the path's last token must.
        for (std::int64_t step = 1; step <= k; ++step)
          detail::copy_view(lt.recurrent_slots[s].view().slice(0, nodes[static_cast<std::size_t>(step - 1)], 1),
                            u.next(step));
        u.commit();
      }
    }
    f.commit();
  } catch (...) {
    c.tree = std::move(held);
    c.tree_handle = this;
    throw;
  }
  c.open_tree = 0;
  cache_ = nullptr;
}

}  // namespace rwd
