// Randomized model-based test: thousands of random operation sequences
// (updates, crops, recording changes, batch operations, reset) on caches
// mixing every layer kind, checked against the naive reference after every
// step: either the cache matches the reference, or the operation threw the
// error the reference predicts and nothing changed. Fixed seeds.
#include <gtest/gtest.h>

#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "conformance/harness.h"

namespace rwt {
namespace {

struct Config {
  const char* name;
  std::vector<std::pair<LayerKind, LayerOptions>> spec;
  int sequences;
  int ops_per_sequence;
  std::uint64_t seed;
};

std::vector<std::pair<LayerKind, LayerOptions>> kinds_spec(const std::vector<LayerKind>& kinds, DType dt,
                                                           bool is_static) {
  std::vector<std::pair<LayerKind, LayerOptions>> spec;
  for (LayerKind k : kinds) {
    LayerOptions o = small_options(k, dt, false, 2);
    if (is_static &&
        (k == LayerKind::FullAttention || k == LayerKind::SlidingAttention || k == LayerKind::ChunkedAttention))
      o.static_capacity = k == LayerKind::FullAttention ? 40 : 24;
    spec.push_back({k, o});
  }
  return spec;
}

class Runner {
 public:
  Runner(const Config& cfg, std::mt19937_64& rng) : cfg_(cfg), rng_(rng), b_(build_cache(cfg.spec)) {}

  i64 uniform(i64 lo, i64 hi) {  // inclusive, platform independent
    return lo + static_cast<i64>(rng_() % static_cast<std::uint64_t>(hi - lo + 1));
  }
  bool chance(int percent) { return uniform(0, 99) < percent; }

  // "" or the failure, with the operation log.
  std::string run() {
    if (chance(60)) {
      const i64 R = uniform(0, 8);
      if (std::string e = op(
              "activate_past_recording(" + std::to_string(R) + ")", [&] { b_.cache.activate_past_recording(R); }, {},
              [&] { b_.ref.activate(R); });
          !e.empty())
        return e;
    }
    for (int i = 0; i < cfg_.ops_per_sequence; ++i) {
      const i64 dice = uniform(0, 99);
      std::string e;
      if (dice < 40) {
        e = update(uniform(1, 6));
      } else if (dice < 64) {
        const i64 L = b_.ref.seq_length();
        e = crop(uniform(-(L + 2), 3));
      } else if (dice < 68) {  // legacy positive crops, also n >= L
        e = crop(uniform(1, b_.ref.seq_length() + 2));
      } else if (dice < 73) {
        e = crop(0);
      } else if (dice < 79) {
        const i64 R = uniform(0, 8);
        e = op(
            "activate_past_recording(" + std::to_string(R) + ")", [&] { b_.cache.activate_past_recording(R); }, {},
            [&] { b_.ref.activate(R); });
      } else if (dice < 82) {
        e = op(
            "deactivate_past_recording()", [&] { b_.cache.deactivate_past_recording(); }, {},
            [&] { b_.ref.deactivate(); });
      } else if (dice < 97) {
        e = batch_op();
      } else {
        e = op(
            "reset()", [&] { b_.cache.reset(); }, {}, [&] { b_.ref.reset(); });
      }
      if (!e.empty()) return e;
    }
    return "";
  }

 private:
  std::string fail(const std::string& what) { return "operations:" + log_ + "\n=> " + what; }

  // Runs `f`; the reference predicts `xs` (any of them; empty = success, then
  // `apply` advances the reference). Checks the outcome and the whole state.
  template <class F, class A>
  std::string op(const std::string& name, F&& f, const std::vector<Expect>& xs, A&& apply) {
    log_ += "\n  " + name;
    // A predicted refusal must leave every observable field as it was (an
    // unexpected refusal or success fails below anyway).
    Observed before;
    if (!xs.empty()) before = observe(b_.cache);
    if (std::string e = expect_any_outcome(f, xs); !e.empty()) return fail(e);
    if (!xs.empty()) {
      log_ += "  -> refused";
      if (std::string e = diff(before, observe(b_.cache)); !e.empty())
        return fail("refused operation changed the cache: " + e);
    } else {
      apply();
    }
    if (std::string e = verify(b_.cache, b_.ref); !e.empty()) return fail(e);
    return "";
  }

  std::string crop(i64 n) {
    const std::vector<Expect> xs = b_.ref.crop_expect(n);
    log_ += "\n  check_crop(" + std::to_string(n) + ")";
    // check_crop changes nothing: the crop below compares the whole state
    // with the (unchanged) reference, or with the state observed here.
    const std::size_t used = b_.cache.memory().bytes_used;
    const i64 L = b_.cache.get_seq_length();
    if (std::string e = expect_any_outcome([&] { b_.cache.check_crop(n); }, xs); !e.empty()) return fail(e);
    if (b_.cache.memory().bytes_used != used || b_.cache.get_seq_length() != L)
      return fail("check_crop changed the cache");
    return op(
        "crop(" + std::to_string(n) + ")  [L=" + std::to_string(b_.ref.seq_length()) +
            ", max_rollback=" + std::to_string(b_.ref.max_rollback()) + "]",
        [&] { b_.cache.crop(n); }, xs, [&] { b_.ref.crop(n); });
  }

  std::string update(i64 q) {
    ++salt_;
    const UpdateStyle style{chance(30), chance(30)};
    log_ += "\n  update(q=" + std::to_string(q) + (style.strided ? ", strided" : "") +
            (style.copy_recurrent ? ", copying recurrent" : "") + ")";
    // A static layer that cannot hold the update refuses it, unchanged.
    for (int i = 0; i < b_.cache.num_layers(); ++i) {
      RefLayer& rl = b_.ref.layers[static_cast<std::size_t>(i)];
      if (rl.stateless()) continue;
      const Expect x = rl.update_expect(q);
      if (x.ok()) continue;
      const StepData st = rl.make_step(q, salt_);
      const HostTensor k = rl.kv_input(st, true, false), v = rl.kv_input(st, false, false);
      const Observed before = observe(b_.cache);
      if (std::string e = expect_outcome([&] { (void)b_.cache.update(k.view(), v.view(), i); }, x); !e.empty())
        return fail("layer " + std::to_string(i) + ": " + e);
      if (std::string e = diff(before, observe(b_.cache)); !e.empty())
        return fail("refused update changed the cache: " + e);
      log_ += "  -> layer " + std::to_string(i) + " full";
      return "";
    }
    if (std::string e = cache_step(b_.cache, b_.ref, q, salt_, style); !e.empty()) return fail(e);
    if (std::string e = verify(b_.cache, b_.ref); !e.empty()) return fail(e);
    return "";
  }

  std::string batch_op() {
    const i64 B = b_.ref.batch();
    const i64 kind = uniform(0, 2);
    if (kind == 0 || (kind == 1 && B > 2)) {
      std::vector<i64> idx(static_cast<std::size_t>(uniform(1, 3)));
      for (i64& i : idx) i = uniform(0, B - 1);
      if (chance(10)) idx[0] = chance(50) ? B : -1;
      if (chance(3)) idx.clear();
      std::vector<Expect> xs;
      if (Expect x = b_.ref.select_expect(idx); !x.ok()) xs.push_back(x);
      return op(
          "batch_select_indices(" + shape_str(idx) + ")", [&] { b_.cache.batch_select_indices(idx); }, xs,
          [&] { b_.ref.batch_apply(idx); });
    }
    if (kind == 1) {
      const i64 r = uniform(1, 2);
      const std::vector<i64> idx = b_.ref.repeat_indices(r);
      return op(
          "batch_repeat_interleave(" + std::to_string(r) + ")", [&] { b_.cache.batch_repeat_interleave(r); }, {},
          [&] { b_.ref.batch_apply(idx); });
    }
    std::vector<i64> beams(static_cast<std::size_t>(B));
    for (i64 i = 0; i < B; ++i) beams[static_cast<std::size_t>(i)] = i;
    for (i64 i = B - 1; i > 0; --i)
      std::swap(beams[static_cast<std::size_t>(i)], beams[static_cast<std::size_t>(uniform(0, i))]);
    if (chance(8)) beams.push_back(0);
    std::vector<Expect> xs;
    if (Expect x = b_.ref.reorder_expect(beams); !x.ok()) xs.push_back(x);
    return op(
        "reorder_cache(" + shape_str(beams) + ")", [&] { b_.cache.reorder_cache(beams); }, xs,
        [&] { b_.ref.batch_apply(beams); });
  }

  const Config& cfg_;
  std::mt19937_64& rng_;
  Built b_;
  std::string log_;
  std::uint64_t salt_ = 0;
};

void PrintTo(const Config& c, std::ostream* os) { *os << c.name; }

class Randomized : public testing::TestWithParam<Config> {};

TEST_P(Randomized, MatchesTheReferenceAfterEveryStep) {
  WarningCapture quiet;
  const Config& cfg = GetParam();
  std::mt19937_64 rng(cfg.seed);
  for (int s = 0; s < cfg.sequences; ++s) {
    Runner r(cfg, rng);
    const std::string e = r.run();
    ASSERT_TRUE(e.empty()) << e << "\nsequence " << s << " of config " << cfg.name << " (seed " << cfg.seed << ")";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Caches, Randomized,
    testing::Values(Config{"every_kind_f32", kinds_spec(kEveryLayerKind, DType::F32, false), 600, 12, 0x5eed0001},
                    Config{"every_kind_static_bf16", kinds_spec(kEveryLayerKind, DType::BF16, true), 500, 12,
                           0x5eed0002},
                    Config{"attention_only_f16",
                           kinds_spec({LayerKind::FullAttention, LayerKind::SlidingAttention,
                                       LayerKind::ChunkedAttention, LayerKind::SparseAttention, LayerKind::Moe},
                                      DType::F16, false),
                           600, 12, 0x5eed0003},
                    Config{"hybrids_f32",
                           kinds_spec({LayerKind::Mlp, LayerKind::Hybrid, LayerKind::HybridSliding, LayerKind::Conv},
                                      DType::F32, false),
                           500, 14, 0x5eed0004}),
    [](const testing::TestParamInfo<Config>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace rwt
