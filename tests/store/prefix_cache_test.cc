// PrefixCache (rewind/prefix_cache.h) over real caches of every layer kind:
// entries written during a chunked prefill, joined back into a restorable
// state that equals the naive reference's at the boundary, and every way an
// entry can be missing, damaged or foreign turning into a shorter hit or a
// miss, never a wrong state.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <thread>

#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "conformance/harness.h"
#include "rewind/prefix_cache.h"
#include "store/store_test_util.h"
#if defined(REWIND_HAVE_REDIS)
#include "rewind/redis_store.h"
#include "store/redis_server.h"
#endif

namespace rwt {
namespace {

using rwd::BlobStore;
using rwd::PrefixCache;
using rwd::PrefixCacheOptions;
using rwd::PrefixHit;

Built every_kind(DType dt = DType::F32) {
  std::vector<std::pair<LayerKind, LayerOptions>> spec;
  for (LayerKind k : kEveryLayerKind) spec.push_back({k, small_options(k, dt, false, 1)});
  return build_cache(spec);
}

PrefixCacheOptions opts(std::int64_t interval, std::string fingerprint = "model-a") {
  PrefixCacheOptions o;
  o.interval = interval;
  o.model_fingerprint = std::move(fingerprint);
  return o;
}

std::vector<std::int32_t> tokens_of(std::int64_t n, std::int32_t salt = 0) {
  std::vector<std::int32_t> t;
  for (std::int64_t i = 0; i < n; ++i) t.push_back(static_cast<std::int32_t>((i * 7 + salt) % 251));
  return t;
}

// Fake logits of the last position: a function of the boundary, checked on a hit.
std::vector<float> logits_at(std::int64_t b) { return {static_cast<float>(b), 1.5f, -2.0f}; }

// Feeds `tokens` (their data comes from the step salts) into a fresh cache in
// chunks ending at the prefix cache's boundaries, storing an entry at each;
// returns the reference after each boundary.
std::map<std::int64_t, RefCache> prefill(PrefixCache& pc, std::span<const std::int32_t> tokens, std::int64_t from,
                                         Built& b) {
  std::map<std::int64_t, RefCache> refs;
  std::int64_t a = from;
  for (std::int64_t e : pc.boundaries(from, static_cast<std::int64_t>(tokens.size()))) {
    EXPECT_EQ(cache_step(b.cache, b.ref, e - a, 1000 + static_cast<std::uint64_t>(e)), "");
    const std::vector<float> l = logits_at(e);
    EXPECT_TRUE(pc.store(tokens.first(static_cast<std::size_t>(e)), a, b.cache.snapshot(a), l));
    refs.emplace(e, b.ref);
    a = e;
  }
  return refs;
}

// Restores `hit` into a fresh cache and compares it with `ref` without history.
std::string check_hit(const PrefixHit& hit, const RefCache& ref, DType dt = DType::F32) {
  Built fresh = every_kind(dt);
  try {
    fresh.cache.restore(hit.state);
  } catch (const rwd::Error& e) {
    return std::string("restore of the hit failed: ") + e.what();
  }
  RefCache want = ref;
  want.deactivate();
  if (std::string e = verify(fresh.cache, want); !e.empty()) return e;
  const std::vector<float> l = logits_at(hit.length);
  if (hit.state.logits.numel() != 3 || hit.state.logits.data<float>()[0] != l[0]) return "the hit's logits differ";
  return "";
}

TEST(PrefixCache, BoundariesAndKeys) {
  PrefixCache pc(rwd::make_memory_store(0), opts(4));
  EXPECT_EQ(pc.boundaries(0, 10), (std::vector<std::int64_t>{4, 8, 10}));
  EXPECT_EQ(pc.boundaries(5, 10), (std::vector<std::int64_t>{8, 10}));
  EXPECT_EQ(pc.boundaries(0, 8), (std::vector<std::int64_t>{4, 8}));
  EXPECT_EQ(pc.boundaries(8, 8), (std::vector<std::int64_t>{}));
  const auto t = tokens_of(10);
  const std::string k = pc.key(t);
  EXPECT_NO_THROW(rwd::check_store_key(k));
  EXPECT_EQ(k, pc.key(t));
  auto u = t;
  u[3] ^= 1;
  EXPECT_NE(pc.key(u), k);
  EXPECT_NE(pc.key(std::span(t).first(9)), k);
  PrefixCache other(rwd::make_memory_store(0), opts(4, "model-b"));
  EXPECT_NE(other.key(t), k);
  EXPECT_THROW(PrefixCache(nullptr, opts(4)), rwd::InvalidArgument);
  EXPECT_THROW(PrefixCache(rwd::make_memory_store(0), opts(0)), rwd::InvalidArgument);
  EXPECT_THROW(PrefixCache(rwd::make_memory_store(0), opts(4, "")), rwd::InvalidArgument);
  EXPECT_THROW(pc.store(t, 10, rwd::Snapshot{}, {}), rwd::InvalidArgument);
}

TEST(PrefixCache, RepeatedAndSharedPrefixesRestoreTheReferenceState) {
  auto store = std::shared_ptr<BlobStore>(rwd::make_memory_store(0));
  PrefixCache writer(store, opts(4));
  const auto t = tokens_of(10);
  Built b = every_kind();
  const auto refs = prefill(writer, t, 0, b);
  EXPECT_EQ(writer.stats().entries_written, 3);

  PrefixCache reader(store, opts(4));  // another user of the same store
  const PrefixHit full = reader.lookup(t);
  ASSERT_EQ(full.length, 10);
  EXPECT_EQ(check_hit(full, refs.at(10)), "");
  // A prompt sharing the first 9 tokens: the longest boundary below is 8.
  auto u = t;
  u[9] = 250;
  const PrefixHit part = reader.lookup(u);
  ASSERT_EQ(part.length, 8);
  EXPECT_EQ(check_hit(part, refs.at(8)), "");
  // Diverging at token 2: nothing.
  u[2] = 249;
  EXPECT_EQ(reader.lookup(u).length, 0);
  // A longer prompt continues from the hit: entries 12 and 13 chain to 10's.
  auto longer = t;
  longer.push_back(3);
  longer.push_back(4);
  longer.push_back(5);
  const auto more = prefill(reader, longer, 10, b);
  const PrefixHit l = PrefixCache(store, opts(4)).lookup(longer);
  ASSERT_EQ(l.length, 13);
  EXPECT_EQ(check_hit(l, more.at(13)), "");
}

TEST(PrefixCache, DamagedMissingOrForeignEntriesAreMissesNotWrongStates) {
  const auto t = tokens_of(12);
  auto fresh_store = [&](std::map<std::int64_t, RefCache>* refs = nullptr) {
    auto store = std::shared_ptr<BlobStore>(rwd::make_memory_store(0));
    PrefixCache writer(store, opts(4));
    Built b = every_kind(DType::BF16);
    auto r = prefill(writer, t, 0, b);
    if (refs) *refs = r;
    return store;
  };
  std::map<std::int64_t, RefCache> refs;
  auto store = fresh_store(&refs);
  PrefixCache pc(store, opts(4));
  const std::string k12 = pc.key(t), k8 = pc.key(std::span(t).first(8)), k4 = pc.key(std::span(t).first(4));
  // A flipped byte in the last entry: the hit falls back to 8.
  {
    auto bytes = *store->get(k12);
    bytes[bytes.size() / 2] ^= std::byte{0x10};
    store->put(k12, bytes);
    PrefixCache r(store, opts(4));
    EXPECT_EQ(r.lookup(t).length, 8);
    EXPECT_GE(r.stats().entries_rejected, 1);
  }
  // A truncated middle entry breaks every chain through it: a miss.
  {
    auto bytes = *store->get(k4);
    bytes.resize(bytes.size() - 7);
    store->put(k4, bytes);
    EXPECT_EQ(PrefixCache(store, opts(4)).lookup(t).length, 0);
  }
  // An entry of another model stored under this model's key: refused (the
  // chains through it break; the hit falls back to 4).
  {
    auto s2 = fresh_store();
    std::string fingerprint;
    rwd::Snapshot entry = rwd::deserialize_snapshot(*s2->get(k8), &fingerprint);
    EXPECT_EQ(fingerprint, "model-a");
    s2->put(k8, rwd::serialize_snapshot(entry, "model-b"));
    PrefixCache r(s2, opts(4));
    const PrefixHit h = r.lookup(t);
    EXPECT_EQ(h.length, 4);
    EXPECT_EQ(check_hit(h, refs.at(4), DType::BF16), "");
    EXPECT_GE(r.stats().entries_rejected, 1);
  }
  // A missing middle entry: the same.
  {
    auto s2 = fresh_store();
    auto s3 = std::shared_ptr<BlobStore>(rwd::make_memory_store(0));
    s3->put(k4, *s2->get(k4));
    s3->put(k12, *s2->get(k12));
    EXPECT_EQ(PrefixCache(s3, opts(4)).lookup(t).length, 4);
  }
  // An entry of other tokens under this key (a collision, or a forged
  // entry): its tokens do not match the prompt, refused.
  {
    auto s2 = fresh_store();
    auto u = t;
    u[5] = 200;
    auto s4 = std::shared_ptr<BlobStore>(rwd::make_memory_store(0));
    PrefixCache w(s4, opts(4));
    Built b = every_kind(DType::BF16);
    prefill(w, u, 0, b);
    s2->put(k8, *s4->get(w.key(std::span(u).first(8))));
    EXPECT_EQ(PrefixCache(s2, opts(4)).lookup(t).length, 4);
  }
}

// A store that always fails, as a stopped server does.
class DeadStore : public BlobStore {
 public:
  std::optional<std::vector<std::byte>> get(const std::string&) override {
    throw rwd::StoreError("connection refused");
  }
  bool put(const std::string&, std::span<const std::byte>) override { throw rwd::StoreError("connection refused"); }
  bool contains(const std::string&) override { throw rwd::StoreError("connection refused"); }
  std::size_t bytes_used() override { return 0; }
  std::string describe() const override { return "dead store"; }
};

TEST(PrefixCache, AFailingStoreIsAMissWithOneWarning) {
  WarningCapture warnings;
  PrefixCache pc(std::make_shared<DeadStore>(), opts(4));
  const auto t = tokens_of(9);
  EXPECT_EQ(pc.lookup(t).length, 0);
  Built b = every_kind();
  ASSERT_EQ(cache_step(b.cache, b.ref, 4, 1), "");
  EXPECT_FALSE(pc.store(std::span(t).first(4), 0, b.cache.snapshot(0), {}));
  EXPECT_EQ(pc.lookup(t).length, 0);
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_EQ(warnings.messages[0].rfind("rewind: warning: prefix cache: dead store: connection refused; skipping", 0),
            0u)
      << warnings.messages[0];
  EXPECT_GE(pc.stats().store_errors, 1);
}

// A store that throws `E` from every get: what a store throws about an entry
// (a value it will not hand out, one too big to copy, an argument a caller's
// store refuses) is a rejected entry, not a failing store: no back-off, no
// warning, and the store is asked again by the next lookup.
template <typename E>
class ThrowingStore : public BlobStore {
 public:
  std::optional<std::vector<std::byte>> get(const std::string&) override {
    ++gets;
    throw E("junk under this key");
  }
  bool put(const std::string&, std::span<const std::byte>) override { return true; }
  bool contains(const std::string&) override { return false; }
  std::size_t bytes_used() override { return 0; }
  std::string describe() const override { return "throwing store"; }
  int gets = 0;
};

template <typename E>
void expect_rejections_only() {
  WarningCapture warnings;
  auto store = std::make_shared<ThrowingStore<E>>();
  PrefixCache pc(store, opts(4));
  const auto t = tokens_of(9);  // candidates 9, 8, 4
  EXPECT_EQ(pc.lookup(t).length, 0);
  EXPECT_EQ(store->gets, 3);
  EXPECT_EQ(pc.lookup(t).length, 0);
  EXPECT_EQ(store->gets, 6);  // no back-off
  EXPECT_EQ(pc.stats().entries_unusable, 6);
  EXPECT_EQ(pc.stats().entries_rejected, 6);
  EXPECT_EQ(pc.stats().store_errors, 0);
  EXPECT_EQ(pc.stats().calls_skipped, 0);
  EXPECT_TRUE(warnings.messages.empty()) << warnings.messages[0];
}

TEST(PrefixCache, WhatAStoreThrowsAboutAnEntryIsARejectedEntry) {
  expect_rejections_only<rwd::StoreValueError>();
  expect_rejections_only<rwd::CapacityError>();
  expect_rejections_only<rwd::InvalidArgument>();
}

// The entries of tokens_of(14) at interval 4 (boundaries 4, 8, 12, 14),
// serialized, by boundary, and the reference state after each.
struct StoredChain {
  std::map<std::int64_t, std::vector<std::byte>> bytes;
  std::map<std::int64_t, RefCache> refs;
};

StoredChain stored_chain(const std::vector<std::int32_t>& t) {
  auto memory = std::shared_ptr<BlobStore>(rwd::make_memory_store(0));
  PrefixCache writer(memory, opts(4));
  Built b = every_kind();
  StoredChain out;
  out.refs = prefill(writer, t, 0, b);
  for (const auto& [boundary, ref] : out.refs) {
    out.bytes[boundary] = *memory->get(writer.key(std::span(t).first(static_cast<std::size_t>(boundary))));
  }
  return out;
}

// Puts every entry of `chain` (written for tokens `t` at interval 4) into `store`.
void put_chain(BlobStore& store, const std::vector<std::int32_t>& t, const StoredChain& chain) {
  const PrefixCache keys(std::shared_ptr<BlobStore>(&store, [](BlobStore*) {}), opts(4));
  for (const auto& [boundary, bytes] : chain.bytes)
    ASSERT_TRUE(store.put(keys.key(std::span(t).first(static_cast<std::size_t>(boundary))), bytes));
}

// Randomized: a directory holding a valid chain where random entries (and
// the never-written candidate P - 1) are replaced by every kind of junk a
// directory can hold under a key's name: huge sparse files, FIFOs, sockets,
// links to /dev/zero and /dev/null, directories, foreign and empty files.
// The hit is the longest prefix whose entries are all intact (independently:
// the largest boundary with no junk at or below it), restoring the
// reference state; every piece of junk consulted is counted as a rejection
// by its reason; nothing blocks, nothing fails, no warning, no back-off.
TEST(PrefixCache, JunkInADirectoryStoreIsRejectedNeverBlockingOrFailing) {
  const auto t = tokens_of(14);
  const StoredChain chain = stored_chain(t);
  const PrefixCache keys(std::shared_ptr<BlobStore>(rwd::make_memory_store(0)), opts(4));
  std::mt19937_64 rng(20260328);
  for (int round = 0; round < 40; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    rwd::store_test::TempDir dir;
    auto store = std::shared_ptr<BlobStore>(rwd::make_directory_store(dir.path()));
    std::map<std::int64_t, rwd::store_test::Junk> junk;
    for (const auto& [boundary, bytes] : chain.bytes) {
      ASSERT_TRUE(store->put(keys.key(std::span(t).first(static_cast<std::size_t>(boundary))), bytes));
      if (rng() % 3 == 0) junk[boundary] = rwd::store_test::kEveryJunk[rng() % std::size(rwd::store_test::kEveryJunk)];
    }
    if (rng() % 2 == 0) junk[13] = rwd::store_test::kEveryJunk[rng() % std::size(rwd::store_test::kEveryJunk)];
    std::string described;
    for (const auto& [boundary, kind] : junk) {
      rwd::store_test::make_junk(dir / keys.key(std::span(t).first(static_cast<std::size_t>(boundary))), kind, rng());
      described += " " + std::to_string(boundary) + ": " + rwd::store_test::junk_name(kind) + ";";
    }
    SCOPED_TRACE("junk at" + described);
    std::int64_t expected = 0;
    for (const auto& [boundary, bytes] : chain.bytes) {
      if (junk.count(boundary)) break;
      expected = boundary;
    }
    WarningCapture warnings;
    PrefixCache pc(store, opts(4));
    const PrefixHit hit = pc.lookup(t);
    ASSERT_EQ(hit.length, expected);
    if (expected > 0) {
      EXPECT_EQ(check_hit(hit, chain.refs.at(expected)), "");
    }
    const auto& st = pc.stats();
    EXPECT_EQ(st.store_errors, 0);
    EXPECT_EQ(st.calls_skipped, 0);
    EXPECT_TRUE(warnings.messages.empty()) << warnings.messages[0];
    EXPECT_EQ(st.entries_rejected, st.entries_unusable + st.entries_corrupt + st.entries_foreign);
    // The first candidate (14) is always consulted: its junk is counted by kind.
    if (junk.count(14)) {
      const bool parsed = junk[14] == rwd::store_test::Junk::kForeignBytes || junk[14] == rwd::store_test::Junk::kEmpty;
      EXPECT_GE(parsed ? st.entries_corrupt : st.entries_unusable, 1);
    }
    if (!junk.empty() && expected < 14) {
      EXPECT_GE(st.entries_rejected, 1);
    }
  }
}

TEST(PrefixCache, EntriesOverMaxEntryBytesAreRejectedUnread) {
  const auto t = tokens_of(14);
  const StoredChain chain = stored_chain(t);
  rwd::store_test::TempDir dir;
  auto store = std::shared_ptr<BlobStore>(rwd::make_directory_store(dir.path()));
  const PrefixCache keys(store, opts(4));
  std::size_t largest = 0;
  for (const auto& [boundary, bytes] : chain.bytes) {
    ASSERT_TRUE(store->put(keys.key(std::span(t).first(static_cast<std::size_t>(boundary))), bytes));
    largest = std::max(largest, bytes.size());
  }
  PrefixCacheOptions small = opts(4);
  small.max_entry_bytes = chain.bytes.at(14).size() - 1;
  PrefixCache pc(store, small);
  EXPECT_LT(pc.lookup(t).length, 14);
  EXPECT_GE(pc.stats().entries_unusable, 1);
  PrefixCacheOptions enough = opts(4);
  enough.max_entry_bytes = largest;
  PrefixCache ok(store, enough);
  EXPECT_EQ(ok.lookup(t).length, 14);
  EXPECT_EQ(ok.stats().entries_rejected, 0);
}

// The per-token bound: the entry ending at b is refused unread past
// entry_fixed_bytes + b * entry_bytes_per_token, so a large file under a
// short prompt's key is not read although it is far below max_entry_bytes.
TEST(PrefixCache, EntriesOverTheirPerTokenBoundAreRejectedUnread) {
  const auto t = tokens_of(14);
  const StoredChain chain = stored_chain(t);
  rwd::store_test::TempDir dir;
  auto store = std::shared_ptr<BlobStore>(rwd::make_directory_store(dir.path()));
  const PrefixCache keys(store, opts(4));
  for (const auto& [boundary, bytes] : chain.bytes) {
    ASSERT_TRUE(store->put(keys.key(std::span(t).first(static_cast<std::size_t>(boundary))), bytes));
  }
  // A bound every real entry meets: each entry's size over its own length.
  std::size_t per_token = 1;
  for (const auto& [boundary, bytes] : chain.bytes) {
    per_token = std::max(per_token,
                         (bytes.size() + static_cast<std::size_t>(boundary) - 1) / static_cast<std::size_t>(boundary));
  }
  PrefixCacheOptions bounded = opts(4);
  bounded.entry_bytes_per_token = per_token;
  PrefixCache ok(store, bounded);
  EXPECT_EQ(ok.lookup(t).length, 14);
  EXPECT_EQ(ok.stats().entries_rejected, 0);

  // The entry at 4 replaced by a file one byte over 4 * per_token (a sparse
  // file: nothing is written or read): refused from its size, so the chain
  // from 0 breaks and the lookup misses, the entry counted as unusable.
  const std::string first = dir.path() + "/" + keys.key(std::span(t).first(4));
  ASSERT_EQ(::truncate(first.c_str(), static_cast<off_t>(4 * per_token + 1)), 0);
  PrefixCache pc(store, bounded);
  EXPECT_EQ(pc.lookup(t).length, 0);
  EXPECT_GE(pc.stats().entries_unusable, 1);
  EXPECT_EQ(pc.stats().entries_corrupt, 0);
  // Without the per-token bound the same file is read and fails its checksums.
  PrefixCache unbounded(store, opts(4));
  EXPECT_EQ(unbounded.lookup(t).length, 0);
  EXPECT_GE(unbounded.stats().entries_corrupt, 1);
}

// A store whose calls advance a fake clock by `delay_s`: a slow store
// without waiting, so that nothing in the test depends on real time.
class ClockedStore : public BlobStore {
 public:
  ClockedStore(std::shared_ptr<BlobStore> inner, std::chrono::steady_clock::time_point& clock)
      : inner_(std::move(inner)), clock_(clock) {}
  std::optional<std::vector<std::byte>> get(const std::string& key) override {
    tick();
    return inner_->get(key);
  }
  bool put(const std::string& key, std::span<const std::byte> value) override {
    tick();
    return inner_->put(key, value);
  }
  bool contains(const std::string& key) override {
    tick();
    return inner_->contains(key);
  }
  std::size_t bytes_used() override { return inner_->bytes_used(); }
  std::string describe() const override { return "clocked " + inner_->describe(); }
  double delay_s = 0;
  int calls = 0;

 private:
  void tick() {
    ++calls;
    clock_ += std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(delay_s));
  }
  std::shared_ptr<BlobStore> inner_;
  std::chrono::steady_clock::time_point& clock_;
};

void advance(std::chrono::steady_clock::time_point& clock, double s) {
  clock += std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s));
}

// The chain of tokens_of(14) at interval 4 in a memory store behind a
// ClockedStore whose calls take 1 s, and options timed by that clock.
struct SlowChain {
  SlowChain() {
    put_chain(*memory, t, chain);
    slow->delay_s = 1.0;
    o.clock = [this] { return clock; };
  }
  SlowChain(const SlowChain&) = delete;  // the store and the options refer to `clock`
  const std::vector<std::int32_t> t = tokens_of(14);
  const StoredChain chain = stored_chain(t);
  std::shared_ptr<BlobStore> memory = std::shared_ptr<BlobStore>(rwd::make_memory_store(0));
  std::chrono::steady_clock::time_point clock = std::chrono::steady_clock::time_point{} + std::chrono::hours(1);
  std::shared_ptr<ClockedStore> slow = std::make_shared<ClockedStore>(memory, clock);
  PrefixCacheOptions o = opts(4);
};

// A store whose calls take 1 s (by the injected clock): the first slow call
// starts a back-off with one warning; lookups and writes meanwhile do not
// call the store (misses: the caller recomputes); a back-off that follows
// another without a fast call between doubles; once fast, the store hits.
TEST(PrefixCache, ASlowStoreBacksOffWithOneWarning) {
  SlowChain sc;
  const std::vector<std::int32_t>& t = sc.t;
  auto& clock = sc.clock;
  auto& slow = sc.slow;
  PrefixCacheOptions& o = sc.o;
  WarningCapture warnings;
  PrefixCache pc(slow, o);
  EXPECT_EQ(pc.lookup(t).length, 0);  // the first get was slow: the chain's others are skipped
  EXPECT_EQ(slow->calls, 1);
  EXPECT_EQ(pc.stats().slow_calls, 1);
  EXPECT_GE(pc.stats().calls_skipped, 1);
  EXPECT_EQ(pc.stats().store_errors, 0);
  EXPECT_DOUBLE_EQ(pc.stats().store_seconds, 1.0);
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_EQ(warnings.messages[0].rfind("rewind: warning: prefix cache: clocked memory store (no cap): a call took 1 s, "
                                       "over the 0.25 s allowed; skipping the store for a while",
                                       0),
            0u)
      << warnings.messages[0];
  // During the back-off (2 s) neither lookups nor writes reach the store.
  Built b = every_kind();
  ASSERT_EQ(cache_step(b.cache, b.ref, 4, 1), "");
  EXPECT_FALSE(pc.store(std::span(t).first(4), 0, b.cache.snapshot(0), {}));
  EXPECT_EQ(pc.lookup(t).length, 0);
  EXPECT_EQ(slow->calls, 1);
  // Fast again after the back-off: a full hit, the reference state.
  advance(clock, 2.5);
  slow->delay_s = 0;
  const PrefixHit hit = pc.lookup(t);
  ASSERT_EQ(hit.length, 14);
  EXPECT_EQ(check_hit(hit, sc.chain.refs.at(14)), "");
  EXPECT_EQ(slow->calls, 5);
  // Slow twice in a row: 2 s, then 4 s.
  slow->delay_s = 1.0;
  EXPECT_EQ(pc.lookup(t).length, 0);
  advance(clock, 2.5);
  EXPECT_EQ(pc.lookup(t).length, 0);
  EXPECT_EQ(slow->calls, 7);
  advance(clock, 3.0);
  EXPECT_EQ(pc.lookup(t).length, 0);
  EXPECT_EQ(slow->calls, 7);  // 3 s into a 4 s back-off
  advance(clock, 1.5);
  EXPECT_EQ(pc.lookup(t).length, 0);
  EXPECT_EQ(slow->calls, 8);
  EXPECT_EQ(pc.stats().slow_calls, 4);
  EXPECT_EQ(warnings.messages.size(), 1u);
}

// lookup_budget_s bounds the store time of one lookup: with calls of 1 s
// and a budget of 2.5 s, a lookup makes three calls and gives up (a miss,
// counted); without a budget the same store gives the full hit.
TEST(PrefixCache, ALookupStopsAtItsTimeBudget) {
  SlowChain sc;
  const std::vector<std::int32_t>& t = sc.t;
  auto& slow = sc.slow;
  PrefixCacheOptions& o = sc.o;
  o.slow_call_s = 0;  // the budget alone
  o.lookup_budget_s = 2.5;
  WarningCapture warnings;
  PrefixCache pc(slow, o);
  EXPECT_EQ(pc.lookup(t).length, 0);
  EXPECT_EQ(slow->calls, 3);
  EXPECT_EQ(pc.stats().lookups_over_budget, 1);
  EXPECT_EQ(pc.stats().slow_calls, 0);
  EXPECT_TRUE(warnings.messages.empty());
  // The next lookup has its own budget.
  EXPECT_EQ(pc.lookup(t).length, 0);
  EXPECT_EQ(slow->calls, 6);
  o.lookup_budget_s = 0;
  PrefixCache unbounded(slow, o);
  EXPECT_EQ(unbounded.lookup(t).length, 14);
  EXPECT_EQ(unbounded.stats().lookups_over_budget, 0);
  EXPECT_THROW(PrefixCache(slow,
                           [&] {
                             auto x = opts(4);
                             x.lookup_budget_s = -1;
                             return x;
                           }()),
               rwd::InvalidArgument);
  EXPECT_THROW(PrefixCache(slow,
                           [&] {
                             auto x = opts(4);
                             x.slow_call_s = std::nan("");
                             return x;
                           }()),
               rwd::InvalidArgument);
  EXPECT_THROW(PrefixCache(slow,
                           [&] {
                             auto x = opts(4);
                             x.slow_bytes_per_s = 0;
                             return x;
                           }()),
               rwd::InvalidArgument);
}

#if defined(REWIND_HAVE_REDIS)
TEST(PrefixCache, SharedThroughRedisAndSurvivesItsStop) {
  rwd::test::RedisServer server;
  const auto t = tokens_of(10);
  std::map<std::int64_t, RefCache> refs;
  {
    PrefixCache writer(std::shared_ptr<BlobStore>(rwd::make_redis_store(rwd::parse_redis_url(server.url()))), opts(4));
    Built b = every_kind();
    refs = prefill(writer, t, 0, b);
    EXPECT_EQ(writer.stats().entries_written, 3);
  }
  WarningCapture warnings;
  PrefixCache reader(std::shared_ptr<BlobStore>(rwd::make_redis_store(rwd::parse_redis_url(server.url()))), opts(4));
  const PrefixHit h = reader.lookup(t);
  ASSERT_EQ(h.length, 10);
  EXPECT_EQ(check_hit(h, refs.at(10)), "");
  server.stop();
  EXPECT_EQ(reader.lookup(t).length, 0);
  EXPECT_EQ(warnings.messages.size(), 1u);
}
#endif

#if defined(REWIND_HAVE_REDIS)
// A TCP proxy on 127.0.0.1 that holds every reply of the server for
// `delay_ms` before passing it on: a slow network store, for real.
class DelayingProxy {
 public:
  DelayingProxy(int server_port, int delay_ms) : server_port_(server_port), delay_ms_(delay_ms) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    if (listen_fd_ < 0 || ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::listen(listen_fd_, 4) != 0) {
      throw std::runtime_error("proxy: cannot listen on 127.0.0.1");
    }
    socklen_t len = sizeof addr;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  DelayingProxy(const DelayingProxy&) = delete;
  DelayingProxy& operator=(const DelayingProxy&) = delete;
  ~DelayingProxy() {
    stop_ = true;
    thread_.join();
    ::close(listen_fd_);
  }
  int port() const { return port_; }

 private:
  // One client at a time (a store holds one connection), polling so that
  // the destructor's stop is seen within 50 ms.
  void serve() {
    while (!stop_) {
      pollfd p{listen_fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      const int client = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (client < 0) continue;
      const int server = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in addr{};
      addr.sin_family = AF_INET;
      addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      addr.sin_port = htons(static_cast<std::uint16_t>(server_port_));
      if (server >= 0 && ::connect(server, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) pump(client, server);
      if (server >= 0) ::close(server);
      ::close(client);
    }
  }
  void pump(int client, int server) {
    char buf[1 << 16];
    while (!stop_) {
      pollfd p[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
      if (::poll(p, 2, 50) <= 0) continue;
      for (int i = 0; i < 2; ++i) {
        if ((p[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
        const ssize_t n = ::recv(p[i].fd, buf, sizeof buf, 0);
        if (n <= 0) return;
        if (i == 1) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
        const int to = i == 0 ? server : client;
        for (ssize_t done = 0; done < n;) {
          const ssize_t w = ::send(to, buf + done, static_cast<std::size_t>(n - done), MSG_NOSIGNAL);
          if (w <= 0) return;
          done += w;
        }
      }
    }
  }

  int server_port_;
  int delay_ms_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// Redis behind a proxy holding each reply 300 ms, the prefix cache's slow
// bound at 50 ms: the first reply already trips the back-off, with one
// warning, and the lookups that follow within the back-off do not wait for
// the store (they are skipped, counted). Only lower bounds of time matter
// here (each reply takes at least 300 ms), so the test cannot flake on a
// slow machine; a machine that stalls for the whole back-off only adds
// calls, which the assertions allow.
TEST(PrefixCache, ASlowRedisTripsTheBackOff) {
  rwd::test::RedisServer server;
  const auto t = tokens_of(14);
  const StoredChain chain = stored_chain(t);
  {
    auto direct = std::shared_ptr<BlobStore>(rwd::make_redis_store(rwd::parse_redis_url(server.url())));
    const PrefixCache keys(direct, opts(4));
    for (const auto& [boundary, bytes] : chain.bytes)
      ASSERT_TRUE(direct->put(keys.key(std::span(t).first(static_cast<std::size_t>(boundary))), bytes));
  }
  DelayingProxy proxy(server.port(), 300);
  rwd::RedisOptions ro;
  ro.port = proxy.port();
  PrefixCacheOptions o = opts(4);
  o.slow_call_s = 0.05;
  WarningCapture warnings;
  PrefixCache pc(std::shared_ptr<BlobStore>(rwd::make_redis_store(ro)), o);
  EXPECT_EQ(pc.lookup(t).length, 0);
  EXPECT_EQ(pc.lookup(t).length, 0);
  EXPECT_GE(pc.stats().slow_calls, 1);
  EXPECT_GE(pc.stats().calls_skipped, 1);
  EXPECT_EQ(pc.stats().store_errors, 0);
  ASSERT_EQ(warnings.messages.size(), 1u);
  EXPECT_NE(warnings.messages[0].find("rewind: warning: prefix cache: redis://127.0.0.1:" +
                                      std::to_string(proxy.port()) + "/rewind:: a call took "),
            std::string::npos)
      << warnings.messages[0];
  EXPECT_EQ(warnings.messages[0].find("redis://"), warnings.messages[0].rfind("redis://")) << "the store named twice";
}
#endif

}  // namespace
}  // namespace rwt
