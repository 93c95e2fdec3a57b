// Token-major storage shared by every per-token part (keys, values, side
// tensors, conv inputs).
//
// A PositionBuffer keeps the rows of a contiguous range of positions
// [first, end) in one aligned allocation; each row holds all batch entries of
// one position (e.g. [B, H, D] elements for keys). Appending q tokens writes
// q rows; cropping moves `end`; eviction moves `first`. Rows before `first`
// stay in memory until the next append needs their room, so views returned
// by the last update remain valid until the next mutation. When the end of
// the allocation is reached the retained rows are moved to the front
// (compaction, amortised O(1) per token because the buffer keeps at least as
// much free room as it retains) or, for dynamic buffers, the allocation
// doubles.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "rewind/error.h"

namespace rwd::detail {

// A budget refusal (CapacityError); layers add their name to its message.
class BudgetExceeded : public CapacityError {
 public:
  using CapacityError::CapacityError;
};

// Bytes the buffers of one cache may reserve (Cache::set_memory_budget).
// Shared by the layers of a cache, which has a single owner: no locking.
struct MemoryBudget {
  std::size_t limit = 0;  // 0: unlimited
  std::size_t reserved = 0;
  // Counts `bytes` against the limit; throws BudgetExceeded (reserved, limit
  // and request in the message) when they do not fit, counting nothing.
  void acquire(std::size_t bytes);
  void release(std::size_t bytes) noexcept { reserved -= bytes; }
};

// 64-byte aligned, move-only byte buffer, counted against an optional budget.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(MemoryBudget* budget) : budget_(budget) {}
  // Allocates `bytes` (rounded up to 64, contents undefined: every user
  // writes before it reads) after acquiring them from `budget`. Throws
  // BudgetExceeded or std::bad_alloc.
  AlignedBuffer(std::size_t bytes, MemoryBudget* budget);
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  std::byte* data() const { return data_.get(); }
  std::size_t size() const { return size_; }
  MemoryBudget* budget() const { return budget_; }
  // Starts counting this buffer against `budget` (REQUIRES: none yet).
  void attach(MemoryBudget* budget) noexcept;

 private:
  struct Free {
    void operator()(std::byte* p) const noexcept;
  };
  std::unique_ptr<std::byte, Free> data_;
  std::size_t size_ = 0;
  MemoryBudget* budget_ = nullptr;
};

class PositionBuffer {
 public:
  PositionBuffer() = default;
  // `row_bytes`: bytes of one position (all batch entries). `origin`: the
  // position of an empty buffer (0, or -K for conv inputs whose zero padding
  // is stored as rows). `static_slots` > 0 allocates exactly that many rows
  // now and never reallocates.
  PositionBuffer(std::size_t row_bytes, std::int64_t origin, std::int64_t static_slots, MemoryBudget* budget);
  void attach(MemoryBudget* budget) noexcept { buffer_.attach(budget); }

  std::int64_t first() const { return first_; }
  std::int64_t end() const { return end_; }
  std::int64_t stored() const { return end_ - first_; }
  std::size_t row_bytes() const { return row_bytes_; }
  bool is_static() const { return static_; }
  std::int64_t slots() const { return slots_; }

  // Address of position `pos`'s row. REQUIRES: pos in [first, end] and the
  // row inside the allocation (not checked).
  std::byte* row(std::int64_t pos) const {
    return buffer_.data() + static_cast<std::size_t>(pos - base_) * row_bytes_;
  }

  // Rows an append of q tokens needs in place (retained + q).
  std::int64_t rows_needed(std::int64_t q) const { return end_ - first_ + q; }
  // False when a static buffer cannot hold retained + q rows.
  bool can_append(std::int64_t q) const { return !static_ || rows_needed(q) <= slots_; }
  // Makes rows [end, end + q) writable (compacting or growing); the logical
  // state is unchanged. REQUIRES can_append(q). Throws std::bad_alloc only.
  void reserve_append(std::int64_t q);
  // Declares rows [end, end + q) written.
  void commit_append(std::int64_t q) { end_ += q; }
  // Drops positions below `pos` (no-op when pos <= first).
  void evict_before(std::int64_t pos) {
    if (pos > first_) first_ = pos;
  }
  // Forgets positions >= new_end. REQUIRES first <= new_end <= end.
  void truncate(std::int64_t new_end) { end_ = new_end; }
  // Empties the buffer back to `origin` (keeps the allocation). Rows for
  // positions [origin, origin + zero_rows) are zero-filled and retained.
  void clear(std::int64_t zero_rows);

  // A copy holding, for every retained position, the batch entries
  // `rows[i]` of `entry_bytes` each. Throws std::bad_alloc.
  PositionBuffer gathered(std::span<const std::int64_t> rows, std::size_t entry_bytes) const;

  std::size_t bytes_reserved() const { return buffer_.size(); }
  std::size_t bytes_used() const { return static_cast<std::size_t>(stored()) * row_bytes_; }

 private:
  AlignedBuffer buffer_;
  std::size_t row_bytes_ = 0;
  std::int64_t origin_ = 0;
  std::int64_t slots_ = 0;  // rows the allocation holds
  std::int64_t base_ = 0;   // position stored in row 0 of the allocation
  std::int64_t first_ = 0;
  std::int64_t end_ = 0;
  bool static_ = false;
};

}  // namespace rwd::detail
