// The in-process LRU store.

#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "rewind/store.h"
#include "store/store_test_util.h"

namespace rwd {
namespace {

using store_test::bytes_of;
using store_test::expect_round_trip;
using store_test::filled;

TEST(MemoryStore, RoundTripsBinaryValuesAndReportsMissingKeys) {
  auto store = make_memory_store(0);
  const std::string text("a\0b\xff\x00z", 6);
  expect_round_trip(*store, text);
  EXPECT_EQ(store->get("empty"), std::vector<std::byte>{});
  EXPECT_EQ(store->bytes_used(), 6u);
  // Replacing a value replaces its bytes.
  EXPECT_TRUE(store->put("k", filled(10, 7)));
  EXPECT_EQ(store->get("k"), filled(10, 7));
  EXPECT_EQ(store->bytes_used(), 10u);
  EXPECT_EQ(store->describe(), "memory store (no cap)");
  EXPECT_EQ(make_memory_store(64u << 20)->describe(), "memory store (cap 64 MiB)");
  EXPECT_EQ(make_memory_store(100)->describe(), "memory store (cap 100 bytes)");
}

// Cap 100. Worked by hand:
//   put a(40) b(30) c(20)          90 bytes, LRU order a b c
//   get a                          order b c a
//   put d(25)   115 > 100: evict b  85 bytes, order c a d
//   contains c  (does not count as a use)
//   put e(50)   135: evict c -> 115, evict a -> 75, order d e
TEST(MemoryStore, EvictsLeastRecentlyUsedPastTheCap) {
  auto store = make_memory_store(100);
  ASSERT_TRUE(store->put("a", filled(40, 'a')));
  ASSERT_TRUE(store->put("b", filled(30, 'b')));
  ASSERT_TRUE(store->put("c", filled(20, 'c')));
  EXPECT_EQ(store->bytes_used(), 90u);
  ASSERT_TRUE(store->get("a").has_value());
  ASSERT_TRUE(store->put("d", filled(25, 'd')));
  EXPECT_EQ(store->bytes_used(), 85u);
  EXPECT_FALSE(store->contains("b"));
  EXPECT_TRUE(store->contains("a"));
  EXPECT_TRUE(store->contains("c"));
  EXPECT_TRUE(store->contains("d"));
  ASSERT_TRUE(store->put("e", filled(50, 'e')));
  EXPECT_EQ(store->bytes_used(), 75u);
  EXPECT_FALSE(store->contains("c"));
  EXPECT_FALSE(store->contains("a"));
  EXPECT_EQ(store->get("d"), filled(25, 'd'));
  EXPECT_EQ(store->get("e"), filled(50, 'e'));
}

// Cap 100: put x(30) y(30) z(30) = 90; replacing x with 60 bytes makes x
// the most recent and 120 bytes; y (now the oldest) goes: 90.
TEST(MemoryStore, ReplacingAValueRefreshesItAndCountsItsNewSize) {
  auto store = make_memory_store(100);
  ASSERT_TRUE(store->put("x", filled(30, 1)));
  ASSERT_TRUE(store->put("y", filled(30, 2)));
  ASSERT_TRUE(store->put("z", filled(30, 3)));
  ASSERT_TRUE(store->put("x", filled(60, 4)));
  EXPECT_EQ(store->bytes_used(), 90u);
  EXPECT_FALSE(store->contains("y"));
  EXPECT_EQ(store->get("x"), filled(60, 4));
  EXPECT_EQ(store->get("z"), filled(30, 3));
}

TEST(MemoryStore, RefusesAValueLargerThanTheCapAndChangesNothing) {
  auto store = make_memory_store(100);
  ASSERT_TRUE(store->put("a", filled(60, 'a')));
  ASSERT_TRUE(store->put("b", filled(40, 'b')));
  EXPECT_FALSE(store->put("big", filled(101, 'x')));
  EXPECT_FALSE(store->contains("big"));
  EXPECT_EQ(store->bytes_used(), 100u);
  // A refused replacement keeps the old value.
  EXPECT_FALSE(store->put("a", filled(101, 'x')));
  EXPECT_EQ(store->get("a"), filled(60, 'a'));
  // Exactly the cap fits, alone.
  EXPECT_TRUE(store->put("full", filled(100, 'f')));
  EXPECT_EQ(store->bytes_used(), 100u);
  EXPECT_FALSE(store->contains("a"));
  EXPECT_FALSE(store->contains("b"));
  EXPECT_EQ(store->get("full"), filled(100, 'f'));
}

TEST(MemoryStore, WithoutCapKeepsEverything) {
  auto store = make_memory_store(0);
  for (int i = 0; i < 100; ++i) ASSERT_TRUE(store->put("k" + std::to_string(i), filled(1000, 1)));
  EXPECT_EQ(store->bytes_used(), 100000u);
  for (int i = 0; i < 100; ++i) EXPECT_TRUE(store->contains("k" + std::to_string(i)));
}

// Four threads put and get seeded values under a cap; every value read is
// whole, and at the end bytes_used is the sum of what is held and within
// the cap.
TEST(MemoryStore, ThreadsShareOneStore) {
  constexpr std::size_t kCap = 200000;
  auto store = make_memory_store(kCap);
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::uint64_t state = static_cast<std::uint64_t>(t) + 1;
      for (int i = 0; i < 2000; ++i) {
        state = store_test::splitmix64(state);
        const std::string key = "k" + std::to_string(state % 16);
        if (state % 3 == 0) {
          store->put(key, store_test::seeded_value(state, 16 + state % 30000));
        } else if (auto v = store->get(key)) {
          if (!store_test::check_seeded_value(*v).empty()) ++bad;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  std::size_t held = 0;
  for (int k = 0; k < 16; ++k) {
    if (auto v = store->get("k" + std::to_string(k))) held += v->size();
  }
  EXPECT_EQ(store->bytes_used(), held);
  EXPECT_LE(held, kCap);
}

}  // namespace
}  // namespace rwd
