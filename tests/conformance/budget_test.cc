// Cache::set_memory_budget: an operation that would reserve more than the
// budget raises CapacityError before allocating, names the layer, and leaves
// the cache exactly as it was; freed memory is counted back.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "conformance/harness.h"

namespace rwt {
namespace {

std::vector<std::pair<LayerKind, LayerOptions>> budget_spec() {
  return {{LayerKind::FullAttention, small_options(LayerKind::FullAttention)},
          {LayerKind::Hybrid, small_options(LayerKind::Hybrid)},
          {LayerKind::SlidingAttention, small_options(LayerKind::SlidingAttention)}};
}

// Updates one token at a time until the budget refuses; checks the refusal
// and returns how many updates succeeded.
int fill_until_refused(Built& b, std::size_t budget, std::uint64_t& salt) {
  for (int n = 0; n < 10000; ++n) {
    std::string e = cache_step(b.cache, b.ref, 1, ++salt);
    EXPECT_LE(b.cache.memory().bytes_reserved, budget);
    if (e.empty()) {
      EXPECT_EQ(verify(b.cache, b.ref), "");
      continue;
    }
    // The step was refused part-way through the layers: the layers before the
    // refusing one took the token, the refusing one did not change.
    EXPECT_NE(e.find("memory budget exceeded"), std::string::npos) << e;
    EXPECT_NE(e.find("nothing was changed"), std::string::npos) << e;
    return n;
  }
  ADD_FAILURE() << "the budget never refused";
  return -1;
}

TEST(MemoryBudget, RefusesBeforeAllocatingAndNamesTheLayer) {
  Built b = build_cache(budget_spec());
  const std::size_t budget = 12 * 1024;
  b.cache.set_memory_budget(budget);
  EXPECT_EQ(b.cache.memory_budget(), budget);
  // Fill the full-attention layer directly until its growth is refused.
  RefLayer& ref0 = b.ref.layers[0];
  std::uint64_t salt = 0;
  for (int n = 0;; ++n) {
    ASSERT_LT(n, 10000) << "the budget never refused";
    const StepData st = ref0.make_step(3, ++salt);
    const HostTensor k = ref0.kv_input(st, true, false), v = ref0.kv_input(st, false, false);
    const Observed before = observe(b.cache);
    try {
      (void)b.cache.update(k.view(), v.view(), 0);
      ref0.apply_update(st);
    } catch (const rwd::CapacityError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("layer 0 (full_attention)"), std::string::npos) << m;
      EXPECT_NE(m.find("memory budget exceeded"), std::string::npos) << m;
      EXPECT_NE(m.find(std::to_string(budget)), std::string::npos) << m;
      EXPECT_EQ(diff(before, observe(b.cache)), "") << "a refused update changed the cache";
      break;
    }
    ASSERT_LE(b.cache.memory().bytes_reserved, budget);
    ASSERT_EQ(verify(b.cache, b.ref), "");
  }
  EXPECT_EQ(verify(b.cache, b.ref), "");
}

TEST(MemoryBudget, RecordingAndBatchOperationsAreRefusedWhole) {
  Built b = build_cache(budget_spec());
  std::uint64_t salt = 0;
  ASSERT_EQ(cache_step(b.cache, b.ref, 4, ++salt), "");
  const std::size_t reserved = b.cache.memory().bytes_reserved;
  b.cache.set_memory_budget(reserved + 256);
  const Observed before = observe(b.cache);
  // 1000 recurrent snapshots do not fit.
  EXPECT_THROW(b.cache.activate_past_recording(1000), rwd::CapacityError);
  EXPECT_FALSE(b.cache.is_recording());
  EXPECT_EQ(diff(before, observe(b.cache)), "");
  // Repeating the batch 4 times needs about 4x the memory.
  EXPECT_THROW(b.cache.batch_repeat_interleave(4), rwd::CapacityError);
  EXPECT_EQ(b.cache.layer(0).batch_size(), 2);
  EXPECT_EQ(diff(before, observe(b.cache)), "");
  EXPECT_EQ(verify(b.cache, b.ref), "");
  // A small R fits and works.
  b.cache.set_memory_budget(0);
  b.cache.activate_past_recording(2);
  b.ref.activate(2);
  EXPECT_EQ(verify(b.cache, b.ref), "");
}

TEST(MemoryBudget, FreedMemoryIsCountedBack) {
  Built b = build_cache(budget_spec());
  const std::size_t budget = 16 * 1024;
  b.cache.set_memory_budget(budget);
  std::uint64_t salt = 0;
  const int first = fill_until_refused(b, budget, salt);
  ASSERT_GT(first, 0);
  // reset() releases everything but the fixed parts; the same number of
  // updates fits again, and again after moving the cache around.
  b.cache.reset();
  b.ref.reset();
  EXPECT_LT(b.cache.memory().bytes_reserved, budget / 4);
  Cache moved(std::move(b.cache));
  b.cache = std::move(moved);
  for (int rounds = 0; rounds < 2; ++rounds) {
    const int again = fill_until_refused(b, budget, salt);
    EXPECT_EQ(again, first);
    b.cache.reset();
    b.ref.reset();
  }
}

// reset() counts only the new layers against the budget: a cache whose cap
// equals what it reserves (no byte of headroom for the fixed parts a new
// cache allocates) resets, to what a new cache reserves, and keeps its cap.
TEST(MemoryBudget, ResetWorksAtTheCap) {
  Built b = build_cache(budget_spec());
  const std::size_t fresh = b.cache.memory().bytes_reserved;
  ASSERT_GT(fresh, 0u);
  std::uint64_t salt = 0;
  ASSERT_EQ(cache_step(b.cache, b.ref, 30, ++salt), "");
  const std::size_t full = b.cache.memory().bytes_reserved;
  ASSERT_GT(full, fresh);
  b.cache.set_memory_budget(full);
  // Refused part-way through the layers (a step without begin_forward): the
  // earlier layers took the tokens, and reset() is the way back.
  EXPECT_NE(cache_step(b.cache, b.ref, 64, ++salt).find("memory budget exceeded"), std::string::npos);
  b.cache.reset();
  b.ref.reset();
  EXPECT_EQ(b.cache.memory().bytes_reserved, fresh);
  EXPECT_EQ(b.cache.memory_budget(), full);
  EXPECT_EQ(verify(b.cache, b.ref), "");
  // The cap still holds afterwards: the same 30 tokens fit, 64 more do not.
  ASSERT_EQ(cache_step(b.cache, b.ref, 30, ++salt), "");
  EXPECT_EQ(verify(b.cache, b.ref), "");
  EXPECT_NE(cache_step(b.cache, b.ref, 64, ++salt).find("memory budget exceeded"), std::string::npos);
  EXPECT_LE(b.cache.memory().bytes_reserved, full);
}

TEST(MemoryBudget, CannotBeSetBelowWhatIsReserved) {
  Built b = build_cache(budget_spec());
  std::uint64_t salt = 0;
  ASSERT_EQ(cache_step(b.cache, b.ref, 20, ++salt), "");
  const std::size_t reserved = b.cache.memory().bytes_reserved;
  b.cache.set_memory_budget(reserved * 2);
  try {
    b.cache.set_memory_budget(reserved / 2);
    ADD_FAILURE() << "no error";
  } catch (const rwd::CapacityError& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(reserved)), std::string::npos) << e.what();
  }
  EXPECT_EQ(b.cache.memory_budget(), reserved * 2);
  b.cache.set_memory_budget(0);  // no cap
  ASSERT_EQ(cache_step(b.cache, b.ref, 200, ++salt), "");
  EXPECT_EQ(verify(b.cache, b.ref), "");
}

}  // namespace
}  // namespace rwt
