// Paged attention storage for SequenceCache: fixed-size blocks from one pool
// per layer, addressed per sequence through a short list of block runs.
//
// A BlockRun is a vector of blocks covering consecutive positions from a
// block-aligned first position. Several sequences may hold ranges of one
// run (after a fork); each holder names the positions [lo, hi) it uses. A
// block is released as soon as no holder's range touches it, so the blocks
// in use are exactly those covering some live sequence's retained
// positions. A sequence writes only into its last run, and only when it
// holds that run alone; otherwise its next write starts a new run (copying
// the rows of a shared, partly filled last block).
//
// Edits are two-phase like everything else in the cache: ranges shrink
// first (nothing is freed), then settle() releases the blocks the shrinking
// left uncovered. A batched forward changes ranges when it opens and
// settles when it commits, so abandoning it can put every range back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cache/position_buffer.h"
#include "cache/token_track.h"
#include "rewind/sequences.h"

namespace rwd::detail {

// Blocks of one layer. Addresses never move; free blocks are kept for reuse
// up to max(16, blocks in use), beyond that they go back to the system.
class BlockPool {
 public:
  BlockPool(std::size_t block_bytes, std::shared_ptr<Storage> storage, MemoryBudget* budget)
      : block_bytes_(block_bytes), storage_(std::move(storage)), budget_(budget) {}
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // A block (contents undefined). Throws BudgetExceeded or CapacityError;
  // nothing is counted then.
  std::byte* acquire();
  // Refuses up front (budget, 2^48 bytes, more than the machine's physical
  // memory) a request for n blocks, so a huge update fails at once instead
  // of after allocating block by block. Throws BudgetExceeded / CapacityError.
  void check_room(std::int64_t n) const;
  void release(std::byte* block) noexcept;
  // Returns every free block to the system.
  void trim() noexcept;
  // Exact undo of a refused operation. mark() remembers the free list's
  // size; until restore_mark() or unmark(), release() keeps every block on
  // the free list (no cap, no early free), so once the operation has given
  // back what it acquired, restore_mark() frees just the blocks it had to
  // allocate: bytes reserved, blocks free and in use are as at mark().
  void mark() noexcept;
  void restore_mark() noexcept;
  void unmark() noexcept { marked_ = false; }

  std::size_t block_bytes() const { return block_bytes_; }
  Storage& storage() const { return *storage_; }
  std::int64_t in_use() const { return in_use_; }
  std::int64_t free_count() const { return static_cast<std::int64_t>(free_.size()); }
  std::size_t bytes_reserved() const { return static_cast<std::size_t>(in_use_ + free_count()) * block_bytes_; }

 private:
  void destroy(std::byte* block) noexcept;
  std::size_t block_bytes_;
  std::shared_ptr<Storage> storage_;
  MemoryBudget* budget_;
  std::vector<std::byte*> free_;  // capacity >= every block ever live, so release never allocates
  std::int64_t in_use_ = 0;
  bool marked_ = false;
  std::size_t mark_ = 0;  // free list size at mark()
};

struct PagedPart;

struct BlockRun {
  struct Holder {
    PagedPart* part;  // the sequence part holding positions [lo, hi)
    std::int64_t lo, hi;
  };
  std::int64_t first_position = 0;  // of blocks[0]; a multiple of the block size
  std::vector<std::byte*> blocks;   // nullptr once released
  std::vector<Holder> holders;

  std::int64_t end_position(std::int64_t bs) const {
    return first_position + static_cast<std::int64_t>(blocks.size()) * bs;
  }
};

// A part's hold on a run: the run and the index of its holder entry there
// (kept current when other holders leave), so lookups are O(1) however
// many forks share the run.
struct RunRef {
  BlockRun* run;
  std::uint32_t holder;
  BlockRun::Holder& get() const { return run->holders[holder]; }
};

// One sequence's attention part of one layer: positions [first, end), held
// as consecutive ranges of `runs` (which partition them). Runs point back
// at their holders' parts: a part must not move once it holds a run.
struct PagedPart {
  std::int64_t first = 0;
  std::int64_t end = 0;
  std::vector<RunRef> runs;

  // What an open forward reserved, and what abandoning it restores.
  struct Pending {
    std::int64_t q = 0;
    BlockRun* fresh = nullptr;  // a new run (copy-on-write start), not yet linked
    std::int64_t appended = 0;  // blocks added to the own last run
    std::int64_t saved_first = 0, saved_end = 0;
    std::vector<RunRef> saved_runs;
    std::vector<std::pair<std::int64_t, std::int64_t>> saved_ranges;  // per saved run
  } pending;
};

// The paged storage of one attention layer: its geometry, rule and pool.
class PagedLayer {
 public:
  // `layout.device` is set to the storage's.
  PagedLayer(RetentionRule rule, BlockLayout layout, std::shared_ptr<Storage> storage, MemoryBudget* budget);

  const RetentionRule& rule() const { return rule_; }
  const BlockLayout& layout() const { return layout_; }
  BlockPool& pool() { return pool_; }
  const BlockPool& pool() const { return pool_; }
  std::int64_t block_size() const { return layout_.block_size; }

  // ---- shrinking edits (cannot fail) ----
  // Keeps positions [max(first, new_first), min(end, new_end)) of `part`
  // (an empty result empties it and moves it to new_end when new_end <=
  // first, for a full rollback: new_first = new_end = 0). Releases blocks
  // nobody holds any more.
  void shrink(PagedPart& part, std::int64_t new_first, std::int64_t new_end) noexcept;
  // Drops every range of `part` (the sequence is removed).
  void release(PagedPart& part) noexcept;

  // ---- fork (two phases) ----
  // Room for `child` to hold every run `parent` holds. Throws CapacityError.
  void prepare_fork(const PagedPart& parent, PagedPart& child) const;
  // REQUIRES prepare_fork(parent, child) since the last change.
  void commit_fork(const PagedPart& parent, PagedPart& child) noexcept;

  // ---- forwards ----
  // Allocates what q new positions need (new blocks; for a shared last
  // block, a new run with that block's retained rows copied). Changes no
  // range. Throws BudgetExceeded / CapacityError, holding nothing then.
  void reserve(PagedPart& part, std::int64_t q);
  // Releases a reservation that was not opened.
  void unreserve(PagedPart& part) noexcept;
  // Makes the reserved positions part of the ranges ([first, end + q)) and
  // saves what abandon restores. REQUIRES reserve(part, q).
  void open(PagedPart& part) noexcept;
  // Restores the ranges saved by open and releases the reservation.
  void abandon(PagedPart& part) noexcept;
  // Ends the forward: evicts what recording R no longer needs and
  // releases every block the forward left uncovered.
  void commit(PagedPart& part, std::int64_t R) noexcept;

  // Writes rows [row0, row0 + n) of `input` (token dimension `token_dim`)
  // as positions [pos, pos + n) of `part` into `part_index`.
  // REQUIRES the positions inside part's last run.
  void write(const PagedPart& part, int part_index, const TensorView& input, int token_dim, std::int64_t row0,
             std::int64_t pos, std::int64_t n) const;
  // True when `span` overlaps a block that positions [pos, pos + n) of part
  // live in.
  bool overlaps(const PagedPart& part, std::int64_t pos, std::int64_t n, std::uintptr_t lo, std::uintptr_t hi) const;
  // Appends to `out` the spans covering positions [from, part.end).
  void spans(const PagedPart& part, std::int64_t from, std::vector<BlockSpan>& out) const;

 private:
  // Releases the blocks of `run` in positions [old_lo, old_hi) (a range
  // that shrank) that no holder's range touches any more.
  void settle_range(BlockRun& run, std::int64_t old_lo, std::int64_t old_hi) noexcept;
  // Removes empty holders / runs, drops released blocks at the ends, merges
  // the last two runs when this part holds both alone.
  void tidy(PagedPart& part) noexcept;
  // Removes `ref`'s holder entry (deleting the run when it was the last).
  void drop_holder(const RunRef& ref) noexcept;

  RetentionRule rule_;
  BlockLayout layout_;
  BlockPool pool_;
};

}  // namespace rwd::detail
