// Whole-cache behaviour: construction from layer_types, transactional crop,
// batch operations over every stored tensor, reset, the encoder-decoder cache
// and the deprecation warning.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "conformance/harness.h"
#include "rewind/encoder_decoder_cache.h"

namespace rwt {
namespace {

const char* const kAllTypeNames[] = {"full_attention",
                                     "sliding_attention",
                                     "chunked_attention",
                                     "linear_attention",
                                     "conv",
                                     "hybrid",
                                     "hybrid_sliding",
                                     "deepseek_sparse_attention",
                                     "moe",
                                     "mlp"};

// Every kind, each with the options it needs (side tensors only on sparse).
std::vector<std::pair<LayerKind, LayerOptions>> every_kind(i64 batch, DType dt = DType::F32) {
  std::vector<std::pair<LayerKind, LayerOptions>> spec;
  for (const char* name : kAllTypeNames) {
    const LayerKind k = rwd::parse_layer_kind(name);
    spec.push_back({k, small_options(k, dt, false, batch)});
  }
  return spec;
}

// ---- construction ------------------------------------------------------------

TEST(Construction, LayerTypeNamesRoundTrip) {
  for (const char* name : kAllTypeNames) EXPECT_EQ(rwd::layer_kind_name(rwd::parse_layer_kind(name)), name);
  EXPECT_EQ(rwd::parse_layer_kind("sliding_attention"), LayerKind::SlidingAttention);
  EXPECT_EQ(rwd::parse_layer_kind("deepseek_sparse_attention"), LayerKind::SparseAttention);
  EXPECT_EQ(rwd::parse_layer_kind("hybrid_sliding"), LayerKind::HybridSliding);
  try {
    (void)rwd::parse_layer_kind("full");
    ADD_FAILURE() << "parse_layer_kind(\"full\") did not throw";
  } catch (const rwd::InvalidArgument& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("full_attention"), std::string::npos) << m;
    EXPECT_NE(m.find("hybrid_sliding"), std::string::npos) << m;
  }
}

TEST(Construction, CacheFromLayerTypes) {
  // Shared options; the conv kind ignores recurrent_shapes, no kind here
  // uses side tensors.
  LayerOptions o = small_options(LayerKind::HybridSliding);
  o.chunk_size = 4;
  const std::vector<std::string> types = {"full_attention",
                                          "sliding_attention",
                                          "chunked_attention",
                                          "linear_attention",
                                          "conv",
                                          "hybrid",
                                          "hybrid_sliding",
                                          "moe",
                                          "mlp"};
  Cache cache(types, o);
  ASSERT_EQ(cache.num_layers(), 9);
  RefCache ref;
  for (int i = 0; i < 9; ++i) {
    const LayerKind k = rwd::parse_layer_kind(types[static_cast<std::size_t>(i)]);
    EXPECT_EQ(cache.layer(i).kind(), k);
    EXPECT_EQ(cache.layer(i).index(), i);
    EXPECT_EQ(cache.memory().layers[static_cast<std::size_t>(i)].kind, types[static_cast<std::size_t>(i)]);
    ref.layers.emplace_back(k, o, i);
  }
  EXPECT_TRUE(cache.layer(7).is_stateless());
  EXPECT_TRUE(cache.layer(4).is_linear());
  EXPECT_FALSE(cache.layer(4).has_attention());
  EXPECT_TRUE(cache.layer(5).has_attention() && cache.layer(5).is_linear());
  cache.activate_past_recording(2);
  ref.activate(2);
  ASSERT_EQ(cache_step(cache, ref, 5, 1), "");
  ASSERT_EQ(verify(cache, ref), "");
  cache.crop(-2);
  ref.crop(-2);
  ASSERT_EQ(verify(cache, ref), "");
}

TEST(Construction, UnknownTypeNamesEntryAndAcceptedNames) {
  LayerOptions o = small_options(LayerKind::FullAttention);
  try {
    Cache c({"full_attention", "full_attention", "bogus_attention"}, o);
    ADD_FAILURE() << "no throw";
  } catch (const rwd::InvalidArgument& e) {
    const std::string m = e.what();
    EXPECT_TRUE(has_number(m, 2)) << m;
    EXPECT_NE(m.find("full_attention"), std::string::npos) << m;
    EXPECT_NE(m.find("linear_attention"), std::string::npos) << m;
  }
}

TEST(Construction, MissingOptionsAreInvalid) {
  LayerOptions o = small_options(LayerKind::FullAttention);
  EXPECT_THROW(Layer(LayerKind::SlidingAttention, o), rwd::InvalidArgument);  // W = 0
  EXPECT_THROW(Layer(LayerKind::ChunkedAttention, o), rwd::InvalidArgument);  // C = 0
  EXPECT_THROW(Layer(LayerKind::SparseAttention, o), rwd::InvalidArgument);   // no side_dims
  EXPECT_THROW(Layer(LayerKind::LinearAttention, o), rwd::InvalidArgument);   // K = 0
  LayerOptions no_heads = o;
  no_heads.num_kv_heads = 0;
  EXPECT_THROW(Layer(LayerKind::FullAttention, no_heads), rwd::InvalidArgument);
  LayerOptions neg_batch = o;
  neg_batch.batch_size = 0;
  EXPECT_THROW(Layer(LayerKind::FullAttention, neg_batch), rwd::InvalidArgument);
  // A cache built from such options fails the same way.
  EXPECT_THROW(Cache({"full_attention", "sliding_attention"}, o), rwd::InvalidArgument);
}

TEST(Construction, FromLayersSetsIndicesAndRejectsUsedLayers) {
  Built b = build_cache(every_kind(2));
  for (int i = 0; i < b.cache.num_layers(); ++i) EXPECT_EQ(b.cache.layer(i).index(), i);
  Layer used(LayerKind::FullAttention, small_options(LayerKind::FullAttention));
  RefLayer ref(LayerKind::FullAttention, small_options(LayerKind::FullAttention), -1);
  ASSERT_EQ(do_update(Target::of(used), ref, 2, 1), "");
  std::vector<Layer> layers;
  layers.push_back(std::move(used));
  EXPECT_THROW(Cache{std::move(layers)}, rwd::StateError);
}

TEST(Construction, CachesAndLayersMoveWithTheirState) {
  Built b = build_cache(every_kind(2));
  b.cache.activate_past_recording(2);
  b.ref.activate(2);
  ASSERT_EQ(cache_step(b.cache, b.ref, 5, 1), "");
  const Observed before = observe(b.cache);
  Cache moved(std::move(b.cache));
  EXPECT_EQ(moved.num_layers(), 10);
  EXPECT_EQ(diff(before, observe(moved)), "");
  Cache assigned({"full_attention"}, small_options(LayerKind::FullAttention));
  assigned = std::move(moved);
  EXPECT_EQ(diff(before, observe(assigned)), "");
  ASSERT_EQ(verify(assigned, b.ref), "");
  ASSERT_EQ(cache_step(assigned, b.ref, 2, 2), "");
  assigned.crop(-2);
  b.ref.crop(-2);
  ASSERT_EQ(verify(assigned, b.ref), "");

  Layer layer(LayerKind::Hybrid, small_options(LayerKind::Hybrid), 1);
  RefLayer ref(LayerKind::Hybrid, small_options(LayerKind::Hybrid), 1);
  ASSERT_EQ(do_update(Target::of(layer), ref, 3, 3), "");
  Layer other(std::move(layer));
  ASSERT_EQ(verify(other, ref), "");
  EXPECT_EQ(other.index(), 1);
}

TEST(Construction, SeqLengthReadsFirstStatefulLayer) {
  Built b = build_cache({{LayerKind::Moe, LayerOptions{}},
                         {LayerKind::Conv, small_options(LayerKind::Conv)},
                         {LayerKind::FullAttention, small_options(LayerKind::FullAttention)}});
  b.cache.activate_past_recording(1);
  b.ref.activate(1);
  EXPECT_EQ(b.cache.get_seq_length(), 0);
  // Advance only the conv layer: the default reads it (layer 1), not layer 2.
  ASSERT_EQ(do_update(Target::of(b.cache, 1), b.ref.layers[1], 3, 5), "");
  EXPECT_EQ(b.cache.get_seq_length(), 3);
  EXPECT_EQ(b.cache.get_seq_length(2), 0);
  EXPECT_EQ(b.cache.get_seq_length(0), 0);
  EXPECT_EQ(b.cache.layer(0).get_seq_length(), 0);
}

TEST(Construction, HasPreviousStateDefaultsToLastLinearLayer) {
  Built b = build_cache({{LayerKind::LinearAttention, small_options(LayerKind::LinearAttention)},
                         {LayerKind::FullAttention, small_options(LayerKind::FullAttention)},
                         {LayerKind::Conv, small_options(LayerKind::Conv)},
                         {LayerKind::FullAttention, small_options(LayerKind::FullAttention)}});
  EXPECT_FALSE(b.cache.has_previous_state());
  ASSERT_EQ(do_update(Target::of(b.cache, 2), b.ref.layers[2], 1, 5), "");
  EXPECT_TRUE(b.cache.has_previous_state()) << "default must read the last linear layer (2)";
  EXPECT_FALSE(b.cache.has_previous_state(0));
  EXPECT_TRUE(b.cache.has_previous_state(2));
}

// ---- transactional crop -----------------------------------------------------------

TEST(TransactionalCrop, NonRecordingLinearLayerRefusesAndNothingChanges) {
  Built b = build_cache({{LayerKind::FullAttention, small_options(LayerKind::FullAttention)},
                         {LayerKind::SparseAttention, small_options(LayerKind::SparseAttention)},
                         {LayerKind::FullAttention, small_options(LayerKind::FullAttention)},
                         {LayerKind::LinearAttention, small_options(LayerKind::LinearAttention)},
                         {LayerKind::FullAttention, small_options(LayerKind::FullAttention)}});
  ASSERT_EQ(cache_step(b.cache, b.ref, 4, 1), "");
  ASSERT_EQ(cache_step(b.cache, b.ref, 2, 2), "");
  const Observed before = observe(b.cache);
  EXPECT_EQ(b.cache.max_rollback(), 0);
  for (i64 n : {-1, 0, -6, -7, 2}) {
    SCOPED_TRACE("crop(" + std::to_string(n) + ")");
    const std::vector<Expect> xs = b.ref.crop_expect(n);
    ASSERT_EQ(xs.size(), 1u);
    EXPECT_EQ(xs[0].layer, 3);
    EXPECT_EQ(expect_any_outcome([&] { b.cache.check_crop(n); }, xs), "");
    EXPECT_EQ(diff(before, observe(b.cache)), "");
    EXPECT_EQ(expect_any_outcome([&] { b.cache.crop(n); }, xs), "");
    EXPECT_EQ(diff(before, observe(b.cache)), "") << "a refused crop changed some layer";
  }
  ASSERT_EQ(verify(b.cache, b.ref), "");
  // The full-attention layers alone would have accepted crop(-1).
  EXPECT_GE(b.cache.layer(0).max_rollback(), 1);
}

TEST(TransactionalCrop, TooDeepInOneLayerLeavesEveryLayerUnchanged) {
  Built b = build_cache({{LayerKind::FullAttention, small_options(LayerKind::FullAttention)},
                         {LayerKind::ChunkedAttention, small_options(LayerKind::ChunkedAttention)},
                         {LayerKind::SparseAttention, small_options(LayerKind::SparseAttention)},
                         {LayerKind::SlidingAttention, small_options(LayerKind::SlidingAttention)},
                         {LayerKind::Moe, LayerOptions{}}});
  b.cache.activate_past_recording(2);
  b.ref.activate(2);
  for (std::uint64_t s = 1; s <= 4; ++s) ASSERT_EQ(cache_step(b.cache, b.ref, 3, s), "");
  // L = 12: sliding keeps [7, 12): max_rollback 2; chunked keeps from 8: 4.
  EXPECT_EQ(b.cache.layer(3).max_rollback(), 2);
  EXPECT_EQ(b.cache.layer(1).max_rollback(), 4);
  EXPECT_EQ(b.cache.max_rollback(), 2);
  const Observed before = observe(b.cache);
  const std::vector<Expect> xs = b.ref.crop_expect(-3);
  ASSERT_EQ(xs.size(), 1u);
  EXPECT_EQ(expect_any_outcome([&] { b.cache.crop(-3); }, xs), "");
  EXPECT_EQ(diff(before, observe(b.cache)), "");
  // Deeper than both: either layer may be reported, nothing changes.
  const std::vector<Expect> xs5 = b.ref.crop_expect(-5);
  ASSERT_EQ(xs5.size(), 2u);
  EXPECT_EQ(expect_any_outcome([&] { b.cache.crop(-5); }, xs5), "");
  EXPECT_EQ(diff(before, observe(b.cache)), "");
  // Within every layer's reach it works.
  b.cache.crop(-2);
  b.ref.crop(-2);
  ASSERT_EQ(verify(b.cache, b.ref), "");
}

TEST(TransactionalCrop, PartsOutOfStepRaiseStateError) {
  Built b = build_cache({{LayerKind::FullAttention, small_options(LayerKind::FullAttention)},
                         {LayerKind::Hybrid, small_options(LayerKind::Hybrid)}});
  b.cache.activate_past_recording(3);
  b.ref.activate(3);
  ASSERT_EQ(cache_step(b.cache, b.ref, 4, 1), "");
  // Layer 1: the next forward has updated its conv state 0 only.
  RefLayer& h = b.ref.layers[1];
  const StepData st = h.make_step(1, 99);
  const HostTensor x0 = h.conv_input(st, 0);
  (void)b.cache.update_conv_state(x0.view(), 1, 0);
  const Observed layer0 = observe(b.cache.layer(0));
  for (i64 n : {-1, 0}) {
    try {
      b.cache.crop(n);
      ADD_FAILURE() << "crop(" << n << ") with parts out of step did not throw";
    } catch (const rwd::StateError& e) {
      EXPECT_TRUE(names_layer(e.what(), 1)) << e.what();
    } catch (const rwd::Error& e) {
      ADD_FAILURE() << "expected StateError, got " << e.what();
    }
  }
  const std::vector<i64> idx = {1, 0};
  EXPECT_THROW(b.cache.reorder_cache(idx), rwd::StateError);
  EXPECT_THROW(b.cache.activate_past_recording(4), rwd::StateError);
  EXPECT_EQ(diff(layer0, observe(b.cache.layer(0))), "") << "layer 0 changed";
  // Finish the forward of layer 1; then everything works again.
  const HostTensor x1 = h.conv_input(st, 1);
  (void)b.cache.update_conv_state(x1.view(), 1, 1);
  for (int s = 0; s < 2; ++s) {
    rwd::RecurrentUpdate u = b.cache.begin_recurrent_update(1, 1, s);
    scatter(st.rec[static_cast<std::size_t>(s)][0], u.next(1));
    u.commit();
  }
  const HostTensor k = h.kv_input(st, true, false), v = h.kv_input(st, false, false);
  (void)b.cache.update(k.view(), v.view(), 1);
  h.apply_update(st);
  ASSERT_EQ(do_update(Target::of(b.cache, 0), b.ref.layers[0], 1, 98), "");
  ASSERT_EQ(verify(b.cache, b.ref), "");
  b.cache.crop(-2);
  b.ref.crop(-2);
  ASSERT_EQ(verify(b.cache, b.ref), "");
}

// ---- batch operations ---------------------------------------------------------------

class BatchOps : public testing::TestWithParam<DType> {};

TEST_P(BatchOps, TouchEveryStoredTensorIncludingSnapshots) {
  WarningCapture quiet;
  Built b = build_cache(every_kind(3, GetParam()));
  b.cache.activate_past_recording(3);
  b.ref.activate(3);
  std::uint64_t salt = 0;
  ASSERT_EQ(cache_step(b.cache, b.ref, 4, ++salt), "");
  ASSERT_EQ(cache_step(b.cache, b.ref, 1, ++salt), "");
  ASSERT_EQ(cache_step(b.cache, b.ref, 2, ++salt), "");
  ASSERT_EQ(verify(b.cache, b.ref), "");

  // After operation `op`: the cache as the reference, then again after a
  // rollback of `back` positions (the snapshots were re-batched too: it
  // restores the chosen rows) and a step of `step` tokens.
  auto verify_rollback = [&](const std::string& op, i64 back, i64 step) {
    ASSERT_EQ(verify(b.cache, b.ref), "") << "after " << op;
    b.cache.crop(-back);
    b.ref.crop(-back);
    ASSERT_EQ(verify(b.cache, b.ref), "") << "crop(-" << back << ") after " << op;
    ASSERT_EQ(cache_step(b.cache, b.ref, step, ++salt), "");
  };

  // select: any order, repeats.
  const std::vector<i64> sel = {2, 0, 2};
  b.cache.batch_select_indices(sel);
  b.ref.batch_apply(sel);
  ASSERT_NO_FATAL_FAILURE(verify_rollback("batch_select_indices", 2, 2));

  const std::vector<i64> two = {1, 0};
  b.cache.batch_select_indices(two);
  b.ref.batch_apply(two);
  b.cache.batch_repeat_interleave(2);  // rows 1, 1, 0, 0 of the original order
  b.ref.batch_apply(b.ref.layers[0].repeat_indices(2));
  EXPECT_EQ(b.cache.layer(0).batch_size(), 4);
  ASSERT_NO_FATAL_FAILURE(verify_rollback("batch_repeat_interleave", 1, 3));

  const std::vector<i64> beams = {3, 1, 0, 2};
  b.cache.reorder_cache(beams);
  b.ref.batch_apply(beams);
  ASSERT_NO_FATAL_FAILURE(verify_rollback("reorder_cache", 3, 1));
  ASSERT_EQ(verify(b.cache, b.ref), "");
}

TEST_P(BatchOps, BadArgumentsChangeNothing) {
  Built b = build_cache(every_kind(3, GetParam()));
  b.cache.activate_past_recording(2);
  b.ref.activate(2);
  ASSERT_EQ(cache_step(b.cache, b.ref, 5, 1), "");
  const Observed before = observe(b.cache);
  const std::vector<i64> empty, out_of_range = {0, 3}, negative = {-1}, short_beams = {0, 1}, bad_beams = {0, 1, 7};
  EXPECT_THROW(b.cache.batch_select_indices(empty), rwd::InvalidArgument);
  EXPECT_THROW(b.cache.batch_select_indices(out_of_range), rwd::IndexError);
  EXPECT_THROW(b.cache.batch_select_indices(negative), rwd::IndexError);
  EXPECT_THROW(b.cache.reorder_cache(short_beams), rwd::InvalidArgument);
  EXPECT_THROW(b.cache.reorder_cache(bad_beams), rwd::IndexError);
  EXPECT_THROW(b.cache.batch_repeat_interleave(0), rwd::InvalidArgument);
  EXPECT_EQ(diff(before, observe(b.cache)), "");
  ASSERT_EQ(verify(b.cache, b.ref), "");
}

INSTANTIATE_TEST_SUITE_P(Dtypes, BatchOps, testing::Values(DType::F32, DType::BF16),
                         [](const testing::TestParamInfo<DType>& i) { return std::string(rwd::dtype_name(i.param)); });

// ---- reset ----------------------------------------------------------------------------

// reset() gives a cache indistinguishable from a new one with the same
// configuration (and recording setting): same observable state, same results
// for the same following operations.
TEST(Reset, IndistinguishableFromNew) {
  WarningCapture quiet;
  for (int recording : {-1, 3}) {
    SCOPED_TRACE("recording " + std::to_string(recording));
    Built used = build_cache(every_kind(2));
    Built fresh = build_cache(every_kind(2));
    if (recording >= 0) {
      for (Built* b : {&used, &fresh}) {
        b->cache.activate_past_recording(recording);
        b->ref.activate(recording);
      }
    }
    std::uint64_t salt = 0;
    ASSERT_EQ(cache_step(used.cache, used.ref, 6, ++salt), "");
    ASSERT_EQ(cache_step(used.cache, used.ref, 2, ++salt), "");
    used.cache.batch_repeat_interleave(2);
    if (recording >= 0) used.cache.crop(-1);
    used.cache.reset();
    used.ref.reset();
    EXPECT_EQ(used.cache.get_seq_length(), 0);
    EXPECT_EQ(used.cache.layer(0).batch_size(), 2) << "reset restores the configured batch size";
    EXPECT_EQ(used.cache.is_recording(), recording >= 0) << "reset keeps the recording setting";
    ASSERT_EQ(verify(used.cache, used.ref), "");
    ASSERT_EQ(diff(observe(fresh.cache), observe(used.cache)), "");
    // Same operations on both: same results, same state.
    for (i64 q : {3, 1, 4}) {
      ++salt;
      for (int i = 0; i < used.cache.num_layers(); ++i) {
        RefLayer& ru = used.ref.layers[static_cast<std::size_t>(i)];
        if (ru.stateless()) continue;
        const StepData st = ru.make_step(q, salt);
        StepOutputs a, c;
        ASSERT_EQ(do_update(Target::of(used.cache, i), ru, st, {}, &a), "");
        ASSERT_EQ(do_update(Target::of(fresh.cache, i), fresh.ref.layers[static_cast<std::size_t>(i)], st, {}, &c), "");
        ASSERT_TRUE(a == c) << "layer " << i << ": outputs differ from a new cache's";
      }
      ASSERT_EQ(diff(observe(fresh.cache), observe(used.cache)), "");
    }
    if (recording >= 0) {
      used.cache.crop(-2);
      fresh.cache.crop(-2);
      used.ref.crop(-2);
      ASSERT_EQ(verify(used.cache, used.ref), "");
      ASSERT_EQ(diff(observe(fresh.cache), observe(used.cache)), "");
    }
  }
}

// transformers #48809: reset zeroed tensors but kept their length.
TEST(Reset, NextUpdateReturnsNoStaleZeros) {
  Layer layer(LayerKind::FullAttention, small_options(LayerKind::FullAttention), 0);
  RefLayer ref(LayerKind::FullAttention, small_options(LayerKind::FullAttention), 0);
  ASSERT_EQ(do_update(Target::of(layer), ref, 5, 1), "");
  layer.reset();
  ref.reset();
  EXPECT_EQ(layer.get_seq_length(), 0);
  EXPECT_EQ(layer.get_mask_sizes(2).kv_length, 2);
  ASSERT_EQ(do_update(Target::of(layer), ref, 2, 2), "");  // returns exactly 2 keys
  ASSERT_EQ(verify(layer, ref), "");
}

// ---- encoder-decoder ----------------------------------------------------------------

TEST(EncoderDecoder, CrossWrittenOnceNeverCroppedBatchedWithSelf) {
  const LayerOptions full = small_options(LayerKind::FullAttention);
  const LayerOptions sliding = small_options(LayerKind::SlidingAttention);
  Built self = build_cache({{LayerKind::FullAttention, full}, {LayerKind::SlidingAttention, sliding}});
  Built cross = build_cache({{LayerKind::FullAttention, full}, {LayerKind::FullAttention, full}});
  rwd::EncoderDecoderCache ed(std::move(self.cache), std::move(cross.cache));
  RefCache& sref = self.ref;
  RefCache& cref = cross.ref;
  ed.self_attention_cache().activate_past_recording(4);
  sref.activate(4);

  EXPECT_FALSE(ed.is_cross_attention_updated(0));
  EXPECT_FALSE(ed.is_cross_attention_updated(1));
  // Encoder output of 6 positions for layer 0.
  const StepData enc = cref.layers[0].make_step(6, 500);
  {
    const HostTensor k = cref.layers[0].kv_input(enc, true, false);
    const HostTensor v = cref.layers[0].kv_input(enc, false, false);
    const rwd::KeyValueView kv = ed.update_cross_attention(k.view(), v.view(), 0);
    cref.layers[0].apply_update(enc);
    EXPECT_EQ(check_view("cross keys", kv.keys, DType::F32, {2, 2, 6, 3}, cref.layers[0].expect_kv(true, 0, 6)), "");
    EXPECT_EQ(check_view("cross values", kv.values, DType::F32, {2, 2, 6, 2}, cref.layers[0].expect_kv(false, 0, 6)),
              "");
  }
  EXPECT_TRUE(ed.is_cross_attention_updated(0));
  EXPECT_FALSE(ed.is_cross_attention_updated(1));
  {
    // A second call returns the stored keys, ignoring its inputs.
    const StepData other = cref.layers[0].make_step(6, 501);
    const HostTensor k = cref.layers[0].kv_input(other, true, false);
    const HostTensor v = cref.layers[0].kv_input(other, false, false);
    const rwd::KeyValueView kv = ed.update_cross_attention(k.view(), v.view(), 0);
    EXPECT_EQ(check_view("cross keys again", kv.keys, DType::F32, {2, 2, 6, 3}, cref.layers[0].expect_kv(true, 0, 6)),
              "");
    EXPECT_EQ(ed.cross_attention_cache().get_seq_length(0), 6);
  }
  ASSERT_EQ(verify(ed.cross_attention_cache().layer(0), cref.layers[0]), "");

  // Self-attention decoding, then a crop: only the self part moves.
  ASSERT_EQ(cache_step(ed.self_attention_cache(), sref, 5, 1), "");
  ASSERT_EQ(cache_step(ed.self_attention_cache(), sref, 3, 2), "");
  EXPECT_EQ(ed.get_seq_length(), 8);
  ed.crop(-3);
  sref.crop(-3);
  EXPECT_EQ(ed.get_seq_length(), 5);
  EXPECT_EQ(ed.cross_attention_cache().get_seq_length(0), 6);
  ASSERT_EQ(verify(ed.self_attention_cache(), sref), "");
  ASSERT_EQ(verify(ed.cross_attention_cache().layer(0), cref.layers[0]), "");

  // Batch operations apply to both parts.
  const std::vector<i64> sel = {1, 0};
  ed.batch_select_indices(sel);
  sref.batch_apply(sel);
  cref.batch_apply(sel);
  ASSERT_EQ(verify(ed.self_attention_cache(), sref), "");
  ASSERT_EQ(verify(ed.cross_attention_cache().layer(0), cref.layers[0]), "");
  ed.batch_repeat_interleave(2);
  sref.batch_apply(sref.layers[0].repeat_indices(2));
  cref.batch_apply(cref.layers[0].repeat_indices(2));
  ASSERT_EQ(verify(ed.self_attention_cache(), sref), "");
  ASSERT_EQ(verify(ed.cross_attention_cache().layer(0), cref.layers[0]), "");
  const std::vector<i64> beams = {2, 3, 1, 0};
  ed.reorder_cache(beams);
  sref.batch_apply(beams);
  cref.batch_apply(beams);
  ASSERT_EQ(verify(ed.self_attention_cache(), sref), "");
  ASSERT_EQ(verify(ed.cross_attention_cache().layer(0), cref.layers[0]), "");
  // Transactional: a bad index changes neither part.
  const Observed s0 = observe(ed.self_attention_cache()), c0 = observe(ed.cross_attention_cache());
  const std::vector<i64> bad = {0, 4};
  EXPECT_THROW(ed.batch_select_indices(bad), rwd::IndexError);
  EXPECT_EQ(diff(s0, observe(ed.self_attention_cache())), "");
  EXPECT_EQ(diff(c0, observe(ed.cross_attention_cache())), "");

  ed.reset();
  EXPECT_EQ(ed.get_seq_length(), 0);
  EXPECT_EQ(ed.cross_attention_cache().get_seq_length(0), 0);
  EXPECT_FALSE(ed.is_cross_attention_updated(0));
  EXPECT_EQ(ed.self_attention_cache().layer(0).batch_size(), 2);
  EXPECT_EQ(ed.cross_attention_cache().layer(0).batch_size(), 2);
}

// ---- deprecation warning --------------------------------------------------------------

TEST(Warnings, PositiveCropWarnsOncePerProcess) {
  WarningCapture capture;
  rwd::reset_one_time_warnings();
  Built b = build_cache({{LayerKind::FullAttention, small_options(LayerKind::FullAttention)},
                         {LayerKind::SparseAttention, small_options(LayerKind::SparseAttention)}});
  ASSERT_EQ(cache_step(b.cache, b.ref, 10, 1), "");
  b.cache.crop(-1);
  b.cache.crop(0);
  EXPECT_EQ(capture.messages.size(), 0u) << "only a positive crop warns";
  b.cache.crop(8);
  b.ref.crop(8);
  ASSERT_EQ(capture.messages.size(), 1u);
  EXPECT_FALSE(capture.messages[0].empty());
  b.cache.crop(6);
  b.ref.crop(6);
  b.cache.crop(5);
  b.ref.crop(5);
  EXPECT_EQ(capture.messages.size(), 1u) << "the warning fires once";
  ASSERT_EQ(verify(b.cache, b.ref), "");
  rwd::reset_one_time_warnings();
  b.cache.crop(3);
  b.ref.crop(3);
  EXPECT_EQ(capture.messages.size(), 2u) << "reset_one_time_warnings re-arms it";
  ASSERT_EQ(verify(b.cache, b.ref), "");
}

TEST(Warnings, SetWarningHandlerReturnsThePreviousOne) {
  int first = 0, second = 0;
  rwd::WarningHandler original = rwd::set_warning_handler([&](const std::string&) { ++first; });
  rwd::WarningHandler prev = rwd::set_warning_handler([&](const std::string&) { ++second; });
  ASSERT_TRUE(static_cast<bool>(prev));
  prev("x");
  EXPECT_EQ(first, 1);
  rwd::reset_one_time_warnings();
  Layer layer(LayerKind::FullAttention, small_options(LayerKind::FullAttention), 0);
  RefLayer ref(LayerKind::FullAttention, small_options(LayerKind::FullAttention), 0);
  ASSERT_EQ(do_update(Target::of(layer), ref, 4, 1), "");
  layer.crop(2);
  EXPECT_EQ(second, 1);
  EXPECT_EQ(first, 1);
  rwd::set_warning_handler(original);
}

}  // namespace
}  // namespace rwt
