// The Python module's buffer registry (python/pinning.cc), linked as the
// module links it (-Wl,--wrap=aligned_alloc,--wrap=free): pins that keep a
// freed block allocated until the last view goes, budgets counted where
// blocks are allocated, and pinning_storage forwarding to its inner storage.
#include "pinning.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "rewind/error.h"
#include "rewind/storage.h"
#include "rewind/tensor.h"

namespace {

using rwd::python::Budget;
using rwd::python::BudgetScope;
using rwd::python::pin;
using rwd::python::pin_stats;
using rwd::python::pinning_storage;
using rwd::python::unpin;

// Another storage, counting what reaches it.
class CountingStorage final : public rwd::Storage {
 public:
  explicit CountingStorage(std::shared_ptr<rwd::Storage> inner) : inner_(std::move(inner)) {}
  rwd::Device device() const override { return inner_->device(); }
  void* allocate(std::size_t bytes) override {
    void* p = inner_->allocate(bytes);
    std::lock_guard lock(mutex_);
    ++allocations;
    live[p] = bytes;
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept override {
    {
      std::lock_guard lock(mutex_);
      ++deallocations;
      freed.emplace_back(p, bytes);
      live.erase(p);
    }
    inner_->deallocate(p, bytes);
  }
  void copy(void* dst, bool dst_on_device, const void* src, bool src_on_device, std::size_t bytes) noexcept override {
    ++copies;
    inner_->copy(dst, dst_on_device, src, src_on_device, bytes);
  }
  void fill_zero(void* dst, std::size_t bytes) noexcept override {
    ++fills;
    inner_->fill_zero(dst, bytes);
  }
  void copy_strided(const rwd::TensorView& src, const rwd::TensorView& dst) noexcept override {
    ++strided_copies;
    inner_->copy_strided(src, dst);
  }
  void synchronize() noexcept override { ++synchronizes; }

  int allocations = 0, deallocations = 0, copies = 0, fills = 0, strided_copies = 0, synchronizes = 0;
  std::map<void*, std::size_t> live;
  std::vector<std::pair<void*, std::size_t>> freed;

 private:
  std::shared_ptr<rwd::Storage> inner_;
  std::mutex mutex_;
};

struct Fixture : ::testing::Test {
  void SetUp() override { baseline = pin_stats(); }
  void TearDown() override {
    const auto now = pin_stats();
    EXPECT_EQ(now.pinned_blocks, baseline.pinned_blocks);
    EXPECT_EQ(now.zombie_blocks, baseline.zombie_blocks);
    EXPECT_EQ(now.zombie_bytes, baseline.zombie_bytes);
  }
  // Device-like memory (mmap pages): pinning_storage never wraps the host
  // storage, whose buffers the aligned_alloc wrap records already.
  std::shared_ptr<CountingStorage> counting = std::make_shared<CountingStorage>(rwd::guarded_storage());
  std::shared_ptr<rwd::Storage> storage = pinning_storage(counting);
  rwd::python::PinStats baseline;
};

using PinningStorage = Fixture;

TEST_F(PinningStorage, AFreeOfAPinnedBlockWaitsForItsLastUnpin) {
  auto* p = static_cast<char*>(storage->allocate(256));
  ASSERT_EQ(counting->allocations, 1);
  void* a = pin(p + 100);  // any address inside pins the whole block
  void* b = pin(p);
  EXPECT_EQ(a, p);
  EXPECT_EQ(b, p);
  storage->deallocate(p, 256);
  EXPECT_EQ(counting->deallocations, 0);
  EXPECT_EQ(pin_stats().zombie_blocks, baseline.zombie_blocks + 1);
  EXPECT_EQ(pin_stats().zombie_bytes, baseline.zombie_bytes + 256);
  EXPECT_EQ(pin(p), nullptr);  // a freed block takes no new pins
  unpin(a);
  EXPECT_EQ(counting->deallocations, 0);
  unpin(b);
  ASSERT_EQ(counting->deallocations, 1);
  EXPECT_EQ(counting->freed[0], std::make_pair(static_cast<void*>(p), std::size_t{256}));
}

TEST_F(PinningStorage, AnUnpinnedBlockIsFreedAtOnce) {
  void* p = storage->allocate(64);
  void* pinned = pin(p);
  unpin(pinned);
  storage->deallocate(p, 64);
  EXPECT_EQ(counting->deallocations, 1);
  EXPECT_EQ(pin(p), nullptr);
}

TEST_F(PinningStorage, AddressesOutsideEveryBlockPinNothing) {
  auto* p = static_cast<char*>(storage->allocate(128));
  EXPECT_EQ(pin(p + 128), nullptr);  // one past the end
  EXPECT_EQ(pin(nullptr), nullptr);
  int on_stack = 0;
  EXPECT_EQ(pin(&on_stack), nullptr);
  unpin(nullptr);
  unpin(&on_stack);  // not a block: ignored
  EXPECT_EQ(pin_stats().pinned_blocks, baseline.pinned_blocks);
  storage->deallocate(p, 128);
  EXPECT_EQ(counting->deallocations, 1);
}

TEST_F(PinningStorage, TheLastUnpinMayComeFromAnotherThread) {
  void* p = storage->allocate(4096);
  void* pinned = pin(p);
  storage->deallocate(p, 4096);
  std::thread([pinned] { unpin(pinned); }).join();
  EXPECT_EQ(counting->deallocations, 1);
}

TEST_F(PinningStorage, BudgetsCountWhereBlocksAreAllocatedAndRefuseWithNothingAllocated) {
  auto parent = std::make_shared<Budget>();
  parent->set_limit(1000);
  auto child = std::make_shared<Budget>();
  child->set_parent(parent);
  child->set_limit(600);
  auto sibling = std::make_shared<Budget>();
  sibling->set_parent(parent);
  void* first = nullptr;
  {
    BudgetScope scope(child);
    first = storage->allocate(500);
    EXPECT_EQ(child->reserved(), 500u);
    EXPECT_EQ(parent->reserved(), 500u);
    EXPECT_THROW(storage->allocate(200), rwd::CapacityError);  // 700 > the child's 600
    EXPECT_TRUE(scope.refused());
    EXPECT_EQ(scope.refused_bytes(), 200u);
    EXPECT_EQ(scope.refused_by(), child.get());
    EXPECT_EQ(counting->allocations, 1);
    EXPECT_EQ(child->reserved(), 500u);
  }
  void* second = nullptr;
  {
    BudgetScope scope(sibling);
    second = storage->allocate(400);
    EXPECT_EQ(parent->reserved(), 900u);
    EXPECT_THROW(storage->allocate(200), rwd::CapacityError);  // 1100 > the parent's 1000
    EXPECT_EQ(scope.refused_by(), parent.get());
    EXPECT_EQ(counting->allocations, 2);
  }
  // A block stops counting when it is freed, even while a view pins it.
  void* pinned = pin(first);
  storage->deallocate(first, 500);
  EXPECT_EQ(child->reserved(), 0u);
  EXPECT_EQ(parent->reserved(), 400u);
  EXPECT_EQ(counting->deallocations, 0);
  unpin(pinned);
  EXPECT_EQ(counting->deallocations, 1);
  // Outside any scope nothing is counted.
  void* uncounted = storage->allocate(5000);
  EXPECT_EQ(parent->reserved(), 400u);
  storage->deallocate(uncounted, 5000);
  storage->deallocate(second, 400);
  EXPECT_EQ(parent->reserved(), 0u);
}

TEST_F(PinningStorage, ALimitBelowWhatIsReservedIsRefusedAndTheOldOneKept) {
  auto budget = std::make_shared<Budget>();
  budget->set_limit(300);
  void* p = nullptr;
  {
    BudgetScope scope(budget);
    p = storage->allocate(200);
  }
  EXPECT_THROW(budget->set_limit(100), rwd::CapacityError);
  EXPECT_EQ(budget->limit(), 300u);
  budget->set_limit(0);  // 0: no limit
  EXPECT_EQ(budget->limit(), 0u);
  storage->deallocate(p, 200);
}

TEST_F(PinningStorage, MovingABudgetToAnotherParentMovesItsReservedBytes) {
  auto a = std::make_shared<Budget>();
  auto b = std::make_shared<Budget>();
  auto child = std::make_shared<Budget>();
  child->set_parent(a);
  void* p = nullptr;
  {
    BudgetScope scope(child);
    p = storage->allocate(700);
  }
  EXPECT_EQ(a->reserved(), 700u);
  child->set_parent(b);
  EXPECT_EQ(a->reserved(), 0u);
  EXPECT_EQ(b->reserved(), 700u);
  storage->deallocate(p, 700);
  EXPECT_EQ(b->reserved(), 0u);
}

TEST_F(PinningStorage, CopiesGoToTheInnerStorage) {
  CountingStorage* guarded = counting.get();
  rwd::Storage* s = storage.get();
  EXPECT_EQ(s->device().type, rwd::DeviceType::Guarded);
  void* d = s->allocate(64);
  const std::vector<unsigned char> in = [] {
    std::vector<unsigned char> v(64);
    for (int i = 0; i < 64; ++i) v[static_cast<std::size_t>(i)] = static_cast<unsigned char>(3 * i + 1);
    return v;
  }();
  std::vector<unsigned char> out(64, 0xAB);
  s->copy(d, true, in.data(), false, 64);
  s->copy(out.data(), false, d, true, 64);
  EXPECT_EQ(out, in);
  s->fill_zero(d, 32);
  s->copy(out.data(), false, d, true, 64);
  for (int i = 0; i < 64; ++i)
    EXPECT_EQ(out[static_cast<std::size_t>(i)], i < 32 ? 0 : in[static_cast<std::size_t>(i)]);
  s->synchronize();
  EXPECT_EQ(guarded->copies, 3);
  EXPECT_EQ(guarded->fills, 1);
  EXPECT_EQ(guarded->synchronizes, 1);
  s->deallocate(d, 64);
  EXPECT_EQ(guarded->deallocations, 1);
}

using HostBuffers = Fixture;

// The library's host buffers come from aligned_alloc, which this link
// routes through the registry: the same pins and budgets.
TEST_F(HostBuffers, AlignedAllocationsArePinnableAndCounted) {
  void* h = std::aligned_alloc(64, 256);
  ASSERT_NE(h, nullptr);
  void* pinned = pin(static_cast<char*>(h) + 255);
  EXPECT_EQ(pinned, h);
  std::free(h);
  EXPECT_EQ(pin_stats().zombie_bytes, baseline.zombie_bytes + 256);
  unpin(pinned);
  EXPECT_EQ(pin_stats().zombie_bytes, baseline.zombie_bytes);

  auto budget = std::make_shared<Budget>();
  budget->set_limit(128);
  BudgetScope scope(budget);
  EXPECT_EQ(std::aligned_alloc(64, 256), nullptr);  // refused: the library turns this into a CapacityError
  EXPECT_TRUE(scope.refused());
  void* fits = std::aligned_alloc(64, 128);
  ASSERT_NE(fits, nullptr);
  EXPECT_EQ(budget->reserved(), 128u);
  std::free(fits);
  EXPECT_EQ(budget->reserved(), 0u);
}

}  // namespace
