// Zero-copy recurrent slots (RecurrentUpdate) and O(1) recurrent rollback
// (docs/semantics.md sections 4 and 5, layer.h).
#include <gtest/gtest.h>

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "conformance/harness.h"

namespace rwt {
namespace {

LayerOptions linear_options(std::vector<std::vector<i64>> shapes = {{2, 3}, {4}}) {
  LayerOptions o = small_options(LayerKind::LinearAttention);
  o.recurrent_shapes = std::move(shapes);
  return o;
}

// Updates the conv states of a linear layer with step `st` (so the parts
// stay in step while a test drives the recurrent states by hand).
void update_convs(Layer& layer, const RefLayer& ref, const StepData& st) {
  for (std::size_t s = 0; s < ref.conv_ch.size(); ++s) {
    const HostTensor x = ref.conv_input(st, s);
    (void)layer.update_conv_state(x.view(), static_cast<int>(s));
  }
}

// One forward of q tokens where state `s` is written through begin/commit
// by hand; returns the data pointer of each next(t) (index t) and previous() (index 0).
std::vector<const void*> forward(Layer& layer, RefLayer& ref, i64 q, std::uint64_t salt) {
  const StepData st = ref.make_step(q, salt);
  update_convs(layer, ref, st);
  std::vector<const void*> ptrs;
  for (std::size_t s = 0; s < ref.rec_shapes.size(); ++s) {
    rwd::RecurrentUpdate u = layer.begin_recurrent_update(q, static_cast<int>(s));
    if (s == 0) {
      ptrs.push_back(u.previous().data);
      for (i64 t = 1; t <= q; ++t) ptrs.push_back(u.next(t).data);
    }
    for (i64 t = 1; t <= q; ++t) scatter(st.rec[s][static_cast<std::size_t>(t - 1)], u.next(t));
    u.commit();
  }
  ref.apply_update(st);
  return ptrs;
}

TEST(RecurrentSlots, WithoutRecordingOneFreshSlotUpdatedInPlace) {
  Layer layer(LayerKind::LinearAttention, linear_options(), 0);
  RefLayer ref(LayerKind::LinearAttention, linear_options(), 0);
  ASSERT_EQ(do_update(Target::of(layer), ref, 2, 1), "");
  const StepData st = ref.make_step(3, 2);
  update_convs(layer, ref, st);
  rwd::RecurrentUpdate u = layer.begin_recurrent_update(3, 0);
  EXPECT_EQ(u.num_tokens(), 3);
  EXPECT_EQ(check_view("previous", u.previous(), DType::F32, {2, 2, 3}, ref.expect_rec(0, 2)), "");
  // One slot apart from S(L), so that S(L) survives until commit; the
  // kernel updates it in place after the first token.
  EXPECT_NE(u.next(1).data, u.previous().data);
  for (i64 t = 2; t <= 3; ++t) EXPECT_EQ(u.next(t).data, u.next(1).data) << "next(" << t << ")";
  for (i64 t = 1; t <= 3; ++t) scatter(st.rec[0][static_cast<std::size_t>(t - 1)], u.next(t));
  u.commit();
  rwd::RecurrentUpdate u1 = layer.begin_recurrent_update(3, 1);
  for (i64 t = 1; t <= 3; ++t) scatter(st.rec[1][static_cast<std::size_t>(t - 1)], u1.next(t));
  u1.commit();
  ref.apply_update(st);
  EXPECT_EQ(layer.get_seq_length(), 5);
  ASSERT_EQ(verify(layer, ref), "");  // S(5) is the state
}

TEST(RecurrentSlots, WithRecordingSlotsNeverAliasTheirPredecessor) {
  for (i64 R : {1, 2, 3, 8}) {
    for (i64 q : {1, 2, 3, 5}) {
      SCOPED_TRACE("R=" + std::to_string(R) + " q=" + std::to_string(q));
      Layer layer(LayerKind::LinearAttention, linear_options(), 0);
      RefLayer ref(LayerKind::LinearAttention, linear_options(), 0);
      layer.activate_past_recording(R);
      ref.activate(R);
      ASSERT_EQ(do_update(Target::of(layer), ref, 4, 1), "");
      const StepData st = ref.make_step(q, 2);
      update_convs(layer, ref, st);
      for (std::size_t s = 0; s < 2; ++s) {
        rwd::RecurrentUpdate u = layer.begin_recurrent_update(q, static_cast<int>(s));
        EXPECT_EQ(check_view("previous", u.previous(), DType::F32, ref.rec_state_shape(s), ref.expect_rec(s, 4)), "");
        EXPECT_NE(u.next(1).data, u.previous().data);
        for (i64 t = 2; t <= q; ++t) EXPECT_NE(u.next(t).data, u.next(t - 1).data) << "t=" << t;
        if (q <= R) {  // S(L)..S(L+q) are all held afterwards: all distinct
          std::set<const void*> distinct{u.previous().data};
          for (i64 t = 1; t <= q; ++t) distinct.insert(u.next(t).data);
          EXPECT_EQ(distinct.size(), static_cast<std::size_t>(q + 1));
        }
        // A kernel reads S(L+t-1) from the previous slot and writes the next.
        for (i64 t = 1; t <= q; ++t) scatter(st.rec[s][static_cast<std::size_t>(t - 1)], u.next(t));
        u.commit();
      }
      ref.apply_update(st);
      ASSERT_EQ(verify(layer, ref), "");  // S(L+q) and the snapshots
    }
  }
}

TEST(RecurrentSlots, RollbackMovesAnIndexNotData) {
  Layer layer(LayerKind::LinearAttention, linear_options(), 0);
  RefLayer ref(LayerKind::LinearAttention, linear_options(), 0);
  layer.activate_past_recording(3);
  ref.activate(3);
  std::vector<const void*> slot_of(1, nullptr);  // slot_of[p]: where S(p) was written
  for (std::uint64_t s = 1; s <= 5; ++s) slot_of.push_back(forward(layer, ref, 1, s)[1]);
  ASSERT_EQ(layer.get_seq_length(), 5);
  ASSERT_EQ(verify(layer, ref), "");
  layer.crop(-2);
  ref.crop(-2);
  EXPECT_EQ(layer.get_recurrent_state(0).data, slot_of[3]) << "S(3) must be restored in place";
  ASSERT_EQ(verify(layer, ref), "");
  layer.crop(-1);
  ref.crop(-1);
  EXPECT_EQ(layer.get_recurrent_state(0).data, slot_of[2]);
  ASSERT_EQ(verify(layer, ref), "");

  // A multi-token forward, then rolling all of it back restores previous()'s slot.
  const std::vector<const void*> p = forward(layer, ref, 3, 9);
  ASSERT_EQ(layer.get_seq_length(), 5);
  EXPECT_EQ(layer.get_recurrent_state(0).data, p[3]);
  layer.crop(-3);
  ref.crop(-3);
  EXPECT_EQ(layer.get_recurrent_state(0).data, p[0]);
  ASSERT_EQ(verify(layer, ref), "");
  EXPECT_THROW((void)layer.recurrent_snapshot(0, 6), rwd::IndexError) << "beyond L";
  EXPECT_THROW((void)layer.recurrent_snapshot(1, 6), rwd::IndexError) << "beyond L";
  layer.crop(0);  // drops the snapshots; the live state stays
  ref.crop(0);
  ASSERT_EQ(verify(layer, ref), "");
  EXPECT_EQ(layer.max_rollback(), 0);
}

// transformers #49036: crop rolled back conv states but not the recurrent state.
TEST(RecurrentSlots, CropRestoresTheRecurrentStateNotOnlyConv) {
  for (LayerKind kind : {LayerKind::LinearAttention, LayerKind::Hybrid, LayerKind::HybridSliding}) {
    SCOPED_TRACE(std::string(rwd::layer_kind_name(kind)));
    Layer layer(kind, small_options(kind), 0);
    RefLayer ref(kind, small_options(kind), 0);
    layer.activate_past_recording(4);
    ref.activate(4);
    ASSERT_EQ(do_update(Target::of(layer), ref, 6, 1), "");
    ASSERT_EQ(do_update(Target::of(layer), ref, 4, 2), "");  // 4 draft tokens
    for (i64 k : {3, 1}) {
      layer.crop(-k);
      ref.crop(-k);
      ASSERT_EQ(check_view("state", layer.get_recurrent_state(0), DType::F32, {2, 2, 3}, ref.expect_rec(0, ref.L)), "");
      ASSERT_EQ(verify(layer, ref), "");
    }
  }
}

TEST(RecurrentSlots, DroppedHandleLeavesTheLengthAndLiveState) {
  Layer layer(LayerKind::LinearAttention, linear_options(), 0);
  RefLayer ref(LayerKind::LinearAttention, linear_options(), 0);
  layer.activate_past_recording(3);
  ref.activate(3);
  ASSERT_EQ(do_update(Target::of(layer), ref, 5, 1), "");
  {
    rwd::RecurrentUpdate u = layer.begin_recurrent_update(2, 0);
    const Bytes junk(static_cast<std::size_t>(2 * 6 * 4), 0xAB);
    scatter(junk, u.next(1));
    scatter(junk, u.next(2));
  }  // dropped without commit
  EXPECT_EQ(layer.get_seq_length(), 5);
  EXPECT_EQ(
      check_view("S(L) intact (q <= R)", layer.get_recurrent_state(0), DType::F32, {2, 2, 3}, ref.expect_rec(0, 5)),
      "");
  EXPECT_TRUE(layer.has_previous_state());
  // The next real forward of the same size works normally.
  ASSERT_EQ(do_update(Target::of(layer), ref, 2, 2), "");
  ASSERT_EQ(verify(layer, ref), "");
  layer.crop(-2);
  ref.crop(-2);
  ASSERT_EQ(verify(layer, ref), "");
}

TEST(RecurrentSlots, StaleHandleCommitThrows) {
  WarningCapture quiet;
  const LayerOptions o = linear_options();
  struct Mutation {
    const char* name;
    std::function<void(Layer&)> apply;
  };
  const std::vector<i64> rows = {1, 0};
  const std::vector<Mutation> mutations = {
      {"crop(-1)", [](Layer& l) { l.crop(-1); }},
      {"crop(0)", [](Layer& l) { l.crop(0); }},
      {"reset", [](Layer& l) { l.reset(); }},
      {"reorder_cache", [&](Layer& l) { l.reorder_cache(rows); }},
      {"batch_repeat_interleave", [](Layer& l) { l.batch_repeat_interleave(2); }},
      {"activate_past_recording(5)", [](Layer& l) { l.activate_past_recording(5); }},
      {"deactivate_past_recording", [](Layer& l) { l.deactivate_past_recording(); }},
      {"the same state advanced",
       [](Layer& l) {
         rwd::RecurrentUpdate other = l.begin_recurrent_update(1, 0);
         other.commit();
       }},
  };
  for (const Mutation& m : mutations) {
    SCOPED_TRACE(m.name);
    Layer layer(LayerKind::LinearAttention, o, 0);
    layer.activate_past_recording(3);
    RefLayer ref(LayerKind::LinearAttention, o, 0);
    ref.activate(3);
    ASSERT_EQ(do_update(Target::of(layer), ref, 4, 1), "");
    rwd::RecurrentUpdate u = layer.begin_recurrent_update(1, 0);
    m.apply(layer);
    const i64 L = layer.get_seq_length();
    EXPECT_THROW(u.commit(), rwd::StateError);
    EXPECT_EQ(layer.get_seq_length(), L) << "a refused commit changed the length";
  }
  // Committing twice.
  Layer layer(LayerKind::LinearAttention, o, 0);
  rwd::RecurrentUpdate u = layer.begin_recurrent_update(1, 1);
  u.commit();
  EXPECT_THROW(u.commit(), rwd::StateError);
}

TEST(RecurrentSlots, OtherPartsMayBeUpdatedWhileAHandleIsOpen) {
  // The forward order of a real model: begin, conv updates, write, commit.
  Layer layer(LayerKind::Hybrid, small_options(LayerKind::Hybrid), 0);
  RefLayer ref(LayerKind::Hybrid, small_options(LayerKind::Hybrid), 0);
  layer.activate_past_recording(2);
  ref.activate(2);
  ASSERT_EQ(do_update(Target::of(layer), ref, 3, 1), "");
  const StepData st = ref.make_step(2, 2);
  rwd::RecurrentUpdate u0 = layer.begin_recurrent_update(2, 0);
  rwd::RecurrentUpdate u1 = layer.begin_recurrent_update(2, 1);
  update_convs(layer, ref, st);
  const HostTensor k = ref.kv_input(st, true, false), v = ref.kv_input(st, false, false);
  (void)layer.update(k.view(), v.view());
  for (i64 t = 1; t <= 2; ++t) {
    scatter(st.rec[0][static_cast<std::size_t>(t - 1)], u0.next(t));
    scatter(st.rec[1][static_cast<std::size_t>(t - 1)], u1.next(t));
  }
  u1.commit();
  u0.commit();
  ref.apply_update(st);
  ASSERT_EQ(verify(layer, ref), "");
}

TEST(RecurrentSlots, RankThreeStatesAndTheCopyingUpdate) {
  const LayerOptions o = linear_options({{2, 2, 3}, {3}});
  for (bool copy : {false, true}) {
    SCOPED_TRACE(copy ? "update_recurrent_state" : "begin/commit");
    Layer layer(LayerKind::LinearAttention, o, 0);
    RefLayer ref(LayerKind::LinearAttention, o, 0);
    layer.activate_past_recording(2);
    ref.activate(2);
    std::uint64_t salt = 0;
    for (i64 q : {3, 1, 2, 1}) ASSERT_EQ(do_update(Target::of(layer), ref, q, ++salt, {false, copy}), "");
    ASSERT_EQ(verify(layer, ref), "");
    layer.crop(-2);
    ref.crop(-2);
    ASSERT_EQ(verify(layer, ref), "");
    ASSERT_EQ(do_update(Target::of(layer), ref, 1, ++salt, {false, copy}), "");
    ASSERT_EQ(verify(layer, ref), "");
  }
}

}  // namespace
}  // namespace rwt
