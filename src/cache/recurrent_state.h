// A recurrent (SSM / gated-delta) state with its rollback snapshots.
//
// The state after j tokens, S(j), is a whole [B, shape...] tensor. The
// snapshots S(L-held+1)..S(L) live in physical slots of one allocation;
// `table[pos % capacity]` names the slot of S(pos). An update of q tokens
// writes S(L+1)..S(L+q) into *fresh* slots, never into a held snapshot, and
// only commit() makes them part of the state: an update that is dropped, or
// a forward that is abandoned, leaves S(L) and every snapshot intact.
// Rolling back k <= held - 1 tokens only moves L: no state is copied.
// S(0) is the zero state and can always be restored.
//
// Slots: R + 1 snapshots (`history`) plus Q = min(q, R + 1) fresh slots for
// the update in flight, so capacity <= 2 (R + 1). With R = 0 the fresh slot
// is reused for every token of an update (in place after the first).
//
// An update given only its final state (Layer::update_recurrent_state_final)
// leaves placeholders in the slots of the states before it: positions
// [unknown_first, unknown_end) hold states the layer never received, and no
// rollback may land there until a rollback below unknown_first removes them.
#pragma once

#include <algorithm>
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
  std::int64_t history = 1;   // R + 1: snapshots kept after an update
  std::int64_t capacity = 1;  // physical slots
  std::int64_t length = 0;
  std::int64_t held = 1;
  std::uint64_t version = 0;  // bumped by advance (stale RecurrentUpdate handles)
  // Positions whose slot holds a placeholder, not a state received (empty
  // when unknown_first == unknown_end).
  std::int64_t unknown_first = 0;
  std::int64_t unknown_end = 0;
  AlignedBuffer ring;
  std::vector<std::int32_t> table;  // capacity entries

  RecurrentState() = default;
  // S(0) = 0 with `history_slots` = R + 1 and `num_slots` >= 1 physical slots.
  // Throws CapacityError / BudgetExceeded.
  RecurrentState(std::vector<std::int64_t> state_shape, DType t, std::int64_t b, std::int64_t history_slots,
                 std::int64_t num_slots, std::shared_ptr<Storage> storage, MemoryBudget* budget);

  std::size_t entry_bytes() const;  // one sequence's state
  std::size_t state_bytes() const { return static_cast<std::size_t>(batch) * entry_bytes(); }
  std::byte* physical(std::int64_t s) const { return ring.data() + static_cast<std::size_t>(s) * state_bytes(); }
  std::byte* slot(std::int64_t pos) const { return physical(table[static_cast<std::size_t>(pos % capacity)]); }
  TensorView view_of(std::byte* data) const;  // [B, shape...]
  TensorView view(std::int64_t pos) const { return view_of(slot(pos)); }
  std::int64_t oldest() const { return length - held + 1; }
  // Deepest rollback whose every landing position is held (S(0) always is).
  std::int64_t held_rollback() const { return oldest() <= 1 ? length : held - 1; }
  bool has_unknown() const { return unknown_first < unknown_end; }
  bool is_unknown(std::int64_t pos) const { return pos >= unknown_first && pos < unknown_end; }
  // Largest k such that every crop(-j), j <= k, lands on a state received.
  std::int64_t max_rollback() const {
    return has_unknown() ? std::min(held_rollback(), length - unknown_end) : held_rollback();
  }
  // Marks S(first)..S(end - 1) as placeholders (a final-state-only update).
  // An older interval still within the held snapshots is merged in
  // (conservatively: the positions between count as unknown too).
  void mark_unknown(std::int64_t first, std::int64_t end);

  // Fresh slots an update of q tokens writes into.
  std::int64_t fresh_count(std::int64_t q) const { return std::min(std::max<std::int64_t>(q, 1), history); }
  bool has_room(std::int64_t q) const { return capacity - held >= fresh_count(q); }
  // Chooses into `fresh` the physical slots an update of q tokens writes:
  // the first fresh_count(q) slots holding no snapshot. REQUIRES has_room(q).
  // Handles of one version see the same choice (the state is unchanged).
  void choose_fresh(std::int64_t q);
  std::vector<std::int32_t> fresh;  // capacity kept between updates
  // A copy with room for an update of q tokens (same snapshots). Throws.
  RecurrentState with_room(std::int64_t q) const;
  // Makes S(L+1)..S(L+q), written into `written` (choose_fresh(q)), the state.
  void advance(std::int64_t q, std::span<const std::int32_t> written);

  // REQUIRES k < length and the snapshot S(length - k) held, or k >= length.
  void rollback(std::int64_t k);
  // Back to S(0) = 0 with no history.
  void clear();
  void drop_history() { held = 1; }
  // Makes S(L) = `state` ([B, shape...], this dtype) the only state held,
  // at length L (a restored snapshot). REQUIRES L >= 0.
  void load(std::int64_t L, const TensorView& state);
  // Copy keeping R + 1 = `history_slots` snapshots at most (the newest).
  RecurrentState resized(std::int64_t history_slots) const;
  RecurrentState gathered(std::span<const std::int64_t> rows) const;
  // A new state of `rows` batch rows and `num_slots` slots holding this
  // state's newest `keep` snapshots, each filled by copy_state(dst, src).
  template <typename CopyState>
  RecurrentState copied(std::int64_t rows, std::int64_t history_slots, std::int64_t num_slots, std::int64_t keep,
                        CopyState&& copy_state) const;
  // Debug aid: marks every slot that holds no snapshot unreadable.
#if defined(REWIND_DEBUG_VIEWS)
  void protect() const noexcept;
#else
  void protect() const noexcept {}
#endif
  std::size_t bytes_reserved() const { return ring.size(); }
  std::size_t bytes_used() const { return static_cast<std::size_t>(held) * state_bytes(); }
};

}  // namespace rwd::detail
