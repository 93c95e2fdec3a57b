#include "cache/recurrent_state.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <string>

#include "tensor_copy.h"

namespace rwd::detail {

RecurrentState::RecurrentState(std::vector<std::int64_t> state_shape, DType t, std::int64_t b,
                               std::int64_t history_slots, std::int64_t num_slots, std::shared_ptr<Storage> storage,
                               MemoryBudget* budget)
    : shape(std::move(state_shape)), dtype(t), batch(b), history(history_slots), capacity(num_slots) {
  const std::size_t bytes = checked_mul(checked_mul(num_slots, b, "a recurrent state"), entry_bytes(),
                                        "a recurrent state");
  ring = AlignedBuffer(bytes, std::move(storage), budget);
  table.assign(static_cast<std::size_t>(capacity), 0);
  for (std::int64_t s = 0; s < capacity; ++s) table[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(s);
  storage_zero(*ring.storage(), slot(0), state_bytes());  // S(0), the zero state
  protect();
}

std::size_t RecurrentState::entry_bytes() const {
  std::size_t n = dtype_size(dtype);
  for (std::int64_t e : shape) n = checked_mul(n, static_cast<std::size_t>(e), "a recurrent state");
  return n;
}

TensorView RecurrentState::view_of(std::byte* data) const {
  TensorView v;
  switch (shape.size()) {
    case 1: v = TensorView::contiguous(data, dtype, {batch, shape[0]}); break;
    case 2: v = TensorView::contiguous(data, dtype, {batch, shape[0], shape[1]}); break;
    default: v = TensorView::contiguous(data, dtype, {batch, shape[0], shape[1], shape[2]}); break;
  }
  v.device = ring.device();
  return v;
}

void RecurrentState::choose_fresh(std::int64_t q) {
  // The decode path calls this once per state and forward: the marks live
  // on the stack while the ring is small (capacity <= 2 (R + 1)).
  std::array<unsigned char, 64> small{};
  std::vector<unsigned char> large;
  unsigned char* held_slot = small.data();
  if (capacity > 64) {
    large.assign(static_cast<std::size_t>(capacity), 0);
    held_slot = large.data();
  }
  for (std::int64_t pos = oldest(); pos <= length; ++pos)
    held_slot[table[static_cast<std::size_t>(pos % capacity)]] = 1;
  fresh.clear();
  const std::int64_t want = fresh_count(q);
  for (std::int64_t s = 0; s < capacity && static_cast<std::int64_t>(fresh.size()) < want; ++s)
    if (!held_slot[s]) fresh.push_back(static_cast<std::int32_t>(s));
}

template <typename CopyState>
RecurrentState RecurrentState::copied(std::int64_t rows, std::int64_t history_slots, std::int64_t num_slots,
                                      std::int64_t keep, CopyState&& copy_state) const {
  RecurrentState out(shape, dtype, rows, history_slots, num_slots, ring.storage(), ring.budget());
  unpoison(out.ring.data(), out.ring.size());
  out.length = length;
  out.held = keep;
  out.unknown_first = unknown_first;
  out.unknown_end = unknown_end;
  // The kept snapshots keep their positions; physical slots are renumbered densely.
  for (std::int64_t pos = out.oldest(), s = 0; pos <= length; ++pos, ++s) {
    out.table[static_cast<std::size_t>(pos % out.capacity)] = static_cast<std::int32_t>(s);
  }
  for (std::int64_t pos = out.oldest(); pos <= length; ++pos) copy_state(out.slot(pos), slot(pos));
  out.protect();
  return out;
}

RecurrentState RecurrentState::with_room(std::int64_t q) const {
  RecurrentState out = copied(
      batch, history, history + fresh_count(q), held,
      [&](std::byte* dst, const std::byte* src) { storage_move(*ring.storage(), dst, src, state_bytes()); });
  out.version = version + 1;  // handles that named the old slots are stale
  return out;
}

void RecurrentState::advance(std::int64_t q, std::span<const std::int32_t> written) {
  const auto Q = static_cast<std::int64_t>(written.size());
  for (std::int64_t t = std::max<std::int64_t>(1, q - Q + 1); t <= q; ++t) {
    table[static_cast<std::size_t>((length + t) % capacity)] = written[static_cast<std::size_t>((t - 1) % Q)];
  }
  length += q;
  held = std::min(held + q, history);
  ++version;
  protect();
}

void RecurrentState::mark_unknown(std::int64_t first, std::int64_t end) {
  if (first >= end) return;
  if (has_unknown() && unknown_end - 1 >= oldest()) first = std::min(first, unknown_first);
  unknown_first = first;
  unknown_end = end;
}

void RecurrentState::rollback(std::int64_t k) {
  if (k >= length) {
    clear();
    return;
  }
  length -= k;
  held -= k;
  if (length < unknown_first) unknown_first = unknown_end = 0;  // the placeholders went with the tokens
  protect();
}

void RecurrentState::clear() {
  length = 0;
  held = 1;
  unknown_first = unknown_end = 0;
  unpoison(ring.data(), ring.size());
  storage_zero(*ring.storage(), slot(0), state_bytes());
  protect();
}

void RecurrentState::load(std::int64_t L, const TensorView& state) {
  unpoison(ring.data(), ring.size());
  length = L;
  held = 1;
  unknown_first = unknown_end = 0;
  table[static_cast<std::size_t>(L % capacity)] = 0;  // physical slot 0 holds S(L)
  copy_view(state, view(L));
  ++version;
  protect();
}

RecurrentState RecurrentState::resized(std::int64_t history_slots) const {
  return copied(batch, history_slots, history_slots + 1, std::min(held, history_slots),
                [&](std::byte* dst, const std::byte* src) { storage_move(*ring.storage(), dst, src, state_bytes()); });
}

RecurrentState RecurrentState::gathered(std::span<const std::int64_t> rows) const {
  const std::size_t entry = entry_bytes();
  return copied(
      static_cast<std::int64_t>(rows.size()), history, history + 1, held, [&](std::byte* dst, const std::byte* src) {
        for (std::size_t i = 0; i < rows.size(); ++i) {
          storage_move(*ring.storage(), dst + i * entry, src + static_cast<std::size_t>(rows[i]) * entry, entry);
        }
      });
}

#if defined(REWIND_DEBUG_VIEWS)
void RecurrentState::protect() const noexcept {
  poison(ring.data(), ring.size());
  for (std::int64_t pos = oldest(); pos <= length; ++pos) unpoison(slot(pos), state_bytes());
}
#endif

}  // namespace rwd::detail
