// The worked examples of docs/semantics.md section 7, number for number (with
// the smallest R they allow, R = 3 and R = 2, and a larger R as section 10.2
// explains), and the transformers #48280 case: update returns exactly what
// get_mask_sizes announced across several updates between crops.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "conformance/harness.h"

namespace rwt {
namespace {

using rwd::PositionRange;

// W = 12, K = 4: full attention, sliding, linear attention, sparse (side
// tensor) layers.
Built example_cache(i64 batch) {
  LayerOptions full;
  full.batch_size = batch;
  full.num_kv_heads = 2;
  full.key_dim = 3;
  full.value_dim = 2;
  LayerOptions sliding = full;
  sliding.sliding_window = 12;
  LayerOptions linear;
  linear.batch_size = batch;
  linear.conv_kernel_size = 4;
  linear.conv_channels = {3};
  linear.recurrent_shapes = {{2, 2}};
  LayerOptions sparse = full;
  sparse.side_dims = {2};
  return build_cache({{LayerKind::FullAttention, full},
                      {LayerKind::SlidingAttention, sliding},
                      {LayerKind::LinearAttention, linear},
                      {LayerKind::SparseAttention, sparse}});
}

void expect_range(const PositionRange& r, i64 first, i64 end, const std::string& what) {
  EXPECT_EQ(r.first, first) << what;
  EXPECT_EQ(r.end, end) << what;
}

class WorkedExample45 : public testing::TestWithParam<i64> {};

TEST_P(WorkedExample45, CropMinus3) {
  const i64 R = GetParam();
  Built b = example_cache(2);
  b.cache.activate_past_recording(R);
  b.ref.activate(R);
  ASSERT_EQ(cache_step(b.cache, b.ref, 45, 1), "");
  ASSERT_EQ(verify(b.cache, b.ref), "");
  // Before: every part can remove R tokens (R <= 5 < 45 - ...).
  EXPECT_EQ(b.cache.max_rollback(), R);

  b.cache.crop(-3);
  b.ref.crop(-3);
  EXPECT_EQ(b.cache.get_seq_length(), 42);
  expect_range(b.cache.layer(0).stored_range(), 0, 42, "full attention keeps 0..41");
  expect_range(b.cache.layer(1).stored_range(), 31 - (R - 3), 42, "sliding keeps 31..41 (R - 3 more for a larger R)");
  const PositionRange conv = b.cache.layer(2).conv_range(0);
  EXPECT_EQ(conv.first, 38 - (R - 3)) << "conv keeps inputs 38..41";
  EXPECT_EQ(conv.end, 42);
  expect_range(b.cache.layer(3).stored_range(), 0, 42, "side tensors keep 0..41");
  EXPECT_EQ(b.cache.layer(3).side(0).size(1), 42);
  EXPECT_EQ(b.cache.layer(1).keys_values().keys.size(2), 11 + (R - 3));
  // The removed tokens' history is gone: max_rollback drops by 3.
  EXPECT_EQ(b.cache.max_rollback(), R - 3);
  EXPECT_EQ(b.cache.layer(0).max_rollback(), 42);
  ASSERT_EQ(verify(b.cache, b.ref), "");
  // The next forward sees exactly the prefix 0..41.
  ASSERT_EQ(cache_step(b.cache, b.ref, 3, 2), "");
  ASSERT_EQ(verify(b.cache, b.ref), "");
}

TEST_P(WorkedExample45, CropZero) {
  const i64 R = GetParam();
  Built b = example_cache(1);
  b.cache.activate_past_recording(R);
  b.ref.activate(R);
  ASSERT_EQ(cache_step(b.cache, b.ref, 45, 1), "");
  b.cache.crop(0);
  b.ref.crop(0);
  EXPECT_EQ(b.cache.get_seq_length(), 45);
  expect_range(b.cache.layer(0).stored_range(), 0, 45, "full attention keeps 0..44");
  expect_range(b.cache.layer(1).stored_range(), 34, 45, "sliding keeps 34..44");
  const PositionRange conv = b.cache.layer(2).conv_range(0);
  EXPECT_EQ(conv.first, 41) << "conv keeps 41..44";
  EXPECT_EQ(conv.end, 45);
  // Recurrent snapshots dropped: only S(45) is held.
  EXPECT_THROW((void)b.cache.layer(2).recurrent_snapshot(0, 44), rwd::IndexError);
  EXPECT_EQ(b.cache.max_rollback(), 0);
  ASSERT_EQ(verify(b.cache, b.ref), "");
  ASSERT_EQ(cache_step(b.cache, b.ref, 1, 2), "");
  ASSERT_EQ(verify(b.cache, b.ref), "");
}

TEST_P(WorkedExample45, CropMinus46) {
  const i64 R = GetParam();
  Built b = example_cache(2);
  b.cache.activate_past_recording(R);
  b.ref.activate(R);
  ASSERT_EQ(cache_step(b.cache, b.ref, 45, 1), "");
  b.cache.crop(-46);
  b.ref.crop(-46);
  EXPECT_EQ(b.cache.get_seq_length(), 0);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(b.cache.get_seq_length(i), 0) << "layer " << i;
  expect_range(b.cache.layer(0).stored_range(), 0, 0, "full attention empty");
  expect_range(b.cache.layer(1).stored_range(), 0, 0, "sliding empty");
  expect_range(b.cache.layer(3).stored_range(), 0, 0, "sparse empty");
  EXPECT_FALSE(b.cache.has_previous_state(2));
  EXPECT_FALSE(b.cache.has_previous_state());
  EXPECT_TRUE(b.cache.is_recording());
  ASSERT_EQ(verify(b.cache, b.ref), "");
  ASSERT_EQ(cache_step(b.cache, b.ref, 5, 2), "");
  ASSERT_EQ(verify(b.cache, b.ref), "");
}

INSTANTIATE_TEST_SUITE_P(R, WorkedExample45, testing::Values(3, 5),
                         [](const testing::TestParamInfo<i64>& i) { return "R" + std::to_string(i.param); });

// Sliding W = 8: prefill 12, crop(0) keeps 5..11; update 4 returns 5..15 with
// mask (11, 5); crop(-2) keeps 7..13 (R = 2; R = 4 keeps 2 more) and L = 14.
class WorkedExampleSliding8 : public testing::TestWithParam<i64> {};

TEST_P(WorkedExampleSliding8, NumberForNumber) {
  const i64 R = GetParam();
  LayerOptions o;
  o.batch_size = 2;
  o.num_kv_heads = 2;
  o.key_dim = 3;
  o.sliding_window = 8;
  Layer layer(LayerKind::SlidingAttention, o, 0);
  RefLayer ref(LayerKind::SlidingAttention, o, 0);
  layer.activate_past_recording(R);
  ref.activate(R);
  ASSERT_EQ(do_update(Target::of(layer), ref, 12, 1), "");
  expect_range(layer.stored_range(), 12 - (7 + R), 12, "after prefill: W-1+R tokens");
  EXPECT_EQ(layer.max_rollback(), R);

  layer.crop(0);
  ref.crop(0);
  expect_range(layer.stored_range(), 5, 12, "crop(0) keeps 5..11");
  EXPECT_EQ(layer.max_rollback(), 0);

  const rwd::MaskSizes ms = layer.get_mask_sizes(4);
  EXPECT_EQ(ms.kv_length, 11);
  EXPECT_EQ(ms.kv_offset, 5);
  const StepData st = ref.make_step(4, 2);
  const HostTensor k = ref.kv_input(st, true, false), v = ref.kv_input(st, false, false);
  const rwd::KeyValueView kv = layer.update(k.view(), v.view());
  ref.apply_update(st);
  EXPECT_EQ(kv.keys.size(2), 11) << "returns 5..15";
  EXPECT_EQ(check_view("keys 5..15", kv.keys, DType::F32, {2, 2, 11, 3}, ref.expect_kv(true, 5, 16)), "");
  EXPECT_EQ(check_view("values 5..15", kv.values, DType::F32, {2, 2, 11, 3}, ref.expect_kv(false, 5, 16)), "");
  expect_range(layer.stored_range(), std::max<i64>(5, 16 - (7 + R)), 16, "after update");

  layer.crop(-2);
  ref.crop(-2);
  EXPECT_EQ(layer.get_seq_length(), 14);
  expect_range(layer.stored_range(), 7 - (R - 2), 14, "crop(-2) keeps 7..13");
  EXPECT_EQ(layer.max_rollback(), R - 2);
  ASSERT_EQ(verify(layer, ref), "");
}

INSTANTIATE_TEST_SUITE_P(R, WorkedExampleSliding8, testing::Values(2, 4),
                         [](const testing::TestParamInfo<i64>& i) { return "R" + std::to_string(i.param); });

// transformers #48280: a recording sliding layer returned the whole
// concatenation while the mask announced W-1+q. Several updates between crops.
TEST(MaskSizes, RecordingSlidingReturnsWhatTheMaskAnnounces) {
  for (LayerKind kind : {LayerKind::SlidingAttention, LayerKind::HybridSliding}) {
    for (i64 R : {0, 1, 4, 8, 20}) {
      SCOPED_TRACE(std::string(rwd::layer_kind_name(kind)) + " R=" + std::to_string(R));
      LayerOptions o = small_options(kind);
      o.sliding_window = 8;
      Layer layer(kind, o, 1);
      RefLayer ref(kind, o, 1);
      layer.activate_past_recording(R);
      ref.activate(R);
      // Hand-worked for W = 8: (L, q) -> (kv_length, kv_offset).
      const std::vector<std::pair<std::pair<i64, i64>, std::pair<i64, i64>>> hand = {
          {{0, 5}, {5, 0}}, {{5, 3}, {8, 0}}, {{8, 3}, {10, 1}}, {{11, 3}, {10, 4}}};
      std::uint64_t salt = 10;
      for (const auto& [lq, want] : hand) {
        ASSERT_EQ(layer.get_seq_length(), lq.first);
        const rwd::MaskSizes ms = layer.get_mask_sizes(lq.second);
        EXPECT_EQ(ms.kv_length, want.first);
        EXPECT_EQ(ms.kv_offset, want.second);
        ASSERT_EQ(do_update(Target::of(layer), ref, lq.second, ++salt), "");
      }
      // Then crops and more updates; do_update checks every returned range
      // against get_mask_sizes and the reference.
      const std::vector<i64> script = {-2, 2, 4, 1, -3, 6, 0, 3, 3, -1, 2, 5, 5, -2, 1};
      for (i64 op : script) {
        SCOPED_TRACE("op " + std::to_string(op));
        if (op <= 0) {
          const Expect x = ref.crop_expect(op);
          ASSERT_EQ(expect_outcome([&] { layer.crop(op); }, x), "");
          if (x.ok()) ref.crop(op);
        } else {
          ASSERT_EQ(do_update(Target::of(layer), ref, op, ++salt), "");
        }
        ASSERT_EQ(verify(layer, ref), "");
      }
    }
  }
}

TEST(MaskSizes, ChunkedAndFullReturnWhatTheMaskAnnounces) {
  // Chunked C = 4 by hand: L = 0, q = 3 -> (3, 0); L = 3, q = 3 -> (6, 0);
  // L = 6, q = 2 -> (4, 4); L = 8, q = 1 -> (1, 8).
  LayerOptions o = small_options(LayerKind::ChunkedAttention);
  Layer layer(LayerKind::ChunkedAttention, o, 0);
  RefLayer ref(LayerKind::ChunkedAttention, o, 0);
  layer.activate_past_recording(3);
  ref.activate(3);
  const std::vector<std::pair<i64, std::pair<i64, i64>>> hand = {{3, {3, 0}}, {3, {6, 0}}, {2, {4, 4}}, {1, {1, 8}}};
  std::uint64_t salt = 0;
  for (const auto& [q, want] : hand) {
    const rwd::MaskSizes ms = layer.get_mask_sizes(q);
    EXPECT_EQ(ms.kv_length, want.first);
    EXPECT_EQ(ms.kv_offset, want.second);
    ASSERT_EQ(do_update(Target::of(layer), ref, q, ++salt), "");
  }
  // L = 9 with R = 3: keeps from floor(6 / 4) * 4 = 4.
  EXPECT_EQ(layer.stored_range().first, 4);
  EXPECT_EQ(layer.max_rollback(), 5);
  layer.crop(-3);  // back to L = 6, inside the chunk that starts at 4
  ref.crop(-3);
  const rwd::MaskSizes ms = layer.get_mask_sizes(2);
  EXPECT_EQ(ms.kv_length, 4);
  EXPECT_EQ(ms.kv_offset, 4);
  ASSERT_EQ(do_update(Target::of(layer), ref, 2, ++salt), "");
  ASSERT_EQ(verify(layer, ref), "");

  Layer full(LayerKind::FullAttention, small_options(LayerKind::FullAttention), 0);
  EXPECT_EQ(full.get_mask_sizes(4).kv_length, 4);
  EXPECT_EQ(full.get_mask_sizes(4).kv_offset, 0);
}

}  // namespace
}  // namespace rwt
