#include "cache/paged_attention.h"

#include <algorithm>
#include <cstring>
#include <new>
#include <string>

#include "aligned_memory.h"
#include "tensor_copy.h"

namespace rwd::detail {

// ---- BlockPool ---------------------------------------------------------------

BlockPool::~BlockPool() { trim(); }

std::byte* BlockPool::acquire() {
  if (!free_.empty()) {
    std::byte* block = free_.back();
    free_.pop_back();
    unpoison(block, block_bytes_);
    ++in_use_;
    return block;
  }
  try {
    free_.reserve(static_cast<std::size_t>(in_use_) + free_.size() + 1);
  } catch (const std::bad_alloc&) {
    throw CapacityError("the system could not allocate the block list");
  }
  if (budget_) budget_->acquire(block_bytes_);
  std::byte* block = nullptr;
  try {
    block = static_cast<std::byte*>(storage_->allocate(block_bytes_));
  } catch (...) {
    if (budget_) budget_->release(block_bytes_);
    throw;
  }
  ++in_use_;
  return block;
}

void BlockPool::check_room(std::int64_t n) const {
  if (n <= free_count()) return;
  const std::size_t bytes = checked_mul(n - free_count(), static_cast<std::int64_t>(block_bytes_),
                                        "the blocks of an update");
  if (budget_) {
    budget_->acquire(bytes);  // the budget's refusal and message, counting nothing
    budget_->release(bytes);
  }
  if (const std::size_t physical = physical_memory_bytes(); physical != 0 && bytes > physical) {
    throw CapacityError("the blocks of an update need " + std::to_string(bytes) + " bytes, more than this machine's " +
                        std::to_string(physical) + " bytes of memory; nothing was allocated");
  }
}

void BlockPool::release(std::byte* block) noexcept {
  --in_use_;
  if (marked_) {
    free_.push_back(block);  // within the capacity reserved by acquire; restore_mark() settles it
    return;
  }
#if defined(REWIND_DEBUG_VIEWS)
  // Debug builds free at once, so a stale view of the block is reported.
  destroy(block);
#else
  if (free_.size() >= static_cast<std::size_t>(std::max<std::int64_t>(16, in_use_))) {
    destroy(block);
    return;
  }
  free_.push_back(block);  // within the capacity reserved by acquire
#endif
}

void BlockPool::trim() noexcept {
  for (std::byte* block : free_) destroy(block);
  free_.clear();
}

void BlockPool::mark() noexcept {
  marked_ = true;
  mark_ = free_.size();
}

void BlockPool::restore_mark() noexcept {
  marked_ = false;
  // The blocks given back beyond the mark are the ones the operation had to
  // allocate (it took the free ones first): freeing them restores the
  // reserved bytes. Every block is interchangeable, so which go does not matter.
  while (free_.size() > mark_) {
    destroy(free_.back());
    free_.pop_back();
  }
}

void BlockPool::destroy(std::byte* block) noexcept {
  storage_->deallocate(block, block_bytes_);
  if (budget_) budget_->release(block_bytes_);
}

// ---- PagedLayer --------------------------------------------------------------

PagedLayer::PagedLayer(RetentionRule rule, BlockLayout layout, std::shared_ptr<Storage> storage, MemoryBudget* budget)
    : rule_(rule), layout_(std::move(layout)), pool_(layout_.block_bytes, std::move(storage), budget) {
  layout_.device = pool_.storage().device();
}

void PagedLayer::settle_range(BlockRun& run, std::int64_t old_lo, std::int64_t old_hi) noexcept {
  if (old_lo >= old_hi) return;
  const std::int64_t bs = block_size();
  const std::int64_t fp = run.first_position;
  std::int64_t j = (old_lo - fp) / bs;
  const std::int64_t last = std::min<std::int64_t>((old_hi - 1 - fp) / bs,
                                                   static_cast<std::int64_t>(run.blocks.size()) - 1);
  while (j <= last) {
    // The holder that touches block j and reaches furthest: every block up
    // to its last one stays, so the scan jumps there (a fork sharing a long
    // prefix costs one pass over the holders, not one per block).
    std::int64_t reach = -1;
    for (const auto& h : run.holders) {
      if (h.lo >= h.hi) continue;
      const std::int64_t b0 = (h.lo - fp) / bs, b1 = (h.hi - 1 - fp) / bs;
      if (b0 <= j && j <= b1) reach = std::max(reach, b1);
    }
    if (reach >= j) {
      j = reach + 1;
      continue;
    }
    std::byte*& block = run.blocks[static_cast<std::size_t>(j)];
    if (block) {
      pool_.release(block);
      block = nullptr;
    }
    ++j;
  }
}

void PagedLayer::drop_holder(const RunRef& ref) noexcept {
  BlockRun* run = ref.run;
  auto& hs = run->holders;
  const std::size_t k = ref.holder;
  if (k + 1 != hs.size()) {
    hs[k] = hs.back();
    // The moved holder's part finds it at its new index.
    PagedPart* moved = hs[k].part;
    for (auto& r : moved->runs)
      if (r.run == run) r.holder = static_cast<std::uint32_t>(k);
    for (auto& r : moved->pending.saved_runs)
      if (r.run == run) r.holder = static_cast<std::uint32_t>(k);
  }
  hs.pop_back();
  if (!hs.empty()) return;
  for (std::byte* block : run->blocks)
    if (block) pool_.release(block);
  delete run;
}

void PagedLayer::tidy(PagedPart& part) noexcept {
  // Runs this part no longer uses. drop_holder may renumber this part's
  // other holders (in other runs only: a part holds a run once), so the
  // kept refs are read after it.
  std::size_t kept = 0;
  for (std::size_t i = 0; i < part.runs.size(); ++i) {
    const RunRef ref = part.runs[i];
    const BlockRun::Holder& h = ref.get();
    if (h.lo >= h.hi) {
      drop_holder(ref);
    } else {
      part.runs[kept++] = part.runs[i];
    }
  }
  part.runs.resize(kept);
  const std::int64_t bs = block_size();
  for (const RunRef& ref : part.runs) {
    BlockRun* run = ref.run;
    if (run->holders.size() != 1) continue;
    auto& blocks = run->blocks;
    while (!blocks.empty() && blocks.back() == nullptr) blocks.pop_back();
    // A sliding sequence's own run releases blocks at its front forever:
    // drop the released entries once they are the larger half.
    std::size_t lead = 0;
    while (lead < blocks.size() && blocks[lead] == nullptr) ++lead;
    if (lead >= 8 && 2 * lead >= blocks.size()) {
      blocks.erase(blocks.begin(), blocks.begin() + static_cast<std::ptrdiff_t>(lead));
      run->first_position += static_cast<std::int64_t>(lead) * bs;
    }
  }
  // Two runs held by this part alone that meet at a block boundary become
  // one (forks that ended leave them behind), so the run list stays short.
  while (part.runs.size() >= 2) {
    BlockRun* a = part.runs[part.runs.size() - 2].run;
    BlockRun* b = part.runs.back().run;
    if (a->holders.size() != 1 || b->holders.size() != 1) break;
    BlockRun::Holder& ha = a->holders.front();
    const BlockRun::Holder& hb = b->holders.front();
    if (ha.hi != hb.lo || hb.lo != b->first_position || a->end_position(bs) != b->first_position) break;
    try {
      a->blocks.insert(a->blocks.end(), b->blocks.begin(), b->blocks.end());
    } catch (const std::bad_alloc&) {
      break;  // best effort: two runs work as well as one
    }
    ha.hi = hb.hi;
    delete b;
    part.runs.pop_back();
  }
}

void PagedLayer::shrink(PagedPart& part, std::int64_t new_first, std::int64_t new_end) noexcept {
  const std::int64_t first = std::max(part.first, new_first);
  const std::int64_t end = std::min(part.end, new_end);
  for (const RunRef& ref : part.runs) {
    BlockRun::Holder& h = ref.get();
    const std::int64_t old_lo = h.lo, old_hi = h.hi;
    h.lo = std::max(h.lo, first);
    h.hi = std::max(h.lo, std::min(h.hi, end));
    if (h.lo != old_lo || h.hi != old_hi) settle_range(*ref.run, old_lo, old_hi);
  }
  if (end <= first) {
    part.first = part.end = end;
  } else {
    part.first = first;
    part.end = end;
  }
  tidy(part);
}

void PagedLayer::release(PagedPart& part) noexcept {
  shrink(part, 0, 0);
  part.first = part.end = 0;
}

void PagedLayer::prepare_fork(const PagedPart& parent, PagedPart& child) const {
  try {
    child.runs.reserve(parent.runs.size());
    for (const RunRef& ref : parent.runs) ref.run->holders.reserve(ref.run->holders.size() + 1);
  } catch (const std::bad_alloc&) {
    throw CapacityError("the system could not allocate the block table of a fork");
  }
}

void PagedLayer::commit_fork(const PagedPart& parent, PagedPart& child) noexcept {
  child.first = parent.first;
  child.end = parent.end;
  child.runs.clear();
  for (const RunRef& ref : parent.runs) {
    const BlockRun::Holder h = ref.get();
    auto& hs = ref.run->holders;
    hs.push_back({&child, h.lo, h.hi});  // capacity reserved
    child.runs.push_back({ref.run, static_cast<std::uint32_t>(hs.size() - 1)});
  }
}

void PagedLayer::reserve(PagedPart& part, std::int64_t q) {
  auto& p = part.pending;
  p.q = q;
  p.fresh = nullptr;
  p.appended = 0;
  const std::int64_t bs = block_size();
  const std::int64_t E = part.end;
  BlockRun* last = part.runs.empty() ? nullptr : part.runs.back().run;
  const bool writable = last != nullptr && last->holders.size() == 1;
  if (writable) {  // a fork that ended may have left released blocks past our range
    while (!last->blocks.empty() && last->blocks.back() == nullptr) last->blocks.pop_back();
  }
  std::vector<std::byte*> acquired;
  try {
    p.saved_runs.reserve(part.runs.size() + 1);
    p.saved_ranges.reserve(part.runs.size() + 1);
    part.runs.reserve(part.runs.size() + 1);
    const std::int64_t first_position = writable ? last->first_position : E / bs * bs;
    const std::int64_t have = writable ? static_cast<std::int64_t>(last->blocks.size()) : 0;
    const std::int64_t want = (E + q - first_position + bs - 1) / bs;
    const std::int64_t more = std::max<std::int64_t>(0, want - have);
    pool_.check_room(more);
    acquired.reserve(static_cast<std::size_t>(more));
    for (std::int64_t i = 0; i < more; ++i) acquired.push_back(pool_.acquire());
    if (writable) {
      last->blocks.reserve(last->blocks.size() + acquired.size());
      last->blocks.insert(last->blocks.end(), acquired.begin(), acquired.end());
      p.appended = more;
      return;
    }
    auto run = std::make_unique<BlockRun>();
    run->first_position = first_position;
    run->holders.reserve(1);
    run->blocks = acquired;
    // Copy-on-write: the retained rows of a shared, partly filled last block.
    const std::int64_t copy_from = std::max(first_position, part.first);
    if (last != nullptr && copy_from < E) {
      const std::byte* src = last->blocks[static_cast<std::size_t>((first_position - last->first_position) / bs)];
      std::byte* dst = run->blocks.front();
      const std::int64_t row = copy_from - first_position;
      for (int k = 0; k < layout_.num_parts(); ++k) {
        const std::size_t row_bytes = static_cast<std::size_t>(layout_.row_elements(k)) * dtype_size(layout_.dtype);
        const std::size_t offset = layout_.part_offsets[static_cast<std::size_t>(k)] +
                                   static_cast<std::size_t>(row) * row_bytes;
        storage_move(pool_.storage(), dst + offset, src + offset, static_cast<std::size_t>(E - copy_from) * row_bytes);
      }
    }
    p.fresh = run.release();
  } catch (...) {
    for (std::byte* block : acquired) pool_.release(block);
    p.q = 0;
    p.fresh = nullptr;
    p.appended = 0;
    throw;
  }
}

void PagedLayer::unreserve(PagedPart& part) noexcept {
  auto& p = part.pending;
  if (p.fresh) {
    for (std::byte* block : p.fresh->blocks) pool_.release(block);
    delete p.fresh;
    p.fresh = nullptr;
  }
  if (p.appended > 0) {
    auto& blocks = part.runs.back().run->blocks;
    for (std::int64_t i = 0; i < p.appended; ++i) {
      pool_.release(blocks.back());
      blocks.pop_back();
    }
    p.appended = 0;
  }
  p.q = 0;
}

void PagedLayer::open(PagedPart& part) noexcept {
  auto& p = part.pending;
  p.saved_first = part.first;
  p.saved_end = part.end;
  p.saved_runs.assign(part.runs.begin(), part.runs.end());  // capacity reserved
  p.saved_ranges.clear();
  for (const RunRef& ref : part.runs) p.saved_ranges.emplace_back(ref.get().lo, ref.get().hi);
  const std::int64_t E = part.end;
  if (p.fresh) {
    if (!part.runs.empty()) {
      BlockRun::Holder& h = part.runs.back().get();
      h.hi = std::max(h.lo, std::min(h.hi, p.fresh->first_position));
    }
    p.fresh->holders.push_back({&part, std::max(p.fresh->first_position, part.first), E + p.q});
    part.runs.push_back({p.fresh, 0});
  } else {
    part.runs.back().get().hi = E + p.q;
  }
  part.end = E + p.q;
}

void PagedLayer::abandon(PagedPart& part) noexcept {
  auto& p = part.pending;
  for (std::size_t i = 0; i < p.saved_runs.size(); ++i) {
    BlockRun::Holder& h = p.saved_runs[i].get();
    h.lo = p.saved_ranges[i].first;
    h.hi = p.saved_ranges[i].second;
  }
  part.runs.assign(p.saved_runs.begin(), p.saved_runs.end());
  part.first = p.saved_first;
  part.end = p.saved_end;
  unreserve(part);
}

void PagedLayer::commit(PagedPart& part, std::int64_t R) noexcept {
  auto& p = part.pending;
  for (std::size_t i = 0; i < p.saved_runs.size(); ++i) {
    const BlockRun::Holder& h = p.saved_runs[i].get();
    if (h.lo != p.saved_ranges[i].first || h.hi != p.saved_ranges[i].second)
      settle_range(*p.saved_runs[i].run, p.saved_ranges[i].first, p.saved_ranges[i].second);
  }
  p.fresh = nullptr;
  p.appended = 0;
  p.q = 0;
  p.saved_runs.clear();
  shrink(part, rule_.keep_first(part.end, R), part.end);
}

void PagedLayer::write(const PagedPart& part, int part_index, const TensorView& input, int token_dim, std::int64_t row0,
                       std::int64_t pos, std::int64_t n) const {
  const BlockRun& run = *part.runs.back().run;
  const BlockSpan span{pos, n, run.blocks.data() + (pos - run.first_position) / block_size()};
  layout_.for_each_block_rows(std::span<const BlockSpan>(&span, 1), pos, n,
                              [&](const std::byte* block, std::int64_t row, std::int64_t count, std::int64_t at) {
                                copy_view(input.slice(token_dim, row0 + at, count),
                                          layout_.rows(block, part_index, row, count));
                              });
}

bool PagedLayer::overlaps(const PagedPart& part, std::int64_t pos, std::int64_t n, std::uintptr_t lo,
                          std::uintptr_t hi) const {
  if (n <= 0) return false;
  const BlockRun& run = *part.runs.back().run;
  const std::int64_t bs = block_size();
  const std::int64_t j0 = (pos - run.first_position) / bs;
  const std::int64_t j1 = (pos + n - 1 - run.first_position) / bs;
  for (std::int64_t j = j0; j <= j1; ++j) {
    const auto begin = reinterpret_cast<std::uintptr_t>(run.blocks[static_cast<std::size_t>(j)]);
    if (lo < begin + layout_.block_bytes && begin < hi) return true;
  }
  return false;
}

void PagedLayer::spans(const PagedPart& part, std::int64_t from, std::vector<BlockSpan>& out) const {
  const std::int64_t bs = block_size();
  for (const RunRef& ref : part.runs) {
    const BlockRun::Holder& h = ref.get();
    const std::int64_t a = std::max(h.lo, from);
    if (a >= h.hi) continue;
    out.push_back({a, h.hi - a, ref.run->blocks.data() + (a - ref.run->first_position) / bs});
  }
}

}  // namespace rwd::detail
