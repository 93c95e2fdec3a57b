// SequenceCache conformance (rewind/sequences.h).
//
// 1. A randomized model-based test: every live sequence of one SequenceCache
//    is compared, after every operation, with its own naive single-sequence
//    reference (reference.h's RefCache; a fork is a deep copy of it): lengths,
//    max_rollback, retained keys / values / side rows (through keys(), values(),
//    side() and row by row through block_spans), conv inputs and windows,
//    recurrent states and snapshots, mask sizes, what each batched update
//    returns (read back with BlockLayout::gather), and the block count
//    (memory().blocks_in_use against the distinct blocks that hold a retained
//    position). Random interleavings of add / fork / seq_rm / seq_keep, ragged
//    batches (entries of 0 tokens included), abandoned batches, crops of any
//    sign, recording changes; every layer kind, f32 / f16 / bf16, block sizes
//    1, 2, 3 and 16. Fixed seeds.
// 2. Targeted tests with hand-worked expectations: handles, fork
//    independence and copy-on-write block counts, batch invariance, abandon,
//    budget, errors, sliding layers returning blocks to the pool.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <optional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "conformance/sequence_model.h"

namespace rwt::seqtest {
namespace {

using rwd::CapacityError;
using rwd::IndexError;
using rwd::InvalidArgument;
using rwd::StateError;

// ---- 1. randomized ------------------------------------------------------------------

struct RandomConfig {
  SeqSpec spec;
  int ops;
  std::uint64_t seed;
};

void PrintTo(const RandomConfig& c, std::ostream* os) { *os << c.spec.name << "/" << c.seed; }

class RandomDriver {
 public:
  explicit RandomDriver(const RandomConfig& cfg) : m_(cfg.spec), rng_(cfg.seed) {}

  std::string run(int ops) {
    for (int k = 0; k < ops; ++k)
      if (std::string e = step(); !e.empty()) return e;
    // Drop the snapshots, remove every sequence, in random order: nothing may stay in use.
    while (!m_.held.empty())
      if (std::string e = m_.drop_snapshot(pick(m_.held.size())); !e.empty()) return e;
    while (!m_.live.empty())
      if (std::string e = m_.remove(pick(m_.live.size())); !e.empty()) return e;
    const SequenceMemory mem = m_.cache.memory();
    if (mem.blocks_in_use != 0 || mem.bytes_used != 0)
      return m_.fail("every sequence removed, yet blocks_in_use = " + std::to_string(mem.blocks_in_use) +
                     ", bytes_used = " + std::to_string(mem.bytes_used));
    return "";
  }

 private:
  SeqModel m_;
  std::mt19937_64 rng_;

  i64 uniform(i64 lo, i64 hi) { return lo + static_cast<i64>(rng_() % static_cast<std::uint64_t>(hi - lo + 1)); }
  bool chance(int percent) { return uniform(0, 99) < percent; }
  std::size_t pick(std::size_t n) { return static_cast<std::size_t>(uniform(0, static_cast<i64>(n) - 1)); }

  std::string step() {
    if (m_.live.empty()) return add();
    // Keep the references short: a sequence past 80 tokens is removed.
    for (std::size_t i = 0; i < m_.live.size(); ++i)
      if (m_.live[i].ref.seq_length() > 80) return m_.remove(i);
    const std::size_t n = m_.live.size();
    const i64 dice = uniform(0, 99);
    if (dice < 8 && n < 6) return add();
    if (dice < 16 && n < 6) return m_.fork(pick(n));
    if (dice < 21) return m_.remove(pick(n));
    if (dice < 24) return stale();
    if (dice < 25) return m_.keep(pick(n));
    if (dice < 45) return crop();
    if (dice < 51) return m_.activate(pick(n), uniform(0, 8));
    if (dice < 53) return m_.deactivate(pick(n));
    if (dice < 56) return invalid_batch();
    if (dice < 58) return m_.shrink();
    if (dice < 64) return snapshot_op();
    return forward();
  }

  std::string snapshot_op() {
    const std::size_t n = m_.live.size();
    const std::size_t h = m_.held.size();
    if (h == 0 || (h < 4 && chance(35))) return m_.take_snapshot(pick(n));
    const i64 dice = uniform(0, 99);
    if (dice < 30 && n < 6) return m_.restore_new(pick(h));
    if (dice < 55) return m_.restore_into(pick(n), pick(h));
    if (dice < 75 && n < 6) return m_.export_import(pick(n), chance(50) ? pick(h) : h);
    return m_.drop_snapshot(pick(h));
  }

  // A new sequence, most of them recording (so that crops are exact).
  std::string add() {
    if (std::string e = m_.add(); !e.empty()) return e;
    return chance(70) ? m_.activate(m_.live.size() - 1, uniform(0, 8)) : "";
  }

  std::string stale() {
    if (!m_.removed.empty() && chance(70)) return m_.stale_calls(m_.removed[pick(m_.removed.size())]);
    const SeqId live = m_.live[pick(m_.live.size())].id;
    const SeqId forged[3] = {SeqId{}, SeqId{live.slot, live.generation + 1000}, SeqId{1u << 30, 1}};
    return m_.stale_calls(forged[uniform(0, 2)]);
  }

  std::string crop() {
    const std::size_t i = pick(m_.live.size());
    const i64 L = m_.live[i].ref.seq_length();
    const i64 mr = m_.live[i].ref.max_rollback();
    const i64 kind = uniform(0, 99);
    i64 n;
    if (kind < 50)
      n = uniform(-(L + 2), -1);
    else if (kind < 65)
      n = 0;
    else if (kind < 80)
      n = uniform(1, L + 2);
    else
      n = chance(50) ? -mr : -(mr + 1);
    return m_.crop(i, n);
  }

  std::vector<std::size_t> subset(std::size_t k) {
    std::vector<std::size_t> idx(m_.live.size());
    std::iota(idx.begin(), idx.end(), std::size_t{0});
    std::shuffle(idx.begin(), idx.end(), rng_);
    idx.resize(k);
    return idx;
  }

  std::string forward() {
    const std::size_t k = static_cast<std::size_t>(uniform(1, std::min<i64>(4, static_cast<i64>(m_.live.size()))));
    std::vector<std::pair<std::size_t, i64>> plan;
    for (std::size_t idx : subset(k)) {
      const i64 q = chance(15) ? 0 : chance(10) ? uniform(7, 20) : uniform(1, 6);
      plan.push_back({idx, q});
    }
    ForwardOptions fo;
    fo.strided = chance(30);
    if (chance(12)) {
      fo.abandon_layer = static_cast<int>(uniform(0, m_.num_layers()));
      fo.abandon_stage = static_cast<int>(uniform(0, 2));
      fo.abandon_how = static_cast<int>(uniform(0, 2));
      fo.remove_after_abandon = chance(50);
    }
    return m_.forward(plan, fo);
  }

  std::string invalid_batch() {
    std::vector<std::pair<std::size_t, i64>> plan;
    const std::size_t i = pick(m_.live.size());
    switch (uniform(0, 3)) {
      case 0: break;                           // empty list
      case 1: plan = {{i, 1}, {i, 2}}; break;  // a sequence twice
      case 2: plan = {{i, -1}}; break;         // a negative count
      default:                                 // no token at all
        for (std::size_t j : subset(m_.live.size())) plan.push_back({j, 0});
    }
    return m_.forward(plan);
  }
};

class SequencesRandomized : public testing::TestWithParam<RandomConfig> {};

TEST_P(SequencesRandomized, EverySequenceMatchesItsReferenceAfterEveryOperation) {
  WarningCapture quiet;  // positive crops warn once
  RandomDriver d(GetParam());
  const std::string e = d.run(GetParam().ops);
  ASSERT_TRUE(e.empty()) << e << "\nconfig " << GetParam().spec.name << ", seed " << GetParam().seed;
}

SeqSpec spec(std::string name, std::vector<LayerKind> kinds, DType dt, i64 bs, i64 W = 4, i64 C = 4, i64 K = 3) {
  SeqSpec s;
  s.name = std::move(name);
  s.kinds = std::move(kinds);
  s.dtype = dt;
  s.block_size = bs;
  s.window = W;
  s.chunk = C;
  s.kernel = K;
  return s;
}

const SeqSpec kMixedF32 = spec("mixed_f32_bs3",
                               {LayerKind::FullAttention, LayerKind::SlidingAttention, LayerKind::LinearAttention,
                                LayerKind::Conv, LayerKind::SparseAttention, LayerKind::Moe},
                               DType::F32, 3);
const SeqSpec kHybridsF16 = spec("hybrids_f16_bs1",
                                 {LayerKind::ChunkedAttention, LayerKind::Hybrid, LayerKind::Mlp,
                                  LayerKind::HybridSliding, LayerKind::FullAttention},
                                 DType::F16, 1, 3, 5, 2);
const SeqSpec kEveryBF16 = spec("every_kind_bf16_bs2", kEveryLayerKind, DType::BF16, 2);
const SeqSpec kAttentionF32 = spec("attention_f32_bs16",
                                   {LayerKind::FullAttention, LayerKind::SlidingAttention, LayerKind::ChunkedAttention,
                                    LayerKind::SparseAttention, LayerKind::HybridSliding},
                                   DType::F32, 16, 6, 3, 4);

INSTANTIATE_TEST_SUITE_P(
    Caches, SequencesRandomized,
    testing::Values(RandomConfig{kMixedF32, 500, 0x5e90001}, RandomConfig{kMixedF32, 500, 0x5e90002},
                    RandomConfig{kHybridsF16, 500, 0x5e90003}, RandomConfig{kHybridsF16, 500, 0x5e90004},
                    RandomConfig{kEveryBF16, 500, 0x5e90005}, RandomConfig{kEveryBF16, 500, 0x5e90006},
                    RandomConfig{kAttentionF32, 500, 0x5e90007}, RandomConfig{kAttentionF32, 500, 0x5e90008}),
    [](const testing::TestParamInfo<RandomConfig>& i) { return i.param.spec.name + "_" + std::to_string(i.index); });

// ---- 2. targeted ---------------------------------------------------------------------

// Full attention only, one head of width 1 (f32): token p of a sequence is
// the key value given, its value the negated key.
LayerOptions scalar_options() {
  LayerOptions o;
  o.dtype = DType::F32;
  o.batch_size = 1;
  o.num_kv_heads = 1;
  o.key_dim = 1;
  o.value_dim = 1;
  o.sliding_window = 4;
  return o;
}

void append(SequenceCache& c, SeqId id, const std::vector<float>& keys) {
  const i64 q = static_cast<i64>(keys.size());
  std::vector<float> k = keys, v;
  for (float x : keys) v.push_back(-x);
  const BatchEntry en[1] = {{id, q}};
  SequenceBatch b = c.begin_batch(en);
  for (int i = 0; i < c.num_layers(); ++i)
    (void)c.update(TensorView::contiguous(k.data(), DType::F32, {1, 1, q, 1}),
                   TensorView::contiguous(v.data(), DType::F32, {1, 1, q, 1}), i);
  b.commit();
}

std::vector<float> floats(const rwd::Tensor& t) {
  return std::vector<float>(t.data<float>(), t.data<float>() + t.numel());
}
std::vector<float> negated(std::vector<float> v) {
  for (float& x : v) x = -x;
  return v;
}
std::vector<float> iota_from(float first, int n) {
  std::vector<float> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), first);
  return v;
}
std::vector<float> cat(std::vector<float> a, const std::vector<float>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

#define EXPECT_SEQ(c, id, want)                                     \
  do {                                                              \
    EXPECT_EQ(floats((c).keys(id, 0)), (want));                     \
    EXPECT_EQ(floats((c).values(id, 0)), negated(want));            \
    EXPECT_EQ((c).seq_length(id), static_cast<i64>((want).size())); \
  } while (0)

TEST(SequenceHandles, StaleAndForgedIdsAreRefusedAndNeverAliasANewSequence) {
  SequenceCache c({"full_attention"}, scalar_options(), {4});
  const SeqId none;
  EXPECT_EQ(none.generation, 0u);
  EXPECT_FALSE(c.contains(none));
  EXPECT_THROW((void)c.seq_length(none), IndexError);
  EXPECT_FALSE(c.seq_rm(none));  // never issued: no live sequence, nothing to remove
  EXPECT_THROW((void)c.fork(none), IndexError);

  const SeqId a = c.add_sequence();
  EXPECT_NE(a.generation, 0u);
  EXPECT_TRUE(c.contains(a));
  append(c, a, {1, 2, 3});
  EXPECT_TRUE(c.seq_rm(a));
  EXPECT_FALSE(c.seq_rm(a));  // idempotent
  EXPECT_FALSE(c.seq_rm(a));
  EXPECT_FALSE(c.contains(a));
  EXPECT_EQ(c.num_sequences(), 0);
  EXPECT_THROW((void)c.seq_length(a), IndexError);
  EXPECT_THROW(c.crop(a, -1), IndexError);
  EXPECT_THROW((void)c.fork(a), IndexError);
  EXPECT_THROW(c.activate_past_recording(a, 2), IndexError);
  EXPECT_THROW((void)c.keys(a, 0), IndexError);
  {
    const BatchEntry en[1] = {{a, 1}};
    EXPECT_THROW((void)c.begin_batch(en), IndexError);
    EXPECT_FALSE(c.batch_open());
  }

  // The freed slot is reused under a new generation; the old id stays dead.
  SeqId reused;
  std::vector<SeqId> others;
  for (int k = 0; k < 8 && reused.generation == 0; ++k) {
    const SeqId b = c.add_sequence();
    EXPECT_FALSE(b == a);
    if (b.slot == a.slot)
      reused = b;
    else
      others.push_back(b);
  }
  ASSERT_NE(reused.generation, 0u) << "slot " << a.slot << " was not reused within 8 add_sequence calls";
  EXPECT_NE(reused.generation, a.generation);
  EXPECT_TRUE(c.contains(reused));
  EXPECT_FALSE(c.contains(a));
  EXPECT_THROW((void)c.seq_length(a), IndexError);
  EXPECT_EQ(c.seq_length(reused), 0);  // not the 3 tokens of the old sequence
  append(c, reused, {7});
  EXPECT_FALSE(c.seq_rm(a));  // does not remove the new one
  EXPECT_TRUE(c.contains(reused));
  EXPECT_SEQ(c, reused, std::vector<float>{7});

  // Forged ids: a generation not issued yet, a slot never used.
  const SeqId ahead{reused.slot, reused.generation + 1000};
  EXPECT_FALSE(c.contains(ahead));
  EXPECT_THROW((void)c.seq_length(ahead), IndexError);
  EXPECT_FALSE(c.seq_rm(ahead));
  const SeqId far{1u << 30, 1};
  EXPECT_FALSE(c.seq_rm(far));
  EXPECT_THROW(c.crop(far, 0), IndexError);
  EXPECT_TRUE(c.contains(reused));
  EXPECT_EQ(c.num_sequences(), static_cast<i64>(others.size()) + 1);
  // An id of another cache names no sequence of this one.
  SequenceCache other({"full_attention"}, scalar_options(), {4});
  const SeqId foreign = other.add_sequence();
  if (!c.contains(foreign)) {
    EXPECT_THROW((void)c.seq_length(foreign), IndexError);
    EXPECT_FALSE(c.seq_rm(foreign));
    EXPECT_TRUE(other.contains(foreign));
  }
  const SeqId mine = c.add_sequence();
  EXPECT_FALSE(other.contains(mine)) << "generations come from one process-wide counter";
  EXPECT_THROW((void)other.seq_length(mine), IndexError);
  EXPECT_FALSE(other.seq_rm(mine));
  EXPECT_TRUE(c.contains(mine));

  EXPECT_EQ(rwd::to_string(SeqId{3, 2}), "sequence 3 (generation 2)");
}

// The header: seq_pos_max is L - 1; seq_pos_min the smallest position whose
// keys some attention layer holds, at most L - 1 (L - 1 without attention);
// both -1 when the sequence is empty.
TEST(SequenceHandles, SeqPosMinAndMax) {
  LayerOptions o = seq_options(kMixedF32);
  o.chunk_size = 3;
  SequenceCache c({"sliding_attention", "conv"}, o, {2});
  const SeqId s = c.add_sequence();
  EXPECT_EQ(c.seq_pos_max(s), -1);
  EXPECT_EQ(c.seq_pos_min(s), -1) << "empty sequence";
  SequenceCache lin({"conv", "mlp"}, o, {2});
  const SeqId t = lin.add_sequence();
  EXPECT_EQ(lin.seq_pos_min(t), -1) << "empty, no attention";
  SequenceCache chunked({"chunked_attention"}, o, {2});
  const SeqId u = chunked.add_sequence();
  auto forward = [](SequenceCache& cc, SeqId id, i64 q) {
    std::vector<float> kb(static_cast<std::size_t>(2 * q * 3), 1.f), vb(static_cast<std::size_t>(2 * q * 2), 2.f),
        x0(static_cast<std::size_t>(3 * q), 3.f), x1(static_cast<std::size_t>(2 * q), 4.f);
    const BatchEntry en[1] = {{id, q}};
    SequenceBatch b = cc.begin_batch(en);
    for (int i = 0; i < cc.num_layers(); ++i) {
      const LayerKind k = cc.layer_kind(i);
      if (k == LayerKind::SlidingAttention || k == LayerKind::ChunkedAttention)
        (void)cc.update(TensorView::contiguous(kb.data(), DType::F32, {1, 2, q, 3}),
                        TensorView::contiguous(vb.data(), DType::F32, {1, 2, q, 2}), i);
      if (k == LayerKind::Conv) {
        (void)cc.update_conv_state(TensorView::contiguous(x0.data(), DType::F32, {1, 3, q}), i, 0);
        (void)cc.update_conv_state(TensorView::contiguous(x1.data(), DType::F32, {1, 2, q}), i, 1);
      }
    }
    b.commit();
  };
  forward(c, s, 6);
  forward(lin, t, 6);
  EXPECT_EQ(c.seq_pos_max(s), 5);
  EXPECT_EQ(c.seq_pos_min(s), 3) << "W = 4: positions 3..5 retained";
  EXPECT_EQ(lin.seq_pos_max(t), 5);
  EXPECT_EQ(lin.seq_pos_min(t), 5) << "no attention: L - 1";
  forward(chunked, u, 5);  // C = 3: chunk {3, 4} retained
  EXPECT_EQ(chunked.seq_pos_min(u), 3);
  forward(chunked, u, 1);  // L = 6: the current chunk starts at 6, no key held
  EXPECT_EQ(chunked.stored_range(u, 0).size(), 0);
  EXPECT_EQ(chunked.seq_pos_min(u), 5) << "no key held: at most L - 1";
}

TEST(SequenceFork, ChildAndParentAreIndependentAcrossASharedPartialBlock) {
  // Block size 4, fork after positions 0..9: blocks {0..3}, {4..7}, {8, 9} shared.
  SequenceCache c({"full_attention"}, scalar_options(), {4});
  const SeqId p = c.add_sequence();
  const std::vector<float> base = iota_from(100, 10);
  append(c, p, base);
  EXPECT_EQ(c.memory().blocks_in_use, 3);
  const SeqId ch = c.fork(p);
  EXPECT_EQ(c.memory().blocks_in_use, 3) << "a fork shares its parent's blocks";
  EXPECT_SEQ(c, ch, base);

  append(c, ch, {200, 201, 202});  // copies the shared partial block {8, 9}, then one new block
  EXPECT_SEQ(c, ch, cat(base, {200, 201, 202}));
  EXPECT_SEQ(c, p, base);
  EXPECT_EQ(c.memory().blocks_in_use, 5);

  c.crop(ch, -5);  // the child back to 0..7: its two own blocks are released
  EXPECT_SEQ(c, ch, iota_from(100, 8));
  EXPECT_SEQ(c, p, base);
  EXPECT_EQ(c.memory().blocks_in_use, 3);

  append(c, p, {110, 111});  // block {8, 9} is the parent's alone now
  EXPECT_SEQ(c, p, iota_from(100, 12));
  EXPECT_SEQ(c, ch, iota_from(100, 8));
  EXPECT_EQ(c.memory().blocks_in_use, 3);

  append(c, ch, {300});  // position 8 of the child: a new block of its own
  EXPECT_SEQ(c, ch, cat(iota_from(100, 8), {300}));
  EXPECT_SEQ(c, p, iota_from(100, 12));
  EXPECT_EQ(c.memory().blocks_in_use, 4);

  c.crop(p, -3);  // parent 0..8: still three blocks, the child's untouched
  EXPECT_SEQ(c, p, iota_from(100, 9));
  EXPECT_SEQ(c, ch, cat(iota_from(100, 8), {300}));
  EXPECT_EQ(c.memory().blocks_in_use, 4);

  EXPECT_TRUE(c.seq_rm(p));  // blocks {0..3}, {4..7} stay for the child
  EXPECT_SEQ(c, ch, cat(iota_from(100, 8), {300}));
  EXPECT_EQ(c.memory().blocks_in_use, 3);
  EXPECT_TRUE(c.seq_rm(ch));
  EXPECT_EQ(c.memory().blocks_in_use, 0);
  EXPECT_EQ(c.memory().bytes_used, 0u);
}

TEST(SequenceFork, BothWritersOfASharedPartialBlockKeepTheirOwnRows) {
  SequenceCache c({"full_attention"}, scalar_options(), {4});
  const SeqId p = c.add_sequence();
  const std::vector<float> base = iota_from(100, 10);
  append(c, p, base);
  const SeqId ch = c.fork(p);
  append(c, p, {110});  // the parent writes row 2 of the shared block first
  EXPECT_EQ(c.memory().blocks_in_use, 4);
  append(c, ch, {210});  // then the child, into the same row of its block
  EXPECT_EQ(c.memory().blocks_in_use, 4);
  EXPECT_SEQ(c, p, cat(base, {110}));
  EXPECT_SEQ(c, ch, cat(base, {210}));
  // A fork of the fork at the same length: three sequences over the shared prefix.
  const SeqId g = c.fork(ch);
  c.crop(g, -2);
  append(c, g, {320, 321, 322});
  EXPECT_SEQ(c, g, cat(iota_from(100, 9), {320, 321, 322}));
  EXPECT_SEQ(c, ch, cat(base, {210}));
  EXPECT_SEQ(c, p, cat(base, {110}));
}

TEST(SequenceFork, EveryKindForkedMidBlockMatchesTheReference) {
  SeqModel m(spec("every_kind_bs4", kEveryLayerKind, DType::F32, 4));
  ASSERT_EQ(m.add(), "");
  ASSERT_EQ(m.activate(0, 3), "");
  ASSERT_EQ(m.forward({{0, 10}}), "");
  ASSERT_EQ(m.fork(0), "");  // sequence 1, forked at L = 10 (mid-block)
  ASSERT_EQ(m.forward({{1, 3}}), "");
  ASSERT_EQ(m.crop(1, -2), "");
  ASSERT_EQ(m.forward({{0, 2}}), "");
  ASSERT_EQ(m.crop(0, -3), "");
  ASSERT_EQ(m.forward({{1, 1}, {0, 4}}), "");
  ASSERT_EQ(m.crop(1, 0), "");
  ASSERT_EQ(m.remove(0), "");
  ASSERT_EQ(m.forward({{0, 2}}), "");
  ASSERT_EQ(m.remove(0), "");
  EXPECT_EQ(m.cache.memory().blocks_in_use, 0);
  EXPECT_EQ(m.cache.memory().bytes_used, 0u);
}

TEST(SequenceBatchInvariance, ARaggedBatchEqualsSingleSequenceBatches) {
  const SeqSpec s = spec("every_kind_bs3", kEveryLayerKind, DType::F32, 3);
  SeqModel a(s), b(s);
  for (SeqModel* m : {&a, &b}) {
    for (int k = 0; k < 3; ++k) ASSERT_EQ(m->add(), "");
    ASSERT_EQ(m->activate(0, 4), "");
    ASSERT_EQ(m->activate(2, 2), "");
  }
  ASSERT_EQ(a.forward({{0, 5}, {1, 2}, {2, 7}}), "");
  ASSERT_EQ(b.forward({{0, 5}}), "");
  ASSERT_EQ(b.forward({{1, 2}}), "");
  ASSERT_EQ(b.forward({{2, 7}}), "");
  // q = {3, 0, 1} in one batch, against {3} and {1} alone ({0} alone is no batch).
  ASSERT_EQ(a.forward({{0, 3}, {1, 0}, {2, 1}}), "");
  ASSERT_EQ(b.forward({{0, 3}}), "");
  ASSERT_EQ(b.forward({{1, 0}}), "");  // refused (InvalidArgument), nothing changes
  ASSERT_EQ(b.forward({{2, 1}}), "");
  for (std::size_t k = 0; k < 3; ++k) {
    EXPECT_EQ(a.live[k].ref.seq_length(), b.live[k].ref.seq_length());
    EXPECT_TRUE(a.fingerprint(a.live[k].id) == b.fingerprint(b.live[k].id)) << "sequence " << k;
  }
  EXPECT_EQ(a.cache.memory().blocks_in_use, b.cache.memory().blocks_in_use);
}

TEST(SequenceAbandon, RestoresContentLengthsAndBlocksAtEveryPoint) {
  SeqModel m(spec("every_kind_bs2", kEveryLayerKind, DType::BF16, 2));
  ASSERT_EQ(m.add(), "");
  ASSERT_EQ(m.add(), "");
  ASSERT_EQ(m.activate(0, 3), "");
  ASSERT_EQ(m.forward({{0, 5}, {1, 3}}), "");
  ASSERT_EQ(m.fork(0), "");
  for (int layer = 0; layer <= m.num_layers(); ++layer)
    for (int stage = 0; stage <= 2; ++stage)
      for (int how = 0; how <= 2; ++how) {
        ForwardOptions fo;
        fo.abandon_layer = layer;
        fo.abandon_stage = stage;
        fo.abandon_how = how;
        const SequenceMemory before = m.cache.memory();
        ASSERT_EQ(m.forward({{2, 3}, {1, 0}, {0, 6}}, fo), "");
        EXPECT_EQ(m.cache.memory().blocks_in_use, before.blocks_in_use);
        EXPECT_EQ(m.cache.memory().bytes_used, before.bytes_used);
      }
  ASSERT_EQ(m.forward({{2, 3}, {1, 1}, {0, 6}}), "");  // and the cache still works
}

TEST(SequenceBudget, ARefusedBatchChangesNothing) {
  SeqModel m(spec("full_linear_bs4", {LayerKind::FullAttention, LayerKind::LinearAttention}, DType::F32, 4));
  ASSERT_EQ(m.add(), "");
  ASSERT_EQ(m.forward({{0, 4}}), "");  // block {0..3} full: the next token needs a block
  m.cache.shrink_to_fit();
  EXPECT_EQ(m.cache.memory().blocks_free, 0);
  const std::size_t reserved = m.cache.memory().bytes_reserved;
  EXPECT_THROW(m.cache.set_memory_budget(reserved - 1), CapacityError);
  EXPECT_EQ(m.cache.memory_budget(), 0u);
  m.cache.set_memory_budget(reserved);
  const Snapshot before = m.snapshot();
  const SeqId id = m.live[0].id;
  {
    const BatchEntry en[1] = {{id, 1}};
    EXPECT_THROW((void)m.cache.begin_batch(en), CapacityError);
  }
  EXPECT_EQ(m.same_as(before), "");
  EXPECT_EQ(m.cache.seq_length(id), 4);
  EXPECT_EQ(m.verify_all(), "");
  m.cache.set_memory_budget(0);
  ASSERT_EQ(m.forward({{0, 1}}), "");
}

TEST(SequenceErrors, ConstructionRefusesBatchesStaticStorageAndBadBlockSizes) {
  const LayerOptions good = seq_options(kMixedF32);
  LayerOptions o = good;
  o.batch_size = 2;
  EXPECT_THROW(SequenceCache({"full_attention"}, o), InvalidArgument);
  o = good;
  o.static_capacity = 16;
  EXPECT_THROW(SequenceCache({"full_attention"}, o), InvalidArgument);
  EXPECT_THROW(SequenceCache({"sliding_attention"}, o), InvalidArgument);
  for (i64 bs : {i64{0}, i64{-1}, i64{65537}, i64{1} << 40})
    EXPECT_THROW(SequenceCache({"full_attention"}, good, {bs}), InvalidArgument) << "block_size " << bs;
  EXPECT_THROW(SequenceCache({"full_attention", "no_such_layer"}, good), InvalidArgument);
  EXPECT_THROW(SequenceCache({}, good), InvalidArgument);
  for (i64 bs : {i64{1}, i64{65536}}) {
    SequenceCache c({"full_attention"}, good, {bs});
    EXPECT_EQ(c.block_size(), bs);
    EXPECT_EQ(c.block_layout(0).block_size, bs);
  }
}

// Layers of different shapes (an LFM2-style conv layer next to a Gated
// DeltaNet layer with another kernel and width, attention of its own head
// size): each keeps its own options, and a batch carries inputs of each
// layer's own shape. Expectations worked by hand: conv inputs are the values
// fed, the window is the K - 1 inputs before (zeros before position 0) and
// the new ones.
TEST(SequenceErrors, LayersOfDifferentShapes) {
  rwd::LayerOptions conv, linear, attention;
  conv.conv_kernel_size = 3;
  conv.conv_channels = {2};
  linear.conv_kernel_size = 4;
  linear.conv_channels = {5};
  linear.recurrent_shapes = {{2}};
  attention.num_kv_heads = 1;
  attention.key_dim = 4;
  attention.sliding_window = 2;
  SequenceCache c({{rwd::LayerKind::Conv, conv},
                   {rwd::LayerKind::LinearAttention, linear},
                   {rwd::LayerKind::SlidingAttention, attention}},
                  {2});
  EXPECT_EQ(c.layer_options(0).conv_kernel_size, 3);
  EXPECT_EQ(c.layer_options(1).conv_channels, (std::vector<i64>{5}));
  EXPECT_EQ(c.layer_options(2).sliding_window, 2);
  EXPECT_THROW((void)c.layer_options(3), IndexError);
  EXPECT_EQ(c.layer_kind(0), rwd::LayerKind::Conv);
  const SeqId a = c.add_sequence(), b = c.add_sequence();
  const std::vector<BatchEntry> entries{{a, 2}, {b, 1}};
  SequenceBatch batch = c.begin_batch(entries);
  // x0: [1, 2, T=3], value 10 * t + channel; x1: [1, 5, 3], 100 + that.
  std::vector<float> x0(6), x1(15), keys(12, 1.0f), values(12, 2.0f);
  for (i64 t = 0; t < 3; ++t) {
    for (i64 ch = 0; ch < 2; ++ch) x0[static_cast<std::size_t>(ch * 3 + t)] = static_cast<float>(10 * t + ch);
    for (i64 ch = 0; ch < 5; ++ch) x1[static_cast<std::size_t>(ch * 3 + t)] = static_cast<float>(100 + 10 * t + ch);
  }
  const auto windows0 = c.update_conv_state(TensorView::contiguous(x0.data(), DType::F32, {1, 2, 3}), 0);
  ASSERT_EQ(windows0.size(), 2u);
  EXPECT_EQ(windows0[0].size(2), 3 - 1 + 2);   // K - 1 + q
  EXPECT_EQ(windows0[0].get(0, 1, 2), 1.0f);   // a's first input, channel 1
  EXPECT_EQ(windows0[1].get(0, 0, 2), 20.0f);  // b's input is the batch's token 2
  EXPECT_EQ(windows0[1].get(0, 0, 0), 0.0f);   // zero padding before position 0
  EXPECT_THROW((void)c.update_conv_state(TensorView::contiguous(x0.data(), DType::F32, {1, 2, 3}), 1),
               InvalidArgument);  // layer 1 has 5 channels
  const auto windows1 = c.update_conv_state(TensorView::contiguous(x1.data(), DType::F32, {1, 5, 3}), 1);
  EXPECT_EQ(windows1[0].size(2), 4 - 1 + 2);
  EXPECT_EQ(windows1[1].get(0, 4, 3), 124.0f);
  BatchRecurrentUpdate u = c.begin_recurrent_update(1);
  for (std::size_t e = 0; e < u.num_entries(); ++e)
    for (i64 t = 1; t <= u.num_tokens(e); ++t) u.next(e, t).set(static_cast<float>(t), 0, 0);
  u.commit();
  const auto kv = c.update(TensorView::contiguous(keys.data(), DType::F32, {1, 1, 3, 4}),
                           TensorView::contiguous(values.data(), DType::F32, {1, 1, 3, 4}), 2);
  EXPECT_EQ(kv[0].kv_length, 2);
  batch.commit();
  EXPECT_EQ(c.conv_range(a, 0).first, -3);  // K zero rows still held: L = 2 <= K
  EXPECT_EQ(c.get_conv_state(b, 1).size(2), 4);
  EXPECT_EQ(c.get_conv_state(b, 1).get(0, 2, 3), 122.0f);
  EXPECT_EQ(c.get_recurrent_state(a, 1).get(0, 0), 2.0f);
  // Each layer's own options are checked, the message names the layer.
  rwd::LayerOptions two_rows = conv;
  two_rows.batch_size = 2;
  try {
    SequenceCache bad({{rwd::LayerKind::Conv, conv}, {rwd::LayerKind::Conv, two_rows}});
    ADD_FAILURE() << "batch_size 2 accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("layer 1"), std::string::npos) << e.what();
  }
  EXPECT_THROW(SequenceCache(std::vector<rwd::SequenceLayer>{}), InvalidArgument);
  rwd::LayerOptions no_kernel = conv;
  no_kernel.conv_kernel_size = 0;
  EXPECT_THROW(SequenceCache({{rwd::LayerKind::Conv, no_kernel}}), InvalidArgument);
}

TEST(SequenceErrors, BlockLayoutGeometry) {
  SequenceCache c({"deepseek_sparse_attention", "linear_attention"}, seq_options(kMixedF32), {3});
  const BlockLayout& bl = c.block_layout(0);
  EXPECT_EQ(bl.block_size, 3);
  EXPECT_EQ(bl.dtype, DType::F32);
  EXPECT_EQ(bl.num_kv_heads, 2);
  EXPECT_EQ(bl.key_dim, 3);
  EXPECT_EQ(bl.value_dim, 2);
  EXPECT_EQ(bl.side_dims, (std::vector<i64>{4, 1}));
  ASSERT_EQ(bl.num_parts(), 4);
  EXPECT_EQ(bl.row_elements(0), 6);  // H * key_dim
  EXPECT_EQ(bl.row_elements(1), 4);  // H * value_dim
  EXPECT_EQ(bl.row_elements(2), 4);
  EXPECT_EQ(bl.row_elements(3), 1);
  ASSERT_EQ(bl.part_offsets.size(), 4u);
  // Parts in order, 64-byte aligned, each block_size rows long, inside the block.
  const std::size_t part_bytes[4] = {3 * 6 * 4, 3 * 4 * 4, 3 * 4 * 4, 3 * 1 * 4};
  for (std::size_t k = 0; k < 4; ++k) {
    EXPECT_EQ(bl.part_offsets[k] % 64, 0u) << "part " << k;
    if (k > 0) {
      EXPECT_GE(bl.part_offsets[k], bl.part_offsets[k - 1] + part_bytes[k - 1]) << "part " << k;
    }
  }
  EXPECT_GE(bl.block_bytes, bl.part_offsets[3] + part_bytes[3]);
  std::vector<std::byte> block(bl.block_bytes + 64);
  const std::byte* base = block.data();
  const TensorView k = bl.rows(base, 0, 1, 2);
  EXPECT_EQ(shape_of(k), (std::vector<i64>{1, 2, 2, 3}));
  EXPECT_EQ(static_cast<const std::byte*>(k.data), base + bl.part_offsets[0] + 1 * 6 * 4);
  const TensorView s = bl.rows(base, 2, 0, 3);
  EXPECT_EQ(shape_of(s), (std::vector<i64>{1, 3, 4}));
  EXPECT_EQ(static_cast<const std::byte*>(s.data), base + bl.part_offsets[2]);
  EXPECT_THROW((void)c.block_layout(1), StateError);
  EXPECT_THROW((void)c.block_layout(2), IndexError);
  EXPECT_THROW((void)c.layer_kind(2), IndexError);
  EXPECT_EQ(c.layer_kind(1), LayerKind::LinearAttention);
}

// Inputs for one batch over a SequenceCache of full_attention,
// linear_attention and deepseek_sparse_attention (kMixedF32, q tokens for the
// first entry): keys [1, 2, q, 3], values [1, 2, q, 2], side rows [1, q, 4] and
// [1, q, 1], conv [1, 3, q] and [1, 2, q].
struct MixedBatchInputs {
  static constexpr i64 q = 2;
  std::vector<float> kb = std::vector<float>(2 * q * 3), vb = std::vector<float>(2 * q * 2),
                     s0 = std::vector<float>(q * 4), s1 = {20.f, 21.f}, c0 = std::vector<float>(3 * q),
                     c1 = std::vector<float>(2 * q);
  TensorView keys, values, side0, side1, conv0, conv1;

  MixedBatchInputs() {
    for (std::size_t i = 0; i < kb.size(); ++i) kb[i] = static_cast<float>(i) + 0.5f;
    for (std::size_t i = 0; i < vb.size(); ++i) vb[i] = -static_cast<float>(i) - 0.25f;
    for (std::size_t i = 0; i < s0.size(); ++i) s0[i] = static_cast<float>(i) + 10.f;
    for (std::size_t i = 0; i < c0.size(); ++i) c0[i] = static_cast<float>(i) + 30.f;
    for (std::size_t i = 0; i < c1.size(); ++i) c1[i] = static_cast<float>(i) + 40.f;
    keys = TensorView::contiguous(kb.data(), DType::F32, {1, 2, q, 3});
    values = TensorView::contiguous(vb.data(), DType::F32, {1, 2, q, 2});
    side0 = TensorView::contiguous(s0.data(), DType::F32, {1, q, 4});
    side1 = TensorView::contiguous(s1.data(), DType::F32, {1, q, 1});
    conv0 = TensorView::contiguous(c0.data(), DType::F32, {1, 3, q});
    conv1 = TensorView::contiguous(c1.data(), DType::F32, {1, 2, q});
  }
  MixedBatchInputs(const MixedBatchInputs&) = delete;  // the views point into this object's vectors
  MixedBatchInputs& operator=(const MixedBatchInputs&) = delete;
};

void expect_refused_outside_a_batch(SequenceCache& c, SeqId s, SeqId t, const MixedBatchInputs& in) {
  EXPECT_THROW((void)c.update(in.keys, in.values, 0), StateError);
  EXPECT_THROW((void)c.update_side(in.side0, 2, 0), StateError);
  EXPECT_THROW((void)c.update_conv_state(in.conv0, 1, 0), StateError);
  EXPECT_THROW((void)c.begin_recurrent_update(1, 0), StateError);
  EXPECT_FALSE(c.batch_open());

  // Refused batches.
  std::vector<BatchEntry> none;
  EXPECT_THROW((void)c.begin_batch(none), InvalidArgument);
  const BatchEntry twice[2] = {{s, 1}, {s, 1}};
  EXPECT_THROW((void)c.begin_batch(twice), InvalidArgument);
  const BatchEntry negative[2] = {{s, 1}, {t, -1}};
  EXPECT_THROW((void)c.begin_batch(negative), InvalidArgument);
  const BatchEntry zero[2] = {{s, 0}, {t, 0}};
  EXPECT_THROW((void)c.begin_batch(zero), InvalidArgument);
  const BatchEntry huge[1] = {{s, kTokenLimit + 1}};
  EXPECT_THROW((void)c.begin_batch(huge), CapacityError);
  EXPECT_FALSE(c.batch_open());
  EXPECT_EQ(c.memory().blocks_in_use, 0);

  // Queries.
  EXPECT_THROW((void)c.get_mask_sizes(s, 0, 0), InvalidArgument);
  EXPECT_THROW((void)c.get_mask_sizes(s, kTokenLimit + 1, 0), InvalidArgument);
  EXPECT_THROW((void)c.get_mask_sizes(s, 1, 1), StateError);
  EXPECT_THROW((void)c.get_mask_sizes(s, 1, 3), IndexError);
  EXPECT_EQ(c.get_mask_sizes(s, kTokenLimit, 0).kv_length, kTokenLimit);
  EXPECT_THROW(c.activate_past_recording(s, -1), InvalidArgument);
  EXPECT_THROW(c.activate_past_recording(s, kTokenLimit + 1), InvalidArgument);
  EXPECT_THROW((void)c.keys(s, 1), StateError);
  EXPECT_THROW((void)c.stored_range(s, 1), StateError);
  EXPECT_EQ(expect_kinds([&] { (void)c.get_recurrent_state(s, 0, 0); }, {Err::State, Err::Index}), "");
}

// Whole-state operations, and wrong calls for the open batch.
void expect_refused_inside_a_batch(SequenceCache& c, SeqId s, SeqId t, const MixedBatchInputs& in) {
  EXPECT_THROW(c.crop(s, 0), StateError);
  EXPECT_THROW(c.crop(t, -1), StateError);
  EXPECT_THROW((void)c.add_sequence(), StateError);
  EXPECT_THROW((void)c.fork(s), StateError);
  EXPECT_THROW((void)c.seq_rm(t), StateError);
  EXPECT_THROW(c.seq_keep(s), StateError);
  EXPECT_THROW(c.activate_past_recording(s, 2), StateError);
  EXPECT_THROW(c.deactivate_past_recording(s), StateError);
  EXPECT_THROW(c.set_memory_budget(1 << 30), StateError);
  EXPECT_THROW(c.shrink_to_fit(), StateError);
  const BatchEntry other[1] = {{t, 1}};
  EXPECT_THROW((void)c.begin_batch(other), StateError);
  EXPECT_EQ(c.num_sequences(), 2);

  EXPECT_THROW((void)c.update(in.keys.slice(2, 0, 1), in.values.slice(2, 0, 1), 0), InvalidArgument);  // T = 1, not 2
  std::vector<std::uint16_t> h(in.kb.size());
  const TensorView f16 = TensorView::contiguous(h.data(), DType::F16, {1, 2, MixedBatchInputs::q, 3});
  EXPECT_THROW((void)c.update(f16, in.values, 0), InvalidArgument);
  EXPECT_THROW((void)c.update(in.keys, in.values, 1), StateError);  // no attention
  EXPECT_THROW((void)c.update(in.keys, in.values, 3), IndexError);
  EXPECT_THROW((void)c.update_conv_state(in.conv0, 0, 0), StateError);
  EXPECT_THROW((void)c.update_conv_state(in.conv0, 1, 5), IndexError);
  EXPECT_THROW((void)c.update_side(in.side0, 2, 5), IndexError);
}

// Both recurrent states of layer 1 for a batch of {q tokens, 0 tokens}: slot
// j of state st holds 100 st + 10 j + e at element e.
void write_recurrent_states(SequenceCache& c, i64 q) {
  for (int st = 0; st < 2; ++st) {
    BatchRecurrentUpdate u = c.begin_recurrent_update(1, st);
    ASSERT_EQ(u.num_entries(), 2u);  // every entry of the batch, the one of 0 tokens included
    EXPECT_EQ(u.num_tokens(0), q);
    EXPECT_EQ(u.num_tokens(1), 0);
    EXPECT_THROW((void)u.next(1, 1), IndexError);
    for (i64 j = 1; j <= q; ++j) {
      const TensorView slot = u.next(0, j);
      const i64 numel = slot.numel();
      for (i64 e = 0; e < numel; ++e) {
        // [1, 2, 3] or [1, 4]: element e of the row-major order.
        if (slot.rank == 3)
          slot.set(static_cast<float>(100 * st + 10 * j + e), 0, e / 3, e % 3);
        else
          slot.set(static_cast<float>(100 * st + 10 * j + e), 0, e);
      }
    }
    u.commit();
    EXPECT_THROW(u.commit(), StateError);
  }
}

// What the committed batch wrote for s (q tokens) and t (none), read back.
void expect_batch_read_back(SequenceCache& c, SeqId s, SeqId t, const MixedBatchInputs& in) {
  const i64 q = MixedBatchInputs::q;
  EXPECT_EQ(c.seq_length(s), q);
  EXPECT_EQ(c.seq_length(t), 0);
  EXPECT_TRUE(rwd::bitwise_equal(c.keys(s, 0).view(), in.keys));
  EXPECT_TRUE(rwd::bitwise_equal(c.values(s, 2).view(), in.values));
  EXPECT_TRUE(rwd::bitwise_equal(c.side(s, 2, 0).view(), in.side0));
  EXPECT_TRUE(rwd::bitwise_equal(c.side(s, 2, 1).view(), in.side1));
  const TensorView conv_state = c.get_conv_state(s, 1, 0);  // [1, 3, K = 3]: one zero, then the 2 inputs
  ASSERT_EQ(shape_of(conv_state), (std::vector<i64>{1, 3, 3}));
  for (i64 ch = 0; ch < 3; ++ch) {
    EXPECT_EQ(conv_state.get(0, ch, 0), 0.f);
    EXPECT_EQ(conv_state.get(0, ch, 1), in.c0[static_cast<std::size_t>(ch * q)]);
    EXPECT_EQ(conv_state.get(0, ch, 2), in.c0[static_cast<std::size_t>(ch * q + 1)]);
  }
  const TensorView rec = c.get_recurrent_state(s, 1, 1);  // S(2) of state 1: [1, 4]
  ASSERT_EQ(shape_of(rec), (std::vector<i64>{1, 4}));
  for (i64 e = 0; e < 4; ++e) EXPECT_EQ(rec.get(0, e), static_cast<float>(100 + 20 + e));
  const TensorView rec0 = c.get_recurrent_state(t, 1, 0);
  for (i64 e = 0; e < 6; ++e) EXPECT_EQ(rec0.get(0, e / 3, e % 3), 0.f);
}

TEST(SequenceErrors, CallsOutsideAndInsideABatch) {
  SequenceCache c({"full_attention", "linear_attention", "deepseek_sparse_attention"}, seq_options(kMixedF32), {2});
  const SeqId s = c.add_sequence();
  const SeqId t = c.add_sequence();
  const MixedBatchInputs in;
  const i64 q = MixedBatchInputs::q;
  expect_refused_outside_a_batch(c, s, t, in);

  const BatchEntry en[2] = {{s, q}, {t, 0}};
  SequenceBatch b = c.begin_batch(en);
  ASSERT_TRUE(b.is_open());
  EXPECT_TRUE(c.batch_open());
  EXPECT_EQ(b.num_tokens(), q);
  EXPECT_EQ(b.offset(0), 0);
  EXPECT_EQ(b.offset(1), q);
  expect_refused_inside_a_batch(c, s, t, in);

  const std::span<const PagedKeyValues> kv = c.update(in.keys, in.values, 0);
  ASSERT_EQ(kv.size(), 2u);
  EXPECT_EQ(kv[0].kv_offset, 0);
  EXPECT_EQ(kv[0].kv_length, q);
  EXPECT_EQ(kv[1].kv_length, 0);
  EXPECT_TRUE(kv[1].spans.empty());
  EXPECT_THROW((void)c.update(in.keys, in.values, 0), StateError);  // layer 0 twice
  // Layers 1 and 2 missing: the commit is refused, the batch stays open.
  try {
    b.commit();
    ADD_FAILURE() << "commit with layers missing did not throw";
  } catch (const StateError& e) {
    EXPECT_NE(std::string(e.what()).find("layer 1"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(b.is_open());
  EXPECT_TRUE(c.batch_open());
  (void)c.update_conv_state(in.conv0, 1, 0);
  EXPECT_THROW(b.commit(), StateError);  // conv state 1 and the recurrent states still missing
  EXPECT_TRUE(b.is_open());
  (void)c.update_conv_state(in.conv1, 1, 1);
  ASSERT_NO_FATAL_FAILURE(write_recurrent_states(c, q));
  EXPECT_THROW(b.commit(), StateError);  // layer 2 (side tensors included) still missing
  (void)c.update(in.keys, in.values, 2);
  EXPECT_THROW(b.commit(), StateError);  // its side tensors still missing
  (void)c.update_side(in.side0, 2, 0);
  (void)c.update_side(in.side1, 2, 1);
  b.commit();
  EXPECT_FALSE(b.is_open());
  EXPECT_FALSE(c.batch_open());
  EXPECT_THROW(b.commit(), StateError);

  ASSERT_NO_FATAL_FAILURE(expect_batch_read_back(c, s, t, in));
  // Crops are allowed again: a linear layer that does not record refuses
  // every crop (crop(0) included); recording from L = 2 on, S(1) is not
  // held, so only a full rollback is exact.
  EXPECT_THROW(c.crop(s, 0), rwd::RollbackError);
  c.activate_past_recording(s, 2);
  EXPECT_EQ(c.max_rollback(s), 0);
  EXPECT_THROW(c.crop(s, -1), rwd::RollbackError);
  EXPECT_EQ(c.seq_length(s), q);
  c.crop(s, -2);
  EXPECT_EQ(c.seq_length(s), 0);
  EXPECT_EQ(c.memory().blocks_in_use, 0);
}

TEST(SequenceErrors, GatherRefusesWrongShapesAndUncoveredPositions) {
  SequenceCache c({"full_attention"}, scalar_options(), {4});
  const SeqId s = c.add_sequence();
  append(c, s, iota_from(1, 6));
  const std::vector<BlockSpan> spans = c.block_spans(s, 0);
  const BlockLayout& bl = c.block_layout(0);
  rwd::Tensor ok(DType::F32, {1, 1, 6, 1});
  bl.gather(spans, 0, 0, ok.view());
  EXPECT_EQ(floats(ok), iota_from(1, 6));
  rwd::Tensor mid(DType::F32, {1, 1, 3, 1});
  bl.gather(spans, 1, 2, mid.view());
  EXPECT_EQ(floats(mid), negated(iota_from(3, 3)));
  rwd::Tensor too_long(DType::F32, {1, 1, 7, 1});
  EXPECT_THROW(bl.gather(spans, 0, 0, too_long.view()), InvalidArgument);
  EXPECT_THROW(bl.gather(spans, 0, 4, mid.view()), InvalidArgument);
  rwd::Tensor wrong_heads(DType::F32, {1, 2, 3, 1});
  EXPECT_THROW(bl.gather(spans, 0, 0, wrong_heads.view()), InvalidArgument);
}

// Batch handles: destroying one open abandons it, moving the cache keeps it
// working, a handle whose cache died is inert; a moved-from cache refuses.
TEST(SequenceErrors, BatchHandlesAndMovedCaches) {
  auto c = std::make_unique<SequenceCache>(std::vector<std::string>{"full_attention"}, scalar_options(),
                                           SequenceCacheOptions{4});
  const SeqId s = c->add_sequence();
  append(*c, s, {1, 2, 3});
  std::vector<float> k{4, 5}, v{-4, -5};
  const TensorView kv = TensorView::contiguous(k.data(), DType::F32, {1, 1, 2, 1});
  const TensorView vv = TensorView::contiguous(v.data(), DType::F32, {1, 1, 2, 1});
  const BatchEntry en[1] = {{s, 2}};
  {
    SequenceBatch b = c->begin_batch(en);
    (void)c->update(kv, vv, 0);
  }  // destroyed open: abandoned
  EXPECT_FALSE(c->batch_open());
  EXPECT_EQ(floats(c->keys(s, 0)), (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(c->memory().blocks_in_use, 1);

  SequenceBatch b = c->begin_batch(en);
  SequenceCache moved(std::move(*c));  // the open batch follows the cache's state
  EXPECT_THROW((void)c->add_sequence(), StateError);
  EXPECT_THROW((void)c->num_sequences(), StateError);
  EXPECT_TRUE(moved.batch_open());
  (void)moved.update(kv, vv, 0);
  b.commit();
  EXPECT_FALSE(moved.batch_open());
  EXPECT_EQ(floats(moved.keys(s, 0)), (std::vector<float>{1, 2, 3, 4, 5}));
  EXPECT_EQ(moved.memory().blocks_in_use, 2);

  auto owner = std::make_unique<SequenceCache>(std::move(moved));
  SequenceBatch orphan = owner->begin_batch(en);
  owner.reset();  // the cache dies first: the handle is inert
  EXPECT_FALSE(orphan.is_open());
  orphan.abandon();
  EXPECT_THROW(orphan.commit(), StateError);
}

TEST(SequenceMemoryBounds, SlidingLayersReturnBlocksToThePool) {
  // W = 4, block size 4: without recording 3 positions are retained (at most
  // 2 blocks), with R = 5 eight (at most 3 blocks).
  SeqModel m(spec("sliding_bs4", {LayerKind::SlidingAttention}, DType::F32, 4, 4));
  ASSERT_EQ(m.add(), "");
  ASSERT_EQ(m.add(), "");
  ASSERT_EQ(m.activate(1, 5), "");
  std::size_t reserved_early = 0;
  for (int k = 0; m.live[0].ref.seq_length() < 1000; ++k) {
    ASSERT_EQ(m.forward({{0, 1 + k % 5}, {1, 1 + (k * 3) % 4}}), "");
    const SequenceMemory mem = m.cache.memory();
    ASSERT_LE(mem.blocks_in_use, 2 + 3) << "at L = " << m.live[0].ref.seq_length();
    EXPECT_EQ(m.cache.stored_range(m.live[0].id, 0).first, std::max<i64>(0, m.live[0].ref.seq_length() - 3));
    EXPECT_EQ(m.cache.stored_range(m.live[1].id, 0).first, std::max<i64>(0, m.live[1].ref.seq_length() - 8));
    if (m.live[0].ref.seq_length() < 100)
      reserved_early = std::max(reserved_early, mem.bytes_reserved);
    else
      ASSERT_LE(mem.bytes_reserved, reserved_early) << "the pool grew at L = " << m.live[0].ref.seq_length();
  }
}

// ---- 3. issue 28: stale handles, exact refusals, lengths, messages -------------------

// Fills every part of every stateful layer of a one-sequence-per-entry batch
// with zeros (the values do not matter to these tests); returns the
// recurrent handle of `keep_layer` (state 0) uncommitted when asked.
void fill_batch(SequenceCache& c, SequenceBatch& b, std::optional<BatchRecurrentUpdate>* keep = nullptr,
                int keep_layer = -1) {
  const i64 T = b.num_tokens();
  for (int i = 0; i < c.num_layers(); ++i) {
    const LayerOptions& o = c.layer_options(i);
    const LayerKind k = c.layer_kind(i);
    const bool attention = k != LayerKind::LinearAttention && k != LayerKind::Conv && k != LayerKind::Moe &&
                           k != LayerKind::Mlp;
    const bool linear = k == LayerKind::LinearAttention || k == LayerKind::Conv || k == LayerKind::Hybrid ||
                        k == LayerKind::HybridSliding;
    if (attention) {
      std::vector<float> kk(static_cast<std::size_t>(o.num_kv_heads * T * o.key_dim), 0.5f);
      std::vector<float> vv(static_cast<std::size_t>(o.num_kv_heads * T * o.value_dim), 0.25f);
      (void)c.update(TensorView::contiguous(kk.data(), DType::F32, {1, o.num_kv_heads, T, o.key_dim}),
                     TensorView::contiguous(vv.data(), DType::F32, {1, o.num_kv_heads, T, o.value_dim}), i);
      if (k == LayerKind::SparseAttention)
        for (std::size_t sd = 0; sd < o.side_dims.size(); ++sd) {
          std::vector<float> r(static_cast<std::size_t>(T * o.side_dims[sd]), 1.0f);
          (void)c.update_side(TensorView::contiguous(r.data(), DType::F32, {1, T, o.side_dims[sd]}), i,
                              static_cast<int>(sd));
        }
    }
    if (!linear) continue;
    for (std::size_t cs = 0; cs < o.conv_channels.size(); ++cs) {
      std::vector<float> x(static_cast<std::size_t>(o.conv_channels[cs] * T), 1.0f);
      (void)c.update_conv_state(TensorView::contiguous(x.data(), DType::F32, {1, o.conv_channels[cs], T}), i,
                                static_cast<int>(cs));
    }
    if (k == LayerKind::Conv) continue;
    for (std::size_t rs = 0; rs < o.recurrent_shapes.size(); ++rs) {
      BatchRecurrentUpdate u = c.begin_recurrent_update(i, static_cast<int>(rs));
      if (keep != nullptr && i == keep_layer && rs == 0) {
        keep->emplace(std::move(u));
        continue;
      }
      u.commit();
    }
  }
}

SequenceCache linear_cache(std::vector<LayerKind> kinds, i64 block_size = 4) {
  const SeqSpec sp = spec("issue28", std::move(kinds), DType::F32, block_size);
  return SequenceCache(type_names(sp.kinds), seq_options(sp), SequenceCacheOptions{block_size});
}

void expect_same_memory(const SequenceMemory& a, const SequenceMemory& b) {
  EXPECT_EQ(a.bytes_reserved, b.bytes_reserved);
  EXPECT_EQ(a.bytes_used, b.bytes_used);
  EXPECT_EQ(a.blocks_in_use, b.blocks_in_use);
  EXPECT_EQ(a.blocks_free, b.blocks_free);
}

// Issue 28 item 1: a BatchRecurrentUpdate kept across abandon + seq_rm read
// the removed sequence's freed layer (heap-use-after-free under ASan).
TEST(SequenceStaleHandles, RecurrentUpdateKeptAcrossAbandonAndSeqRmIsRefused) {
  SequenceCache c = linear_cache({LayerKind::LinearAttention, LayerKind::FullAttention});
  const SeqId a = c.add_sequence(), b = c.add_sequence();
  const BatchEntry en[2] = {{a, 2}, {b, 0}};
  std::optional<BatchRecurrentUpdate> step;
  {
    SequenceBatch batch = c.begin_batch(en);
    step.emplace(c.begin_recurrent_update(0));
    batch.abandon();
  }
  ASSERT_TRUE(c.seq_rm(a));
  EXPECT_THROW((void)step->previous(0), StateError);
  EXPECT_THROW((void)step->previous(1), StateError);  // the 0-token entry's S(L) view too
  EXPECT_THROW((void)step->next(0, 1), StateError);
  EXPECT_THROW(step->commit(), StateError);
  // A new batch (the slot of `a` reused by a new sequence) does not revive it.
  const SeqId d = c.add_sequence();
  const BatchEntry en2[1] = {{d, 1}};
  SequenceBatch again = c.begin_batch(en2);
  EXPECT_THROW(step->commit(), StateError);
  EXPECT_THROW((void)step->previous(0), StateError);
  fill_batch(c, again);
  again.commit();
  EXPECT_EQ(c.seq_length(d), 1);
}

TEST(SequenceStaleHandles, RecurrentUpdateOfACommittedBatchIsRefusedEverywhere) {
  SequenceCache c = linear_cache({LayerKind::Hybrid});
  const SeqId a = c.add_sequence();
  const BatchEntry en[1] = {{a, 3}};
  std::optional<BatchRecurrentUpdate> kept;
  {
    SequenceBatch batch = c.begin_batch(en);
    fill_batch(c, batch, &kept, 0);
    EXPECT_NO_THROW((void)kept->previous(0));
    kept->commit();
    batch.commit();
  }
  EXPECT_THROW((void)kept->previous(0), StateError);
  EXPECT_THROW(kept->commit(), StateError);
  // Across restore (the sequence's layers replaced) and snapshot restore.
  const rwd::SequenceSnapshot snap = c.snapshot(a);
  c.restore(a, snap);
  EXPECT_THROW((void)kept->next(0, 1), StateError);
  c.seq_keep(a);
  EXPECT_THROW(kept->commit(), StateError);
  EXPECT_EQ(c.seq_length(a), 3);
}

// Tree slot handles read the tree's scratch, freed when the tree ends.
TEST(SequenceStaleHandles, TreeRecurrentSlotsAfterTheTreeEndedAreRefused) {
  LayerOptions o = seq_options(spec("t", {LayerKind::LinearAttention}, DType::F32, 4));
  rwd::Cache c(std::vector<std::string>{"linear_attention"}, o);
  const std::vector<std::int64_t> parents{-1, 0, 0};
  std::optional<rwd::TreeRecurrentSlots> slots;
  {
    rwd::TreeForward t = c.begin_tree(parents);
    slots.emplace(t.recurrent_slots(0, 0));
    EXPECT_NO_THROW((void)slots->previous(1));
    t.abandon();
  }
  EXPECT_THROW((void)slots->previous(1), StateError);
  EXPECT_THROW((void)slots->next(2), StateError);
  rwd::TreeForward t2 = c.begin_tree(parents);  // another tree does not revive them
  EXPECT_THROW((void)slots->next(0), StateError);
  t2.abandon();
  EXPECT_EQ(c.get_seq_length(), 0);
}

// Issue 28 item 3: a refusal at the second layer left the first layer's
// block on the free list (bytes_reserved 0 -> 128, blocks_free 0 -> 1).
TEST(SequenceBudget, ARefusalAtEveryLayerLeavesMemoryExactlyAsItWas) {
  for (int layers = 1; layers <= 3; ++layers) {
    for (int fits = 0; fits < layers; ++fits) {  // the budget holds the blocks of `fits` layers
      SequenceCache c = linear_cache(
          std::vector<LayerKind>(static_cast<std::size_t>(layers), LayerKind::FullAttention));
      const SeqId a = c.add_sequence();
      const std::size_t block = c.block_layout(0).block_bytes;
      const SequenceMemory before = c.memory();
      c.set_memory_budget(before.bytes_reserved + static_cast<std::size_t>(fits) * block + block / 2);
      const BatchEntry en[1] = {{a, 2}};
      EXPECT_THROW((void)c.begin_batch(en), CapacityError);
      expect_same_memory(c.memory(), before);
      // import_snapshot of 2 tokens needs one block per layer too.
      c.set_memory_budget(0);
      SequenceCache src = linear_cache(
          std::vector<LayerKind>(static_cast<std::size_t>(layers), LayerKind::FullAttention));
      const SeqId s = src.add_sequence();
      const BatchEntry es[1] = {{s, 2}};
      SequenceBatch sb = src.begin_batch(es);
      fill_batch(src, sb);
      sb.commit();
      const rwd::Snapshot exported = src.export_snapshot(s);
      const SequenceMemory before_import = c.memory();
      c.set_memory_budget(before_import.bytes_reserved + static_cast<std::size_t>(fits) * block + block / 2);
      EXPECT_THROW((void)c.import_snapshot(exported), CapacityError);
      expect_same_memory(c.memory(), before_import);
      EXPECT_EQ(c.num_sequences(), 1);
      c.set_memory_budget(0);
      const SeqId imported = c.import_snapshot(exported);  // and it still works
      EXPECT_EQ(c.seq_length(imported), 2);
    }
  }
}

TEST(SequenceBudget, ARefusalWithFreeBlocksOnTheListLeavesThemThere) {
  // 20 sequences of one block each, removed: 16 blocks stay on the free list
  // of each layer (the pool keeps max(16, in use)).
  SequenceCache c = linear_cache({LayerKind::FullAttention, LayerKind::FullAttention}, 2);
  std::vector<SeqId> ids;
  for (int k = 0; k < 20; ++k) ids.push_back(c.add_sequence());
  std::vector<BatchEntry> en;
  for (const SeqId& id : ids) en.push_back({id, 2});
  SequenceBatch b = c.begin_batch(en);
  fill_batch(c, b);
  b.commit();
  for (const SeqId& id : ids) ASSERT_TRUE(c.seq_rm(id));
  const SeqId a = c.add_sequence();
  ASSERT_EQ(c.memory().blocks_in_use, 0);
  const SequenceMemory before = c.memory();
#if !defined(REWIND_DEBUG_VIEWS)  // debug-views builds free a released block at once: no free list there
  ASSERT_GT(before.blocks_free, 0);
#endif
  // 2 * 16 + 2 positions: layer 0 takes its free blocks and allocates more, layer 1 is refused.
  const i64 free_per_layer = before.blocks_free / 2;
  const i64 q = 2 * (free_per_layer + 2);
  c.set_memory_budget(before.bytes_reserved + 2 * c.block_layout(0).block_bytes + 1);
  const BatchEntry big[1] = {{a, q}};
  EXPECT_THROW((void)c.begin_batch(big), CapacityError);
  expect_same_memory(c.memory(), before);
}

// Issue 28 item 10: fork at the budget named "a batch operation".
TEST(SequenceBudget, ForkAtTheBudgetNamesTheForkAndChangesNothing) {
  SequenceCache c = linear_cache({LayerKind::FullAttention, LayerKind::LinearAttention});
  const SeqId a = c.add_sequence();
  const BatchEntry en[1] = {{a, 2}};
  SequenceBatch b = c.begin_batch(en);
  fill_batch(c, b);
  b.commit();
  const SequenceMemory before = c.memory();
  c.set_memory_budget(before.bytes_reserved);
  try {
    (void)c.fork(a);
    ADD_FAILURE() << "fork passed the budget";
  } catch (const CapacityError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("fork(" + rwd::to_string(a) + ")"), std::string::npos) << m;
    EXPECT_EQ(m.find("a batch operation"), std::string::npos) << m;
    EXPECT_EQ(m.find("nothing was changed"), m.rfind("nothing was changed")) << m;  // said once
  }
  expect_same_memory(c.memory(), before);
  EXPECT_EQ(c.num_sequences(), 1);
  EXPECT_THROW((void)c.snapshot(a), CapacityError);
  expect_same_memory(c.memory(), before);
}

// Issue 28 item 4.
TEST(SequenceSnapshots, ASnapshotOfADestroyedCacheIsEmptyWithLengthZero) {
  rwd::SequenceSnapshot snap;
  {
    SequenceCache c = linear_cache({LayerKind::FullAttention, LayerKind::Conv});
    const SeqId a = c.add_sequence();
    const BatchEntry en[1] = {{a, 3}};
    SequenceBatch b = c.begin_batch(en);
    fill_batch(c, b);
    b.commit();
    snap = c.snapshot(a);
    EXPECT_TRUE(snap.valid());
    EXPECT_EQ(snap.length(), 3);
  }
  EXPECT_FALSE(snap.valid());
  EXPECT_EQ(snap.length(), 0);
  const rwd::SequenceSnapshot copy = snap;
  EXPECT_EQ(copy.length(), 0);
}

TEST(SequenceHandles, AModelWithoutStateCountsNoTokensAsCacheDoes) {
  const std::vector<std::string> types{"moe", "mlp"};
  const LayerOptions o = seq_options(spec("stateless", {LayerKind::Moe, LayerKind::Mlp}, DType::F32, 4));
  rwd::Cache single(types, o);
  {
    rwd::Forward f = single.begin_forward(4);
    f.commit();
  }
  SequenceCache c(types, o);
  const SeqId a = c.add_sequence();
  const BatchEntry en[1] = {{a, 4}};
  SequenceBatch b = c.begin_batch(en);
  b.commit();
  EXPECT_EQ(single.get_seq_length(), 0);
  EXPECT_EQ(c.seq_length(a), single.get_seq_length());
  EXPECT_EQ(c.seq_pos_max(a), -1);
  EXPECT_EQ(c.seq_pos_min(a), -1);
  EXPECT_EQ(c.max_rollback(a), single.max_rollback());
  EXPECT_EQ(c.snapshot(a).length(), 0);
  EXPECT_EQ(c.export_snapshot(a).length, single.snapshot().length);
}

// Issue 28 item 10: tree messages say what was asked, once.
TEST(TreeMessages, CommitAtTheBudgetNamesTheCommitNotBeginForward) {
  LayerOptions o = seq_options(spec("t", {LayerKind::FullAttention}, DType::F32, 4));
  rwd::Cache c(std::vector<std::string>{"full_attention"}, o);
  const std::vector<std::int64_t> parents{-1, 0, 1};
  c.set_memory_budget(c.memory().bytes_reserved + 1);  // the tree's scratch is not the layers'
  rwd::TreeForward t = c.begin_tree(parents);
  std::vector<float> k(static_cast<std::size_t>(2 * 3 * 3), 1.0f), v(static_cast<std::size_t>(2 * 3 * 2), 1.0f);
  (void)t.update(TensorView::contiguous(k.data(), DType::F32, {1, 2, 3, 3}),
                 TensorView::contiguous(v.data(), DType::F32, {1, 2, 3, 2}), 0);
  try {
    t.commit(2);
    ADD_FAILURE() << "the commit passed the budget";
  } catch (const CapacityError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("TreeForward::commit(2)"), std::string::npos) << m;
    EXPECT_EQ(m.find("begin_forward"), std::string::npos) << m;
  }
  EXPECT_TRUE(t.is_open());
  EXPECT_EQ(c.get_seq_length(), 0);
  t.abandon();
}

#if defined(REWIND_DEBUG_VIEWS) && defined(__SANITIZE_ADDRESS__)
// Issue 28 item 9: a conv window of an abandoned batch read as valid data.
TEST(SequenceDebugViewsDeathTest, ConvWindowOfAnAbandonedBatchIsReported) {
  SequenceCache c = linear_cache({LayerKind::Conv});
  const SeqId a = c.add_sequence();
  const BatchEntry en[1] = {{a, 2}};
  std::vector<float> x(3 * 2, 1.0f);
  TensorView window;
  {
    SequenceBatch b = c.begin_batch(en);
    window = c.update_conv_state(TensorView::contiguous(x.data(), DType::F32, {1, 3, 2}), 0)[0];
    EXPECT_EQ(window.get(0, 0, 0), 0.0f);  // the zero padding before position 0, readable while open
    b.abandon();
  }
  EXPECT_DEATH((void)window.get(0, 0, 0), "use-after-poison|heap-use-after-free");
  EXPECT_DEATH((void)window.get(0, 0, 2), "use-after-poison|heap-use-after-free");
}
#endif

}  // namespace
}  // namespace rwt::seqtest
