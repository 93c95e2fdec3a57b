#include "cache/recurrent_state.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <string>

namespace rwd::detail {

RecurrentState::RecurrentState(std::vector<std::int64_t> state_shape, DType t, std::int64_t b,
                               std::int64_t history_slots, std::int64_t num_slots, MemoryBudget* budget)
    : shape(std::move(state_shape)), dtype(t), batch(b), history(history_slots), capacity(num_slots) {
  const std::size_t bytes = checked_mul(checked_mul(num_slots, b, "a recurrent state"), entry_bytes(),
                                        "a recurrent state");
  ring = AlignedBuffer(bytes, budget);
  table.assign(static_cast<std::size_t>(capacity), 0);
  for (std::int64_t s = 0; s < capacity; ++s) table[static_cast<std::size_t>(s)] = static_cast<std::int32_t>(s);
  std::memset(slot(0), 0, state_bytes());  // S(0), the zero state
  protect();
}

std::size_t RecurrentState::entry_bytes() const {
  std::size_t n = dtype_size(dtype);
  for (std::int64_t e : shape) n = checked_mul(n, static_cast<std::size_t>(e), "a recurrent state");
  return n;
}

TensorView RecurrentState::view_of(std::byte* data) const {
  switch (shape.size()) {
    case 1: return TensorView::contiguous(data, dtype, {batch, shape[0]});
    case 2: return TensorView::contiguous(data, dtype, {batch, shape[0], shape[1]});
    default: return TensorView::contiguous(data, dtype, {batch, shape[0], shape[1], shape[2]});
  }
}

void RecurrentState::choose_fresh(std::int64_t q) {
  // The decode path calls this once per state and forward: no allocation
  // for the marks while the ring is small (capacity <= 2 (R + 1)).
  std::array<bool, 64> small{};
  std::vector<bool> large;
  if (capacity > 64) large.assign(static_cast<std::size_t>(capacity), false);
  auto mark = [&](std::int64_t s) {
    if (capacity > 64) large[static_cast<std::size_t>(s)] = true; else small[static_cast<std::size_t>(s)] = true;
  };
  auto marked = [&](std::int64_t s) {
    return capacity > 64 ? static_cast<bool>(large[static_cast<std::size_t>(s)]) : small[static_cast<std::size_t>(s)];
  };
  for (std::int64_t pos = oldest(); pos <= length; ++pos) mark(table[static_cast<std::size_t>(pos % capacity)]);
  fresh.clear();
  const std::int64_t want = fresh_count(q);
  for (std::int64_t s = 0; s < capacity && static_cast<std::int64_t>(fresh.size()) < want; ++s)
    if (!marked(s)) fresh.push_back(static_cast<std::int32_t>(s));
}

RecurrentState RecurrentState::with_room(std::int64_t q) const {
  RecurrentState out(shape, dtype, batch, history, history + fresh_count(q), ring.budget());
  unpoison(out.ring.data(), out.ring.size());
  out.length = length;
  out.held = held;
  out.version = version + 1;  // handles that named the old slots are stale
  // Snapshots keep their positions; physical slots are renumbered densely.
  for (std::int64_t pos = oldest(), s = 0; pos <= length; ++pos, ++s) {
    out.table[static_cast<std::size_t>(pos % out.capacity)] = static_cast<std::int32_t>(s);
  }
  for (std::int64_t pos = oldest(); pos <= length; ++pos) std::memcpy(out.slot(pos), slot(pos), state_bytes());
  out.protect();
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

void RecurrentState::rollback(std::int64_t k) {
  if (k >= length) {
    clear();
    return;
  }
  length -= k;
  held -= k;
  protect();
}

void RecurrentState::clear() {
  length = 0;
  held = 1;
  unpoison(ring.data(), ring.size());
  std::memset(slot(0), 0, state_bytes());
  protect();
}

RecurrentState RecurrentState::resized(std::int64_t history_slots) const {
  RecurrentState out(shape, dtype, batch, history_slots, history_slots + 1, ring.budget());
  unpoison(out.ring.data(), out.ring.size());
  out.length = length;
  out.held = std::min(held, history_slots);
  for (std::int64_t pos = out.oldest(), s = 0; pos <= length; ++pos, ++s) {
    out.table[static_cast<std::size_t>(pos % out.capacity)] = static_cast<std::int32_t>(s);
  }
  for (std::int64_t pos = out.oldest(); pos <= length; ++pos) std::memcpy(out.slot(pos), slot(pos), state_bytes());
  out.protect();
  return out;
}

RecurrentState RecurrentState::gathered(std::span<const std::int64_t> rows) const {
  RecurrentState out(shape, dtype, static_cast<std::int64_t>(rows.size()), history, history + 1, ring.budget());
  unpoison(out.ring.data(), out.ring.size());
  out.length = length;
  out.held = held;
  for (std::int64_t pos = oldest(), s = 0; pos <= length; ++pos, ++s) {
    out.table[static_cast<std::size_t>(pos % out.capacity)] = static_cast<std::int32_t>(s);
  }
  const std::size_t entry = entry_bytes();
  for (std::int64_t pos = oldest(); pos <= length; ++pos) {
    for (std::size_t i = 0; i < rows.size(); ++i) {
      std::memcpy(out.slot(pos) + i * entry, slot(pos) + static_cast<std::size_t>(rows[i]) * entry, entry);
    }
  }
  out.protect();
  return out;
}

#if defined(REWIND_DEBUG_VIEWS)
void RecurrentState::protect() const noexcept {
  poison(ring.data(), ring.size());
  for (std::int64_t pos = oldest(); pos <= length; ++pos) unpoison(slot(pos), state_bytes());
}
#endif

}  // namespace rwd::detail
