// Layer::update_recurrent_state_final / Cache::update_recurrent_state_final:
// a multi-token recurrent update given only its final state (transformers'
// Gated DeltaNet convention), and the rollback bounds it sets
// (docs/semantics.md section 4, layer.h).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "rewind/cache.h"
#include "rewind/error.h"
#include "rewind/layer.h"
#include "rewind/tensor.h"

namespace {

using rwd::Cache;
using rwd::DType;
using rwd::Layer;
using rwd::LayerKind;
using rwd::LayerOptions;
using rwd::Tensor;
using rwd::TensorView;
using i64 = std::int64_t;

constexpr i64 kBatch = 2;
constexpr i64 kWidth = 3;

LayerOptions recurrent_options() {
  LayerOptions o;
  o.batch_size = kBatch;
  o.recurrent_shapes = {{kWidth}};
  return o;
}

// The state a test gives for "position p": every element differs per
// position, batch row and column, so a wrong slot shows.
float value(i64 p, i64 b, i64 e) { return static_cast<float>(100 * p + 10 * b + e) + 0.5F; }

Tensor state_at(i64 p) {
  Tensor t(DType::F32, {kBatch, kWidth});
  for (i64 b = 0; b < kBatch; ++b)
    for (i64 e = 0; e < kWidth; ++e) t.data<float>()[b * kWidth + e] = value(p, b, e);
  return t;
}

// "" when `v` holds the state of position p (p == 0: the zero state).
std::string expect_state(const TensorView& v, i64 p) {
  if (v.rank != 2 || v.shape[0] != kBatch || v.shape[1] != kWidth) return "wrong shape " + v.describe();
  Tensor copy(DType::F32, {kBatch, kWidth});
  rwd::copy_tensor(v, copy);
  for (i64 b = 0; b < kBatch; ++b)
    for (i64 e = 0; e < kWidth; ++e) {
      const float want = p == 0 ? 0.0F : value(p, b, e);
      const float got = copy.data<float>()[b * kWidth + e];
      if (got != want) {
        return "S(" + std::to_string(p) + ")[" + std::to_string(b) + "," + std::to_string(e) + "] is " +
               std::to_string(got) + ", expected " + std::to_string(want);
      }
    }
  return "";
}

// Length, rollback depth and every held snapshot, bit for bit.
struct Seen {
  i64 length = 0;
  i64 max_rollback = 0;
  std::vector<std::vector<float>> held;
  bool operator==(const Seen&) const = default;
};

Seen observe(const Layer& layer) {
  Seen s;
  s.length = layer.get_seq_length();
  s.max_rollback = layer.is_recording() ? layer.max_rollback() : 0;
  for (i64 p = s.length; p >= 0; --p) {
    TensorView v;
    try {
      v = layer.recurrent_snapshot(0, p);
    } catch (const rwd::IndexError&) {
      break;
    }
    Tensor copy(DType::F32, {kBatch, kWidth});
    rwd::copy_tensor(v, copy);
    s.held.emplace_back(copy.data<float>(), copy.data<float>() + kBatch * kWidth);
  }
  return s;
}

// Token by token, S(from+1)..S(to), each state given.
void exact_updates(Layer& layer, i64 from, i64 to) {
  for (i64 p = from + 1; p <= to; ++p) layer.update_recurrent_state(state_at(p), 0);
}

// Throws RollbackError naming "never received" and the landing length.
void expect_never_received(Layer& layer, i64 n) {
  const Seen before = observe(layer);
  const i64 target = layer.get_seq_length() + n;
  try {
    layer.crop(n);
    ADD_FAILURE() << "crop(" << n << ") landing at " << target << " was accepted";
  } catch (const rwd::RollbackError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("never received"), std::string::npos) << what;
    EXPECT_NE(what.find("after " + std::to_string(target) + " tokens"), std::string::npos) << what;
    EXPECT_NE(what.find("layer 0"), std::string::npos) << what;
  }
  EXPECT_EQ(observe(layer), before) << "a refused crop(" << n << ") changed the layer";
}

TEST(RecurrentFinal, StoresTheFinalStateAndRefusesCropsIntoTheUpdate) {
  Layer layer(LayerKind::LinearAttention, recurrent_options(), 0);
  layer.activate_past_recording(8);
  exact_updates(layer, 0, 3);
  layer.update_recurrent_state_final(state_at(7), 4, 0);  // positions 4..7, only S(7) given
  EXPECT_EQ(layer.get_seq_length(), 7);
  EXPECT_EQ(expect_state(layer.get_recurrent_state(0), 7), "");
  EXPECT_EQ(layer.max_rollback(), 0);  // crop(-1) would land on S(6), never received
  for (i64 n : {-1, -2, -3}) expect_never_received(layer, n);
  for (i64 n : {-1, -2, -3}) EXPECT_THROW(layer.check_crop(n), rwd::RollbackError);
  // Landing at 3, before the update, is exact: S(3) was given.
  layer.check_crop(-4);
  layer.crop(-4);
  EXPECT_EQ(layer.get_seq_length(), 3);
  EXPECT_EQ(expect_state(layer.get_recurrent_state(0), 3), "");
  // The placeholders went with the tokens: every rollback is exact again.
  EXPECT_EQ(layer.max_rollback(), 3);
  layer.crop(-1);
  EXPECT_EQ(expect_state(layer.get_recurrent_state(0), 2), "");
}

TEST(RecurrentFinal, TokensAfterTheUpdateRollBackUpToIt) {
  Layer layer(LayerKind::LinearAttention, recurrent_options(), 0);
  layer.activate_past_recording(8);
  layer.update_recurrent_state_final(state_at(5), 5, 0);  // a prefill: S(1)..S(4) unknown
  exact_updates(layer, 5, 8);
  EXPECT_EQ(layer.max_rollback(), 3);  // down to S(5)
  expect_never_received(layer, -4);    // S(4)
  expect_never_received(layer, -7);    // S(1)
  layer.crop(-2);
  EXPECT_EQ(expect_state(layer.get_recurrent_state(0), 6), "");
  EXPECT_EQ(layer.max_rollback(), 1);
  layer.crop(-1);
  EXPECT_EQ(expect_state(layer.get_recurrent_state(0), 5), "");
  EXPECT_EQ(layer.max_rollback(), 0);
  expect_never_received(layer, -1);
  // A full rollback is exact (S(0) is the zero state) and clears the bound.
  layer.crop(-5);
  EXPECT_EQ(layer.get_seq_length(), 0);
  EXPECT_EQ(expect_state(layer.get_recurrent_state(0), 0), "");
  exact_updates(layer, 0, 3);
  EXPECT_EQ(layer.max_rollback(), 3);
  layer.crop(-2);
  EXPECT_EQ(expect_state(layer.get_recurrent_state(0), 1), "");
}

TEST(RecurrentFinal, OneTokenIsAnOrdinaryUpdate) {
  Layer layer(LayerKind::LinearAttention, recurrent_options(), 0);
  layer.activate_past_recording(4);
  for (i64 p = 1; p <= 3; ++p) layer.update_recurrent_state_final(state_at(p), 1, 0);
  EXPECT_EQ(layer.max_rollback(), 3);
  layer.crop(-2);
  EXPECT_EQ(expect_state(layer.get_recurrent_state(0), 1), "");
}

TEST(RecurrentFinal, ASecondUpdateWidensTheRefusedRange) {
  Layer layer(LayerKind::LinearAttention, recurrent_options(), 0);
  layer.activate_past_recording(16);
  layer.update_recurrent_state_final(state_at(3), 3, 0);  // S(1), S(2) unknown
  exact_updates(layer, 3, 4);
  layer.update_recurrent_state_final(state_at(7), 3, 0);  // S(5), S(6) unknown
  EXPECT_EQ(expect_state(layer.get_recurrent_state(0), 7), "");
  // Conservative while both are held: S(3) and S(4) were given, but the
  // refused range is one interval, 1..6.
  for (i64 n : {-1, -2, -3, -4, -5, -6}) expect_never_received(layer, n);
  layer.crop(-7);
  EXPECT_EQ(expect_state(layer.get_recurrent_state(0), 0), "");
}

TEST(RecurrentFinal, AnOldUpdateOutOfTheHistoryIsForgotten) {
  Layer layer(LayerKind::LinearAttention, recurrent_options(), 0);
  layer.activate_past_recording(2);
  layer.update_recurrent_state_final(state_at(3), 3, 0);  // S(1), S(2) unknown
  exact_updates(layer, 3, 8);                             // history: S(6)..S(8)
  layer.update_recurrent_state_final(state_at(11), 3, 0);
  // S(9), S(10) unknown; the held S(11) alone remains, so nothing but a full
  // rollback is exact.
  EXPECT_EQ(layer.max_rollback(), 0);
  expect_never_received(layer, -1);
  expect_never_received(layer, -2);
  EXPECT_THROW(layer.crop(-3), rwd::RollbackError);  // S(8) is no longer held
  exact_updates(layer, 11, 13);
  EXPECT_EQ(layer.max_rollback(), 2);
  layer.crop(-2);
  EXPECT_EQ(expect_state(layer.get_recurrent_state(0), 11), "");
}

TEST(RecurrentFinal, RefusedCallsChangeNothing) {
  Layer layer(LayerKind::LinearAttention, recurrent_options(), 0);
  layer.activate_past_recording(4);
  exact_updates(layer, 0, 2);
  const Seen before = observe(layer);
  EXPECT_THROW(layer.update_recurrent_state_final(state_at(9), 0, 0), rwd::InvalidArgument);
  EXPECT_THROW(layer.update_recurrent_state_final(state_at(9), -3, 0), rwd::InvalidArgument);
  Tensor wide(DType::F32, {kBatch, kWidth + 1});
  EXPECT_THROW(layer.update_recurrent_state_final(wide, 3, 0), rwd::InvalidArgument);
  Tensor half(DType::F16, {kBatch, kWidth});
  EXPECT_THROW(layer.update_recurrent_state_final(half, 3, 0), rwd::InvalidArgument);
  EXPECT_THROW(layer.update_recurrent_state_final(state_at(9), 3, 1), rwd::IndexError);
  EXPECT_EQ(observe(layer), before);
  // Layers without recurrent states refuse it with StateError.
  LayerOptions attention;
  attention.batch_size = kBatch;
  attention.num_kv_heads = 1;
  attention.key_dim = 2;
  Layer full(LayerKind::FullAttention, attention, 1);
  EXPECT_THROW(full.update_recurrent_state_final(state_at(1), 2, 0), rwd::StateError);
}

TEST(RecurrentFinal, WithoutRecordingTheUpdateIsStoredAndCropsRefusedAsAlways) {
  Layer layer(LayerKind::LinearAttention, recurrent_options(), 0);
  layer.update_recurrent_state_final(state_at(6), 6, 0);
  EXPECT_EQ(expect_state(layer.get_recurrent_state(0), 6), "");
  EXPECT_EQ(layer.max_rollback(), 0);
  EXPECT_THROW(layer.crop(-1), rwd::RollbackError);
  // Recording from here on: the placeholders are gone from the history.
  layer.activate_past_recording(4);
  exact_updates(layer, 6, 8);
  EXPECT_EQ(layer.max_rollback(), 2);
  layer.crop(-2);
  EXPECT_EQ(expect_state(layer.get_recurrent_state(0), 6), "");
}

TEST(RecurrentFinal, AViewOfTheLayerItselfIsAValidInputWhenTheSlotsGrow) {
  Layer layer(LayerKind::LinearAttention, recurrent_options(), 0);
  layer.activate_past_recording(2);
  exact_updates(layer, 0, 1);
  // 20 tokens need fresh slots beyond the ring's: the slots move while the
  // input still points into the old ones.
  layer.update_recurrent_state_final(layer.get_recurrent_state(0), 20, 0);
  EXPECT_EQ(layer.get_seq_length(), 21);
  EXPECT_EQ(expect_state(layer.get_recurrent_state(0), 1), "");  // S(21) is the S(1) given
}

TEST(RecurrentFinal, CloneKeepsTheBound) {
  Layer layer(LayerKind::LinearAttention, recurrent_options(), 0);
  layer.activate_past_recording(8);
  exact_updates(layer, 0, 2);
  layer.update_recurrent_state_final(state_at(5), 3, 0);
  Layer copy = layer.clone();
  EXPECT_EQ(copy.max_rollback(), 0);
  expect_never_received(copy, -1);
  copy.crop(-3);
  EXPECT_EQ(expect_state(copy.get_recurrent_state(0), 2), "");
  EXPECT_EQ(expect_state(layer.get_recurrent_state(0), 5), "");  // the original is untouched
  expect_never_received(layer, -2);
}

// A two-layer cache: full attention (one head, key_dim 2) and recurrent.
Cache two_layer_cache() {
  std::vector<Layer> layers;
  LayerOptions attention;
  attention.batch_size = kBatch;
  attention.num_kv_heads = 1;
  attention.key_dim = 2;
  layers.emplace_back(LayerKind::FullAttention, attention, 0);
  layers.emplace_back(LayerKind::LinearAttention, recurrent_options(), 1);
  return Cache(std::move(layers));
}

// q tokens through both layers, the recurrent one given only S(L + q).
void cache_forward(Cache& cache, i64 q) {
  const i64 end = cache.get_seq_length() + q;
  Tensor k(DType::F32, {kBatch, 1, q, 2});
  (void)cache.update(k, k, 0);
  cache.update_recurrent_state_final(state_at(end), q, 1, 0);
}

TEST(RecurrentFinal, CacheCropIsRefusedWholeAndExactOutside) {
  Cache cache = two_layer_cache();
  cache.activate_past_recording(8);
  cache_forward(cache, 1);
  cache_forward(cache, 1);
  cache_forward(cache, 4);  // the recurrent layer's S(3)..S(5) unknown
  EXPECT_EQ(cache.get_seq_length(), 6);
  EXPECT_EQ(cache.max_rollback(), 0);
  for (i64 n : {-1, -2, -3}) {
    try {
      cache.crop(n);
      ADD_FAILURE() << "crop(" << n << ") accepted";
    } catch (const rwd::RollbackError& e) {
      EXPECT_NE(std::string(e.what()).find("never received"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("layer 1"), std::string::npos) << e.what();
    }
    // Nothing changed in either layer.
    EXPECT_EQ(cache.get_seq_length(0), 6);
    EXPECT_EQ(cache.get_seq_length(1), 6);
    EXPECT_EQ(expect_state(cache.get_recurrent_state(1, 0), 6), "");
  }
  cache.crop(-4);
  EXPECT_EQ(cache.get_seq_length(0), 2);
  EXPECT_EQ(expect_state(cache.get_recurrent_state(1, 0), 2), "");
  EXPECT_EQ(cache.max_rollback(), 2);
}

TEST(RecurrentFinal, AnAbandonedForwardRestoresTheBound) {
  Cache cache = two_layer_cache();
  cache.activate_past_recording(8);
  cache_forward(cache, 3);  // S(1), S(2) unknown
  cache_forward(cache, 1);
  cache_forward(cache, 1);  // L = 5: crop(-2) lands on S(3), given
  {
    rwd::Forward f = cache.begin_forward(3);
    cache_forward(cache, 3);  // inside the forward: S(6), S(7) unknown, merged with 1..2
    EXPECT_EQ(cache.get_seq_length(1), 8);
    f.abandon();
  }
  EXPECT_EQ(cache.get_seq_length(1), 5);
  EXPECT_EQ(expect_state(cache.get_recurrent_state(1, 0), 5), "");
  EXPECT_EQ(cache.max_rollback(), 2);
  EXPECT_THROW(cache.check_crop(-3), rwd::RollbackError);  // S(2), never received
  cache.crop(-2);
  EXPECT_EQ(expect_state(cache.get_recurrent_state(1, 0), 3), "");
}

TEST(RecurrentFinal, InsideAForwardTheWholeForwardIsOneUpdate) {
  Cache cache = two_layer_cache();
  cache.activate_past_recording(4);
  rwd::Forward f = cache.begin_forward(3);
  Tensor k(DType::F32, {kBatch, 1, 3, 2});
  (void)cache.update(k, k, 0);
  EXPECT_THROW(cache.update_recurrent_state_final(state_at(2), 2, 1, 0), rwd::StateError);
  EXPECT_EQ(cache.get_seq_length(1), 0);
  cache.update_recurrent_state_final(state_at(3), 3, 1, 0);
  f.commit();
  EXPECT_EQ(expect_state(cache.get_recurrent_state(1, 0), 3), "");
  EXPECT_EQ(cache.max_rollback(), 0);
  cache.crop(-3);
  EXPECT_EQ(cache.get_seq_length(), 0);
}

}  // namespace
