// Snapshots of a whole Cache and of SequenceCache sequences
// (rewind/snapshot.h, Cache::snapshot / restore, SequenceCache::snapshot /
// restore / export_snapshot / import_snapshot). The oracle is the naive
// reference (reference.h): a restored state equals the original's reference
// with its rollback history dropped, and both then continue identically.
// The random interleavings with forks, batches and crops are in
// sequences_test.cc (SeqModel's snapshot operations).
#include <gtest/gtest.h>

#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "conformance/harness.h"
#include "conformance/sequence_model.h"
#include "rewind/sequences.h"
#include "rewind/snapshot.h"

namespace rwt {
namespace {

using rwd::SeqId;
using rwd::SequenceCache;
using rwd::SequenceSnapshot;
using rwd::Snapshot;

std::vector<std::pair<LayerKind, LayerOptions>> every_kind(DType dt, bool is_static) {
  std::vector<std::pair<LayerKind, LayerOptions>> spec;
  for (LayerKind k : kEveryLayerKind) {
    LayerOptions o = small_options(k, dt, is_static, 1);
    if (is_static && (k == LayerKind::FullAttention || k == LayerKind::Hybrid || k == LayerKind::SparseAttention))
      o.static_capacity = 160;  // full attention holds the whole test's tokens
    spec.push_back({k, o});
  }
  return spec;
}

struct Case {
  DType dtype;
  bool is_static;
  i64 R;  // -1: not recording
};

// A random history (forwards of 1..5 tokens, exact crops), snapshot, restore
// into a new cache, then both continue with the same tokens and crops.
std::string restore_and_continue(const Case& c, i64 steps, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto uniform = [&](i64 lo, i64 hi) { return lo + static_cast<i64>(rng() % static_cast<std::uint64_t>(hi - lo + 1)); };
  Built a = build_cache(every_kind(c.dtype, c.is_static));
  if (c.R >= 0) {
    a.cache.activate_past_recording(c.R);
    a.ref.activate(c.R);
  }
  std::uint64_t salt = seed;
  auto step = [&](Cache& cache, RefCache& ref, std::uint64_t s, i64 q) { return cache_step(cache, ref, q, s); };
  for (i64 i = 0; i < steps; ++i) {
    const i64 q = uniform(1, 5);
    if (std::string e = step(a.cache, a.ref, ++salt, q); !e.empty()) return "history: " + e;
    if (c.R > 0 && uniform(0, 2) == 0) {
      const i64 k = uniform(0, std::min(a.ref.max_rollback(), q));
      a.cache.crop(-k);
      a.ref.crop(-k);
    }
  }
  const Snapshot snap = a.cache.snapshot();
  if (snap.length != a.ref.seq_length()) return "snapshot().length differs from the sequence length";

  Built b = build_cache(every_kind(c.dtype, c.is_static));
  RefCache ref_b = a.ref;
  ref_b.deactivate();
  if (c.R >= 0) {
    b.cache.activate_past_recording(c.R);
    ref_b.activate(c.R);
  }
  b.cache.restore(snap);
  if (std::string e = verify(b.cache, ref_b); !e.empty()) return "after restore: " + e;
  // A snapshot of the restored cache holds the same bytes.
  const Snapshot again = b.cache.snapshot();
  for (std::size_t l = 0; l < snap.layers.size(); ++l) {
    const auto& x = snap.layers[l];
    const auto& y = again.layers[l];
    bool same = x.first == y.first && x.sides.size() == y.sides.size() &&
                x.conv_states.size() == y.conv_states.size() && x.recurrent_states.size() == y.recurrent_states.size();
    if (same && x.keys.view().data) same = rwd::bitwise_equal(x.keys, y.keys) && rwd::bitwise_equal(x.values, y.values);
    for (std::size_t k = 0; same && k < x.sides.size(); ++k) same = rwd::bitwise_equal(x.sides[k], y.sides[k]);
    for (std::size_t k = 0; same && k < x.conv_states.size(); ++k)
      same = rwd::bitwise_equal(x.conv_states[k], y.conv_states[k]);
    for (std::size_t k = 0; same && k < x.recurrent_states.size(); ++k)
      same = rwd::bitwise_equal(x.recurrent_states[k], y.recurrent_states[k]);
    if (!same) return "snapshot of the restored cache differs at layer " + std::to_string(l);
  }
  // Both continue with the same tokens (same salts) and crops.
  for (i64 i = 0; i < 8; ++i) {
    const i64 q = uniform(1, 4);
    ++salt;
    if (std::string e = step(a.cache, a.ref, salt, q); !e.empty()) return "original, continuing: " + e;
    if (std::string e = step(b.cache, ref_b, salt, q); !e.empty()) return "restored, continuing: " + e;
    if (c.R > 0 && uniform(0, 1) == 0) {
      const i64 k = uniform(0, std::min({ref_b.max_rollback(), a.ref.max_rollback(), q}));
      a.cache.crop(-k);
      a.ref.crop(-k);
      b.cache.crop(-k);
      ref_b.crop(-k);
    }
    if (std::string e = verify(b.cache, ref_b); !e.empty()) return "restored, continuing: " + e;
  }
  return "";
}

TEST(CacheSnapshot, EveryKindRestoresAndContinuesExactly) {
  const Case cases[] = {{DType::F32, false, -1}, {DType::F32, false, 3},  {DType::BF16, false, 2},
                        {DType::F16, true, 4},   {DType::BF16, true, -1}, {DType::F32, true, 0}};
  std::uint64_t seed = 0x5a9;
  for (const Case& c : cases) {
    for (i64 steps : {0, 1, 2, 3, 7, 15}) {
      const std::string e = restore_and_continue(c, steps, ++seed);
      ASSERT_TRUE(e.empty()) << e << " [dtype " << rwd::dtype_name(c.dtype) << ", static " << c.is_static << ", R "
                             << c.R << ", steps " << steps << "]";
    }
  }
}

// A snapshot with its own tensors, for the tests to damage one field of.
Snapshot deep_copy(const Snapshot& s) {
  auto dup = [](const rwd::Tensor& t) {
    if (!t.view().data && t.view().rank == 0) return rwd::Tensor();
    rwd::Tensor d(t.view().dtype, t.view().shape.data(), t.view().rank);
    rwd::copy_tensor(t, d.view());
    return d;
  };
  Snapshot out;
  out.length = s.length;
  for (const auto& l : s.layers) {
    rwd::LayerSnapshot c;
    c.kind = l.kind;
    c.first = l.first;
    c.keys = dup(l.keys);
    c.values = dup(l.values);
    for (const auto& t : l.sides) c.sides.push_back(dup(t));
    for (const auto& t : l.conv_states) c.conv_states.push_back(dup(t));
    for (const auto& t : l.recurrent_states) c.recurrent_states.push_back(dup(t));
    out.layers.push_back(std::move(c));
  }
  return out;
}

// "" when restoring s into cache throws InvalidArgument whose message holds
// fragment and leaves the cache as `before` observed it.
std::string refused_restore(Cache& cache, const Observed& before, const Snapshot& s, const std::string& fragment) {
  try {
    cache.restore(s);
    return std::string("restore did not throw (wanted: ") + fragment + ")";
  } catch (const rwd::InvalidArgument& e) {
    if (std::string(e.what()).find(fragment) == std::string::npos)
      return "message \"" + std::string(e.what()) + "\" lacks \"" + fragment + "\"";
  }
  return diff(before, observe(cache));
}

TEST(CacheSnapshot, RestoreRefusesWhatDoesNotFitAndChangesNothing) {
  Built a = build_cache(every_kind(DType::F32, false));
  for (int i = 0; i < 3; ++i) ASSERT_EQ(cache_step(a.cache, a.ref, 4, 10 + static_cast<std::uint64_t>(i)), "");
  const Snapshot good = a.cache.snapshot();  // L = 12

  Built b = build_cache(every_kind(DType::F32, false));
  ASSERT_EQ(cache_step(b.cache, b.ref, 3, 99), "");
  const Observed before = observe(b.cache);
  auto refused = [&](const Snapshot& s, const std::string& fragment) {
    return refused_restore(b.cache, before, s, fragment);
  };
  {
    Snapshot s = deep_copy(good);
    s.layers.pop_back();
    EXPECT_EQ(refused(s, "the snapshot has 9 layers, this cache 10"), "");
  }
  {
    Snapshot s = deep_copy(good);
    s.layers[1].kind = LayerKind::FullAttention;
    EXPECT_EQ(refused(s, "layer 1 (sliding_attention): the snapshot holds a full_attention layer"), "");
  }
  {
    Snapshot s = deep_copy(good);
    s.layers[0].keys = rwd::Tensor(DType::F32, {1, 2, 12, 5});
    EXPECT_EQ(
        refused(
            s,
            "layer 0 (full_attention): the snapshot's keys is [1, 2, 12, 5] f32, this layer needs [1, 2, 12, 3] f32"),
        "");
  }
  {
    Snapshot s = deep_copy(good);  // a full layer needs positions from 0
    s.layers[0].first = 2;
    s.layers[0].keys = rwd::Tensor(DType::F32, {1, 2, 10, 3});
    s.layers[0].values = rwd::Tensor(DType::F32, {1, 2, 10, 2});
    EXPECT_EQ(refused(s, "holds positions [2, 12) of its attention, but restoring length 12 needs [0, 12)"), "");
  }
  {
    Snapshot s = deep_copy(good);
    s.layers[3].recurrent_states[1] = rwd::Tensor(DType::F16, {1, 4});
    EXPECT_EQ(refused(s, "recurrent state 1 is [1, 4] f16, this layer needs [1, 4] f32"), "");
  }
  {
    Snapshot s = deep_copy(good);
    s.layers[4].recurrent_states.push_back(rwd::Tensor(DType::F32, {1, 4}));  // conv layers have none
    EXPECT_EQ(refused(s, "holds 2 conv and 1 recurrent states, this layer has 2 and 0"), "");
  }
  {
    Snapshot s = deep_copy(good);
    s.length = 13;  // rows no longer match the length
    EXPECT_EQ(refused(s, "layer 0 (full_attention)"), "");
  }
  {
    Snapshot s = deep_copy(good);
    s.length = -1;
    EXPECT_EQ(refused(s, "outside [0, 2^40]"), "");
  }
  // A forward open: StateError, nothing changes.
  {
    rwd::Forward f = b.cache.begin_forward(1);
    EXPECT_THROW(b.cache.restore(good), rwd::StateError);
    f.abandon();
    EXPECT_EQ(diff(before, observe(b.cache)), "");
  }
  // First positions outside [0, L], near 2^63 included, are refused.
  for (const i64 from : {i64{-1}, i64{13}, std::numeric_limits<i64>::max(), std::numeric_limits<i64>::min()})
    EXPECT_THROW((void)a.cache.snapshot(from), rwd::InvalidArgument) << from;
  {
    Snapshot s = deep_copy(good);
    s.length = std::numeric_limits<i64>::max();
    EXPECT_EQ(refused(s, "outside [0, 2^40]"), "");
  }
  // Restoring works on layers out of step (the way back, like reset).
  {
    Built c = build_cache(every_kind(DType::F32, false));
    ASSERT_EQ(do_update(Target::of(c.cache, 0), c.ref.layers[0], 2, 7), "");  // layer 0 alone
    EXPECT_THROW((void)c.cache.snapshot(), rwd::StateError);
    c.cache.restore(good);
    RefCache want = a.ref;
    want.deactivate();
    EXPECT_EQ(verify(c.cache, want), "");
  }
}

TEST(CacheSnapshot, RestoreRefusesASnapshotTooLargeForAStaticLayerAndChangesNothing) {
  std::vector<std::pair<LayerKind, LayerOptions>> spec{
      {LayerKind::FullAttention, small_options(LayerKind::FullAttention, DType::F32, false, 1)}};
  spec[0].second.static_capacity = 8;
  Built small = build_cache(spec);
  Built big = build_cache({{LayerKind::FullAttention, small_options(LayerKind::FullAttention, DType::F32, false, 1)}});
  ASSERT_EQ(cache_step(big.cache, big.ref, 12, 5), "");
  ASSERT_EQ(cache_step(small.cache, small.ref, 2, 6), "");
  const Observed small_before = observe(small.cache);
  EXPECT_THROW(small.cache.restore(big.cache.snapshot()), rwd::CapacityError);
  EXPECT_EQ(diff(small_before, observe(small.cache)), "");
  EXPECT_EQ(verify(small.cache, small.ref), "");
}

TEST(CacheSnapshot, SnapshotRefusesBatchRowsOtherThanOne) {
  Built wide = build_cache({{LayerKind::FullAttention, small_options(LayerKind::FullAttention, DType::F32, false, 2)}});
  EXPECT_THROW((void)wide.cache.snapshot(), rwd::InvalidArgument);
}

// ---- SequenceCache -----------------------------------------------------------------

seqtest::SeqSpec every_spec(DType dt, i64 block_size) {
  seqtest::SeqSpec s;
  s.name = "every";
  s.kinds = kEveryLayerKind;
  s.dtype = dt;
  s.block_size = block_size;
  return s;
}

TEST(SequenceSnapshot, SharesBlocksAndCostsNothingPerToken) {
  seqtest::SeqModel m(every_spec(DType::F32, 4));
  ASSERT_EQ(m.add(), "");
  for (int i = 0; i < 40; ++i) ASSERT_EQ(m.forward({{0, 5}}), "");  // L = 200
  const rwd::SequenceMemory before = m.cache.memory();
  ASSERT_EQ(m.take_snapshot(0), "");
  const rwd::SequenceMemory after = m.cache.memory();
  // The snapshot shares every attention block: none is added.
  EXPECT_EQ(after.blocks_in_use, before.blocks_in_use);
  // It copies only the conv inputs and recurrent states (their bytes do not depend on L).
  const std::size_t linear_bytes = after.bytes_used - before.bytes_used;
  ASSERT_EQ(m.take_snapshot(0), "");
  EXPECT_EQ(m.cache.memory().bytes_used - after.bytes_used, linear_bytes);
  EXPECT_GT(linear_bytes, 0u);
  // Continue the original: its writes go to its own blocks, the snapshot keeps its content.
  ASSERT_EQ(m.forward({{0, 3}}), "");
  ASSERT_EQ(m.restore_new(0), "");
  ASSERT_EQ(m.forward({{1, 2}, {0, 1}}), "");
  ASSERT_EQ(m.restore_into(0, 1), "");
  ASSERT_EQ(m.export_import(1, 0), "");
  ASSERT_EQ(m.export_import(0, m.held.size()), "");
  while (!m.held.empty()) ASSERT_EQ(m.drop_snapshot(0), "");
  while (!m.live.empty()) ASSERT_EQ(m.remove(0), "");
  EXPECT_EQ(m.cache.memory().blocks_in_use, 0);
}

TEST(SequenceSnapshot, RestoreIntoARecordingSequenceKeepsItsBound) {
  seqtest::SeqModel m(every_spec(DType::BF16, 3));
  ASSERT_EQ(m.add(), "");
  ASSERT_EQ(m.add(), "");
  ASSERT_EQ(m.activate(1, 5), "");
  ASSERT_EQ(m.forward({{0, 9}, {1, 2}}), "");
  ASSERT_EQ(m.take_snapshot(0), "");
  ASSERT_EQ(m.restore_into(1, 0), "");
  EXPECT_EQ(m.cache.recording_capacity(m.live[1].id), 5);
  EXPECT_EQ(m.cache.max_rollback(m.live[1].id), 0);
  ASSERT_EQ(m.forward({{1, 4}}), "");
  ASSERT_EQ(m.crop(1, -4), "");  // the new tokens roll back exactly
}

TEST(SequenceSnapshot, HandlesOfOtherOrDeadCachesAreRefused) {
  const seqtest::SeqSpec spec = every_spec(DType::F32, 4);
  SequenceSnapshot orphan;
  EXPECT_FALSE(orphan.valid());
  EXPECT_EQ(orphan.length(), 0);
  {
    SequenceCache c(seqtest::type_names(spec.kinds), seqtest::seq_options(spec));
    const SeqId id = c.add_sequence();
    orphan = c.snapshot(id);
    EXPECT_TRUE(orphan.valid());
    EXPECT_EQ(c.num_snapshots(), 1);
    SequenceSnapshot copy = orphan;  // copies share one snapshot
    EXPECT_EQ(c.num_snapshots(), 1);
  }
  EXPECT_FALSE(orphan.valid());  // its cache is gone; destroying it later is harmless
  SequenceCache other(seqtest::type_names(spec.kinds), seqtest::seq_options(spec));
  const SeqId id = other.add_sequence();
  EXPECT_THROW((void)other.restore(orphan), rwd::InvalidArgument);
  EXPECT_THROW(other.restore(id, orphan), rwd::InvalidArgument);
  EXPECT_THROW((void)other.export_snapshot(orphan), rwd::InvalidArgument);
  EXPECT_THROW((void)other.restore(SequenceSnapshot{}), rwd::InvalidArgument);
  SequenceCache third(seqtest::type_names(spec.kinds), seqtest::seq_options(spec));
  const SequenceSnapshot foreign = third.snapshot(third.add_sequence());
  try {
    (void)other.restore(foreign);
    ADD_FAILURE() << "a snapshot of another cache was accepted";
  } catch (const rwd::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("belongs to another SequenceCache"), std::string::npos) << e.what();
  }
  EXPECT_EQ(other.num_sequences(), 1);
  EXPECT_THROW((void)other.snapshot(SeqId{}), rwd::IndexError);
  EXPECT_THROW((void)other.export_snapshot(id, -1), rwd::InvalidArgument);
  EXPECT_THROW((void)other.export_snapshot(id, std::numeric_limits<i64>::max()), rwd::InvalidArgument);
  other.seq_rm(id);
  EXPECT_THROW((void)other.snapshot(id), rwd::IndexError);  // a removed sequence
  EXPECT_THROW((void)other.export_snapshot(id), rwd::IndexError);
}

TEST(SequenceSnapshot, DroppedInsideABatchReleasesWhenItCloses) {
  const seqtest::SeqSpec spec = every_spec(DType::F32, 2);
  SequenceCache c(seqtest::type_names({LayerKind::FullAttention}), seqtest::seq_options(spec), {2});
  const SeqId a = c.add_sequence();
  {
    const rwd::BatchEntry e{a, 5};
    rwd::SequenceBatch b = c.begin_batch({&e, 1});
    rwd::Tensor k(DType::F32, {1, 2, 5, 3}), v(DType::F32, {1, 2, 5, 2});
    (void)c.update(k, v, 0);
    b.commit();
  }
  auto snap = std::make_unique<SequenceSnapshot>(c.snapshot(a));
  c.crop(a, -3);  // only the snapshot holds positions 2..4 now: 2 blocks
  EXPECT_EQ(c.memory().blocks_in_use, 3);
  const rwd::BatchEntry e{a, 1};
  rwd::SequenceBatch b = c.begin_batch({&e, 1});
  EXPECT_THROW((void)c.snapshot(a), rwd::StateError);
  EXPECT_THROW((void)c.restore(*snap), rwd::StateError);
  snap.reset();  // dropped while the batch is open: released when it closes
  EXPECT_EQ(c.num_snapshots(), 0);
  rwd::Tensor k(DType::F32, {1, 2, 1, 3}), v(DType::F32, {1, 2, 1, 2});
  (void)c.update(k, v, 0);
  b.commit();
  EXPECT_EQ(c.memory().blocks_in_use, 2);  // positions 0..2 of `a`
}

// A SequenceCache sequence, exported, restores a Cache; the Cache's own
// snapshot imports back into the SequenceCache: the same bytes everywhere.
TEST(SequenceSnapshot, PlainSnapshotsMoveBetweenCacheAndSequenceCache) {
  for (DType dt : {DType::F32, DType::F16}) {
    seqtest::SeqModel m(every_spec(dt, 3));
    ASSERT_EQ(m.add(), "");
    ASSERT_EQ(m.activate(0, 2), "");
    for (int i = 0; i < 6; ++i) ASSERT_EQ(m.forward({{0, 1 + i % 3}}), "");
    const Snapshot plain = m.cache.export_snapshot(m.live[0].id);
    Cache solo(seqtest::type_names(kEveryLayerKind), m.options());
    solo.restore(plain);
    EXPECT_EQ(solo.get_seq_length(), m.live[0].ref.seq_length());
    RefCache want = m.live[0].ref;
    want.deactivate();
    EXPECT_EQ(verify(solo, want), "");
    const Snapshot back = solo.snapshot();
    const SeqId id = m.cache.import_snapshot(back);
    m.live.push_back(seqtest::SeqState{id, want, 1000, 0});
    EXPECT_EQ(m.check(), "");
  }
}

}  // namespace
}  // namespace rwt
