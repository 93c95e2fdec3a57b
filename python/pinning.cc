// Keeps cache memory alive while Python tensors view it, and counts it
// against memory budgets.
//
// rewind's layers move their buffers when they grow or shrink, and free them
// when a layer is destroyed. A Python tensor returned by the module points
// into those buffers, and Python code may keep it as long as it likes, so a
// plain view could read freed memory. The module is linked with
// `-Wl,--wrap=aligned_alloc -Wl,--wrap=free` (python/CMakeLists.txt): every
// aligned buffer of the library and the runtime linked into the module is
// recorded here, and a buffer that a returned tensor still views is not
// handed back to the system when the library frees it: it becomes a zombie,
// released when the last tensor viewing it goes. The library itself is not
// changed; only this module's link is.
//
// The same records carry budgets: an allocation made inside a BudgetScope
// counts against that budget and its parent, and is refused (null, as if the
// system had no memory) when it would pass a limit. The library treats a
// refused allocation as a CapacityError that changes nothing, so a budget
// here has the guarantees of rwd::Cache::set_memory_budget.
#include "pinning.h"

#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include "rewind/error.h"
#include "rewind/tensor.h"

extern "C" {
void* __real_aligned_alloc(std::size_t alignment, std::size_t size);
void __real_free(void* p);
void* __wrap_aligned_alloc(std::size_t alignment, std::size_t size);
void __wrap_free(void* p);
}

namespace rwd::python {

struct BudgetAccess {
  static std::size_t& reserved(Budget& b) { return b.reserved_; }
  static std::size_t reserved_of(const Budget& b) { return b.reserved_; }
  static std::size_t limit(const Budget& b) { return b.limit_; }
  static Budget* parent(const Budget& b) { return b.parent_.get(); }
  static std::shared_ptr<Budget>& parent_ref(Budget& b) { return b.parent_; }
  static void refuse(BudgetScope& s, std::size_t bytes, const Budget* by) {
    s.refused_ = true;
    s.refused_bytes_ = bytes;
    s.refused_by_ = by;
  }
  static const std::shared_ptr<Budget>& budget(const BudgetScope& s) { return s.budget_; }
  static BudgetScope*& outer(BudgetScope& s) { return s.outer_; }
};

namespace {

struct Block {
  std::size_t size = 0;
  std::int64_t pins = 0;
  bool freed = false;              // the library released it while pinned
  std::shared_ptr<Budget> budget;  // counted against, until the library frees it
  std::shared_ptr<Storage> owner;  // a device block's storage (frees it); null: host, __real_free
};

// Blocks by start address. Intentionally leaked: frees may arrive during
// static destruction, after a function-local static would be gone.
struct Registry {
  std::mutex mutex;
  std::map<std::uintptr_t, Block> blocks;
};

Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

thread_local BudgetScope* current_scope = nullptr;

void add(Budget* b, std::size_t bytes) {
  for (; b != nullptr; b = BudgetAccess::parent(*b)) BudgetAccess::reserved(*b) += bytes;
}
void subtract(Budget* b, std::size_t bytes) {
  for (; b != nullptr; b = BudgetAccess::parent(*b)) BudgetAccess::reserved(*b) -= bytes;
}

// The budget in `budget`'s chain that `size` more bytes would take past its
// limit, or null. REQUIRES: the registry lock.
const Budget* refusing_budget(const Budget* budget, std::size_t size) {
  for (const Budget* b = budget; b != nullptr; b = BudgetAccess::parent(*b)) {
    const std::size_t limit = BudgetAccess::limit(*b);
    if (limit != 0 && (size > limit || BudgetAccess::reserved_of(*b) > limit - size)) return b;
  }
  return nullptr;
}

// Frees a block no view pins any more: the device's storage or the system.
void release_block(void* p, std::size_t size, const std::shared_ptr<Storage>& owner) noexcept {
  if (owner)
    owner->deallocate(p, size);
  else
    __real_free(p);
}

// A device Storage whose blocks are in the registry (pinning_storage).
class PinningStorage final : public Storage {
 public:
  explicit PinningStorage(std::shared_ptr<Storage> inner) : inner_(std::move(inner)) {}

  Device device() const override { return inner_->device(); }
  void* allocate(std::size_t bytes) override {
    Registry& r = registry();
    BudgetScope* scope = current_scope;
    std::shared_ptr<Budget> budget = scope != nullptr ? BudgetAccess::budget(*scope) : nullptr;
    if (budget) {
      std::lock_guard lock(r.mutex);
      if (const Budget* by = refusing_budget(budget.get(), bytes)) {
        BudgetAccess::refuse(*scope, bytes, by);
        throw CapacityError("an allocation of " + std::to_string(bytes) + " bytes on " + inner_->device().describe() +
                            " passes a memory budget; nothing was allocated");
      }
    }
    void* p = inner_->allocate(bytes);  // throws CapacityError, allocating nothing
    std::lock_guard lock(r.mutex);
    add(budget.get(), bytes);
    r.blocks[reinterpret_cast<std::uintptr_t>(p)] = Block{bytes, 0, false, std::move(budget), inner_};
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept override {
    if (p == nullptr) return;
    Registry& r = registry();
    std::shared_ptr<Budget> released;  // destroyed outside the lock
    {
      std::lock_guard lock(r.mutex);
      auto it = r.blocks.find(reinterpret_cast<std::uintptr_t>(p));
      if (it != r.blocks.end()) {
        subtract(it->second.budget.get(), it->second.size);
        released = std::move(it->second.budget);
        if (it->second.pins > 0) {
          it->second.freed = true;  // released by unpin() when its last view goes
          return;
        }
        r.blocks.erase(it);
      }
    }
    inner_->deallocate(p, bytes);
  }
  void copy(void* dst, bool dst_on_device, const void* src, bool src_on_device, std::size_t bytes) noexcept override {
    inner_->copy(dst, dst_on_device, src, src_on_device, bytes);
  }
  void fill_zero(void* dst, std::size_t bytes) noexcept override { inner_->fill_zero(dst, bytes); }
  void copy_strided(const TensorView& src, const TensorView& dst) noexcept override { inner_->copy_strided(src, dst); }
  void synchronize() noexcept override { inner_->synchronize(); }

 private:
  std::shared_ptr<Storage> inner_;
};

}  // namespace

std::size_t Budget::limit() const {
  std::lock_guard lock(registry().mutex);
  return limit_;
}

std::size_t Budget::reserved() const {
  std::lock_guard lock(registry().mutex);
  return reserved_;
}

void Budget::set_limit(std::size_t bytes) {
  std::lock_guard lock(registry().mutex);
  if (bytes != 0 && reserved_ > bytes) {
    throw CapacityError("set_memory_budget(" + std::to_string(bytes) + "): the cache already reserves " +
                        std::to_string(reserved_) +
                        " bytes; free some first (crop(0), shrink_to_fit, reset) or set a larger budget");
  }
  limit_ = bytes;
}

void Budget::set_parent(const std::shared_ptr<Budget>& parent) {
  std::lock_guard lock(registry().mutex);
  subtract(parent_.get(), reserved_);
  parent_ = parent;
  add(parent_.get(), reserved_);
}

BudgetScope::BudgetScope(std::shared_ptr<Budget> budget) : budget_(std::move(budget)), outer_(current_scope) {
  current_scope = this;
}

BudgetScope::~BudgetScope() { current_scope = outer_; }

void* pin(const void* address) {
  if (address == nullptr) return nullptr;
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  const auto a = reinterpret_cast<std::uintptr_t>(address);
  auto it = r.blocks.upper_bound(a);
  if (it == r.blocks.begin()) return nullptr;
  --it;
  if (a >= it->first + it->second.size || it->second.freed) return nullptr;
  ++it->second.pins;
  return reinterpret_cast<void*>(it->first);
}

void unpin(void* block) noexcept {
  if (block == nullptr) return;
  Registry& r = registry();
  void* release = nullptr;
  std::size_t size = 0;
  std::shared_ptr<Storage> owner;
  {
    std::lock_guard lock(r.mutex);
    auto it = r.blocks.find(reinterpret_cast<std::uintptr_t>(block));
    if (it == r.blocks.end()) return;
    if (--it->second.pins == 0 && it->second.freed) {
      size = it->second.size;
      owner = std::move(it->second.owner);
      r.blocks.erase(it);
      release = block;
    }
  }
  if (release != nullptr) release_block(release, size, owner);
}

std::shared_ptr<Storage> pinning_storage(std::shared_ptr<Storage> inner) {
  return std::make_shared<PinningStorage>(std::move(inner));
}

PinStats pin_stats() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  PinStats s;
  for (const auto& [start, block] : r.blocks) {
    (void)start;
    if (block.pins > 0) ++s.pinned_blocks;
    if (block.freed) {
      ++s.zombie_blocks;
      s.zombie_bytes += block.size;
    }
  }
  return s;
}

}  // namespace rwd::python

extern "C" void* __wrap_aligned_alloc(std::size_t alignment, std::size_t size) {
  using rwd::python::BudgetAccess;
  auto& r = rwd::python::registry();
  rwd::python::BudgetScope* scope = rwd::python::current_scope;
  std::shared_ptr<rwd::python::Budget> budget = scope != nullptr ? BudgetAccess::budget(*scope) : nullptr;
  if (budget) {
    std::lock_guard lock(r.mutex);
    if (const rwd::python::Budget* by = rwd::python::refusing_budget(budget.get(), size)) {
      BudgetAccess::refuse(*scope, size, by);
      return nullptr;  // the library reports a CapacityError and changes nothing
    }
  }
  void* p = __real_aligned_alloc(alignment, size);
  if (p != nullptr) {
    std::lock_guard lock(r.mutex);
    rwd::python::add(budget.get(), size);
    r.blocks[reinterpret_cast<std::uintptr_t>(p)] = rwd::python::Block{size, 0, false, std::move(budget), nullptr};
  }
  return p;
}

extern "C" void __wrap_free(void* p) {
  if (p == nullptr) return;
  auto& r = rwd::python::registry();
  std::shared_ptr<rwd::python::Budget> released;  // destroyed outside the lock
  {
    std::lock_guard lock(r.mutex);
    auto it = r.blocks.find(reinterpret_cast<std::uintptr_t>(p));
    if (it != r.blocks.end()) {
      rwd::python::subtract(it->second.budget.get(), it->second.size);
      released = std::move(it->second.budget);
      if (it->second.pins > 0) {
        it->second.freed = true;  // released by unpin() when its last view goes
        return;
      }
      r.blocks.erase(it);
    }
  }
  __real_free(p);
}
