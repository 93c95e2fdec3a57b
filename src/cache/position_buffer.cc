#include "cache/position_buffer.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <utility>

#include "rewind/error.h"

namespace rwd::detail {

void MemoryBudget::acquire(std::size_t bytes) {
  if (limit != 0 && (reserved > limit || bytes > limit - reserved)) {
    throw BudgetExceeded("memory budget exceeded: " + std::to_string(bytes) + " more bytes were needed, " +
                        std::to_string(reserved) + " of the budget's " + std::to_string(limit) +
                        " bytes are reserved");
  }
  reserved += bytes;
}

void AlignedBuffer::Free::operator()(std::byte* p) const noexcept { std::free(p); }

AlignedBuffer::AlignedBuffer(std::size_t bytes, MemoryBudget* budget) : budget_(budget) {
  const std::size_t rounded = (bytes + 63) / 64 * 64;
  if (rounded == 0) return;
  if (budget_) budget_->acquire(bytes);
  data_.reset(static_cast<std::byte*>(std::aligned_alloc(64, rounded)));
  if (!data_) {
    if (budget_) budget_->release(bytes);
    throw std::bad_alloc();
  }
  size_ = bytes;
}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::move(other.data_)), size_(std::exchange(other.size_, 0)), budget_(other.budget_) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    if (budget_ && size_) budget_->release(size_);
    data_ = std::move(other.data_);
    size_ = std::exchange(other.size_, 0);
    budget_ = other.budget_;
  }
  return *this;
}

AlignedBuffer::~AlignedBuffer() {
  if (budget_ && size_) budget_->release(size_);
}

void AlignedBuffer::attach(MemoryBudget* budget) noexcept {
  budget_ = budget;
  if (budget_) budget_->reserved += size_;
}

PositionBuffer::PositionBuffer(std::size_t row_bytes, std::int64_t origin, std::int64_t static_slots,
                               MemoryBudget* budget)
    : buffer_(budget), row_bytes_(row_bytes), origin_(origin), base_(origin), first_(origin), end_(origin),
      static_(static_slots > 0) {
  if (static_) {
    buffer_ = AlignedBuffer(static_cast<std::size_t>(static_slots) * row_bytes_, budget);
    slots_ = static_slots;
  }
}

void PositionBuffer::reserve_append(std::int64_t q) {
  if (end_ + q - base_ <= slots_) return;
  const std::int64_t kept = end_ - first_;
  // Compact (move the retained rows to the front) when the allocation is at
  // least twice what is needed: the free room then exceeds what is copied,
  // so compaction costs amortised O(1) per token. A static buffer always
  // compacts (the caller checked can_append).
  if (static_ || 2 * (kept + q) <= slots_) {
    if (kept > 0 && first_ != base_) {
      std::memmove(buffer_.data(), row(first_), static_cast<std::size_t>(kept) * row_bytes_);
    }
    base_ = first_;
    return;
  }
  const std::int64_t wanted = std::max({slots_ * 2, 2 * (kept + q), std::int64_t{16}});
  AlignedBuffer grown(static_cast<std::size_t>(wanted) * row_bytes_, buffer_.budget());
  if (kept > 0) std::memcpy(grown.data(), row(first_), static_cast<std::size_t>(kept) * row_bytes_);
  buffer_ = std::move(grown);
  slots_ = wanted;
  base_ = first_;
}

void PositionBuffer::clear(std::int64_t zero_rows) {
  base_ = first_ = origin_;
  end_ = origin_ + zero_rows;
  if (zero_rows > 0) {
    if (slots_ < zero_rows) {
      const std::int64_t wanted = std::max(zero_rows, std::int64_t{16});
      buffer_ = AlignedBuffer(static_cast<std::size_t>(wanted) * row_bytes_, buffer_.budget());
      slots_ = wanted;
    }
    std::memset(buffer_.data(), 0, static_cast<std::size_t>(zero_rows) * row_bytes_);
  }
}

PositionBuffer PositionBuffer::gathered(std::span<const std::int64_t> rows, std::size_t entry_bytes) const {
  PositionBuffer out;
  out.row_bytes_ = rows.size() * entry_bytes;
  out.origin_ = origin_;
  out.static_ = static_;
  out.base_ = first_;
  out.first_ = first_;
  out.end_ = end_;
  const std::int64_t kept = end_ - first_;
  out.slots_ = static_ ? slots_ : std::max(kept, std::int64_t{16});
  out.buffer_ = AlignedBuffer(static_cast<std::size_t>(out.slots_) * out.row_bytes_, buffer_.budget());
  for (std::int64_t pos = first_; pos < end_; ++pos) {
    const std::byte* src = row(pos);
    std::byte* dst = out.row(pos);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      std::memcpy(dst + i * entry_bytes, src + static_cast<std::size_t>(rows[i]) * entry_bytes, entry_bytes);
    }
  }
  return out;
}

}  // namespace rwd::detail
