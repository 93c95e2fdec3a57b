// The scratch of an open tree (Cache::begin_tree): the nodes' inputs, conv
// windows and recurrent slots per layer. The layers themselves do not change
// until the tree commits.
#pragma once

#include <cstdint>
#include <vector>

#include "cache/state_tensor.h"
#include "rewind/tensor.h"

namespace rwd::detail {

struct TreeState {
  std::int64_t start = 0;             // L
  std::vector<std::int64_t> parents;  // -1 for the root
  std::vector<std::int64_t> depths;

  struct LayerTree {
    bool kv_done = false;
    StateTensor keys, values;                 // [1, H, N, D]
    std::vector<std::int64_t> first_visible;  // per node
    std::vector<bool> sides_done;
    std::vector<StateTensor> sides;  // [1, N, D]
    std::vector<bool> convs_done;
    std::vector<StateTensor> conv_inputs;   // [N, C]: each node's inputs, time-major
    std::vector<StateTensor> conv_windows;  // [N, K, C] storage of the [N, C, K] windows
    std::vector<bool> recurrents_done;
    std::vector<StateTensor> recurrent_slots;  // [N, shape...]
  };
  std::vector<LayerTree> layers;

  std::int64_t size() const { return static_cast<std::int64_t>(parents.size()); }
};

}  // namespace rwd::detail
