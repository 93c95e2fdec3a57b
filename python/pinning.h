// The module's view of rewind's buffers (see pinning.cc): pins that keep a
// buffer allocated while a Python tensor views it, and memory budgets
// counted where the buffers are allocated. Host buffers are the library's
// aligned allocations; device buffers are those of a pinning_storage.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "rewind/storage.h"

namespace rwd::python {

// Pins the block (host or device) that contains `address` and returns its start, to
// pass to unpin(); null when no live block contains it (then nothing is
// pinned). While pinned, a block the library frees stays allocated.
void* pin(const void* address);
// Drops one pin; frees the block when the library already released it and
// this was the last pin. Safe from any thread, without the GIL.
void unpin(void* block) noexcept;

struct PinStats {
  std::int64_t pinned_blocks = 0;  // blocks at least one tensor views
  std::int64_t zombie_blocks = 0;  // of those, blocks the library already freed
  std::size_t zombie_bytes = 0;
};
PinStats pin_stats();

// `inner` with every allocation recorded here as the library's host buffers
// are: counted against the current BudgetScope (a refusal throws
// CapacityError, nothing allocated), pinnable by pin(), and a deallocate of
// a pinned block deferred to its last unpin(), which calls inner's. For
// device storage, where the aligned_alloc wrap sees nothing. Never wrap the
// host storage: its buffers are recorded by the wrap already.
std::shared_ptr<rwd::Storage> pinning_storage(std::shared_ptr<rwd::Storage> inner);

// Bytes of aligned buffers allocated on behalf of a layer or a cache. A
// layer's budget has its cache's as parent: an allocation counts in both and
// is refused (the allocator returns null, which the library turns into a
// CapacityError that changes nothing) when it would take either past its
// limit (0: none). A buffer stops counting when the library frees it, even
// if a pinned view keeps it allocated a while longer.
class Budget {
 public:
  Budget() = default;
  std::size_t limit() const;
  std::size_t reserved() const;
  // Throws rwd::CapacityError, keeping the old limit, when more than
  // `bytes` (non-zero) are reserved already.
  void set_limit(std::size_t bytes);
  // Moves this budget's reserved bytes from its old parent to `parent`
  // (null: none). A parent's limit may be exceeded by the move itself.
  void set_parent(const std::shared_ptr<Budget>& parent);
  const std::shared_ptr<Budget>& parent() const { return parent_; }

 private:
  friend struct BudgetAccess;
  std::size_t limit_ = 0;
  std::size_t reserved_ = 0;
  std::shared_ptr<Budget> parent_;
};

// While alive, aligned allocations on this thread count against `budget`
// (may be null: nothing counted). Nests.
class BudgetScope {
 public:
  explicit BudgetScope(std::shared_ptr<Budget> budget);
  ~BudgetScope();
  BudgetScope(const BudgetScope&) = delete;
  BudgetScope& operator=(const BudgetScope&) = delete;
  // True when an allocation in this scope was refused by a budget; then
  // refused_bytes / refused_by say which.
  bool refused() const { return refused_; }
  std::size_t refused_bytes() const { return refused_bytes_; }
  const Budget* refused_by() const { return refused_by_; }

 private:
  friend struct BudgetAccess;
  std::shared_ptr<Budget> budget_;
  BudgetScope* outer_ = nullptr;
  bool refused_ = false;
  std::size_t refused_bytes_ = 0;
  const Budget* refused_by_ = nullptr;
};

}  // namespace rwd::python
