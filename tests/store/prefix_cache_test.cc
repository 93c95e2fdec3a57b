// PrefixCache (rewind/prefix_cache.h) over real caches of every layer kind:
// entries written during a chunked prefill, joined back into a restorable
// state that equals the naive reference's at the boundary, and every way an
// entry can be missing, damaged or foreign turning into a shorter hit or a
// miss, never a wrong state.
#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <span>
#include <memory>
#include <string>
#include <vector>

#include "conformance/harness.h"
#include "rewind/prefix_cache.h"
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
  std::optional<std::vector<std::byte>> get(const std::string&) override { throw rwd::StoreError("connection refused"); }
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
  EXPECT_NE(warnings.messages[0].find("dead store: connection refused"), std::string::npos) << warnings.messages[0];
  EXPECT_GE(pc.stats().store_errors, 1);
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

}  // namespace
}  // namespace rwt
