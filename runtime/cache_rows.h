// runtime/cache_rows.h (private to runtime/model.cc): how a forward
// addresses its cache. One interface, CacheRows, for one sequence (Cache),
// a batch of sequences (SequenceCache, paged) and a draft tree
// (TreeForward), and its three adapters, so that Model writes each layer
// kind once. The adapters call only the public cache API.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "rewind/cache.h"
#include "rewind/sequences.h"
#include "rewind/tree.h"
#include "runtime/kernels.h"
#include "runtime/model.h"

namespace rwd::runtime::detail {

namespace k = kernels;

// Adds the wall time of its scope to *sink (when sink is non-null).
class CacheTimer {
 public:
  explicit CacheTimer(double* sink) : sink_(sink) {
    if (sink_) start_ = std::chrono::steady_clock::now();
  }
  ~CacheTimer() {
    if (sink_) *sink_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  CacheTimer(const CacheTimer&) = delete;
  CacheTimer& operator=(const CacheTimer&) = delete;

 private:
  double* sink_;
  std::chrono::steady_clock::time_point start_;
};

// The [B=1, H, n, D] keys / values view of token-major rows [n, H, D].
inline TensorView heads_view(float* rows, std::int64_t n, std::int64_t heads, std::int64_t dim) {
  return TensorView::strided(rows, DType::F32, {1, heads, n, dim}, {n * heads * dim, dim, heads * dim, 1});
}

// The [B=1, C, n] conv-input view of token-major rows [n, C].
inline TensorView channels_view(float* rows, std::int64_t n, std::int64_t channels) {
  return TensorView::strided(rows, DType::F32, {1, channels, n}, {n * channels, 1, channels});
}

// What one group's queries attend in one attention layer: positions
// [kv_offset, kv_offset + kv_len) as runs of keys and values, in position
// order (kernels::attention_paged's arguments).
struct AttendedKeys {
  std::span<const k::KVRun> runs;
  k::StridedKV k_strides, v_strides;
  std::int64_t kv_offset = 0, kv_len = 0;
};

// One group's conv window: channel c at window position s is
// data[c * channel_stride + s * time_stride], s in [0, K - 1 + count)
// (kernels::causal_conv1d's layout).
struct ConvWindow {
  const float* data = nullptr;
  std::int64_t channel_stride = 0, time_stride = 0;
};

// One group's recurrent chain: the state before its first row, and the
// slot each of its rows' states goes to (kernels::gated_delta_rule's
// state_in and state_out).
struct RecurrentChain {
  const float* previous = nullptr;
  float* const* next = nullptr;
};

// One forward's view of its cache, whatever the cache holds: one sequence
// (Cache, inside a Forward), a batch of sequences (SequenceCache, inside a
// SequenceBatch, paged) or a draft tree (TreeForward). The forward's rows
// fall into groups of consecutive rows that each continue one chain of
// tokens: all rows for one sequence, each sequence's rows in a batch, each
// node in a tree (whose chain is its path). A layer block hands the cache
// its rows (keys and values, conv inputs, recurrent states), then runs its
// kernel once per group over what that group reads, so Model writes each
// layer kind once for all three. The model's buffers are token-major: row
// t's keys at keys + t * heads * dim, its conv inputs at x + t * channels.
class CacheRows {
 public:
  struct Group {
    std::int64_t row = 0, count = 0;  // rows [row, row + count)
  };
  virtual ~CacheRows() = default;
  CacheRows() = default;
  CacheRows(const CacheRows&) = delete;
  CacheRows& operator=(const CacheRows&) = delete;

  std::int64_t rows() const { return static_cast<std::int64_t>(positions_.size()); }
  // The position of every row (RoPE, attention masks), in row order.
  std::span<const std::int64_t> positions() const { return positions_; }
  std::span<const Group> groups() const { return groups_; }

  // Each call below makes the layer's one update of that part through the
  // cache (Cache::update / update_conv_state / begin_recurrent_update,
  // SequenceCache's, TreeForward's) and throws what that update throws,
  // storing nothing then. REQUIRES: the forward's transaction (Forward,
  // SequenceBatch, TreeForward) is open; each part of a layer is given
  // once; `keys`, `values` and `x` stay valid until the block ends.

  // Stores the rows' keys and values ([rows, heads, dim] each) of
  // attention layer `layer`.
  virtual void store_keys(int layer, float* keys, float* values, std::int64_t heads, std::int64_t dim) = 0;
  // What group g attends in the layer of the last store_keys; valid until
  // the next call. REQUIRES: store_keys ran for this layer, g < groups().size().
  virtual AttendedKeys attended(std::size_t g) = 0;
  // Appends the rows' inputs x [rows, channels] to the conv state of
  // `layer`; returns every group's window (valid until the next call).
  virtual std::span<const ConvWindow> conv(int layer, float* x, std::int64_t channels) = 0;
  // Every group's recurrent chain in `layer` (valid until end_recurrent);
  // the kernel writes the rows' states, group by group in order (a tree's
  // node reads its parent's), then end_recurrent() keeps them.
  virtual std::span<const RecurrentChain> begin_recurrent(int layer) = 0;
  virtual void end_recurrent() = 0;

 protected:
  std::vector<std::int64_t> positions_;
  std::vector<Group> groups_;
};

// The window of a [1, C, K - 1 + q] (or one tree node's [C, K]) view.
inline ConvWindow conv_window(const TensorView& w) {
  return {static_cast<const float*>(w.data), w.stride(1), w.stride(2)};
}

// One sequence (Cache, inside a Forward): one group, rows at positions
// [pos0, pos0 + n), the layers' contiguous storage.
class SequenceRows final : public CacheRows {
 public:
  SequenceRows(Cache& cache, std::int64_t pos0, std::int64_t n, double* cache_seconds)
      : cache_(cache), seconds_(cache_seconds), next_(static_cast<std::size_t>(n)) {
    for (std::int64_t t = 0; t < n; ++t) positions_.push_back(pos0 + t);
    groups_.push_back({0, n});
  }

  void store_keys(int layer, float* keys, float* values, std::int64_t heads, std::int64_t dim) override {
    CacheTimer timer(seconds_);
    const MaskSizes mask = cache_.get_mask_sizes(rows(), layer);
    const KeyValueView kv = cache_.update(heads_view(keys, rows(), heads, dim), heads_view(values, rows(), heads, dim),
                                          layer);
    const k::StridedKV k_strides{static_cast<const float*>(kv.keys.data), kv.keys.stride(1), kv.keys.stride(2)};
    const k::StridedKV v_strides{static_cast<const float*>(kv.values.data), kv.values.stride(1), kv.values.stride(2)};
    run_ = {k_strides.data, v_strides.data, mask.kv_length};
    keys_ = {std::span<const k::KVRun>(&run_, 1), k_strides, v_strides, mask.kv_offset, mask.kv_length};
  }
  AttendedKeys attended(std::size_t) override { return keys_; }

  std::span<const ConvWindow> conv(int layer, float* x, std::int64_t channels) override {
    CacheTimer timer(seconds_);
    window_ = conv_window(cache_.update_conv_state(channels_view(x, rows(), channels), layer));
    return {&window_, 1};
  }

  std::span<const RecurrentChain> begin_recurrent(int layer) override {
    CacheTimer timer(seconds_);
    update_.emplace(cache_.begin_recurrent_update(rows(), layer));
    for (std::int64_t t = 0; t < rows(); ++t)
      next_[static_cast<std::size_t>(t)] = static_cast<float*>(update_->next(t + 1).data);
    chain_ = {static_cast<const float*>(update_->previous().data), next_.data()};
    return {&chain_, 1};
  }
  void end_recurrent() override {
    CacheTimer timer(seconds_);
    update_->commit();
    update_.reset();
  }

 private:
  Cache& cache_;
  double* seconds_;
  k::KVRun run_;
  AttendedKeys keys_;
  ConvWindow window_;
  std::optional<RecurrentUpdate> update_;
  std::vector<float*> next_;
  RecurrentChain chain_;
};

// A ragged batch (SequenceCache, inside a SequenceBatch): one group per
// entry with tokens, entry e's rows [offset[e], offset[e] + its tokens) at
// positions [pos0[e], ...), attention read in place, block by block.
class BatchRows final : public CacheRows {
 public:
  BatchRows(SequenceCache& cache, std::span<const SequenceTokens> batch, std::span<const std::int64_t> pos0,
            std::span<const std::int64_t> offset)
      : cache_(cache) {
    for (std::size_t e = 0; e < batch.size(); ++e) {
      const auto n = static_cast<std::int64_t>(batch[e].tokens.size());
      for (std::int64_t t = 0; t < n; ++t) positions_.push_back(pos0[e] + t);
      if (n == 0) continue;
      groups_.push_back({offset[e], n});
      entries_.push_back(e);
    }
    next_.resize(positions_.size());
    windows_.resize(groups_.size());
    chains_.resize(groups_.size());
  }

  void store_keys(int layer, float* keys, float* values, std::int64_t heads, std::int64_t dim) override {
    kv_ = cache_.update(heads_view(keys, rows(), heads, dim), heads_view(values, rows(), heads, dim), layer);
    layout_ = &cache_.block_layout(layer);
    strides_ = {nullptr, dim, heads * dim};
  }
  // The same values in the same order as a contiguous cache holds them, so
  // the result is the single-sequence one.
  AttendedKeys attended(std::size_t g) override {
    const PagedKeyValues& kv = kv_[entries_[g]];
    runs_.clear();
    layout_->for_each_block_rows(
        kv.spans, kv.kv_offset, kv.kv_length,
        [&](const std::byte* block, std::int64_t row, std::int64_t count, std::int64_t) {
          runs_.push_back({static_cast<const float*>(layout_->rows(block, 0, row, count).data),
                           static_cast<const float*>(layout_->rows(block, 1, row, count).data), count});
        });
    return {runs_, strides_, strides_, kv.kv_offset, kv.kv_length};
  }

  std::span<const ConvWindow> conv(int layer, float* x, std::int64_t channels) override {
    const std::span<const TensorView> windows = cache_.update_conv_state(channels_view(x, rows(), channels), layer);
    for (std::size_t g = 0; g < groups_.size(); ++g) windows_[g] = conv_window(windows[entries_[g]]);
    return windows_;
  }

  std::span<const RecurrentChain> begin_recurrent(int layer) override {
    update_.emplace(cache_.begin_recurrent_update(layer));
    for (std::size_t g = 0; g < groups_.size(); ++g) {
      const Group& group = groups_[g];
      float** next = next_.data() + group.row;
      for (std::int64_t t = 0; t < group.count; ++t)
        next[t] = static_cast<float*>(update_->next(entries_[g], t + 1).data);
      chains_[g] = {static_cast<const float*>(update_->previous(entries_[g]).data), next};
    }
    return chains_;
  }
  void end_recurrent() override {
    update_->commit();
    update_.reset();
  }

 private:
  SequenceCache& cache_;
  std::vector<std::size_t> entries_;  // the batch entry of each group
  std::span<const PagedKeyValues> kv_;
  const BlockLayout* layout_ = nullptr;
  k::StridedKV strides_;
  std::vector<k::KVRun> runs_;
  std::vector<ConvWindow> windows_;
  std::optional<BatchRecurrentUpdate> update_;
  std::vector<float*> next_;
  std::vector<RecurrentChain> chains_;
};

// A draft tree (TreeForward): one group per node, node i at position
// L + depth(i); every node reads the committed rows and its own path.
class TreeRows final : public CacheRows {
 public:
  TreeRows(TreeForward& tree, double* cache_seconds) : tree_(tree), seconds_(cache_seconds) {
    const std::int64_t n = tree.num_nodes();
    for (std::int64_t i = 0; i < n; ++i) {
      positions_.push_back(tree.position(i));
      groups_.push_back({i, 1});
    }
    windows_.resize(groups_.size());
    next_.resize(groups_.size());
    chains_.resize(groups_.size());
  }

  void store_keys(int layer, float* keys, float* values, std::int64_t heads, std::int64_t dim) override {
    {
      CacheTimer timer(seconds_);
      kv_ = tree_.update(heads_view(keys, rows(), heads, dim), heads_view(values, rows(), heads, dim), layer);
    }
    keys_ = keys;
    values_ = values;
    row_ = heads * dim;
    strides_ = {nullptr, dim, row_};  // token-major, as the committed rows
  }
  // Node i reads the committed rows its window sees, then its path's rows
  // in position order: the keys its chain would hold, in the same order.
  AttendedKeys attended(std::size_t node) override {
    const std::int64_t first = kv_.first_visible[node], L = tree_.start_length();
    path_k_.clear();
    path_v_.clear();
    for (std::int64_t p : tree_.path(static_cast<std::int64_t>(node))) {
      if (tree_.position(p) < first) continue;
      path_k_.insert(path_k_.end(), keys_ + p * row_, keys_ + (p + 1) * row_);
      path_v_.insert(path_v_.end(), values_ + p * row_, values_ + (p + 1) * row_);
    }
    const std::int64_t own = static_cast<std::int64_t>(path_k_.size()) / row_;
    const std::int64_t committed = std::max<std::int64_t>(0, L - first);
    const std::int64_t skip = std::max<std::int64_t>(0, first - kv_.committed_first);
    runs_[0] = {static_cast<const float*>(kv_.committed.keys.data) + skip * row_,
                static_cast<const float*>(kv_.committed.values.data) + skip * row_, committed};
    runs_[1] = {path_k_.data(), path_v_.data(), own};
    const std::span<const k::KVRun> runs(runs_ + (committed == 0 ? 1 : 0), committed == 0 ? 1 : 2);
    return {runs, strides_, strides_, first, committed + own};
  }

  // Each node's window along its path: [N, C, K] (time-major rows).
  std::span<const ConvWindow> conv(int layer, float* x, std::int64_t channels) override {
    CacheTimer timer(seconds_);
    const TensorView windows = tree_.update_conv(channels_view(x, rows(), channels), layer);
    for (std::size_t node = 0; node < windows_.size(); ++node) {
      windows_[node] = conv_window(windows);
      windows_[node].data += static_cast<std::int64_t>(node) * windows.stride(0);
    }
    return windows_;
  }

  // Parents come before their children: a node's previous state (its
  // parent's slot) is written before it is read.
  std::span<const RecurrentChain> begin_recurrent(int layer) override {
    {
      CacheTimer timer(seconds_);
      slots_ = tree_.recurrent_slots(layer);
    }
    for (std::size_t node = 0; node < chains_.size(); ++node) {
      const auto i = static_cast<std::int64_t>(node);
      next_[node] = static_cast<float*>(slots_.next(i).data);
      chains_[node] = {static_cast<const float*>(slots_.previous(i).data), &next_[node]};
    }
    return chains_;
  }
  void end_recurrent() override {}  // the slots are the tree's; commit(leaf) keeps a path's

 private:
  TreeForward& tree_;
  double* seconds_;
  TreeKeyValues kv_;
  const float* keys_ = nullptr;
  const float* values_ = nullptr;
  std::int64_t row_ = 0;
  k::StridedKV strides_;
  std::vector<float> path_k_, path_v_;
  k::KVRun runs_[2];
  std::vector<ConvWindow> windows_;
  TreeRecurrentSlots slots_;
  std::vector<float*> next_;
  std::vector<RecurrentChain> chains_;
};

}  // namespace rwd::runtime::detail
