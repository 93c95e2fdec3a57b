// Budget sweeps (issue 28): every memory-allocating Cache operation, over
// layer mixes of 1..N layers, under each budget between "only what is
// reserved fits" and "everything fits" at which the refusal comes from a
// different allocation (so from each layer, and each part of a layer, in
// turn). The next budget of a sweep is read off the refusal itself
// (MemoryBudget's message says how many bytes were reserved and how many
// more were asked), so every allocation the operation makes is refused once.
// A refusal must leave every figure of memory() (per layer too) and every
// observable byte exactly as they were; a success must match the reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "conformance/budget_sweep.h"
#include "conformance/harness.h"
#include "conformance/tree_model.h"
#include "rewind/cache.h"
#include "rewind/snapshot.h"

namespace rwt {
namespace {

using Spec = std::vector<std::pair<LayerKind, LayerOptions>>;

struct SweepResult {
  std::string error;
  int refusals = 0;
};

// Builds a cache with `setup` for each budget in turn and runs `op` on it:
// op returns "" after a success it checked, or throws (CapacityError under
// the budget) before the reference advanced.
SweepResult sweep(const std::function<Built()>& setup, const std::function<std::string(Built&)>& op) {
  SweepResult r;
  std::size_t budget = setup().cache.memory().bytes_reserved;
  if (budget == 0) budget = 1;  // 0 means no cap
  for (int round = 0; round < 4000; ++round) {
    Built b = setup();
    b.cache.set_memory_budget(budget);
    const std::string mem_before = memory_str(b.cache.memory());
    const Observed before = observe(b.cache);
    const std::string at = "budget " + std::to_string(budget) + ": ";
    try {
      if (std::string e = op(b); !e.empty()) {
        r.error = at + e;
        return r;
      }
      if (b.cache.memory().bytes_reserved > budget) r.error = at + "reserves past the budget after success";
      return r;
    } catch (const rwd::CapacityError& e) {
      ++r.refusals;
      const std::string m = e.what();
      if (m.find("nothing was changed") == std::string::npos && m.find("memory budget exceeded") == std::string::npos) {
        r.error = at + "refused with an unexpected message: " + m;
        return r;
      }
      if (std::string now = memory_str(b.cache.memory()); now != mem_before) {
        r.error = at + "refused (" + m + ") but memory() changed:\n  before " + mem_before + "\n  after  " + now;
        return r;
      }
      if (std::string d = diff(before, observe(b.cache)); !d.empty()) {
        r.error = at + "refused (" + m + ") but " + d;
        return r;
      }
      if (std::string v = verify(b.cache, b.ref); !v.empty()) {
        r.error = at + "refused, then: " + v;
        return r;
      }
      budget = next_budget(m, budget);
    } catch (const rwd::Error& e) {
      r.error = at + "unexpected error: " + e.what();
      return r;
    }
  }
  r.error = "the operation never fitted";
  return r;
}

std::string mix_name(const std::vector<LayerKind>& kinds) {
  std::string s;
  for (LayerKind k : kinds) s += std::string(s.empty() ? "" : ",") + std::string(rwd::layer_kind_name(k));
  return s;
}

// A cache of `kinds` (batch B), recording R (-1: not), fed `steps` chains.
Built make(const std::vector<LayerKind>& kinds, i64 B, i64 R, const std::vector<i64>& steps, std::uint64_t salt) {
  Spec spec;
  for (LayerKind k : kinds) spec.push_back({k, small_options(k, DType::F32, false, B)});
  Built b = build_cache(spec);
  if (R >= 0) {
    b.cache.activate_past_recording(R);
    b.ref.activate(R);
  }
  for (i64 q : steps) {
    rwd::Forward f = b.cache.begin_forward(q);
    if (std::string e = cache_step(b.cache, b.ref, q, ++salt); !e.empty()) ADD_FAILURE() << "setup: " << e;
    f.commit();
  }
  return b;
}

struct Op {
  std::string name;
  i64 B = 1;
  i64 R = -1;
  std::function<std::string(Built&)> run;
};

std::vector<Op> cache_ops() {
  std::vector<Op> ops;
  for (i64 q : {1, 5, 40}) {
    for (i64 R : {-1, 3}) {
      ops.push_back({"begin_forward(" + std::to_string(q) + ") R=" + std::to_string(R), 2, R, [q](Built& b) {
                       rwd::Forward f = b.cache.begin_forward(q);
                       if (std::string e = cache_step(b.cache, b.ref, q, 777); !e.empty()) return e;
                       f.commit();
                       return verify(b.cache, b.ref);
                     }});
    }
  }
  for (i64 n : {1, 4, 9}) {
    ops.push_back({"begin_tree + commit, " + std::to_string(n) + " nodes", 1, 2, [n](Built& b) {
                     std::vector<std::int64_t> parents{-1};
                     for (i64 i = 1; i < n; ++i) parents.push_back((i - 1) / 2);
                     std::vector<StepData> data;
                     std::uint64_t salt = 900;
                     for (const RefLayer& rl : b.ref.layers) data.push_back(rl.make_step(n, ++salt));
                     rwd::TreeForward tree = b.cache.begin_tree(parents);
                     if (std::string e = tree_updates(b.cache, b.ref, tree, data); !e.empty()) return e;
                     const i64 leaf = n - 1;
                     const std::vector<std::int64_t> path = tree.path(leaf);
                     try {
                       tree.commit(leaf);
                     } catch (const rwd::CapacityError&) {
                       // The tree stays open and the cache unchanged; abandon it to compare.
                       if (!tree.is_open()) ADD_FAILURE() << "a refused commit closed the tree";
                       tree.abandon();
                       throw;
                     }
                     for (std::size_t li = 0; li < b.ref.layers.size(); ++li)
                       if (!b.ref.layers[li].stateless()) b.ref.layers[li].apply_update(path_step(data[li], path));
                     return verify(b.cache, b.ref);
                   }});
  }
  for (i64 R : {2, 30}) {
    ops.push_back({"activate_past_recording(" + std::to_string(R) + ")", 2, -1, [R](Built& b) {
                     b.cache.activate_past_recording(R);
                     b.ref.activate(R);
                     return verify(b.cache, b.ref);
                   }});
  }
  ops.push_back({"deactivate_past_recording()", 2, 3, [](Built& b) {
                   b.cache.deactivate_past_recording();
                   b.ref.deactivate();
                   return verify(b.cache, b.ref);
                 }});
  ops.push_back({"batch_select_indices({1})", 2, 3, [](Built& b) {
                   const std::vector<i64> idx{1};
                   b.cache.batch_select_indices(idx);
                   b.ref.batch_apply(idx);
                   return verify(b.cache, b.ref);
                 }});
  ops.push_back({"batch_repeat_interleave(3)", 2, 3, [](Built& b) {
                   const std::vector<i64> idx = b.ref.repeat_indices(3);
                   b.cache.batch_repeat_interleave(3);
                   b.ref.batch_apply(idx);
                   return verify(b.cache, b.ref);
                 }});
  ops.push_back({"reorder_cache({1, 0})", 2, 3, [](Built& b) {
                   const std::vector<i64> idx{1, 0};
                   b.cache.reorder_cache(idx);
                   b.ref.batch_apply(idx);
                   return verify(b.cache, b.ref);
                 }});
  ops.push_back({"reset()", 2, 3, [](Built& b) {
                   b.cache.reset();
                   b.ref.reset();
                   return verify(b.cache, b.ref);
                 }});
  ops.push_back({"snapshot()", 1, 3, [](Built& b) {
                   const rwd::Snapshot s = b.cache.snapshot();
                   const rwd::Snapshot again = b.cache.snapshot();
                   if (rwd::serialize_snapshot(s, "") != rwd::serialize_snapshot(again, ""))
                     return std::string("two snapshots of one state differ");
                   return verify(b.cache, b.ref);
                 }});
  return ops;
}

TEST(BudgetSweep, EveryCacheOperationRefusesAtEachAllocationChangingNothing) {
  int refusals = 0;
  for (const auto& kinds : sweep_mixes()) {
    for (const Op& op : cache_ops()) {
      auto setup = [&] { return make(kinds, op.B, op.R, {3, 2}, 11); };
      const SweepResult r = sweep(setup, op.run);
      refusals += r.refusals;
      ASSERT_EQ(r.error, "") << op.name << " over [" << mix_name(kinds) << "]";
    }
  }
  // The sweep refused at many points, not only at the first allocation.
  EXPECT_GT(refusals, 200);
  RecordProperty("refusals", refusals);
}

// Cache::restore(s) of a longer state (static and dynamic parts grow),
// under each budget between what the cache holds and what s needs.
TEST(BudgetSweep, RestoreRefusesAtEachAllocationChangingNothing) {
  int refusals = 0;
  for (const auto& kinds : sweep_mixes()) {
    Built src = make(kinds, 1, -1, {20, 20, 3}, 41);
    const rwd::Snapshot s = src.cache.snapshot();
    const std::vector<std::byte> want = rwd::serialize_snapshot(s, "");
    for (i64 R : {-1, 4}) {
      auto setup = [&] { return make(kinds, 1, R, {2}, 5); };
      const SweepResult r = sweep(setup, [&](Built& b) {
        b.cache.restore(s);
        if (rwd::serialize_snapshot(b.cache.snapshot(), "") != want) return std::string("restored state differs");
        if (b.cache.get_seq_length() != src.cache.get_seq_length()) return std::string("restored length differs");
        return std::string();
      });
      refusals += r.refusals;
      ASSERT_EQ(r.error, "") << "restore, R " << R << " over [" << mix_name(kinds) << "]";
    }
  }
  EXPECT_GT(refusals, 20);
}

// Per-layer updates without begin_forward, in caches of the one-part kinds
// (each call is then a whole step of its layer, checked by the reference):
// a refused call leaves memory() and every byte as they were, the layers
// before it keeping the token they took.
TEST(BudgetSweep, PerLayerUpdatesWithoutBeginForwardRefuseChangingNothing) {
  const std::vector<LayerKind> one_part = {LayerKind::FullAttention, LayerKind::SlidingAttention,
                                           LayerKind::ChunkedAttention, LayerKind::Conv, LayerKind::Mlp};
  std::vector<std::vector<LayerKind>> kinds_list;
  for (std::size_t n = 1; n <= one_part.size(); ++n) {
    kinds_list.emplace_back(one_part.begin(), one_part.begin() + static_cast<long>(n));
    if (n > 1) kinds_list.emplace_back(one_part.rbegin(), one_part.rbegin() + static_cast<long>(n));
  }
  // One conv state per conv layer, so that one call is the layer's whole step.
  auto make1 = [](const std::vector<LayerKind>& kinds, i64 R) {
    Spec spec;
    for (LayerKind k : kinds) {
      LayerOptions o = small_options(k, DType::F32, false, 2);
      if (k == LayerKind::Conv) o.conv_channels = {3};
      spec.push_back({k, o});
    }
    Built b = build_cache(spec);
    if (R >= 0) {
      b.cache.activate_past_recording(R);
      b.ref.activate(R);
    }
    if (std::string e = cache_step(b.cache, b.ref, 2, 3); !e.empty()) ADD_FAILURE() << "setup: " << e;
    return b;
  };
  int refusals = 0;
  for (const auto& kinds : kinds_list) {
    for (i64 R : {-1, 2}) {
      const std::size_t start = make1(kinds, R).cache.memory().bytes_reserved;
      for (std::size_t extra = 1; extra <= 4001; extra += 250) {
        Built b = make1(kinds, R);
        b.cache.set_memory_budget(start + extra);
        std::uint64_t salt = 50;
        bool refused = false;
        for (int n = 0; n < 200 && !refused; ++n) {
          for (int li = 0; li < b.cache.num_layers() && !refused; ++li) {
            RefLayer& rl = b.ref.layers[static_cast<std::size_t>(li)];
            if (rl.stateless()) continue;
            const StepData st = rl.make_step(1 + n % 3, ++salt);
            const std::string mem_before = memory_str(b.cache.memory());
            const Observed before = observe(b.cache);
            try {
              if (rl.has_attention()) {
                const HostTensor k = rl.kv_input(st, true, false), v = rl.kv_input(st, false, false);
                (void)b.cache.update(k.view(), v.view(), li);
              } else {
                (void)b.cache.update_conv_state(rl.conv_input(st, 0).view(), li, 0);
              }
            } catch (const rwd::CapacityError& e) {
              ++refusals;
              refused = true;
              ASSERT_EQ(memory_str(b.cache.memory()), mem_before)
                  << mix_name(kinds) << " layer " << li << ": " << e.what();
              ASSERT_EQ(diff(before, observe(b.cache)), "") << mix_name(kinds) << " layer " << li;
              break;
            }
            rl.apply_update(st);
            ASSERT_EQ(verify(b.cache, b.ref), "") << mix_name(kinds) << " layer " << li;
          }
        }
        // Full attention grows without bound: within 200 steps its growth is refused.
        if (std::find(kinds.begin(), kinds.end(), LayerKind::FullAttention) != kinds.end()) {
          ASSERT_TRUE(refused) << mix_name(kinds) << ": the budget never refused";
        }
      }
    }
  }
  EXPECT_GT(refusals, 10);
}

}  // namespace
}  // namespace rwt
