// Parameterized crop conformance (docs/semantics.md sections 3, 4, 10): every
// layer kind x recording (off, R = 0, 3, 8) x dtype, for lengths below, at and
// above the window / chunk / kernel boundaries and every interesting crop(n).
// The result is either exactly the reference (retained state, and the result
// of a following update, which must also equal what a fresh layer fed the
// first L - k tokens returns) or the documented error with the layer
// completely unchanged.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "conformance/harness.h"

namespace rwt {
namespace {

struct KindCase {
  const char* name;
  LayerKind kind;
  bool is_static;
};

const KindCase kKinds[] = {
    {"full", LayerKind::FullAttention, false},
    {"full_static", LayerKind::FullAttention, true},
    {"sliding", LayerKind::SlidingAttention, false},
    {"sliding_static", LayerKind::SlidingAttention, true},
    {"chunked", LayerKind::ChunkedAttention, false},
    {"chunked_static", LayerKind::ChunkedAttention, true},
    {"linear", LayerKind::LinearAttention, false},
    {"conv", LayerKind::Conv, false},
    {"hybrid", LayerKind::Hybrid, false},
    {"hybrid_sliding", LayerKind::HybridSliding, false},
    {"sparse", LayerKind::SparseAttention, false},
    {"moe", LayerKind::Moe, false},
    {"mlp", LayerKind::Mlp, false},
};

// -1: not recording.
const int kRecordings[] = {-1, 0, 3, 8};
const DType kDtypes[] = {DType::F32, DType::F16, DType::BF16};

using Param = std::tuple<int, int, DType>;

std::string param_name(const testing::TestParamInfo<Param>& info) {
  const auto [k, r, dt] = info.param;
  std::string name = kKinds[k].name;
  name += r < 0 ? "_norec" : "_R" + std::to_string(r);
  name += "_" + std::string(rwd::dtype_name(dt));
  return name;
}

class CropConformance : public testing::TestWithParam<Param> {
 protected:
  const KindCase& kc() const { return kKinds[std::get<0>(GetParam())]; }
  int rec() const { return std::get<1>(GetParam()); }
  DType dt() const { return std::get<2>(GetParam()); }
  LayerOptions opts() const { return small_options(kc().kind, dt(), kc().is_static); }
  // Full attention (with or without side tensors) and placeholders accept every crop.
  bool ref_never_refuses() const {
    const LayerKind k = kc().kind;
    return k == LayerKind::FullAttention || k == LayerKind::SparseAttention || k == LayerKind::Moe ||
           k == LayerKind::Mlp;
  }
};

// Brings a fresh layer to length L with one of three histories:
// 0: one prefill; 1: updates of 1, 2, 3, 1, 2, 3, ...; 2: L + 2 tokens in
// updates of 3 then crop(-2) (only where the reference allows it).
// Returns false when the pattern does not apply.
bool reach(Layer& layer, RefLayer& ref, i64 L, int pattern, std::uint64_t& salt, std::string& err) {
  if (ref.stateless()) return L == 0 && pattern == 0;
  if (pattern == 0) {
    if (L > 0) err = do_update(Target::of(layer), ref, L, ++salt);
    return true;
  }
  if (pattern == 1) {
    i64 q = 1;
    while (err.empty() && ref.L < L) {
      err = do_update(Target::of(layer), ref, std::min(q, L - ref.L), ++salt, {true, true});
      q = q % 3 + 1;
    }
    return L > 1;
  }
  while (err.empty() && ref.L < L + 2) err = do_update(Target::of(layer), ref, std::min<i64>(3, L + 2 - ref.L), ++salt);
  if (!err.empty()) return true;
  const Expect x = ref.crop_expect(-2);
  if (!x.ok()) return false;
  layer.crop(-2);
  ref.crop(-2);
  return true;
}

TEST_P(CropConformance, CropMatchesReferenceOrRefusesUnchanged) {
  WarningCapture quiet;
  const LayerOptions o = opts();
  std::uint64_t salt = 1000;
  int cases = 0, refused = 0;
  for (i64 L : {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13}) {
    // Three histories in f32; the 2-byte types (stored the same way) get one.
    const int patterns = dt() == DType::F32 ? 3 : 1;
    for (int pattern = 0; pattern < patterns; ++pattern) {
      for (i64 n : {i64{5}, i64{4}, i64{3}, i64{2}, i64{1}, i64{0}, i64{-1}, i64{-2}, i64{-3}, i64{-5}, -L, -(L + 1)}) {
        SCOPED_TRACE("L=" + std::to_string(L) + " pattern=" + std::to_string(pattern) + " crop(" + std::to_string(n) +
                     ")");
        Layer layer(kc().kind, o);
        layer.set_index(2);
        RefLayer ref(kc().kind, o, 2);
        if (rec() >= 0 && !ref.stateless()) {
          layer.activate_past_recording(rec());
          ref.activate(rec());
        }
        std::string err;
        if (!reach(layer, ref, L, pattern, salt, err)) continue;
        ASSERT_EQ(err, "");
        ASSERT_EQ(ref.L, L);
        ASSERT_EQ(verify(layer, ref), "");

        const Observed before = observe(layer);
        const Expect x = ref.crop_expect(n);
        ASSERT_EQ(expect_outcome([&] { layer.check_crop(n); }, x), "") << "check_crop";
        ASSERT_EQ(diff(before, observe(layer)), "") << "check_crop changed the layer";
        ASSERT_EQ(expect_outcome([&] { layer.crop(n); }, x), "");
        ++cases;
        if (!x.ok()) {
          ++refused;
          ASSERT_EQ(diff(before, observe(layer)), "") << "a refused crop changed the layer";
        } else {
          ref.crop(n);
        }
        ASSERT_EQ(verify(layer, ref), "");
        if (ref.stateless()) continue;

        // The next forward: must equal the reference and a fresh replay of
        // the retained prefix.
        Replayed rp = replay(ref);
        ASSERT_EQ(rp.error, "") << "replay";
        const StepData st = ref.make_step(2, ++salt);
        if (!ref.update_expect(2).ok()) continue;
        StepOutputs a, b;
        ASSERT_EQ(do_update(Target::of(layer), ref, st, {}, &a), "") << "update after crop";
        ASSERT_EQ(do_update(Target::of(rp.layer), rp.ref, st, {}, &b), "") << "update of replay";
        ASSERT_EQ(a.size(), b.size());
        for (std::size_t i = 0; i < a.size(); ++i)
          ASSERT_TRUE(a[i] == b[i]) << "output " << a[i].first << " differs from the replay's";
        ASSERT_EQ(verify(layer, ref), "");
      }
    }
  }
  // The grid must exercise both outcomes where the kind can refuse at all.
  EXPECT_GT(cases, 0);
  if (!ref_never_refuses()) {
    EXPECT_GT(refused, 0);
  }
}

// A full rollback followed by appends behaves exactly like a new layer: same
// observable state, same results for the same following updates.
using FullRollback = CropConformance;

TEST_P(FullRollback, IsANewLayer) {
  const LayerOptions o = opts();
  std::uint64_t salt = 77;
  for (i64 L : {1, 3, 4, 7, 13}) {
    for (i64 extra : {0, 1, 9}) {
      SCOPED_TRACE("L=" + std::to_string(L) + " crop(-" + std::to_string(L + extra) + ")");
      Layer used(kc().kind, o), fresh(kc().kind, o);
      used.set_index(2);
      fresh.set_index(2);
      RefLayer ref(kc().kind, o, 2), fref(kc().kind, o, 2);
      if (rec() >= 0) {
        used.activate_past_recording(rec());
        fresh.activate_past_recording(rec());
        ref.activate(rec());
        fref.activate(rec());
      }
      for (i64 q = 1; ref.L < L; q = q % 3 + 1)
        ASSERT_EQ(do_update(Target::of(used), ref, std::min(q, L - ref.L), ++salt), "");
      const Expect x = ref.crop_expect(-(L + extra));
      ASSERT_EQ(expect_outcome([&] { used.crop(-(L + extra)); }, x), "");
      if (!x.ok()) continue;  // linear layers without recording refuse even a full rollback
      ref.crop(-(L + extra));
      ASSERT_EQ(ref.L, 0);
      ASSERT_EQ(verify(used, ref), "");
      ASSERT_EQ(diff(observe(fresh), observe(used)), "") << "differs from a new layer";
      for (i64 q : {2, 5, 1, 3}) {
        const StepData st = ref.make_step(q, ++salt);
        StepOutputs a, b;
        ASSERT_EQ(do_update(Target::of(used), ref, st, {}, &a), "");
        ASSERT_EQ(do_update(Target::of(fresh), fref, st, {}, &b), "");
        ASSERT_TRUE(a == b) << "outputs differ from a new layer's";
        ASSERT_EQ(diff(observe(fresh), observe(used)), "") << "differs from a new layer";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllKinds, CropConformance,
                         testing::Combine(testing::Range(0, static_cast<int>(std::size(kKinds))),
                                          testing::ValuesIn(kRecordings), testing::ValuesIn(kDtypes)),
                         param_name);

// Stateful kinds only (the last two entries are the placeholders).
INSTANTIATE_TEST_SUITE_P(StatefulKinds, FullRollback,
                         testing::Combine(testing::Range(0, static_cast<int>(std::size(kKinds)) - 2),
                                          testing::ValuesIn(kRecordings), testing::Values(DType::F32, DType::BF16)),
                         param_name);

}  // namespace
}  // namespace rwt
