// Token-major storage shared by every per-token part (keys, values, side
// tensors, conv inputs).
//
// A PositionBuffer keeps the rows of a contiguous range of positions
// [first, end) in one aligned allocation; each row holds all batch entries of
// one position (e.g. [B, H, D] elements for keys). Appending q tokens writes
// q rows; cropping moves `end`; eviction moves `first`. Rows before `first`
// stay in memory until the next append needs their room, so views returned
// by the last update remain valid until the next mutation.
//
// Room for an append is planned, then applied: plan_append() allocates what
// the append needs (may throw, changes nothing), apply() moves the retained
// rows into place (cannot fail, changes no position). Whole-cache and
// whole-forward operations plan every buffer before applying any.
//
// Reservation policy (docs/semantics.md section 11): a dynamic buffer grows
// by doubling (amortised O(1) per token), compacts in place when it holds
// at least twice what is needed, and shrinks to twice what is needed when it
// holds more than four times that (at the next append or crop(0)), so the
// bytes it reserves stay within 4x of (retained + current update).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "aligned_memory.h"
#include "rewind/error.h"
#include "rewind/storage.h"

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

// A move-only allocation from a Storage (64-byte aligned), counted against
// an optional budget. Its bytes are read and written only through the
// storage's copy calls (the copy / zero helpers below): they may be device
// memory.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // An empty buffer that will allocate from `storage` (null: the host).
  AlignedBuffer(std::shared_ptr<Storage> storage, MemoryBudget* budget)
      : storage_(std::move(storage)), device_(storage_ ? storage_->device() : Device{}), budget_(budget) {}
  // Allocates `bytes` (contents undefined: every user writes before it
  // reads) from `storage` after acquiring them from `budget`. Throws
  // BudgetExceeded or CapacityError; nothing is counted then.
  AlignedBuffer(std::size_t bytes, std::shared_ptr<Storage> storage, MemoryBudget* budget);
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() {
    if (data_ != nullptr) free();  // an empty plan (every update makes one) costs nothing
  }

  std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  MemoryBudget* budget() const { return budget_; }
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  Device device() const { return device_; }  // kept: views are made on every update
  // Counts this buffer against `budget` (null: none) instead of the one before.
  void attach(MemoryBudget* budget) noexcept;
  // True when addresses [lo, hi) intersect this allocation.
  bool overlaps(std::uintptr_t lo, std::uintptr_t hi) const {
    const auto begin = reinterpret_cast<std::uintptr_t>(data_);
    return size_ != 0 && lo < begin + size_ && begin < hi;
  }

 private:
  void free() noexcept;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::shared_ptr<Storage> storage_;
  Device device_{};
  MemoryBudget* budget_ = nullptr;
};

// Copies and zero fills of state memory, through its storage (`dst` and
// `src` both `storage`'s memory).
inline void storage_move(Storage& storage, std::byte* dst, const std::byte* src, std::size_t bytes) noexcept {
  storage.copy(dst, true, src, true, bytes);
}
inline void storage_zero(Storage& storage, std::byte* dst, std::size_t bytes) noexcept {
  storage.fill_zero(dst, bytes);
}

class PositionBuffer {
 public:
  PositionBuffer() = default;
  // `row_bytes`: bytes of one position (all batch entries). `origin`: the
  // position of an empty buffer (0, or -K for conv inputs whose zero padding
  // is stored as rows). `static_slots` > 0 allocates exactly that many rows
  // now and never changes the row count. Throws CapacityError / BudgetExceeded.
  PositionBuffer(std::size_t row_bytes, std::int64_t origin, std::int64_t static_slots,
                 std::shared_ptr<Storage> storage, MemoryBudget* budget);
  void attach(MemoryBudget* budget) noexcept { buffer_.attach(budget); }

  std::int64_t first() const { return first_; }
  std::int64_t end() const { return end_; }
  std::int64_t stored() const { return end_ - first_; }
  std::size_t row_bytes() const { return row_bytes_; }
  bool is_static() const { return static_; }
  std::int64_t slots() const { return slots_; }
  const AlignedBuffer& allocation() const { return buffer_; }
  Device device() const { return buffer_.device(); }

  // Address of position `pos`'s row. REQUIRES: pos in [first, end] and the
  // row inside the allocation (not checked).
  std::byte* row(std::int64_t pos) const { return buffer_.data() + static_cast<std::size_t>(pos - base_) * row_bytes_; }

  // Rows an append of q tokens needs in place (retained + q).
  std::int64_t rows_needed(std::int64_t q) const { return end_ - first_ + q; }
  // False when a static buffer cannot hold retained + q rows.
  bool can_append(std::int64_t q) const { return !static_ || rows_needed(q) <= slots_; }

  // Room for an append of q tokens: a new allocation when the current one
  // must grow or shrink, nothing when it fits (after compaction).
  struct Plan {
    AlignedBuffer grown;
    std::int64_t slots = 0;  // rows of `grown`; 0: keep the allocation
  };
  // REQUIRES can_append(q), 0 <= q and end + q within 2^40 tokens (the
  // layer checks the token limit). Throws CapacityError (sizes past 2^48
  // bytes, or the system refuses) or BudgetExceeded; changes nothing.
  Plan plan_append(std::int64_t q) const;
  // Makes rows [end, end + q) writable, moving the retained rows into the
  // planned allocation or to the front of the current one. Cannot fail; the
  // logical state (first, end, contents) is unchanged.
  void apply(Plan plan, std::int64_t q) noexcept;
  // True when an append of q tokens needs a new allocation (growth, shrink,
  // or a debug-mode relocation). REQUIRES can_append(q).
  bool plan_allocates(std::int64_t q) const { return planned_slots(rows_needed(q), q) != 0; }
  // True when rows [end, end + q) are writable without apply().
  bool has_room(std::int64_t q) const { return end_ + q - base_ <= slots_; }

  // Declares rows [end, end + q) written.
  void commit_append(std::int64_t q) { end_ += q; }
  // Drops positions below `pos` (no-op when pos <= first).
  void evict_before(std::int64_t pos) {
    if (pos > first_) first_ = pos;
  }
  // Forgets positions >= new_end. REQUIRES first <= new_end <= end.
  void truncate(std::int64_t new_end) { end_ = new_end; }
  // Restores a range saved earlier (an abandoned forward). REQUIRES: the
  // rows of [first, end) were not overwritten since (no append or apply
  // beyond the room reserved then).
  void restore(std::int64_t first, std::int64_t end) {
    first_ = first;
    end_ = end;
  }
  // Empties the buffer and places its end at `pos` (a restored snapshot
  // starts past the origin). The allocation is kept; clear() still returns
  // to the origin.
  void place_at(std::int64_t pos) noexcept { base_ = first_ = end_ = pos; }
  // Empties the buffer back to `origin`. Rows for positions
  // [origin, origin + zero_rows) are zero-filled and retained. Keeps the
  // allocation unless it holds more than four times what is retained.
  void clear(std::int64_t zero_rows) noexcept;
  // Best effort: when a dynamic buffer reserves more than four times
  // max(what it retains, `refill_rows`), moves the rows into an allocation
  // of twice that. `refill_rows` is what the part will hold again after its
  // next updates (its retention bound with recording R), so a crop(0)
  // between updates does not shrink a buffer the next update regrows. An
  // allocation failure keeps the old one (nothing is lost).
  void shrink_if_oversized(std::int64_t refill_rows) noexcept;
  // Best effort: reallocates a dynamic buffer to exactly what it retains.
  void shrink_to_fit() noexcept;

  // A copy holding, for every retained position, the batch entries
  // `rows[i]` of `entry_bytes` each. Throws CapacityError / BudgetExceeded.
  PositionBuffer gathered(std::span<const std::int64_t> rows, std::size_t entry_bytes) const;

  // Debug aid (REWIND_DEBUG_VIEWS under ASan): rows outside
  // [min(visible_first, first), end) are marked unreadable, so a view kept
  // past its validity reads poison instead of replaced data.
#if defined(REWIND_DEBUG_VIEWS)
  void protect(std::int64_t visible_first) const noexcept;
  // Moves the retained rows to a new allocation of the same size (best
  // effort), so every view into the old one reads freed memory: an
  // abandoned forward's views, old rows included, are then reported.
  void relocate() noexcept;
#else
  void protect(std::int64_t) const noexcept {}
  void relocate() noexcept {}
#endif

  std::size_t bytes_reserved() const { return buffer_.size(); }
  std::size_t bytes_used() const { return static_cast<std::size_t>(stored()) * row_bytes_; }

 private:
  // Rows of a new allocation for `needed` rows, or 0 to keep the current one.
  std::int64_t planned_slots(std::int64_t needed, std::int64_t q) const;
  // The one shrink rule: a dynamic buffer holding more than 4 max(need, 16)
  // rows moves into 2 max(need, 16). The new row count, or 0 to keep.
  std::int64_t shrunk_slots(std::int64_t need) const;
  // Best effort: moves the retained rows into a new allocation of `slots`
  // rows; a refused allocation keeps the current one.
  void try_move_into(std::int64_t slots) noexcept;
  void move_into(AlignedBuffer grown, std::int64_t slots) noexcept;
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
