// The error messages of docs/semantics.md section 8 (verbatim openings), and
// bad input of every kind: each raises the right rwd::Error subclass, names
// the layer and the numbers, and leaves the cache unchanged.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "conformance/harness.h"

namespace rwt {
namespace {

// Runs f, which must throw exactly type E; returns the message ("" if not).
template <class E, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const rwd::Error& e) {
    ADD_FAILURE() << "wrong error type (" << err_name(classify(e)) << "): " << e.what();
    return "";
  } catch (const std::exception& e) {
    ADD_FAILURE() << "non-rewind exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "nothing was thrown";
  return "";
}

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

// ---- section 8, verbatim ------------------------------------------------------------

TEST(Messages, NotTrackingPastStates) {
  Layer layer(LayerKind::LinearAttention, small_options(LayerKind::LinearAttention), 4);
  RefLayer ref(LayerKind::LinearAttention, small_options(LayerKind::LinearAttention), 4);
  ASSERT_EQ(do_update(Target::of(layer), ref, 3, 1), "");
  const std::string m = message_of<rwd::RollbackError>([&] { layer.crop(-1); });
  EXPECT_TRUE(starts_with(m, kNotTracking)) << m;
  EXPECT_TRUE(names_layer(m, 4)) << m;
  const std::string m0 = message_of<rwd::RollbackError>([&] { layer.crop(0); });
  EXPECT_TRUE(starts_with(m0, kNotTracking)) << m0;
}

TEST(Messages, NotTrackingSlidingWindowReached) {
  Layer layer(LayerKind::SlidingAttention, small_options(LayerKind::SlidingAttention), 3);
  RefLayer ref(LayerKind::SlidingAttention, small_options(LayerKind::SlidingAttention), 3);
  ASSERT_EQ(do_update(Target::of(layer), ref, 3, 1), "");
  layer.crop(-1);  // L = 3 < W = 4: still possible without recording
  ref.crop(-1);
  ASSERT_EQ(do_update(Target::of(layer), ref, 7, 2), "");  // L = 9 >= W
  const std::string m = message_of<rwd::RollbackError>([&] { layer.crop(-1); });
  EXPECT_TRUE(starts_with(m, kSlidingNotTracking)) << m;
  EXPECT_TRUE(names_layer(m, 3)) << m;
  EXPECT_TRUE(has_number(m, 9)) << "names L: " << m;
  EXPECT_TRUE(has_number(m, 4)) << "names W: " << m;
  EXPECT_TRUE(starts_with(message_of<rwd::RollbackError>([&] { layer.crop(0); }), kSlidingNotTracking));
}

TEST(Messages, LinearLayersOnlyNegativeCrop) {
  WarningCapture quiet;
  for (LayerKind kind : {LayerKind::LinearAttention, LayerKind::Conv, LayerKind::Hybrid, LayerKind::HybridSliding}) {
    SCOPED_TRACE(std::string(rwd::layer_kind_name(kind)));
    Layer layer(kind, small_options(kind), 6);
    RefLayer ref(kind, small_options(kind), 6);
    layer.activate_past_recording(4);
    ref.activate(4);
    ASSERT_EQ(do_update(Target::of(layer), ref, 2, 1), "");
    const Observed before = observe(layer);
    for (i64 n : {1, 2, 5}) {
      const std::string m = message_of<rwd::RollbackError>([&] { layer.crop(n); });
      EXPECT_TRUE(starts_with(m, kLinearNegative)) << m;
      EXPECT_TRUE(names_layer(m, 6)) << m;
    }
    EXPECT_EQ(diff(before, observe(layer)), "");
  }
}

TEST(Messages, OnceSlidingWindowReached) {
  WarningCapture quiet;
  Layer layer(LayerKind::SlidingAttention, small_options(LayerKind::SlidingAttention), 1);
  RefLayer ref(LayerKind::SlidingAttention, small_options(LayerKind::SlidingAttention), 1);
  layer.activate_past_recording(8);
  ref.activate(8);
  ASSERT_EQ(do_update(Target::of(layer), ref, 3, 1), "");
  layer.crop(2);  // L = 3 < W: keeps the first 2
  ref.crop(2);
  ASSERT_EQ(verify(layer, ref), "");
  ASSERT_EQ(do_update(Target::of(layer), ref, 3, 2), "");  // L = 5 >= W
  const Observed before = observe(layer);
  const std::string m = message_of<rwd::RollbackError>([&] { layer.crop(2); });
  EXPECT_TRUE(starts_with(m, kOnceSliding)) << m;
  EXPECT_TRUE(names_layer(m, 1)) << m;
  EXPECT_EQ(diff(before, observe(layer)), "");
}

TEST(Messages, UpdateConvStateOnAttentionLayer) {
  Built b = build_cache(
      {{LayerKind::FullAttention, small_options(LayerKind::FullAttention)}, {LayerKind::Moe, LayerOptions{}}});
  HostTensor x(DType::F32, {2, 3, 1});
  const std::string m = message_of<rwd::StateError>([&] { (void)b.cache.update_conv_state(x.view(), 0); });
  EXPECT_TRUE(starts_with(m, kConvOnNonLinear)) << m;
  Layer moe(LayerKind::Moe, LayerOptions{}, 1);
  const std::string m2 = message_of<rwd::StateError>([&] { (void)moe.update_conv_state(x.view()); });
  EXPECT_TRUE(starts_with(m2, kConvOnNonLinear)) << m2;
  EXPECT_EQ(b.cache.get_seq_length(), 0);
}

TEST(Messages, HasPreviousStateOnAttentionOnlyCache) {
  Built b = build_cache({{LayerKind::FullAttention, small_options(LayerKind::FullAttention)},
                         {LayerKind::SlidingAttention, small_options(LayerKind::SlidingAttention)}});
  const std::string m = message_of<rwd::StateError>([&] { (void)b.cache.has_previous_state(); });
  EXPECT_TRUE(starts_with(m, kHasPreviousOnAttention)) << m;
  const std::string m2 = message_of<rwd::StateError>([&] { (void)b.cache.layer(0).has_previous_state(); });
  EXPECT_TRUE(starts_with(m2, kHasPreviousOnAttention)) << m2;
}

// ---- bad input: right type, names the layer, nothing changes -------------------------

// Layers: 0 full, 1 sliding, 2 hybrid, 3 sparse, 4 static full (M = 12).
class BadInput : public testing::Test {
 protected:
  void SetUp() override {
    LayerOptions st = small_options(LayerKind::FullAttention);
    st.static_capacity = 12;
    b_ = std::make_unique<Built>(build_cache({{LayerKind::FullAttention, small_options(LayerKind::FullAttention)},
                                              {LayerKind::SlidingAttention, small_options(LayerKind::SlidingAttention)},
                                              {LayerKind::Hybrid, small_options(LayerKind::Hybrid)},
                                              {LayerKind::SparseAttention, small_options(LayerKind::SparseAttention)},
                                              {LayerKind::FullAttention, st}}));
    cache().activate_past_recording(2);
    b_->ref.activate(2);
    ASSERT_EQ(cache_step(cache(), b_->ref, 3, 1), "");
    before_ = observe(cache());
  }
  Cache& cache() { return b_->cache; }
  // f must throw E naming `layer` (when >= 0) and `numbers`; nothing changes.
  template <class E, class F>
  void check(const std::string& what, int layer, std::vector<i64> numbers, F&& f) {
    SCOPED_TRACE(what);
    const std::string m = message_of<E>(f);
    if (m.empty()) return;
    if (layer >= 0) {
      EXPECT_TRUE(names_layer(m, layer)) << "does not name layer " << layer << ": " << m;
    }
    for (i64 n : numbers) EXPECT_TRUE(has_number(m, n)) << "does not name " << n << ": " << m;
    EXPECT_EQ(diff(before_, observe(cache())), "") << "changed by a refused call";
    EXPECT_EQ(verify(cache(), b_->ref), "");
  }
  HostTensor kv(std::vector<i64> shape, DType dt = DType::F32) { return HostTensor(dt, std::move(shape)); }

  std::unique_ptr<Built> b_;
  Observed before_;
};

TEST_F(BadInput, UpdateKeysValues) {
  for (int layer : {0, 1, 2, 3}) {
    const HostTensor good_k = kv({2, 2, 1, 3}), good_v = kv({2, 2, 1, 2});
    using IA = rwd::InvalidArgument;
    check<IA>("rank 3 keys", layer, {}, [&] { (void)cache().update(kv({2, 2, 3}).view(), good_v.view(), layer); });
    check<IA>("3 heads", layer, {3}, [&] {
      (void)cache().update(kv({2, 3, 1, 3}).view(), kv({2, 3, 1, 2}).view(), layer);
    });
    check<IA>("key_dim 4", layer, {4}, [&] { (void)cache().update(kv({2, 2, 1, 4}).view(), good_v.view(), layer); });
    check<IA>("value_dim 3", layer, {}, [&] { (void)cache().update(good_k.view(), kv({2, 2, 1, 3}).view(), layer); });
    check<IA>("values q != keys q", layer, {}, [&] {
      (void)cache().update(good_k.view(), kv({2, 2, 2, 2}).view(), layer);
    });
    check<IA>("f16 keys", layer, {}, [&] {
      (void)cache().update(kv({2, 2, 1, 3}, DType::F16).view(), kv({2, 2, 1, 2}, DType::F16).view(), layer);
    });
    check<IA>("batch 3", layer, {3}, [&] {
      (void)cache().update(kv({3, 2, 1, 3}).view(), kv({3, 2, 1, 2}).view(), layer);
    });
    check<IA>("q = 0", layer, {}, [&] {
      (void)cache().update(kv({2, 2, 0, 3}).view(), kv({2, 2, 0, 2}).view(), layer);
    });
    check<IA>("get_mask_sizes(0)", layer, {}, [&] { (void)cache().get_mask_sizes(0, layer); });
  }
}

TEST_F(BadInput, SideTensors) {
  using IA = rwd::InvalidArgument;
  check<IA>("side width 3 instead of 4", 3, {}, [&] { (void)cache().update_side(kv({2, 1, 3}).view(), 3, 0); });
  check<IA>("side batch 1", 3, {}, [&] { (void)cache().update_side(kv({1, 1, 4}).view(), 3, 0); });
  check<IA>("side rank 2", 3, {}, [&] { (void)cache().update_side(kv({2, 4}).view(), 3, 0); });
  check<IA>("side dtype", 3, {}, [&] { (void)cache().update_side(kv({2, 1, 4}, DType::BF16).view(), 3, 0); });
  check<rwd::IndexError>("side 2 of 2", 3, {2}, [&] { (void)cache().update_side(kv({2, 1, 1}).view(), 3, 2); });
  check<rwd::IndexError>("side -1", 3, {}, [&] { (void)cache().update_side(kv({2, 1, 4}).view(), 3, -1); });
  check<rwd::IndexError>("side(5)", -1, {}, [&] { (void)cache().layer(3).side(5); });
}

TEST_F(BadInput, ConvAndRecurrentStates) {
  using IA = rwd::InvalidArgument;
  check<IA>("conv channels 2 instead of 3", 2, {}, [&] {
    (void)cache().update_conv_state(kv({2, 2, 1}).view(), 2, 0);
  });
  check<IA>("conv batch 1", 2, {}, [&] { (void)cache().update_conv_state(kv({1, 3, 1}).view(), 2, 0); });
  check<IA>("conv rank 2", 2, {}, [&] { (void)cache().update_conv_state(kv({2, 3}).view(), 2, 0); });
  check<IA>("conv dtype", 2, {}, [&] { (void)cache().update_conv_state(kv({2, 3, 1}, DType::F16).view(), 2, 0); });
  check<rwd::IndexError>("conv state 2 of 2", 2, {2}, [&] {
    (void)cache().update_conv_state(kv({2, 3, 1}).view(), 2, 2);
  });
  check<rwd::IndexError>("get_conv_state(5)", -1, {}, [&] { (void)cache().get_conv_state(2, 5); });
  check<rwd::IndexError>("recurrent state 2 of 2", 2, {2}, [&] { (void)cache().begin_recurrent_update(1, 2, 2); });
  check<IA>("recurrent q = 0", 2, {}, [&] { (void)cache().begin_recurrent_update(0, 2, 0); });
  check<IA>("recurrent shape", 2, {}, [&] { cache().update_recurrent_state(kv({2, 3, 2}).view(), 2, 0); });
  check<IA>("recurrent batch", 2, {}, [&] { cache().update_recurrent_state(kv({1, 2, 3}).view(), 2, 0); });
  check<IA>("recurrent dtype", 2, {}, [&] { cache().update_recurrent_state(kv({2, 2, 3}, DType::BF16).view(), 2, 0); });
  check<rwd::IndexError>("get_recurrent_state(7)", -1, {}, [&] { (void)cache().get_recurrent_state(2, 7); });
  check<rwd::IndexError>("snapshot beyond L", -1, {}, [&] { (void)cache().layer(2).recurrent_snapshot(0, 4); });
  {
    rwd::RecurrentUpdate u = cache().begin_recurrent_update(2, 2, 0);
    EXPECT_THROW((void)u.next(0), rwd::IndexError);
    EXPECT_THROW((void)u.next(3), rwd::IndexError);
  }  // dropped without commit: nothing changes
  EXPECT_EQ(cache().get_seq_length(2), 3);
  EXPECT_EQ(diff(before_, observe(cache())), "");
  check<rwd::StateError>("get_mask_sizes on a linear-only layer", -1, {}, [&] {
    Layer lin(LayerKind::LinearAttention, small_options(LayerKind::LinearAttention), 0);
    (void)lin.get_mask_sizes(1);
  });
}

TEST_F(BadInput, LayerIndexOutOfRange) {
  const HostTensor k = kv({2, 2, 1, 3}), v = kv({2, 2, 1, 2});
  using IE = rwd::IndexError;
  check<IE>("update layer 7", -1, {7, 5}, [&] { (void)cache().update(k.view(), v.view(), 7); });
  check<IE>("update layer -1", -1, {5}, [&] { (void)cache().update(k.view(), v.view(), -1); });
  check<IE>("layer(5)", -1, {5}, [&] { (void)cache().layer(5); });
  check<IE>("get_seq_length(9)", -1, {9}, [&] { (void)cache().get_seq_length(9); });
  check<IE>("get_mask_sizes layer 6", -1, {6}, [&] { (void)cache().get_mask_sizes(1, 6); });
  check<IE>("update_conv_state layer 8", -1, {8}, [&] { (void)cache().update_conv_state(kv({2, 3, 1}).view(), 8); });
  check<IE>("has_previous_state(5)", -1, {5}, [&] { (void)cache().has_previous_state(5); });
}

TEST_F(BadInput, StaticCapacityOverflow) {
  // Layer 4 holds 3 of 12 tokens: 10 more do not fit.
  check<rwd::CapacityError>("static overflow", 4, {12}, [&] {
    (void)cache().update(kv({2, 2, 10, 3}).view(), kv({2, 2, 10, 2}).view(), 4);
  });
  // 9 more fit exactly.
  ASSERT_EQ(do_update(Target::of(cache(), 4), b_->ref.layers[4], 9, 9), "");
  ASSERT_EQ(verify(cache(), b_->ref), "");
  before_ = observe(cache());
  check<rwd::CapacityError>("static overflow by one", 4, {12}, [&] {
    (void)cache().update(kv({2, 2, 1, 3}).view(), kv({2, 2, 1, 2}).view(), 4);
  });
}

TEST_F(BadInput, RollbackTooDeep) {
  // Bring every layer to L = 10 with R = 2: sliding keeps W-1+R = 5.
  ASSERT_EQ(cache_step(cache(), b_->ref, 4, 2), "");
  ASSERT_EQ(cache_step(cache(), b_->ref, 3, 3), "");
  before_ = observe(cache());
  EXPECT_EQ(cache().max_rollback(), 2);
  check<rwd::RollbackError>("crop(-5) on the sliding layer", 1, {5, 2}, [&] { cache().layer(1).check_crop(-5); });
  check<rwd::RollbackError>("crop(-3) on the hybrid layer", 2, {3, 2}, [&] { cache().layer(2).check_crop(-3); });
  check<rwd::RollbackError>("check_crop(-4) on the sliding layer", 1, {4, 2}, [&] { cache().layer(1).check_crop(-4); });
  // Through the cache: one of the refusing layers (1 or 2) is named.
  const std::vector<Expect> xs = b_->ref.crop_expect(-4);
  ASSERT_EQ(xs.size(), 2u);
  EXPECT_EQ(expect_any_outcome([&] { cache().crop(-4); }, xs), "");
  EXPECT_EQ(diff(before_, observe(cache())), "");
}

TEST_F(BadInput, PositiveCropOnLinearLayer) {
  WarningCapture quiet;
  check<rwd::RollbackError>("crop(2) with a hybrid layer", 2, {}, [&] { cache().crop(2); });
  check<rwd::RollbackError>("crop(1) of the hybrid layer", 2, {}, [&] { cache().layer(2).check_crop(1); });
}

TEST_F(BadInput, CropWithoutRecording) {
  cache().deactivate_past_recording();
  b_->ref.deactivate();
  ASSERT_EQ(verify(cache(), b_->ref), "");
  before_ = observe(cache());
  check<rwd::RollbackError>("crop(-1) of the hybrid without recording", 2, {}, [&] { cache().crop(-1); });
  check<rwd::RollbackError>("crop(0) of the hybrid without recording", 2, {}, [&] { cache().crop(0); });
  check<rwd::RollbackError>("full rollback without recording", 2, {}, [&] { cache().crop(-100); });
  // The attention-only layers alone could still crop (L = 3 < W).
  EXPECT_NO_THROW(cache().layer(1).check_crop(-1));
  EXPECT_EQ(diff(before_, observe(cache())), "");
}

TEST_F(BadInput, RecordingArguments) {
  check<rwd::InvalidArgument>("activate_past_recording(-1)", -1, {}, [&] { cache().activate_past_recording(-1); });
  // A static sliding layer of 8 slots, W = 4: R = 4 fits (W - 1 + R + 1 = 8), R = 5 does not.
  LayerOptions o = small_options(LayerKind::SlidingAttention);
  o.static_capacity = 8;
  Layer layer(LayerKind::SlidingAttention, o, 5);
  layer.activate_past_recording(4);
  EXPECT_EQ(layer.recording_capacity(), 4);
  const std::string m = message_of<rwd::CapacityError>([&] { layer.activate_past_recording(5); });
  EXPECT_TRUE(names_layer(m, 5)) << m;
  EXPECT_TRUE(has_number(m, 8)) << m;
  EXPECT_EQ(layer.recording_capacity(), 4) << "a refused activation changed R";
}

TEST(BadInputStatic, SlidingUpdateLargerThanItsSlots) {
  LayerOptions o = small_options(LayerKind::SlidingAttention);
  o.static_capacity = 8;
  Layer layer(LayerKind::SlidingAttention, o, 2);
  RefLayer ref(LayerKind::SlidingAttention, o, 2);
  ASSERT_EQ(do_update(Target::of(layer), ref, 5, 1), "");
  const Observed before = observe(layer);
  // Returning W - 1 + 9 = 12 keys cannot fit 8 slots.
  HostTensor k(DType::F32, {2, 2, 9, 3}), v(DType::F32, {2, 2, 9, 2});
  try {
    (void)layer.update(k.view(), v.view());
    ADD_FAILURE() << "no throw";
  } catch (const rwd::CapacityError& e) {
    EXPECT_TRUE(names_layer(e.what(), 2)) << e.what();
    EXPECT_TRUE(has_number(e.what(), 8)) << e.what();
  }
  EXPECT_EQ(diff(before, observe(layer)), "");
  // A static sliding layer holds any L: many small updates work.
  for (std::uint64_t s = 2; s < 20; ++s) ASSERT_EQ(do_update(Target::of(layer), ref, 3, s), "");
  ASSERT_EQ(verify(layer, ref), "");
}

}  // namespace
}  // namespace rwt
