// Cache::adopt / release_layers: layers owned elsewhere lent to a cache for
// one transactional whole-cache operation, then given back.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "conformance/harness.h"

namespace rwt {
namespace {

LayerOptions attention_options(std::int64_t batch) {
  LayerOptions o;
  o.batch_size = batch;
  o.num_kv_heads = 1;
  o.key_dim = 2;
  return o;
}

// Appends q tokens whose key / value entries are position * 10 + batch row.
void feed(Layer& l, std::int64_t q) {
  const std::int64_t B = l.batch_size(), L = l.get_seq_length();
  rwd::Tensor k(rwd::DType::F32, {B, 1, q, 2});
  float* p = k.data<float>();
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < q; ++t)
      for (std::int64_t d = 0; d < 2; ++d) p[(b * q + t) * 2 + d] = static_cast<float>((L + t) * 10 + b);
  l.update(k, k);
}

// Key entry 0 of every retained row of batch row b.
std::vector<float> keys_of(const Layer& l, std::int64_t b) {
  const rwd::TensorView k = l.keys_values().keys;
  std::vector<float> out;
  for (std::int64_t t = 0; t < k.size(2); ++t)
    out.push_back(k.get(b, 0, t, 0));  // through the view's storage (it may be a device's)
  return out;
}

TEST(CacheAdopt, TakesLayersInAnyStateAndGivesThemBack) {
  std::vector<Layer> layers;
  layers.emplace_back(LayerKind::FullAttention, attention_options(2), 7);
  layers.emplace_back(
      LayerKind::SlidingAttention,
      [] {
        LayerOptions o = attention_options(2);
        o.sliding_window = 3;
        return o;
      }(),
      7);
  for (Layer& l : layers) {
    l.activate_past_recording(2);
    feed(l, 5);
  }
  Cache c = Cache::adopt(std::move(layers));
  ASSERT_EQ(c.num_layers(), 2);
  EXPECT_EQ(c.get_seq_length(), 5);
  c.reorder_cache(std::vector<std::int64_t>{1, 0});
  c.crop(-2);
  std::vector<Layer> back = c.release_layers();
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[0].index(), 7);  // the indices the caller gave are kept
  EXPECT_EQ(back[0].get_seq_length(), 3);
  EXPECT_EQ(keys_of(back[0], 0), (std::vector<float>{1, 11, 21}));  // row 0 is the old row 1
  EXPECT_EQ(back[1].get_seq_length(), 3);
  EXPECT_THROW(c.get_seq_length(), rwd::StateError);  // moved-from after release
  EXPECT_THROW(c.release_layers(), rwd::StateError);
}

TEST(CacheAdopt, WholeCacheOperationIsAllOrNothingOverAdoptedLayers) {
  std::vector<Layer> layers;
  layers.emplace_back(LayerKind::FullAttention, attention_options(2), 0);
  LayerOptions window = attention_options(2);
  window.sliding_window = 2;
  layers.emplace_back(LayerKind::SlidingAttention, window, 1);  // not recording, past its window: cannot roll back
  for (Layer& l : layers) feed(l, 4);
  Cache c = Cache::adopt(std::move(layers));
  EXPECT_THROW(c.crop(-1), rwd::RollbackError);
  std::vector<Layer> back = c.release_layers();
  EXPECT_EQ(back[0].get_seq_length(), 4);  // the layer that could crop was not cropped
  EXPECT_EQ(keys_of(back[0], 1), (std::vector<float>{1, 11, 21, 31}));
}

TEST(CacheAdopt, OutOfStepLayersAreTakenAndRefusedByName) {
  std::vector<Layer> layers;
  layers.emplace_back(LayerKind::FullAttention, attention_options(1), 3);
  layers.emplace_back(LayerKind::FullAttention, attention_options(1), 4);
  feed(layers[0], 2);
  feed(layers[1], 1);
  Cache c = Cache::adopt(std::move(layers));
  try {
    c.reorder_cache(std::vector<std::int64_t>{0});
    FAIL() << "out-of-step layers were reordered";
  } catch (const rwd::StateError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("layer 3: 2, layer 4: 1"), std::string::npos) << what;
  }
  c.reset();  // works on out-of-step layers
  EXPECT_EQ(c.get_seq_length(), 0);
}

TEST(CacheAdopt, RefusesAnEmptyListAndAReleaseWhileAForwardIsOpen) {
  EXPECT_THROW(Cache::adopt({}), rwd::InvalidArgument);
  std::vector<Layer> layers;
  layers.emplace_back(LayerKind::FullAttention, attention_options(1), 0);
  Cache c = Cache::adopt(std::move(layers));
  {
    rwd::Forward f = c.begin_forward(1);
    EXPECT_THROW(c.release_layers(), rwd::StateError);
  }
  EXPECT_EQ(c.release_layers().size(), 1u);
}

}  // namespace
}  // namespace rwt
