// Layer::clone: a deep, independent copy (parts, history, recording), outside
// any cache's budget.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "conformance/harness.h"

namespace rwt {
namespace {

// Fills `t` with distinct values from `salt`.
void fill(const rwd::Tensor& t, float salt) {
  float* p = t.data<float>();
  for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = salt + static_cast<float>(i) * 0.25f;
}

// One forward of q tokens through every part of a hybrid layer (B = 2).
void step(Layer& l, std::int64_t q, float salt) {
  const LayerOptions& o = l.options();
  rwd::Tensor k(rwd::DType::F32, {2, o.num_kv_heads, q, o.key_dim}),
      v(rwd::DType::F32, {2, o.num_kv_heads, q, o.value_dim});
  fill(k, salt);
  fill(v, salt + 100);
  l.update(k, v);
  for (std::size_t s = 0; s < o.conv_channels.size(); ++s) {
    rwd::Tensor x(rwd::DType::F32, {2, o.conv_channels[s], q});
    fill(x, salt + 200 + static_cast<float>(s));
    l.update_conv_state(x, static_cast<int>(s));
  }
  for (std::size_t s = 0; s < o.recurrent_shapes.size(); ++s) {
    rwd::RecurrentUpdate u = l.begin_recurrent_update(q, static_cast<int>(s));
    for (std::int64_t t = 1; t <= q; ++t) {
      // Written from a host tensor: the slot may be device memory.
      const rwd::TensorView slot = u.next(t);
      const rwd::Tensor h(slot.dtype, slot.shape.data(), slot.rank);
      for (std::int64_t i = 0; i < slot.numel(); ++i) h.data<float>()[i] = salt + 300 + static_cast<float>(t * 10 + i);
      rwd::copy_tensor(h, slot);
    }
    u.commit();
  }
}

void expect_same_state(const Layer& a, const Layer& b) {
  ASSERT_EQ(a.get_seq_length(), b.get_seq_length());
  EXPECT_EQ(a.max_rollback(), b.max_rollback());
  EXPECT_EQ(a.is_recording(), b.is_recording());
  EXPECT_EQ(a.recording_capacity(), b.recording_capacity());
  EXPECT_TRUE(rwd::bitwise_equal(a.keys_values().keys, b.keys_values().keys));
  EXPECT_TRUE(rwd::bitwise_equal(a.keys_values().values, b.keys_values().values));
  for (int s = 0; s < 2; ++s) {
    EXPECT_TRUE(rwd::bitwise_equal(a.get_conv_state(s), b.get_conv_state(s))) << s;
    EXPECT_TRUE(rwd::bitwise_equal(a.get_recurrent_state(s), b.get_recurrent_state(s))) << s;
  }
}

TEST(LayerClone, CopiesEveryPartAndTheRollbackHistory) {
  Layer l(LayerKind::Hybrid, small_options(LayerKind::Hybrid), 3);
  l.activate_past_recording(3);
  step(l, 4, 1.0f);
  step(l, 1, 2.0f);
  step(l, 2, 3.0f);
  Layer c = l.clone();
  EXPECT_EQ(c.index(), 3);
  expect_same_state(l, c);
  // The copy rolls back through the copied history to what the original holds there.
  c.crop(-3);
  l.crop(-3);
  expect_same_state(l, c);
}

TEST(LayerClone, IsIndependentOfTheOriginal) {
  Layer l(LayerKind::Hybrid, small_options(LayerKind::Hybrid));
  step(l, 3, 1.0f);
  Layer c = l.clone();
  Layer before = l.clone();
  step(c, 2, 9.0f);
  c.batch_select_indices(std::vector<std::int64_t>{1});
  expect_same_state(l, before);
  EXPECT_EQ(l.batch_size(), 2);
  EXPECT_EQ(c.get_seq_length(), 5);
}

TEST(LayerClone, OfACacheLayerCountsAgainstNoBudgetAndOutlivesTheCache) {
  std::vector<Layer> layers;
  layers.emplace_back(LayerKind::Hybrid, small_options(LayerKind::Hybrid));
  auto cache = std::make_unique<Cache>(std::move(layers));
  rwd::Tensor k(rwd::DType::F32, {2, 2, 3, 3}), v(rwd::DType::F32, {2, 2, 3, 2});
  fill(k, 1.0f);
  fill(v, 2.0f);
  cache->update(k, v, 0);
  rwd::Tensor x0(rwd::DType::F32, {2, 3, 3}), x1(rwd::DType::F32, {2, 2, 3});
  cache->update_conv_state(x0, 0, 0);
  cache->update_conv_state(x1, 0, 1);
  for (int s = 0; s < 2; ++s) {
    rwd::RecurrentUpdate u = cache->begin_recurrent_update(3, 0, s);
    u.commit();
  }
  const std::size_t reserved = cache->memory().bytes_reserved;
  cache->set_memory_budget(reserved);  // the tightest cap the cache accepts
  cache->set_memory_budget(0);
  Layer c = cache->layer(0).clone();
  // The copy's buffers do not count in the cache's budget: the same cap is still accepted.
  cache->set_memory_budget(reserved);
  expect_same_state(cache->layer(0), c);
  cache.reset();
  step(c, 1, 5.0f);
  EXPECT_EQ(c.get_seq_length(), 4);
}

}  // namespace
}  // namespace rwt
