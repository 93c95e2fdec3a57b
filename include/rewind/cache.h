// rewind/cache.h: the whole model's inference state.
//
// A Cache holds one Layer per model layer, built from transformers'
// `layer_types` strings (so a config.json maps directly) or from Layer
// objects. Per-layer operations take the layer index; whole-cache operations
// (crop, recording changes, batch operations, reset) are transactional:
// every layer is checked (and any memory allocated) before any layer
// changes, so an error leaves the whole cache untouched. The cache
// owns its layers: it hands out read-only access to them, and every change
// goes through the cache, which keeps the layers in step.
//
// Typical speculative-decoding round (docs/semantics.md has the contract):
//   cache.activate_past_recording(8);        // once, before the first forward
//   Forward f = cache.begin_forward(K + 1);  // all-or-nothing forward
//   ... every layer: update / update_conv_state / begin_recurrent_update ...
//   f.commit();                              // (an exception abandons it)
//   cache.crop(-(K - accepted));             // also when that is 0
//
// Conventions: see rewind/layer.h ("REQUIRES" is the caller's duty, "Throws
// E when" is checked and changes nothing).
//
// Thread safety: none inside; one owner per cache. Separate caches may be
// used concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "rewind/layer.h"
#include "rewind/snapshot.h"
#include "rewind/tree.h"

namespace rwd {

struct MemoryReport {
  std::vector<LayerMemory> layers;
  std::size_t bytes_reserved = 0;  // sum over layers
  std::size_t bytes_used = 0;
};

class Forward;
class TreeForward;

class Cache {
 public:
  // One layer per entry of `layer_types`, each built with `options`
  // (`side_dims` go to deepseek_sparse_attention layers only).
  // Throws InvalidArgument for an empty list, an unknown type (message lists
  // the accepted names and the entry's index) or an option a kind needs and
  // lacks; CapacityError when the shapes need more than 2^48 bytes.
  Cache(const std::vector<std::string>& layer_types, const LayerOptions& options);
  // Takes ownership of ready-made layers (they may differ in shapes).
  // Throws InvalidArgument for an empty list, StateError when a layer is not
  // empty (L > 0).
  explicit Cache(std::vector<Layer> layers);
  // Takes ownership of layers in any state (Cache(layers) needs them empty),
  // keeping each layer's index for messages: a caller that owns its layers
  // elsewhere (the Python module) lends them to a cache for one
  // transactional whole-cache operation and takes them back with
  // release_layers(). Layers out of step are taken; the whole-cache
  // operations refuse them then, as on any cache.
  // Throws InvalidArgument for an empty list.
  static Cache adopt(std::vector<Layer> layers);
  // Hands every layer back, in order, and leaves this cache moved-from
  // (every later call but destruction throws StateError). Throws StateError
  // while a forward or a tree is open (nothing changes then) or on a
  // moved-from cache.
  std::vector<Layer> release_layers();
  ~Cache();
  Cache(Cache&&) noexcept;
  Cache& operator=(Cache&&) noexcept;
  Cache(const Cache&) = delete;
  Cache& operator=(const Cache&) = delete;

  int num_layers() const;
  // Read-only access to a layer (its kind, options, stored views, memory).
  // Throws IndexError for an index outside [0, num_layers()).
  const Layer& layer(int layer_idx) const;

  // Sequence length of `layer_idx`, or (no index) of the first layer that
  // has state (0 when none has). Inside an open forward, layers already
  // updated report L + q and the others L.
  std::int64_t get_seq_length() const;
  std::int64_t get_seq_length(int layer_idx) const;
  MaskSizes get_mask_sizes(std::int64_t query_length, int layer_idx) const;

  // Per-layer forwards; see Layer for shapes, results and errors. Every one
  // also throws IndexError for a bad layer_idx.
  KeyValueView update(const TensorView& keys, const TensorView& values, int layer_idx);
  TensorView update_side(const TensorView& rows, int layer_idx, int side = 0);
  // Window layout and how a conv kernel reads it: Layer::update_conv_state.
  TensorView update_conv_state(const TensorView& x, int layer_idx, int state = 0);
  RecurrentUpdate begin_recurrent_update(std::int64_t q, int layer_idx, int state = 0);
  void update_recurrent_state(const TensorView& new_state, int layer_idx, int state = 0);
  // Layer::update_recurrent_state_final on `layer_idx`: q tokens given only
  // the state after the last; crops into them throw RollbackError.
  void update_recurrent_state_final(const TensorView& final_state, std::int64_t q, int layer_idx, int state = 0);
  TensorView get_recurrent_state(int layer_idx, int state = 0) const;
  TensorView get_conv_state(int layer_idx, int state = 0) const;
  // For `layer_idx`, or (default) the last linear layer. Throws StateError
  // with the transformers message when the cache has no linear layer.
  bool has_previous_state() const;
  bool has_previous_state(int layer_idx) const;

  // Starts an all-or-nothing forward of q tokens through every layer
  // (docs/semantics.md section 11). Checks that every stateful layer is in
  // step, then reserves, for every part of every layer, the room and the
  // budget q tokens need, before any layer changes. Until the returned
  // handle commits or abandons, each part takes at most q tokens (a
  // recurrent state exactly q, in one update) without allocating (apart
  // from the copy of an input that aliases the cache), and the whole-cache
  // operations below throw StateError. Abandoning (explicitly,
  // or by destroying the handle uncommitted, e.g. while an exception
  // unwinds) restores every layer exactly, recurrent states and rollback
  // history included, whatever q and R are.
  // Throws InvalidArgument unless 1 <= q <= 2^40, StateError when a forward
  // is already open or the layers are out of step, CapacityError when a
  // static layer, the budget or the system cannot hold q more tokens;
  // nothing changes then.
  Forward begin_forward(std::int64_t q);
  bool forward_open() const;

  // Transactional crop of every layer (docs/semantics.md section 3).
  // Throws RollbackError when a layer cannot crop exactly, StateError when
  // the stateful layers are at different lengths (a forward that failed
  // halfway without begin_forward; the message names each layer's length)
  // or a forward is open; nothing changes then.
  void crop(std::int64_t n);
  // Throws what crop(n) would, changes nothing.
  void check_crop(std::int64_t n) const;
  // Smallest max_rollback over stateful layers (0 when every layer is
  // stateless).
  // Throws StateError as crop does when the layers are out of step.
  std::int64_t max_rollback() const;
  // Throws InvalidArgument unless 0 <= R <= 2^40, CapacityError (static
  // layers, budget, system), StateError as crop does.
  void activate_past_recording(std::int64_t max_tokens);
  // Throws StateError as crop does, CapacityError (recurrent slots).
  void deactivate_past_recording();
  // True when every layer records.
  bool is_recording() const;

  // Transactional batch operations over every layer (see Layer). Throw
  // StateError as crop does, and what the Layer operation throws.
  void batch_select_indices(std::span<const std::int64_t> indices);
  void batch_repeat_interleave(std::int64_t repeats);
  void reorder_cache(std::span<const std::int64_t> beam_idx);
  // Every layer back to new (works on out-of-step layers: the way back from
  // a failed forward made without begin_forward). Only the new layers count
  // against the budget (the old ones go as they commit), so a cache at its
  // cap resets whenever a new one fits. Throws StateError while a forward is
  // open, CapacityError when the budget refuses the new layers themselves or
  // the system refuses memory (nothing changes then).
  void reset();

  // ---- tree speculation (rewind/tree.h) ----
  // Opens a tree of N = parents.size() nodes at length L: parents[0] = -1
  // (the root, the pending token), 0 <= parents[i] < i. Until it commits or
  // abandons, every stateful layer takes one tree update per part through
  // the returned handle (TreeForward::update, update_side, update_conv,
  // recurrent_slots) and nothing else: the per-layer updates and
  // whole-cache operations throw StateError; the layers do not change
  // before commit. Throws InvalidArgument for a malformed tree or N outside
  // [1, 1024] (naming the node) or a layer with batch_size != 1, StateError
  // as crop does (an open forward or tree, layers out of step),
  // CapacityError past 2^40 tokens or when the tree's scratch cannot be
  // allocated; nothing changes then.
  TreeForward begin_tree(std::span<const std::int64_t> parents);
  bool tree_open() const;

  // ---- snapshots (rewind/snapshot.h) ----
  // A copy of what every layer needs to continue from the current length L:
  // attention rows [keep_first, L) (all of them for full attention, the
  // last W - 1 for a filled window), the last K inputs of every conv state,
  // every S(L). Rollback history is not included. With from_position > 0
  // the attention rows start at max(from_position, keep_first): a segment
  // (a prefix-cache entry, rewind/prefix_cache.h) that restores only once
  // joined with the rows before it. Throws InvalidArgument when a layer has
  // batch_size != 1 or from_position is outside [0, L], StateError as crop
  // does (an open forward, layers out of step), CapacityError when the copy
  // cannot be allocated.
  Snapshot snapshot(std::int64_t from_position = 0) const;
  // Replaces the whole state with `s` (from snapshot(), a SequenceCache or
  // deserialize_snapshot): decoding then continues bit-identically to the
  // cache the snapshot was taken from. Recording stays as set here, with no
  // rollback history yet. Works on layers out of step (like reset).
  // Transactional. Throws InvalidArgument when `s` does not fit this cache
  // (number of layers, a kind, shape or dtype, attention rows that start
  // after the first position a layer needs, a length past 2^40; the message
  // names the layer), StateError while a forward is open, CapacityError
  // (static capacity, budget, system); nothing changes then.
  void restore(const Snapshot& s);

  MemoryReport memory() const;
  // Releases the slack of every dynamic buffer (full attention keeps up to
  // 2x what it holds after growing); recurrent slots are kept. Best effort:
  // a buffer whose smaller copy cannot be allocated keeps its allocation.
  // Changes no content. Throws StateError while a forward is open.
  void shrink_to_fit();
  // Caps the bytes this cache may reserve (0: no cap, the default). An
  // operation that would allocate past the cap throws CapacityError before
  // allocating and changes nothing; growth counts old and new buffer while
  // both exist. The cap counts the cache's buffers, not the temporary copy
  // of an input that aliases the cache, an open tree's scratch (the nodes'
  // keys, values, windows and recurrent slots, freed when the tree ends:
  // begin_tree and the tree's updates are never refused by the cap, only
  // TreeForward::commit, which grows the layers) nor a Snapshot (the
  // caller's copy). Throws CapacityError, keeping the
  // old cap, when more than `bytes` are already reserved, StateError while
  // a forward is open.
  void set_memory_budget(std::size_t bytes);
  std::size_t memory_budget() const;

  struct Impl;  // defined in src/cache

 private:
  friend class EncoderDecoderCache;
  friend class Forward;
  friend class TreeForward;
  Cache() = default;  // adopt's starting point
  // The state; throws StateError on a moved-from cache.
  Impl& state() const;
  std::unique_ptr<Impl> impl_;
};

// An open forward (Cache::begin_forward). Move-only. Destroying it while it
// is open abandons it; a handle whose cache was destroyed is inert.
class Forward {
 public:
  Forward(Forward&& other) noexcept;
  Forward& operator=(Forward&& other) noexcept;
  Forward(const Forward&) = delete;
  Forward& operator=(const Forward&) = delete;
  ~Forward();

  std::int64_t num_tokens() const { return q_; }
  std::int64_t start_length() const { return start_; }  // L at begin_forward
  bool is_open() const { return cache_ != nullptr; }
  // Ends the forward, keeping its tokens. Throws StateError when a stateful
  // layer did not receive exactly q tokens in every part, naming the first
  // such layer and each of its parts (the forward stays open then), or when
  // the handle is not open.
  void commit();
  // Ends the forward, restoring every layer to its state at begin_forward.
  // A no-op when the handle is not open.
  void abandon() noexcept;

 private:
  friend class Cache;
  friend struct Cache::Impl;
  Forward(Cache::Impl* cache, std::int64_t q, std::int64_t start) : cache_(cache), q_(q), start_(start) {}
  Cache::Impl* cache_ = nullptr;
  std::int64_t q_ = 0;
  std::int64_t start_ = 0;
};

// An open tree (Cache::begin_tree): the nodes' updates of every layer go
// through it. Move-only; destroying it open abandons it. A handle whose
// cache was destroyed is inert: not open, its updates throw StateError,
// abandon does nothing. What the updates return (views into the cache and
// the tree's scratch) is valid while the tree is open. REQUIRES: those views
// are not used after the tree ends or the cache is destroyed.
class TreeForward {
 public:
  TreeForward(TreeForward&& other) noexcept;
  TreeForward& operator=(TreeForward&& other) noexcept;
  TreeForward(const TreeForward&) = delete;
  TreeForward& operator=(const TreeForward&) = delete;
  ~TreeForward();

  bool is_open() const { return cache_ != nullptr; }
  // True when this tree is open on `cache` (not on another cache).
  bool is_open_on(const Cache& cache) const;
  std::int64_t num_nodes() const { return static_cast<std::int64_t>(parents_.size()); }
  std::int64_t start_length() const { return start_; }  // L
  // Parent (-1 for the root), depth (0 for the root) and position L + depth
  // of a node; path(node) lists root..node. Throw IndexError for a node
  // outside [0, N).
  std::int64_t parent(std::int64_t node) const;
  std::int64_t depth(std::int64_t node) const;
  std::int64_t position(std::int64_t node) const { return start_ + depth(node); }
  std::vector<std::int64_t> path(std::int64_t node) const;
  // True when `a` lies on the path root..node (a == node included). Throws
  // IndexError as above.
  bool is_ancestor(std::int64_t a, std::int64_t node) const;

  // ---- the tree updates: one per part of every stateful layer ----
  // Every one throws StateError when the tree is not open, when this part
  // already took its tree update or the layer lacks the part,
  // IndexError for a bad layer_idx (or part), InvalidArgument for shapes or
  // dtype; nothing is stored then. The layers change only at commit.

  // The nodes' keys [1, H, N, key_dim] and values (any strides, the layer's
  // dtype), copied; returns what the nodes attend to. Throws StateError
  // also on a layer without attention.
  TreeKeyValues update(const TensorView& keys, const TensorView& values, int layer_idx);
  // Side tensor rows [1, N, D] of the nodes, copied.
  TreeRows update_side(const TensorView& rows, int layer_idx, int side = 0);
  // The nodes' conv inputs x [1, C, N]; returns their windows [N, C, K]:
  // row n holds, for the K positions ending at node n's, the inputs along
  // its path (committed inputs before L, zeros before position 0), oldest
  // first. Stored time-major as the cache keeps conv inputs (strides
  // [K * C, 1, C]: one position's channels contiguous).
  TensorView update_conv(const TensorView& x, int layer_idx, int state = 0);
  // The slots of recurrent state `state` (TreeRecurrentSlots); the kernel
  // writes every node's state into next(node) before commit.
  TreeRecurrentSlots recurrent_slots(int layer_idx, int state = 0);

  // Keeps the path root..leaf: every layer then holds exactly what feeding
  // those depth(leaf) + 1 tokens as a chain would leave (what a rollback can
  // undo included), and the tree ends. Throws IndexError for a bad leaf,
  // StateError when a stateful layer did not receive its tree update in
  // every part (naming the first such layer and part) or the handle is not
  // open, CapacityError when the layers cannot take the path's tokens
  // (static capacity, budget, system); the tree stays open and the cache
  // unchanged then.
  void commit(std::int64_t leaf);
  // Ends the tree; the cache is exactly as before begin_tree. No-op when not open.
  void abandon() noexcept;

 private:
  friend class Cache;
  TreeForward() = default;
  Cache::Impl* cache_ = nullptr;
  std::int64_t start_ = 0;
  std::vector<std::int64_t> parents_, depths_;
};

}  // namespace rwd
