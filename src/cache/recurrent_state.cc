#include "cache/recurrent_state.h"

#include <cstring>

namespace rwd::detail {

RecurrentState::RecurrentState(std::vector<std::int64_t> state_shape, DType t, std::int64_t b,
                               std::int64_t num_slots, MemoryBudget* budget)
    : shape(std::move(state_shape)), dtype(t), batch(b), slots(num_slots),
      ring(static_cast<std::size_t>(num_slots) * static_cast<std::size_t>(b) * entry_bytes(), budget) {
  std::memset(slot(0), 0, state_bytes());  // S(0), the zero state
}

std::size_t RecurrentState::entry_bytes() const {
  std::size_t n = dtype_size(dtype);
  for (std::int64_t e : shape) n *= static_cast<std::size_t>(e);
  return n;
}

TensorView RecurrentState::view(std::int64_t pos) const {
  std::byte* data = slot(pos);
  switch (shape.size()) {
    case 1: return TensorView::contiguous(data, dtype, {batch, shape[0]});
    case 2: return TensorView::contiguous(data, dtype, {batch, shape[0], shape[1]});
    default: return TensorView::contiguous(data, dtype, {batch, shape[0], shape[1], shape[2]});
  }
}

void RecurrentState::rollback(std::int64_t k) {
  if (k >= length) {
    clear();
    return;
  }
  length -= k;
  held -= k;
}

void RecurrentState::clear() {
  length = 0;
  held = 1;
  std::memset(slot(0), 0, state_bytes());
}

RecurrentState RecurrentState::resized(std::int64_t num_slots) const {
  RecurrentState out(shape, dtype, batch, num_slots, ring.budget());
  out.length = length;
  out.held = std::min(held, num_slots);
  for (std::int64_t pos = length - out.held + 1; pos <= length; ++pos) {
    std::memcpy(out.slot(pos), slot(pos), state_bytes());
  }
  return out;
}

RecurrentState RecurrentState::gathered(std::span<const std::int64_t> rows) const {
  RecurrentState out(shape, dtype, static_cast<std::int64_t>(rows.size()), slots, ring.budget());
  out.length = length;
  out.held = held;
  const std::size_t entry = entry_bytes();
  for (std::int64_t pos = oldest(); pos <= length; ++pos) {
    for (std::size_t i = 0; i < rows.size(); ++i) {
      std::memcpy(out.slot(pos) + i * entry, slot(pos) + static_cast<std::size_t>(rows[i]) * entry, entry);
    }
  }
  return out;
}

}  // namespace rwd::detail
