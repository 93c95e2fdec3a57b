#include "cache/position_buffer.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "rewind/error.h"

namespace rwd::detail {

#if defined(REWIND_DEBUG_VIEWS)
// Relocations always go to a new allocation, so a view into the old one
// reads freed memory (reported by ASan) rather than rows that moved.
constexpr bool kRelocateToNewAllocation = true;
#else
constexpr bool kRelocateToNewAllocation = false;
#endif

void MemoryBudget::acquire(std::size_t bytes) {
  if (limit != 0 && (reserved > limit || bytes > limit - reserved)) {
    throw BudgetExceeded("memory budget exceeded: " + std::to_string(bytes) + " more bytes were needed, " +
                         std::to_string(reserved) + " of the budget's " + std::to_string(limit) +
                         " bytes are reserved");
  }
  reserved += bytes;
}

AlignedBuffer::AlignedBuffer(std::size_t bytes, std::shared_ptr<Storage> storage, MemoryBudget* budget)
    : storage_(storage ? std::move(storage) : host_storage()), device_(storage_->device()), budget_(budget) {
  if (bytes == 0) return;
  if (bytes > kMaxBufferBytes) {
    throw CapacityError("an allocation of " + std::to_string(bytes) + " bytes exceeds the limit of 2^48 bytes");
  }
  if (budget_) budget_->acquire(bytes);
  try {
    data_ = static_cast<std::byte*>(storage_->allocate(bytes));
  } catch (...) {
    if (budget_) budget_->release(bytes);
    throw;
  }
  size_ = bytes;
}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)), storage_(other.storage_),
      device_(other.device_), budget_(other.budget_) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    free();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    storage_ = other.storage_;
    device_ = other.device_;
    budget_ = other.budget_;
  }
  return *this;
}

void AlignedBuffer::free() noexcept {
  if (budget_ && size_) budget_->release(size_);
  if (data_ != nullptr) {
    unpoison(data_, size_);
    storage_->deallocate(data_, size_);
  }
  data_ = nullptr;
  size_ = 0;
}

void AlignedBuffer::attach(MemoryBudget* budget) noexcept {
  if (budget_ && size_) budget_->release(size_);  // moves the count (Layer::clone detaches from its cache's)
  budget_ = budget;
  if (budget_) budget_->reserved += size_;
}

PositionBuffer::PositionBuffer(std::size_t row_bytes, std::int64_t origin, std::int64_t static_slots,
                               std::shared_ptr<Storage> storage, MemoryBudget* budget)
    : buffer_(storage ? std::move(storage) : host_storage(), budget), row_bytes_(row_bytes), origin_(origin),
      base_(origin), first_(origin), end_(origin), static_(static_slots > 0) {
  if (static_) {
    buffer_ = AlignedBuffer(checked_mul(static_slots, static_cast<std::int64_t>(row_bytes_), "static_capacity"),
                            buffer_.storage(), budget);
    slots_ = static_slots;
  } else if (origin < 0) {
    // Room for the zero padding rows (conv inputs before position 0) that
    // clear() writes: a dynamic buffer never holds fewer rows than that.
    slots_ = std::max(-origin, std::int64_t{16});
    buffer_ = AlignedBuffer(checked_mul(slots_, static_cast<std::int64_t>(row_bytes_), "a conv state"),
                            buffer_.storage(), budget);
  }
}

std::int64_t PositionBuffer::planned_slots(std::int64_t needed, std::int64_t q) const {
  if (static_) {
    if (has_room(q)) return 0;
    return kRelocateToNewAllocation ? slots_ : 0;
  }
  if (const std::int64_t smaller = shrunk_slots(needed)) return smaller;
  if (has_room(q)) return 0;
  // Compacting costs amortised O(1) per token when the free room exceeds
  // what is copied, i.e. when the allocation is at least twice the need.
  if (2 * needed <= slots_) return kRelocateToNewAllocation ? slots_ : 0;
  return std::max(slots_ * 2, 2 * std::max(needed, std::int64_t{16}));
}

std::int64_t PositionBuffer::shrunk_slots(std::int64_t need) const {
  if (static_) return 0;
  const std::int64_t floor = std::max(need, std::int64_t{16});
  return slots_ > 4 * floor ? 2 * floor : 0;
}

void PositionBuffer::try_move_into(std::int64_t slots) noexcept {
  try {
    move_into(AlignedBuffer(static_cast<std::size_t>(slots) * row_bytes_, buffer_.storage(), buffer_.budget()), slots);
  } catch (const Error&) {
    // the budget or the system refused the smaller copy: keep the larger allocation, nothing is lost
  }
}

PositionBuffer::Plan PositionBuffer::plan_append(std::int64_t q) const {
  Plan plan;
  const std::int64_t needed = rows_needed(q);
  // Every size below is checked before anything is allocated: a wrapped
  // product would allocate too little and the copy would overflow it.
  checked_mul(needed, static_cast<std::int64_t>(row_bytes_), "an append of " + std::to_string(q) + " tokens");
  const std::int64_t slots = planned_slots(needed, q);
  if (slots == 0) return plan;
  const std::size_t bytes = checked_mul(slots, static_cast<std::int64_t>(row_bytes_),
                                        "an append of " + std::to_string(q) + " tokens");
  const bool same_size = static_ || slots == slots_;
  // A same-size relocation (debug mode) does not count twice against the budget.
  plan.grown = AlignedBuffer(bytes, buffer_.storage(), same_size ? nullptr : buffer_.budget());
  plan.slots = slots;
  return plan;
}

void PositionBuffer::move_into(AlignedBuffer grown, std::int64_t slots) noexcept {
  const std::int64_t kept = end_ - first_;
  unpoison(buffer_.data(), buffer_.size());
  if (kept > 0)
    storage_move(*buffer_.storage(), grown.data(), row(first_), static_cast<std::size_t>(kept) * row_bytes_);
  MemoryBudget* budget = buffer_.budget();
  const bool counted = grown.budget() != nullptr;
  buffer_ = std::move(grown);
  if (!counted && budget) buffer_.attach(budget);
  slots_ = slots;
  base_ = first_;
}

void PositionBuffer::apply(Plan plan, std::int64_t q) noexcept {
  unpoison(buffer_.data(), buffer_.size());
  if (plan.slots != 0) {
    move_into(std::move(plan.grown), plan.slots);
  } else if (!has_room(q)) {
    const std::int64_t kept = end_ - first_;
    if (kept > 0 && first_ != base_) {
      storage_move(*buffer_.storage(), buffer_.data(), row(first_), static_cast<std::size_t>(kept) * row_bytes_);
    }
    base_ = first_;
  }
  unpoison(buffer_.data(), buffer_.size());
}

void PositionBuffer::clear(std::int64_t zero_rows) noexcept {
  // zero_rows (the conv padding, K rows) was allocated with the buffer:
  // a dynamic buffer starts with max(16, K) rows and never goes below.
  unpoison(buffer_.data(), buffer_.size());
  base_ = first_ = end_ = origin_;
  if (const std::int64_t smaller = shrunk_slots(zero_rows)) try_move_into(smaller);  // moves no rows: empty
  end_ = origin_ + zero_rows;
  if (zero_rows > 0) storage_zero(*buffer_.storage(), buffer_.data(), static_cast<std::size_t>(zero_rows) * row_bytes_);
}

void PositionBuffer::shrink_if_oversized(std::int64_t refill_rows) noexcept {
  if (const std::int64_t smaller = shrunk_slots(std::max(stored(), refill_rows))) try_move_into(smaller);
}

void PositionBuffer::shrink_to_fit() noexcept {
  const std::int64_t fit = std::max(stored(), std::int64_t{1});
  if (!static_ && slots_ != fit) try_move_into(fit);
}

PositionBuffer PositionBuffer::gathered(std::span<const std::int64_t> rows, std::size_t entry_bytes) const {
  PositionBuffer out;
  out.row_bytes_ = checked_mul(rows.size(), entry_bytes, "a batch operation");
  out.origin_ = origin_;
  out.static_ = static_;
  out.base_ = first_;
  out.first_ = first_;
  out.end_ = end_;
  const std::int64_t kept = end_ - first_;
  out.slots_ = static_ ? slots_ : std::max(kept, std::int64_t{16});
  out.buffer_ = AlignedBuffer(checked_mul(out.slots_, static_cast<std::int64_t>(out.row_bytes_), "a batch operation"),
                              buffer_.storage(), buffer_.budget());
  for (std::int64_t pos = first_; pos < end_; ++pos) {
    const std::byte* src = row(pos);
    std::byte* dst = out.row(pos);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      storage_move(*buffer_.storage(), dst + i * entry_bytes, src + static_cast<std::size_t>(rows[i]) * entry_bytes,
                   entry_bytes);
    }
  }
  return out;
}

#if defined(REWIND_DEBUG_VIEWS)
void PositionBuffer::relocate() noexcept {
  if (buffer_.size() == 0 || static_) return;  // a static buffer's address is part of its contract
  try {
    // Not counted twice against the budget: move_into counts the new one as the old one goes.
    move_into(AlignedBuffer(static_cast<std::size_t>(slots_) * row_bytes_, buffer_.storage(), nullptr), slots_);
  } catch (...) {
    // the system refused the copy: the old allocation stays (only a debug aid is lost)
  }
}

void PositionBuffer::protect(std::int64_t visible_first) const noexcept {
  if (buffer_.size() == 0) return;
  const std::int64_t lo = std::max(std::min(visible_first, first_), base_);
  poison(buffer_.data(), buffer_.size());
  if (end_ > lo) unpoison(row(lo), static_cast<std::size_t>(end_ - lo) * row_bytes_);
}
#endif

}  // namespace rwd::detail
