// rewind/tree.h: tree speculation on one sequence, exactly, on every layer
// kind.
//
// A draft tree verifies several branches in one forward (SpecInfer, Medusa,
// EAGLE-2): node 0 is the root (the pending token, at position L), node
// i > 0 has a parent p(i) < i and sits at position L + depth(i). Every node
// attends to the committed positions its window sees and to the nodes on its
// own path from the root; conv layers read each node's window along its path;
// recurrent layers give every node a state slot computed from its parent's.
// After verification the caller commits the path to one node: the cache is
// then bit-identical to having fed that path's tokens as a chain (rollback
// history included), or abandons the tree: the cache is as before.
//
// Typical round (Cache::begin_tree):
//   TreeForward t = cache.begin_tree(parents);      // layers unchanged until commit
//   ... every layer: t.update / t.update_side / t.update_conv /
//       t.recurrent_slots (the kernel writes each node's state) ...
//   t.commit(leaf);                                  // keep root..leaf
//
// Memory: the tree's inputs, conv windows and recurrent slots live in
// scratch owned by the tree (N node states per recurrent state: the chosen
// trade-off against replaying an input log at commit, see
// docs/semantics.md section 16) and go when it ends; commit copies the
// path's rows and states into the layers.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "rewind/layer.h"

namespace rwd {

// What a tree's queries attend to in one attention layer.
struct TreeKeyValues {
  KeyValueView committed;  // [1, H, L - committed_first, D]: positions [committed_first, L)
  std::int64_t committed_first = 0;
  KeyValueView nodes;  // [1, H, N, D]: the nodes' keys and values, in node order
  // Per node, the first position it attends: committed positions
  // [first_visible[i], L) and the nodes on its path whose position is >=
  // first_visible[i] (the window or chunk of its own position).
  std::span<const std::int64_t> first_visible;
};

// The same for a side tensor: committed rows [1, L - committed_first, D]
// and the nodes' rows [1, N, D].
struct TreeRows {
  TensorView committed;
  std::int64_t committed_first = 0;
  TensorView nodes;
};

// Recurrent state slots of a tree (TreeForward::recurrent_slots), one per
// node, for one recurrent state of one layer: previous(i) is the state
// before node i (S(L) for the root, the parent's slot otherwise), next(i)
// the slot the kernel writes node i's state into. Valid while the tree is open: once it ends (commit, abandon),
// previous and next throw StateError. REQUIRES: the cache outlives it.
class TreeRecurrentSlots {
 public:
  std::int64_t num_nodes() const { return static_cast<std::int64_t>(parents_.size()); }
  // [1, shape...]. Throw IndexError for a node outside [0, N), StateError
  // once the tree ended.
  TensorView previous(std::int64_t node) const;
  TensorView next(std::int64_t node) const;

 private:
  friend class TreeForward;
  // Throws StateError unless the tree these slots were taken in is open.
  void check_open(const char* operation) const;
  const std::uint64_t* open_tree_ = nullptr;  // the cache's serial of its open tree (0: none)
  std::uint64_t tree_ = 0;                    // the serial of the tree these slots belong to
  TensorView root_;                           // S(L)
  std::vector<TensorView> slots_;             // per node
  std::span<const std::int64_t> parents_;
};

}  // namespace rwd
