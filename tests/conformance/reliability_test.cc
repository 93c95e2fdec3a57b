// Regression tests for the holes a new user found (issue "Reliability"): each
// test reproduces the user's program and asserts the documented outcome.
//   1. sizes that overflow        -> CapacityError / InvalidArgument, nothing changed
//   2. inputs aliasing the cache  -> appended correctly (copied first)
//   3. a forward failing halfway  -> whole-cache operations refuse; begin_forward
//                                    makes forwards all-or-nothing
//   4. Cache::layer()             -> read-only
//   5. reserved memory            -> bounded by the retention bound, not the peak
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "conformance/harness.h"

namespace rwt {
namespace {

using rwd::Forward;
using rwd::KeyValueView;

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// ---- 1. size overflow -------------------------------------------------------------

// A legal broadcast view: stride 0 on the token dimension, so 2^59 tokens
// need only one token's worth of memory.
TensorView broadcast_keys(std::vector<float>& one_token, i64 q) {
  return TensorView::strided(one_token.data(), DType::F32, {1, 2, q, 4}, {8, 4, 0, 1});
}

TEST(SizeOverflow, BroadcastOf2To59TokensIsRefusedBeforeAnyAllocation) {
  for (LayerKind kind : {LayerKind::FullAttention, LayerKind::SlidingAttention, LayerKind::ChunkedAttention}) {
    SCOPED_TRACE(std::string(rwd::layer_kind_name(kind)));
    LayerOptions o;
    o.num_kv_heads = 2;
    o.key_dim = 4;
    o.sliding_window = 8;
    o.chunk_size = 8;
    Cache cache({std::string(rwd::layer_kind_name(kind))}, o);
    cache.set_memory_budget(1 << 20);
    std::vector<float> k(8, 1.0f), v(8, 2.0f);
    (void)cache.update(broadcast_keys(k, 3), broadcast_keys(v, 3), 0);
    const Observed before = observe(cache);
    const std::size_t reserved_before = cache.memory().bytes_reserved;
    for (i64 q : {(i64{1} << 59) + 1, i64{1} << 59, i64{1} << 62, std::numeric_limits<i64>::max()}) {
      try {
        (void)cache.update(broadcast_keys(k, q), broadcast_keys(v, q), 0);
        ADD_FAILURE() << "an update of " << q << " tokens was accepted";
      } catch (const rwd::CapacityError& e) {
        EXPECT_TRUE(contains(e.what(), "layer 0")) << e.what();
      }
      EXPECT_EQ(diff(before, observe(cache)), "") << "q = " << q;
    }
    // Nothing was allocated for the refused updates.
    EXPECT_EQ(cache.memory().bytes_reserved, reserved_before);
    EXPECT_NO_THROW((void)cache.update(broadcast_keys(k, 1), broadcast_keys(v, 1), 0));
    EXPECT_EQ(cache.get_seq_length(), 4);
  }
}

TEST(SizeOverflow, BroadcastConvAndSideInputsAndBeginForward) {
  LayerOptions o = small_options(LayerKind::SparseAttention);
  o.batch_size = 1;
  Cache sparse({"deepseek_sparse_attention"}, o);
  std::vector<float> row(4, 1.0f);
  const TensorView side = TensorView::strided(row.data(), DType::F32, {1, i64{1} << 59, 4}, {4, 0, 1});
  EXPECT_THROW((void)sparse.update_side(side, 0, 0), rwd::CapacityError);
  EXPECT_EQ(sparse.layer(0).get_seq_length(), 0);

  LayerOptions c = small_options(LayerKind::Conv);
  c.batch_size = 1;
  Cache conv({"conv"}, c);
  std::vector<float> col(3, 1.0f);
  const TensorView x = TensorView::strided(col.data(), DType::F32, {1, 3, (i64{1} << 59) + 1}, {3, 1, 0});
  EXPECT_THROW((void)conv.update_conv_state(x, 0), rwd::CapacityError);
  EXPECT_EQ(conv.get_seq_length(), 0);
  EXPECT_THROW((void)conv.begin_forward(i64{1} << 59), rwd::InvalidArgument);
  EXPECT_FALSE(conv.forward_open());
}

TEST(SizeOverflow, HugeShapesAndTensorsAreRwdErrors) {
  LayerOptions o;
  o.num_kv_heads = i64{1} << 40;
  o.key_dim = i64{1} << 40;
  EXPECT_THROW(Cache({"full_attention"}, o), rwd::CapacityError);
  LayerOptions r;
  r.recurrent_shapes = {{i64{1} << 30, i64{1} << 30, i64{1} << 30}};
  EXPECT_THROW(Cache({"linear_attention"}, r), rwd::CapacityError);
  LayerOptions s = small_options(LayerKind::SparseAttention);
  s.side_dims = {i64{1} << 62};
  EXPECT_THROW(Cache({"deepseek_sparse_attention"}, s), rwd::CapacityError);
  // Tensor: a product past 2^62 elements, or bytes the system cannot give.
  EXPECT_THROW(rwd::Tensor(DType::F32, {i64{1} << 40, i64{1} << 40}), rwd::InvalidArgument);
  EXPECT_THROW(rwd::Tensor(DType::F32, {i64{1} << 47}), rwd::CapacityError);
  EXPECT_THROW((void)TensorView::contiguous(nullptr, DType::F32, {i64{1} << 40, i64{1} << 40}), rwd::InvalidArgument);
}

TEST(SizeOverflow, HugeRepeatsAndRecurrentLengthsAreCapacityErrors) {
  Cache cache({"linear_attention"}, small_options(LayerKind::LinearAttention));
  EXPECT_THROW(cache.batch_repeat_interleave(i64{1} << 40), rwd::CapacityError);
  EXPECT_THROW(cache.batch_repeat_interleave(i64{1} << 62), rwd::CapacityError);
  EXPECT_THROW((void)cache.begin_recurrent_update(i64{1} << 41, 0, 0), rwd::CapacityError);
  EXPECT_THROW((void)cache.begin_recurrent_update(0, 0, 0), rwd::InvalidArgument);
  EXPECT_EQ(cache.layer(0).batch_size(), 2);
}

// Found by fuzz_cache_ops: each overflowed (UBSan) or allocated terabytes
// before refusing.
TEST(SizeOverflow, FuzzerFindingsRefuseCleanly) {
  LayerOptions o;
  o.num_kv_heads = 1;
  o.key_dim = 2;
  Cache one({"full_attention"}, o);  // batch 1: 2^40 repeats passed the old 2^40-row check
  EXPECT_THROW(one.batch_repeat_interleave(i64{1} << 40), rwd::CapacityError);
  EXPECT_THROW(one.batch_repeat_interleave((i64{1} << 24) + 1), rwd::CapacityError);
  LayerOptions huge_batch = o;
  huge_batch.batch_size = (i64{1} << 24) + 1;
  EXPECT_THROW(Cache({"full_attention"}, huge_batch), rwd::InvalidArgument);

  // A window near INT64_MAX never evicts: it behaves as full attention.
  LayerOptions w = o;
  w.sliding_window = std::numeric_limits<i64>::max();
  Layer sliding(LayerKind::SlidingAttention, w);
  Layer full(LayerKind::FullAttention, o);
  sliding.activate_past_recording(2);
  full.activate_past_recording(2);
  std::vector<float> k(2 * 9, 1.0f);
  for (int round = 0; round < 3; ++round) {
    const TensorView kv = TensorView::contiguous(k.data(), DType::F32, {1, 1, 9, 2});
    EXPECT_TRUE(rwd::bitwise_equal(sliding.update(kv, kv).keys, full.update(kv, kv).keys));
    EXPECT_EQ(sliding.get_mask_sizes(1).kv_length, full.get_mask_sizes(1).kv_length);
  }
  EXPECT_EQ(sliding.max_rollback(), 27);

  // A static layer holding tokens, fed INT64_MAX broadcast tokens.
  LayerOptions s = o;
  s.sliding_window = 4;
  s.static_capacity = 24;
  Cache fixed({"sliding_attention"}, s);
  (void)fixed.update(TensorView::contiguous(k.data(), DType::F32, {1, 1, 1, 2}),
                     TensorView::contiguous(k.data(), DType::F32, {1, 1, 1, 2}), 0);
  const TensorView endless = TensorView::strided(k.data(), DType::F32, {1, 1, std::numeric_limits<i64>::max(), 2},
                                                 {2, 2, 0, 1});
  EXPECT_THROW((void)fixed.update(endless, endless, 0), rwd::CapacityError);
  EXPECT_EQ(fixed.get_seq_length(), 1);
}

// ---- 2. inputs that alias the cache --------------------------------------------------

// Appends the layer's own retained keys / values (a view into its storage)
// to a growing full-attention layer, as std::vector::push_back(v[0]) does.
TEST(Aliasing, KeysValuesOfTheLayerAppendedWhileItGrows) {
  LayerOptions o;
  o.num_kv_heads = 2;
  o.key_dim = 3;
  Cache cache({"full_attention"}, o);
  Layer plain(LayerKind::FullAttention, o);  // the expected result, fed copies
  std::vector<float> k(6 * 5), v(6 * 5);
  std::iota(k.begin(), k.end(), 1.0f);
  std::iota(v.begin(), v.end(), 100.0f);
  const TensorView k5 = TensorView::contiguous(k.data(), DType::F32, {1, 2, 5, 3});
  const TensorView v5 = TensorView::contiguous(v.data(), DType::F32, {1, 2, 5, 3});
  (void)cache.update(k5, v5, 0);
  (void)plain.update(k5, v5);
  for (int round = 0; round < 6; ++round) {  // 5, 10, 20, ... tokens: several reallocations
    const KeyValueView own = cache.layer(0).keys_values();
    rwd::Tensor kc(DType::F32, own.keys.shape.data(), 4), vc(DType::F32, own.values.shape.data(), 4);
    rwd::copy_tensor(own.keys, kc.view());
    rwd::copy_tensor(own.values, vc.view());
    const KeyValueView got = cache.update(own.keys, own.values, 0);
    const KeyValueView want = plain.update(kc.view(), vc.view());
    ASSERT_TRUE(rwd::bitwise_equal(got.keys, want.keys)) << "round " << round;
    ASSERT_TRUE(rwd::bitwise_equal(got.values, want.values)) << "round " << round;
  }
  EXPECT_EQ(cache.get_seq_length(), 5 << 6);
}

TEST(Aliasing, ReturnedViewsAndSlicesOfEveryPartFedBack) {
  // Sliding (static, so compaction moves rows in place), conv windows and
  // recurrent states, each fed a view of its own storage.
  LayerOptions o = small_options(LayerKind::HybridSliding, DType::F32, true, 1);
  o.static_capacity = 8;
  Layer layer(LayerKind::HybridSliding, o);
  Layer plain(LayerKind::HybridSliding, o);
  RefLayer ref(LayerKind::HybridSliding, o, 0);
  ASSERT_EQ(do_update(Target::of(plain), ref, 3, 1), "");
  RefLayer ref2(LayerKind::HybridSliding, o, 0);
  ASSERT_EQ(do_update(Target::of(layer), ref2, 3, 1), "");
  for (int round = 0; round < 12; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    const KeyValueView own = layer.keys_values();
    const i64 n = own.keys.size(2);
    const TensorView ks = own.keys.slice(2, n - 1, 1), vs = own.values.slice(2, n - 1, 1);
    rwd::Tensor kc(DType::F32, ks.shape.data(), 4), vc(DType::F32, vs.shape.data(), 4);
    rwd::copy_tensor(ks, kc.view());
    rwd::copy_tensor(vs, vc.view());
    const KeyValueView got = layer.update(ks, vs);
    const KeyValueView want = plain.update(kc.view(), vc.view());
    ASSERT_TRUE(rwd::bitwise_equal(got.keys, want.keys));
    ASSERT_TRUE(rwd::bitwise_equal(got.values, want.values));
    for (int s = 0; s < 2; ++s) {
      const TensorView window = layer.get_conv_state(s);
      const TensorView last = window.slice(2, window.size(2) - 1, 1);
      rwd::Tensor xc(DType::F32, last.shape.data(), 3);
      rwd::copy_tensor(last, xc.view());
      ASSERT_TRUE(rwd::bitwise_equal(layer.update_conv_state(last, s), plain.update_conv_state(xc.view(), s)));
      const TensorView state = layer.get_recurrent_state(s);
      rwd::Tensor sc(DType::F32, state.shape.data(), state.rank);
      rwd::copy_tensor(state, sc.view());
      layer.update_recurrent_state(state, s);
      plain.update_recurrent_state(sc.view(), s);
      ASSERT_TRUE(rwd::bitwise_equal(layer.get_recurrent_state(s), plain.get_recurrent_state(s)));
    }
  }
  EXPECT_EQ(diff(observe(plain), observe(layer)), "");
}

// ---- 3. a forward that fails halfway -------------------------------------------------

struct ThreeFull {
  Cache cache{{"full_attention", "full_attention", "full_attention"}, options()};
  std::vector<float> k = std::vector<float>(2 * 40 * 4, 0.5f), v = std::vector<float>(2 * 40 * 4, 0.25f);
  static LayerOptions options() {
    LayerOptions o;
    o.num_kv_heads = 2;
    o.key_dim = 4;
    return o;
  }
  TensorView keys(i64 q) { return TensorView::contiguous(k.data(), DType::F32, {1, 2, q, 4}); }
  TensorView values(i64 q) { return TensorView::contiguous(v.data(), DType::F32, {1, 2, q, 4}); }
  void forward(i64 q) {
    for (int i = 0; i < 3; ++i) (void)cache.update(keys(q), values(q), i);
  }
};

// A budget for three full layers at 10 tokens that lets one layer grow by
// 40 tokens but not two (measured on a twin cache).
std::size_t one_growth_budget() {
  ThreeFull probe;
  probe.forward(10);
  const std::size_t before = probe.cache.memory().bytes_reserved;
  probe.forward(20);
  const std::size_t before_growth = probe.cache.memory().bytes_reserved;
  EXPECT_EQ(before_growth, before) << "30 tokens were expected to fit without growing";
  (void)probe.cache.update(probe.keys(20), probe.values(20), 0);
  const std::size_t after = probe.cache.memory().bytes_reserved;
  return after + (after - before);  // covers old + new while layer 0 grows, not layer 1
}

// The user's reproducer: a budget that lets layer 0 grow but not layer 1.
TEST(MidForwardFailure, OutOfStepLayersRefuseWholeCacheOperations) {
  ThreeFull t;
  t.forward(10);
  t.cache.set_memory_budget(one_growth_budget());
  t.forward(20);                                    // 30 tokens fit without growing
  EXPECT_THROW(t.forward(20), rwd::CapacityError);  // layer 0 grows to 50, layer 1 refuses
  ASSERT_EQ(t.cache.get_seq_length(0), 50);
  ASSERT_EQ(t.cache.get_seq_length(1), 30);
  ASSERT_EQ(t.cache.get_seq_length(2), 30);
  const Observed before = observe(t.cache);
  const std::vector<i64> rows = {0};
  auto refused = [&](const char* what, auto&& f) {
    SCOPED_TRACE(what);
    try {
      f();
      ADD_FAILURE() << what << " was accepted on out-of-step layers";
    } catch (const rwd::StateError& e) {
      const std::string m = e.what();
      EXPECT_TRUE(contains(m, "layer 0: 50")) << m;
      EXPECT_TRUE(contains(m, "layer 1: 30")) << m;
      EXPECT_TRUE(contains(m, "layer 2: 30")) << m;
    }
    EXPECT_EQ(diff(before, observe(t.cache)), "");
  };
  refused("check_crop(-20)", [&] { t.cache.check_crop(-20); });
  refused("crop(-20)", [&] { t.cache.crop(-20); });
  refused("crop(0)", [&] { t.cache.crop(0); });
  refused("max_rollback", [&] { (void)t.cache.max_rollback(); });
  refused("activate_past_recording", [&] { t.cache.activate_past_recording(4); });
  refused("deactivate_past_recording", [&] { t.cache.deactivate_past_recording(); });
  refused("batch_select_indices", [&] { t.cache.batch_select_indices(rows); });
  refused("batch_repeat_interleave", [&] { t.cache.batch_repeat_interleave(1); });
  refused("reorder_cache", [&] { t.cache.reorder_cache(rows); });
  refused("begin_forward", [&] { (void)t.cache.begin_forward(1); });
  // No token was lost: layers 1 and 2 still hold their 30.
  EXPECT_EQ(t.cache.layer(1).keys_values().keys.size(2), 30);
  // reset() is the way back.
  t.cache.set_memory_budget(0);
  t.cache.reset();
  EXPECT_EQ(t.cache.get_seq_length(), 0);
  EXPECT_EQ(t.cache.max_rollback(), 0);
}

TEST(MidForwardFailure, BeginForwardRefusesTheWholeForwardUpFront) {
  ThreeFull t;
  t.forward(10);
  const std::size_t reserved = t.cache.memory().bytes_reserved;
  t.cache.set_memory_budget(one_growth_budget());
  const Observed before = observe(t.cache);
  try {
    Forward f = t.cache.begin_forward(40);
    ADD_FAILURE() << "begin_forward reserved more than the budget allows";
  } catch (const rwd::CapacityError& e) {
    EXPECT_TRUE(contains(e.what(), "begin_forward")) << e.what();
    EXPECT_TRUE(contains(e.what(), "memory budget exceeded")) << e.what();
  }
  EXPECT_FALSE(t.cache.forward_open());
  EXPECT_EQ(diff(before, observe(t.cache)), "");
  EXPECT_EQ(t.cache.memory().bytes_reserved, reserved);
  // A forward that fits works, every layer at 15.
  Forward f = t.cache.begin_forward(5);
  t.forward(5);
  f.commit();
  EXPECT_EQ(t.cache.max_rollback(), 15);
}

// A forward abandoned after some layers were updated (an exception in a
// kernel, say) leaves every layer kind exactly as before begin_forward:
// contents, lengths, rollback history, recurrent snapshots, even for q > R.
class AbandonedForward : public testing::TestWithParam<std::pair<i64, i64>> {};

TEST_P(AbandonedForward, RestoresEveryLayerExactly) {
  const auto [R, q] = GetParam();
  std::vector<std::pair<LayerKind, LayerOptions>> spec;
  for (LayerKind k :
       {LayerKind::FullAttention, LayerKind::SlidingAttention, LayerKind::ChunkedAttention, LayerKind::LinearAttention,
        LayerKind::Conv, LayerKind::Hybrid, LayerKind::HybridSliding, LayerKind::SparseAttention, LayerKind::Mlp})
    spec.push_back({k, small_options(k, DType::BF16, k == LayerKind::SlidingAttention)});
  Built b = build_cache(spec);
  b.cache.activate_past_recording(R);
  b.ref.activate(R);
  std::uint64_t salt = 0;
  for (i64 step : {5, 1, 3}) ASSERT_EQ(cache_step(b.cache, b.ref, step, ++salt), "");
  const Observed before = observe(b.cache);
  for (int stop_after = 0; stop_after <= b.cache.num_layers(); ++stop_after) {
    SCOPED_TRACE("abandoned after " + std::to_string(stop_after) + " layers");
    RefCache scratch = b.ref;  // the reference advances; the cache must not
    {
      Forward f = b.cache.begin_forward(q);
      for (int i = 0; i < stop_after; ++i) {
        RefLayer& rl = scratch.layers[static_cast<std::size_t>(i)];
        if (!rl.stateless()) {
          ASSERT_EQ(do_update(Target::of(b.cache, i), rl, q, ++salt), "");
        }
      }
      if (stop_after == b.cache.num_layers() && stop_after % 2 == 0) {
        f.abandon();  // explicitly; otherwise the destructor does it
        EXPECT_FALSE(f.is_open());
      }
    }
    EXPECT_FALSE(b.cache.forward_open());
    ASSERT_EQ(diff(before, observe(b.cache)), "");
    ASSERT_EQ(verify(b.cache, b.ref), "");
  }
  // The cache keeps working as if nothing happened.
  ASSERT_EQ(cache_step(b.cache, b.ref, q, ++salt), "");
  ASSERT_EQ(verify(b.cache, b.ref), "");
  b.cache.crop(-std::min(R, q));
  b.ref.crop(-std::min(R, q));
  ASSERT_EQ(verify(b.cache, b.ref), "");
}

INSTANTIATE_TEST_SUITE_P(RAndQ, AbandonedForward,
                         testing::Values(std::pair<i64, i64>{0, 1}, std::pair<i64, i64>{0, 4},
                                         std::pair<i64, i64>{2, 2}, std::pair<i64, i64>{2, 7},
                                         std::pair<i64, i64>{4, 3}));

TEST(ForwardTransaction, CommitNeedsEveryPartAndRefusesOverflowingUpdates) {
  Built b = build_cache({{LayerKind::FullAttention, small_options(LayerKind::FullAttention)},
                         {LayerKind::Hybrid, small_options(LayerKind::Hybrid)}});
  b.cache.activate_past_recording(2);
  b.ref.activate(2);
  std::uint64_t salt = 0;
  ASSERT_EQ(cache_step(b.cache, b.ref, 3, ++salt), "");
  Forward f = b.cache.begin_forward(2);
  EXPECT_EQ(f.num_tokens(), 2);
  EXPECT_EQ(f.start_length(), 3);
  // Whole-cache operations wait for the forward.
  EXPECT_THROW(b.cache.crop(-1), rwd::StateError);
  EXPECT_THROW(b.cache.reset(), rwd::StateError);
  EXPECT_THROW(b.cache.activate_past_recording(3), rwd::StateError);
  EXPECT_THROW((void)b.cache.begin_forward(1), rwd::StateError);
  ASSERT_EQ(do_update(Target::of(b.cache, 0), b.ref.layers[0], 2, ++salt), "");
  // A third token does not fit the forward: refused, nothing written.
  const Observed mid = observe(b.cache);
  std::vector<float> k(2 * 2 * 3, 1.0f), v(2 * 2 * 2, 1.0f);
  EXPECT_THROW((void)b.cache.update(TensorView::contiguous(k.data(), DType::F32, {2, 2, 1, 3}),
                                    TensorView::contiguous(v.data(), DType::F32, {2, 2, 1, 2}), 0),
               rwd::StateError);
  EXPECT_EQ(diff(mid, observe(b.cache)), "");
  // Layer 1 has not received its tokens: commit refuses, naming it.
  try {
    f.commit();
    ADD_FAILURE() << "commit accepted an incomplete forward";
  } catch (const rwd::StateError& e) {
    EXPECT_TRUE(contains(e.what(), "layer 1")) << e.what();
    EXPECT_TRUE(contains(e.what(), "recurrent state")) << e.what();
  }
  EXPECT_TRUE(f.is_open());
  // A recurrent state takes the forward's tokens in one update.
  EXPECT_THROW((void)b.cache.begin_recurrent_update(1, 1, 0), rwd::StateError);
  ASSERT_EQ(do_update(Target::of(b.cache, 1), b.ref.layers[1], 2, ++salt), "");
  f.commit();
  EXPECT_FALSE(f.is_open());
  EXPECT_THROW(f.commit(), rwd::StateError);
  ASSERT_EQ(verify(b.cache, b.ref), "");
}

TEST(ForwardTransaction, HandleSurvivesMovesAndItsCache) {
  std::optional<Forward> kept;
  {
    Cache cache({"full_attention"}, ThreeFull::options());
    Forward f = cache.begin_forward(1);
    Forward g = std::move(f);
    EXPECT_FALSE(f.is_open());  // NOLINT: moved-from is specified
    EXPECT_TRUE(g.is_open());
    EXPECT_TRUE(cache.forward_open());
    Cache moved = std::move(cache);  // the handle follows the cache's state
    EXPECT_TRUE(moved.forward_open());
    g.abandon();
    EXPECT_FALSE(moved.forward_open());
    kept.emplace(moved.begin_forward(1));
  }  // the cache dies first: the handle becomes inert
  EXPECT_FALSE(kept->is_open());
  kept.reset();
}

// A forward whose q tokens reach a part in several updates: nothing may move
// inside the forward (abandon needs every row where begin_forward left it),
// even when the first update is small and the buffer looks oversized.
TEST(ForwardTransaction, SplitUpdatesInsideAForwardAbandonExactly) {
  LayerOptions o = small_options(LayerKind::SlidingAttention, DType::F32, false, 1);
  Cache cache({"sliding_attention"}, o);
  cache.activate_past_recording(2);
  std::vector<float> k(2 * 100 * 3, 1.5f), v(2 * 100 * 2, 2.5f);
  auto keys = [&](i64 q) { return TensorView::contiguous(k.data(), DType::F32, {1, 2, q, 3}); };
  auto values = [&](i64 q) { return TensorView::contiguous(v.data(), DType::F32, {1, 2, q, 2}); };
  (void)cache.update(keys(3), values(3), 0);
  const Observed before = observe(cache);
  {
    Forward f = cache.begin_forward(100);
    (void)cache.update(keys(1), values(1), 0);
    (void)cache.update(keys(99), values(99), 0);
  }  // abandoned
  EXPECT_EQ(diff(before, observe(cache)), "");
  Forward f = cache.begin_forward(100);
  (void)cache.update(keys(1), values(1), 0);
  (void)cache.update(keys(99), values(99), 0);
  f.commit();
  EXPECT_EQ(cache.get_seq_length(), 103);
}

// Found by fuzz_cache_ops: a begin_forward refused at a later layer kept the
// room it had planned for the earlier ones, counted against the budget.
TEST(MidForwardFailure, RefusedBeginForwardGivesBackWhatItPlanned) {
  ThreeFull t;
  t.forward(10);
  const std::size_t reserved = t.cache.memory().bytes_reserved;
  t.cache.set_memory_budget(one_growth_budget());
  EXPECT_THROW((void)t.cache.begin_forward(40), rwd::CapacityError);
  EXPECT_EQ(t.cache.memory().bytes_reserved, reserved);
  // The budget counts only what the buffers hold: it can be set to exactly that.
  EXPECT_NO_THROW(t.cache.set_memory_budget(reserved));
}

// ---- 4. Cache::layer() is read-only ---------------------------------------------------

static_assert(std::is_const_v<std::remove_reference_t<decltype(std::declval<Cache&>().layer(0))>>,
              "Cache::layer must not hand out a mutable Layer: the cache keeps its layers in step");

TEST(ReadOnlyLayers, EmptyLayerListsAreRefused) {
  EXPECT_THROW(Cache(std::vector<std::string>{}, LayerOptions{}), rwd::InvalidArgument);
  EXPECT_THROW(Cache(std::vector<Layer>{}), rwd::InvalidArgument);
  Cache cache({"full_attention"}, ThreeFull::options());
  Cache other = std::move(cache);
  EXPECT_THROW((void)cache.get_seq_length(), rwd::StateError);  // NOLINT: a moved-from cache says so
  EXPECT_EQ(other.num_layers(), 1);
}

// ---- 5. reserved memory returns to the retention bound ---------------------------------

std::size_t reserved(const Cache& c) { return c.memory().bytes_reserved; }

TEST(ReservedMemory, SlidingLayerAfterA20000TokenUpdate) {
  LayerOptions o;
  o.num_kv_heads = 2;
  o.key_dim = 4;
  o.sliding_window = 64;
  Cache cache({"sliding_attention"}, o);
  const i64 R = 4;
  cache.activate_past_recording(R);
  const std::size_t row = 2 * 2 * 4 * sizeof(float);  // keys + values of one token
  std::vector<float> big(2 * 20000 * 4, 1.0f);
  (void)cache.update(TensorView::contiguous(big.data(), DType::F32, {1, 2, 20000, 4}),
                     TensorView::contiguous(big.data(), DType::F32, {1, 2, 20000, 4}), 0);
  EXPECT_GE(reserved(cache), 20000 * row);  // the update itself needed the room
  // The next one-token update returns to a reservation proportional to W - 1 + R + q.
  (void)cache.update(TensorView::contiguous(big.data(), DType::F32, {1, 2, 1, 4}),
                     TensorView::contiguous(big.data(), DType::F32, {1, 2, 1, 4}), 0);
  const std::size_t bound = 4 * (64 - 1 + R + 1) * row;
  EXPECT_LE(reserved(cache), bound);
  // And so does crop(0) right after a large update.
  (void)cache.update(TensorView::contiguous(big.data(), DType::F32, {1, 2, 20000, 4}),
                     TensorView::contiguous(big.data(), DType::F32, {1, 2, 20000, 4}), 0);
  cache.crop(0);
  EXPECT_LE(reserved(cache), 4 * (64 - 1 + 1) * row);
  EXPECT_EQ(cache.get_seq_length(), 40001);
}

TEST(ReservedMemory, LinearAndConvAndChunkedLayersAfterALargePrefill) {
  LayerOptions o;
  o.num_kv_heads = 1;
  o.key_dim = 4;
  o.chunk_size = 32;
  o.conv_kernel_size = 4;
  o.conv_channels = {16};
  o.recurrent_shapes = {{2, 4, 4}};
  Cache cache({"linear_attention", "conv", "chunked_attention"}, o);
  const i64 R = 3, q = 20000;
  cache.activate_past_recording(R);
  std::vector<float> x(16 * q, 0.5f), kv(4 * q, 0.5f);
  auto forward = [&](i64 n) {
    Forward f = cache.begin_forward(n);
    (void)cache.update_conv_state(TensorView::contiguous(x.data(), DType::F32, {1, 16, n}), 0);
    rwd::RecurrentUpdate u = cache.begin_recurrent_update(n, 0);
    u.commit();
    (void)cache.update_conv_state(TensorView::contiguous(x.data(), DType::F32, {1, 16, n}), 1);
    (void)cache.update(TensorView::contiguous(kv.data(), DType::F32, {1, 1, n, 4}),
                       TensorView::contiguous(kv.data(), DType::F32, {1, 1, n, 4}), 2);
    f.commit();
  };
  forward(q);
  forward(1);
  const std::size_t conv_row = 16 * sizeof(float), kv_row = 2 * 4 * sizeof(float);
  const std::size_t state = 2 * 4 * 4 * sizeof(float);
  const rwd::MemoryReport m = cache.memory();
  // conv: K + R inputs (+ the update), within 4x; recurrent: at most 2 (R + 1) states.
  EXPECT_LE(m.layers[0].bytes_reserved, 4 * (4 + R + 1) * conv_row + 2 * (R + 1) * state);
  EXPECT_LE(m.layers[1].bytes_reserved, 4 * (4 + R + 1) * conv_row);
  EXPECT_LE(m.layers[2].bytes_reserved, 4 * (32 - 1 + R + 1) * kv_row);
  EXPECT_EQ(cache.max_rollback(), R);
}

TEST(ReservedMemory, FullAttentionKeepsItsDoublingUntilShrinkToFit) {
  ThreeFull t;
  t.forward(20);
  t.forward(1);  // 21 tokens: dynamic growth has doubled past them
  const std::size_t row = 2 * 2 * 4 * sizeof(float);
  EXPECT_LE(reserved(t.cache), 3 * 2 * 2 * 21 * row);
  t.cache.shrink_to_fit();
  EXPECT_EQ(reserved(t.cache), 3 * 21 * row);
  EXPECT_EQ(t.cache.memory().bytes_used, 3 * 21 * row);
  // Contents unchanged; the next update grows again.
  EXPECT_EQ(t.cache.layer(2).keys_values().keys.get(0, 1, 20, 3), 0.5f);
  t.forward(1);
  EXPECT_EQ(t.cache.get_seq_length(), 22);
}

// ---- 6. stale views, caught in debug builds ---------------------------------------------

// A dropped update handle leaves S(L) and every snapshot exactly as they
// were, whatever q and R (before, the slots of the oldest snapshots were
// overwritten while `held` still claimed them).
TEST(StaleState, DroppedRecurrentUpdateKeepsEverySnapshot) {
  for (i64 R : {0, 1, 3}) {
    for (i64 q : {1, 2, 5}) {
      SCOPED_TRACE("R = " + std::to_string(R) + ", q = " + std::to_string(q));
      Layer layer(LayerKind::LinearAttention, small_options(LayerKind::LinearAttention), 0);
      RefLayer ref(LayerKind::LinearAttention, small_options(LayerKind::LinearAttention), 0);
      layer.activate_past_recording(R);
      ref.activate(R);
      ASSERT_EQ(do_update(Target::of(layer), ref, 6, 1), "");
      const Observed before = observe(layer);
      {
        rwd::RecurrentUpdate u = layer.begin_recurrent_update(q, 0);
        for (i64 t = 1; t <= q; ++t) {
          const TensorView slot = u.next(t);  // written from a host tensor: it may be device memory
          const rwd::Tensor h(slot.dtype, slot.shape.data(), slot.rank);
          std::memset(h.data<void>(), 0xAB, h.bytes());
          rwd::copy_tensor(h, slot);
        }
      }  // dropped
      EXPECT_EQ(diff(before, observe(layer)), "");
      ASSERT_EQ(verify(layer, ref), "");
      if (R > 0) {
        layer.crop(-R);
        ref.crop(-R);
        ASSERT_EQ(verify(layer, ref), "");
      }
    }
  }
}

#if defined(REWIND_DEBUG_VIEWS) && defined(__SANITIZE_ADDRESS__)
// Under REWIND_DEBUG_VIEWS + ASan, reading a view after the mutation that
// made it stale is reported instead of returning replaced data.
TEST(DebugViewsDeathTest, StaleSlidingViewIsReported) {
  LayerOptions o = small_options(LayerKind::SlidingAttention, DType::F32, false, 1);
  Layer layer(LayerKind::SlidingAttention, o);
  std::vector<float> k(2 * 8 * 3, 1.0f), v(2 * 8 * 2, 1.0f);
  const KeyValueView old = layer.update(TensorView::contiguous(k.data(), DType::F32, {1, 2, 8, 3}),
                                        TensorView::contiguous(v.data(), DType::F32, {1, 2, 8, 2}));
  (void)layer.update(TensorView::contiguous(k.data(), DType::F32, {1, 2, 8, 3}),
                     TensorView::contiguous(v.data(), DType::F32, {1, 2, 8, 2}));
  EXPECT_DEATH((void)old.keys.get(0, 0, 0, 0), "use-after-poison|heap-use-after-free");
}

TEST(DebugViewsDeathTest, RecurrentStateViewAfterCropIsReported) {
  Layer layer(LayerKind::LinearAttention, small_options(LayerKind::LinearAttention), 0);
  RefLayer ref(LayerKind::LinearAttention, small_options(LayerKind::LinearAttention), 0);
  layer.activate_past_recording(2);
  ref.activate(2);
  ASSERT_EQ(do_update(Target::of(layer), ref, 3, 1), "");
  const TensorView state = layer.get_recurrent_state(0);
  layer.crop(-1);
  EXPECT_DEATH((void)state.get(0, 0, 0), "use-after-poison|heap-use-after-free");
  // The state of the kept position reads fine.
  EXPECT_EQ(check_view("S(L) after crop", layer.get_recurrent_state(0), DType::F32, {2, 2, 3}, ref.expect_rec(0, 2)),
            "");
}
#endif

}  // namespace
}  // namespace rwt
