// libFuzzer target: Cache::adopt / Cache::release_layers, the way the Python
// module lends its layers to a C++ cache for one transactional whole-cache
// operation.
//
// Two identical sets of layers are driven from the input: the "lent" set
// goes through Cache::adopt, whole-cache operations (crop, check_crop,
// recording on / off, reorder / select / repeat, reset, shrink_to_fit, an
// open forward) and release_layers; the "mirror" set gets the same
// operations one layer at a time through the Layer API, without a Cache.
// Per-part updates (attention, conv, exact or final-state-only recurrent)
// go to both, sometimes to one part only, so layers fall out of step.
// Checked after every operation:
//   - an operation the cache accepts, every mirror layer accepts too, and
//     the two sets then hold the same bits (lengths, retained keys, conv
//     inputs, held recurrent snapshots, recording, rollback depth);
//   - an operation the cache refuses changes nothing in the lent layers, and
//     has a reason the mirror shows: the stateful layers are at different
//     lengths, a forward is open, or some mirror layer refuses it alone.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "rewind/cache.h"
#include "rewind/error.h"
#include "rewind/layer.h"
#include "rewind/tensor.h"

namespace {

using rwd::DType;
using rwd::Layer;
using rwd::LayerKind;
using rwd::Tensor;
using rwd::TensorView;
using i64 = std::int64_t;

enum Stat {
  kWholeAccepted,
  kWholeRefused,
  kRefusedOutOfStep,
  kRefusedForward,
  kFinalUpdates,
  kRefusedNeverReceived,
  kForwardsCommitted,
  kForwardsAbandoned,
  kStatCount
};
constexpr const char* kStatNames[kStatCount] = {"whole-cache operations accepted",
                                                "whole-cache operations refused",
                                                "  refused: layers out of step",
                                                "  refused: a forward open",
                                                "final-state-only recurrent updates",
                                                "  crops refused: a state never received",
                                                "forwards committed",
                                                "forwards abandoned"};
rwt::FuzzStats<kStatCount>& stats() {
  static rwt::FuzzStats<kStatCount> s(kStatNames);
  return s;
}

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_cache_adopt: %s\n", what.c_str());
  std::abort();
}

constexpr std::array<LayerKind, 8> kKinds = {
    LayerKind::FullAttention, LayerKind::SlidingAttention, LayerKind::ChunkedAttention, LayerKind::LinearAttention,
    LayerKind::Conv,          LayerKind::Hybrid,           LayerKind::HybridSliding,    LayerKind::Mlp};
constexpr i64 kMaxBatch = 6;
constexpr i64 kMaxLength = 40;
constexpr int kMaxSteps = 64;
constexpr i64 kMaxQ = 4;
constexpr i64 kMaxPartLength = kMaxLength + kMaxSteps * kMaxQ;

rwd::LayerOptions options_for(i64 batch) {
  rwd::LayerOptions o;
  o.batch_size = batch;
  o.num_kv_heads = 1;
  o.key_dim = 2;
  o.sliding_window = 3;
  o.chunk_size = 3;
  o.conv_kernel_size = 3;
  o.conv_channels = {2};
  o.recurrent_shapes = {{2}};
  return o;
}

// ---- what a layer shows --------------------------------------------------------

std::vector<float> bits(const TensorView& v) {
  Tensor copy(v.dtype, v.shape.data(), v.rank);  // every part here is f32
  rwd::copy_tensor(v, copy);
  return {copy.data<float>(), copy.data<float>() + copy.numel()};
}

struct Seen {
  i64 length = 0, batch = 0, recording = -1;
  i64 max_rollback = -2;  // -1: refused (parts out of step)
  std::vector<i64> ranges;
  std::vector<std::vector<float>> data;
  std::array<int, 4> crops{};  // outcome of check_crop(-1..-3), check_crop(0)
  bool operator==(const Seen&) const = default;
};

int outcome(const std::function<void()>& f) {
  try {
    f();
    return 0;
  } catch (const rwd::RollbackError&) {
    return 1;
  } catch (const rwd::StateError&) {
    return 2;
  } catch (const rwd::Error&) {
    return 3;
  }
}

Seen observe(const Layer& l) {
  Seen s;
  s.length = l.get_seq_length();
  s.batch = l.batch_size();
  s.recording = l.is_recording() ? l.recording_capacity() : -1;
  try {
    s.max_rollback = l.max_rollback();
  } catch (const rwd::StateError&) {
    s.max_rollback = -1;
  }
  for (int i = 0; i < 3; ++i) s.crops[static_cast<std::size_t>(i)] = outcome([&] { l.check_crop(-(i + 1)); });
  s.crops[3] = outcome([&] { l.check_crop(0); });
  if (l.has_attention()) {
    const auto r = l.stored_range();
    s.ranges.insert(s.ranges.end(), {r.first, r.end});
    const auto kv = l.keys_values();
    s.data.push_back(bits(kv.keys));
    s.data.push_back(bits(kv.values));
  }
  if (l.is_linear()) {
    const auto kind = l.kind();
    const auto r = l.conv_range(0);
    s.ranges.insert(s.ranges.end(), {r.first, r.end});
    s.data.push_back(bits(l.conv_inputs(0)));
    if (kind != LayerKind::Conv) {
      // S(L) of the recurrent state, whose length differs from the layer's
      // when its parts are out of step: found by its slot.
      const void* current = l.get_recurrent_state(0).data;
      i64 L = -1;
      auto at = [&](i64 p) {
        try {
          return l.recurrent_snapshot(0, p).data == current;
        } catch (const rwd::IndexError&) {
          return false;
        }
      };
      if (at(s.length)) {
        L = s.length;
      } else {
        for (i64 p = 0; p <= kMaxPartLength && L < 0; ++p)
          if (at(p)) L = p;
      }
      s.ranges.push_back(L);
      for (i64 p = L; p >= 0; --p) {
        try {
          s.data.push_back(bits(l.recurrent_snapshot(0, p)));
        } catch (const rwd::IndexError&) {
          break;
        }
      }
    }
  }
  return s;
}

void expect_same(const std::vector<Layer>& lent, const std::vector<Layer>& mirror, const char* after) {
  for (std::size_t i = 0; i < lent.size(); ++i) {
    if (!(observe(lent[i]) == observe(mirror[i]))) {
      fail("after " + std::string(after) + ", layer " + std::to_string(i) + " differs from its mirror");
    }
  }
}

// ---- updates -----------------------------------------------------------------------

struct Filler {
  float next = 1.0F;
  Tensor make(std::initializer_list<i64> shape) {
    Tensor t(DType::F32, shape);
    for (i64 i = 0; i < t.numel(); ++i) t.data<float>()[i] = next++;
    return t;
  }
};

// Parts of a layer: 0 attention, 1 conv, 2 recurrent (exact), 3 recurrent
// (final-state-only).
bool has_part(const Layer& l, int part) {
  switch (part) {
    case 0: return l.has_attention();
    case 1: return l.is_linear();
    default: return l.is_linear() && l.kind() != LayerKind::Conv;
  }
}

// The same update on a lent layer (`a`, or layer `idx` of `cache` when `a`
// is null) and its mirror `b`: both must agree on accepting it.
void update_part(Layer* a, Layer& b, int part, i64 q, Filler& fill, rwd::Cache* cache, int idx) {
  const i64 B = b.batch_size();
  const std::uint32_t seed = static_cast<std::uint32_t>(fill.next);
  auto run = [&](Layer* l) {
    const bool through_cache = l == nullptr;
    Filler f{static_cast<float>(seed)};
    return outcome([&] {
      switch (part) {
        case 0: {
          Tensor k = f.make({B, 1, q, 2});
          Tensor v = f.make({B, 1, q, 2});
          if (through_cache) {
            (void)cache->update(k, v, idx);
          } else {
            (void)l->update(k, v);
          }
          break;
        }
        case 1: {
          Tensor x = f.make({B, 2, q});
          if (through_cache) {
            (void)cache->update_conv_state(x, idx, 0);
          } else {
            (void)l->update_conv_state(x, 0);
          }
          break;
        }
        case 2: {
          rwd::RecurrentUpdate u = through_cache ? cache->begin_recurrent_update(q, idx, 0)
                                                 : l->begin_recurrent_update(q, 0);
          for (i64 t = 1; t <= q; ++t) {
            Tensor s = f.make({B, 2});
            rwd::copy_tensor(s, u.next(t));
          }
          u.commit();
          break;
        }
        default: {
          Tensor s = f.make({B, 2});
          if (through_cache) {
            cache->update_recurrent_state_final(s, q, idx, 0);
          } else {
            l->update_recurrent_state_final(s, q, 0);
          }
          break;
        }
      }
    });
  };
  const int ra = run(a);
  const int rb = run(&b);
  fill.next = static_cast<float>(seed) + 1000.0F;
  if (ra != rb) fail("update of part " + std::to_string(part) + " accepted by one twin only");
  if (part == 3 && ra == 0) stats().count(kFinalUpdates);
}

// ---- whole-cache operations ------------------------------------------------------

struct WholeOp {
  std::string name;
  std::function<void(rwd::Cache&)> on_cache;
  std::function<void(Layer&)> on_layer;
  bool works_out_of_step = false;  // reset
  bool check_only = false;         // check_crop, max_rollback: changes nothing either way
};

WholeOp pick_op(rwt::ByteReader& in, const std::vector<Layer>& mirror) {
  const i64 L = mirror.front().get_seq_length();
  const i64 B = mirror.front().batch_size();
  switch (in.range(0, 9)) {
    case 0:
    case 1: {
      // Mostly shallow crops (speculative decoding's), which land inside a
      // recent multi-token update.
      const i64 n = in.one_in(2) ? in.range(-L - 1, 1) : in.range(-3, 0);
      return {"crop(" + std::to_string(n) + ")", [n](rwd::Cache& c) { c.crop(n); }, [n](Layer& l) { l.crop(n); }};
    }
    case 2: {
      const i64 n = in.range(-L - 1, 1);
      return {"check_crop(" + std::to_string(n) + ")", [n](rwd::Cache& c) { c.check_crop(n); },
              [n](Layer& l) { l.check_crop(n); }, false, true};
    }
    case 3: {
      const i64 r = in.range(0, 6);
      return {"activate_past_recording(" + std::to_string(r) + ")",
              [r](rwd::Cache& c) { c.activate_past_recording(r); }, [r](Layer& l) { l.activate_past_recording(r); }};
    }
    case 4:
      return {"deactivate_past_recording", [](rwd::Cache& c) { c.deactivate_past_recording(); },
              [](Layer& l) { l.deactivate_past_recording(); }};
    case 5: {
      std::vector<i64> idx(static_cast<std::size_t>(B));
      for (auto& v : idx) v = in.range(0, B);  // B itself: out of range, refused
      if (!in.one_in(4)) std::sort(idx.begin(), idx.end());
      if (!in.one_in(3)) {
        for (i64 i = 0; i < B; ++i) idx[static_cast<std::size_t>(i)] = (i + in.range(0, B - 1)) % B;
      }
      return {"reorder_cache", [idx](rwd::Cache& c) { c.reorder_cache(idx); },
              [idx](Layer& l) { l.reorder_cache(idx); }};
    }
    case 6: {
      std::vector<i64> idx(static_cast<std::size_t>(in.range(0, 3)));
      for (auto& v : idx) v = in.range(0, B);
      return {"batch_select_indices", [idx](rwd::Cache& c) { c.batch_select_indices(idx); },
              [idx](Layer& l) { l.batch_select_indices(idx); }};
    }
    case 7: {
      const i64 r = B * 3 <= kMaxBatch ? in.range(0, 3) : in.range(0, 1);
      return {"batch_repeat_interleave(" + std::to_string(r) + ")",
              [r](rwd::Cache& c) { c.batch_repeat_interleave(r); }, [r](Layer& l) { l.batch_repeat_interleave(r); }};
    }
    case 8: return {"reset", [](rwd::Cache& c) { c.reset(); }, [](Layer& l) { l.reset(); }, true};
    default: return {"shrink_to_fit", [](rwd::Cache& c) { c.shrink_to_fit(); }, [](Layer& l) { l.shrink_to_fit(); }};
  }
}

bool lengths_differ(const std::vector<Layer>& layers) {
  std::optional<i64> L;
  for (const auto& l : layers) {
    if (l.is_stateless()) continue;
    try {
      (void)l.max_rollback();  // throws when the layer's own parts are out of step
    } catch (const rwd::StateError&) {
      return true;
    }
    if (L && *L != l.get_seq_length()) return true;
    L = l.get_seq_length();
  }
  return false;
}

// Runs `op` on the adopted cache and, per the rules at the top, on the mirror.
void whole(rwd::Cache& cache, std::vector<Layer>& mirror, const WholeOp& op, bool forward_open) {
  std::vector<Seen> before;
  for (int i = 0; i < cache.num_layers(); ++i) before.push_back(observe(cache.layer(i)));
  std::string refused;
  try {
    op.on_cache(cache);
  } catch (const rwd::Error& e) {
    refused = e.what();
    if (std::string(e.what()).find("never received") != std::string::npos) stats().count(kRefusedNeverReceived);
  }
  for (int i = 0; i < cache.num_layers(); ++i) {
    if ((!refused.empty() || op.check_only) && !(observe(cache.layer(i)) == before[static_cast<std::size_t>(i)])) {
      fail(op.name + (refused.empty() ? "" : " refused (" + refused + ")") + " changed layer " + std::to_string(i));
    }
  }
  if (!refused.empty()) {
    stats().count(kWholeRefused);
    if (forward_open) {
      stats().count(kRefusedForward);
      return;
    }
    if (!op.works_out_of_step && lengths_differ(mirror)) {
      stats().count(kRefusedOutOfStep);
      return;
    }
    for (const auto& l : mirror) {
      std::optional<Layer> trial;
      if (outcome([&] { trial.emplace(l.clone()); }) != 0) return;  // parts out of step
      if (outcome([&] { op.on_layer(*trial); }) != 0) return;
    }
    fail(op.name + " refused by the cache (" + refused + ") but accepted by every layer alone");
  }
  if (forward_open) fail(op.name + " accepted while a forward is open");
  stats().count(kWholeAccepted);
  for (std::size_t i = 0; i < mirror.size(); ++i) {
    const int r = outcome([&] { op.on_layer(mirror[i]); });
    if (r != 0) fail(op.name + " accepted by the cache but refused by layer " + std::to_string(i) + " alone");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  rwt::ByteReader in(data, size);
  const i64 B = in.range(1, 3);
  const i64 num_layers = in.range(1, 4);
  std::vector<Layer> lent, mirror;
  for (i64 i = 0; i < num_layers; ++i) {
    const LayerKind kind = kKinds[static_cast<std::size_t>(in.range(0, static_cast<i64>(kKinds.size()) - 1))];
    lent.emplace_back(kind, options_for(B), static_cast<int>(i));
    mirror.emplace_back(kind, options_for(B), static_cast<int>(i));
  }
  Filler fill;
  for (int step = 0; step < kMaxSteps && !in.empty(); ++step) {
    const i64 choice = in.range(0, 9);
    if (choice <= 3) {
      // A step of q tokens: every part of every layer (as a forward does),
      // or one part of one layer (a forward that failed halfway).
      const i64 q = in.range(1, kMaxQ);
      if (lent.front().get_seq_length() + q > kMaxLength) continue;
      const bool one = in.one_in(6);
      const i64 only = in.range(0, num_layers - 1);
      const int rec_style = in.one_in(3) ? 3 : 2;
      for (i64 i = 0; i < num_layers; ++i) {
        if (one && i != only) continue;
        for (int part = 0; part < 3; ++part) {
          if (!has_part(lent[static_cast<std::size_t>(i)], part) || (one && in.one_in(2))) continue;
          update_part(&lent[static_cast<std::size_t>(i)], mirror[static_cast<std::size_t>(i)],
                      part == 2 ? rec_style : part, q, fill, nullptr, 0);
        }
      }
      continue;
    }
    // Lend the layers to a cache for a few operations, then take them back.
    rwd::Cache cache = rwd::Cache::adopt(std::move(lent));
    const int ops = static_cast<int>(in.range(1, 3));
    for (int k = 0; k < ops; ++k) {
      if (in.one_in(5)) {
        // An open forward: whole-cache operations and release are refused;
        // it then commits (every part updated) or is abandoned.
        const i64 q = in.range(1, 3);
        std::optional<rwd::Forward> f;
        try {
          f.emplace(cache.begin_forward(q));
        } catch (const rwd::Error&) {
          continue;  // out of step: nothing opened
        }
        whole(cache, mirror, pick_op(in, mirror), true);
        try {
          (void)cache.release_layers();
          fail("release_layers accepted while a forward is open");
        } catch (const rwd::StateError&) {
        }
        if (in.one_in(2)) {
          f->abandon();
          stats().count(kForwardsAbandoned);
          continue;
        }
        // The mirror gets the forward's updates without a forward.
        const int rec_style = in.one_in(3) ? 3 : 2;
        for (int i = 0; i < cache.num_layers(); ++i) {
          Layer& m = mirror[static_cast<std::size_t>(i)];
          for (int part = 0; part < 3; ++part)
            if (has_part(m, part)) update_part(nullptr, m, part == 2 ? rec_style : part, q, fill, &cache, i);
        }
        f->commit();
        stats().count(kForwardsCommitted);
        continue;
      }
      whole(cache, mirror, pick_op(in, mirror), false);
    }
    lent = cache.release_layers();
    if (lent.size() != mirror.size()) fail("release_layers returned a different number of layers");
    expect_same(lent, mirror, "release_layers");
  }
  expect_same(lent, mirror, "the last operation");
  return 0;
}
