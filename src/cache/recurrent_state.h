// A recurrent (SSM / gated-delta) state with its rollback snapshots.
//
// The state after j tokens, S(j), lives in slot j mod N of a ring of
// N = R + 1 slots, each [B, shape...]. A kernel reads S(L) and writes
// S(L+1)..S(L+q) straight into their slots; `held` counts the consecutive
// snapshots S(L-held+1)..S(L) still intact. Rolling back k <= held - 1
// tokens only moves L: no state is copied. S(0) is the zero state and can
// always be restored.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "cache/position_buffer.h"
#include "rewind/tensor.h"

namespace rwd::detail {

struct RecurrentState {
  std::vector<std::int64_t> shape;  // per sequence, rank 1..3
  DType dtype = DType::F32;
  std::int64_t batch = 1;
  std::int64_t slots = 1;
  std::int64_t length = 0;
  std::int64_t held = 1;
  std::uint64_t version = 0;  // bumped by advance (stale RecurrentUpdate handles)
  AlignedBuffer ring;

  RecurrentState() = default;
  RecurrentState(std::vector<std::int64_t> state_shape, DType t, std::int64_t b, std::int64_t num_slots,
                 MemoryBudget* budget);

  std::size_t entry_bytes() const;  // one sequence's state
  std::size_t state_bytes() const { return static_cast<std::size_t>(batch) * entry_bytes(); }
  std::byte* slot(std::int64_t pos) const {
    return ring.data() + static_cast<std::size_t>(pos % slots) * state_bytes();
  }
  TensorView view(std::int64_t pos) const;  // [B, shape...]
  std::int64_t oldest() const { return length - held + 1; }
  std::int64_t max_rollback() const { return oldest() <= 1 ? length : held - 1; }

  void advance(std::int64_t q) {
    length += q;
    held = std::min(held + q, slots);
    ++version;
  }
  // REQUIRES k < length and the snapshot S(length - k) held or k >= length.
  void rollback(std::int64_t k);
  // Back to S(0) = 0 with no history.
  void clear();
  void drop_history() { held = 1; }
  // Copy with `num_slots` slots keeping the newest snapshots that fit.
  RecurrentState resized(std::int64_t num_slots) const;
  RecurrentState gathered(std::span<const std::int64_t> rows) const;
  std::size_t bytes_reserved() const { return ring.size(); }
  std::size_t bytes_used() const { return static_cast<std::size_t>(held) * state_bytes(); }
};

}  // namespace rwd::detail
