// Tree speculation (rewind/tree.h, Cache::begin_tree): random trees over a
// cache of every layer kind, every node's view checked against the naive
// reference (reference.h), then the path to a random node committed and the
// whole cache compared with the reference advanced by that path as a chain
// (rollback history included: crops of every exact depth afterwards), or the
// tree abandoned and nothing changed. Refusals change nothing.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <utility>
#include <vector>

#include "conformance/harness.h"
#include "conformance/tree_model.h"
#include "rewind/cache.h"

namespace rwt {
namespace {

struct Config {
  DType dtype;
  bool is_static;
  i64 R;  // -1: not recording
};

std::string run_trees(const Config& cfg, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto uniform = [&](i64 lo, i64 hi) { return lo + static_cast<i64>(rng() % static_cast<std::uint64_t>(hi - lo + 1)); };
  Built b = tree_cache(cfg.dtype, cfg.is_static);
  if (cfg.R >= 0) {
    b.cache.activate_past_recording(cfg.R);
    b.ref.activate(cfg.R);
  }
  std::uint64_t salt = seed * 1000;
  for (int round = 0; round < 14; ++round) {
    if (uniform(0, 2) == 0)
      if (std::string e = cache_step(b.cache, b.ref, uniform(1, 4), ++salt); !e.empty()) return "chain step: " + e;
    const i64 n = uniform(1, 9);
    std::vector<std::int64_t> parents{-1};
    for (i64 i = 1; i < n; ++i) parents.push_back(uniform(0, i - 1));
    const Observed before = observe(b.cache);
    rwd::TreeForward tree = b.cache.begin_tree(parents);
    std::vector<StepData> data;
    for (const RefLayer& rl : b.ref.layers) data.push_back(rl.make_step(n, ++salt));
    if (std::string e = tree_updates(b.cache, b.ref, tree, data); !e.empty())
      return "round " + std::to_string(round) + ": " + e;
    if (uniform(0, 3) == 0) {
      tree.abandon();
      if (std::string d = diff(before, observe(b.cache)); !d.empty()) return "abandon changed " + d;
      if (std::string e = verify(b.cache, b.ref); !e.empty()) return "after abandon: " + e;
      continue;
    }
    const i64 leaf = uniform(0, n - 1);
    const std::vector<std::int64_t> path = tree.path(leaf);
    tree.commit(leaf);
    if (tree.is_open()) return "the tree is still open after commit";
    for (std::size_t li = 0; li < b.ref.layers.size(); ++li)
      if (!b.ref.layers[li].stateless()) b.ref.layers[li].apply_update(path_step(data[li], path));
    if (std::string e = verify(b.cache, b.ref); !e.empty())
      return "round " + std::to_string(round) + ", after commit(" + std::to_string(leaf) + ") of " + std::to_string(n) +
             " nodes: " + e;
    // The rollback history is the chain's: crop back exactly.
    if (cfg.R > 0 && uniform(0, 1) == 0) {
      const i64 k = uniform(0, b.ref.max_rollback());
      b.cache.crop(-k);
      b.ref.crop(-k);
      if (std::string e = verify(b.cache, b.ref); !e.empty()) return "crop after commit: " + e;
    }
  }
  return "";
}

TEST(Tree, RandomTreesMatchTheReferenceAndCommitAsAChain) {
  const Config configs[] = {{DType::F32, false, -1}, {DType::F32, false, 6}, {DType::BF16, false, 2},
                            {DType::F16, true, 5},   {DType::BF16, true, 0}, {DType::F32, false, 1}};
  std::uint64_t seed = 7;
  for (const Config& c : configs) {
    for (int rep = 0; rep < 3; ++rep) {
      const std::string e = run_trees(c, ++seed);
      ASSERT_TRUE(e.empty()) << e << " [dtype " << rwd::dtype_name(c.dtype) << ", static " << c.is_static << ", R "
                             << c.R << ", seed " << seed << "]";
    }
  }
}

TEST(Tree, RefusalsChangeNothing) {
  Built b = tree_cache(DType::F32, false);
  b.cache.activate_past_recording(3);
  b.ref.activate(3);
  ASSERT_EQ(cache_step(b.cache, b.ref, 5, 1), "");
  const Observed before = observe(b.cache);
  const std::vector<std::int64_t> bad_root{0}, bad_parent{-1, 0, 2}, empty{};
  EXPECT_THROW(b.cache.begin_tree(bad_root), rwd::InvalidArgument);
  EXPECT_THROW(b.cache.begin_tree(bad_parent), rwd::InvalidArgument);
  EXPECT_THROW(b.cache.begin_tree(empty), rwd::InvalidArgument);
  std::vector<std::int64_t> huge(1025, 0);
  huge[0] = -1;
  EXPECT_THROW(b.cache.begin_tree(huge), rwd::InvalidArgument);
  EXPECT_FALSE(b.cache.tree_open());
  {
    const std::vector<std::int64_t> parents{-1, 0, 0};
    rwd::TreeForward tree = b.cache.begin_tree(parents);
    EXPECT_TRUE(b.cache.tree_open());
    // Nothing else while the tree is open.
    EXPECT_THROW(b.cache.crop(-1), rwd::StateError);
    EXPECT_THROW((void)b.cache.begin_forward(1), rwd::StateError);
    EXPECT_THROW(b.cache.begin_tree(parents), rwd::StateError);
    EXPECT_THROW(b.cache.reset(), rwd::StateError);
    EXPECT_THROW((void)b.cache.snapshot(), rwd::StateError);
    HostTensor k(DType::F32, {1, 2, 1, 3}), v(DType::F32, {1, 2, 1, 2});
    EXPECT_THROW(b.cache.update(k.view(), v.view(), 0), rwd::StateError);
    // Wrong shapes, a layer without attention, twice.
    HostTensor k3(DType::F32, {1, 2, 3, 3}), v3(DType::F32, {1, 2, 3, 2}), k2(DType::F32, {1, 2, 2, 3});
    EXPECT_THROW(tree.update(k2.view(), v3.view(), 0), rwd::InvalidArgument);
    EXPECT_THROW(tree.update(k3.view(), v3.view(), 3), rwd::StateError);  // linear_attention
    (void)tree.update(k3.view(), v3.view(), 0);
    EXPECT_THROW(tree.update(k3.view(), v3.view(), 0), rwd::StateError);
    // Commit before every layer took its update: StateError, the tree stays open.
    try {
      tree.commit(1);
      ADD_FAILURE() << "commit of an incomplete tree";
    } catch (const rwd::StateError& e) {
      EXPECT_NE(std::string(e.what()).find("layer 1 (sliding_attention) did not receive"), std::string::npos)
          << e.what();
    }
    EXPECT_TRUE(tree.is_open());
    EXPECT_THROW(tree.commit(3), rwd::IndexError);
  }  // the handle goes: abandoned
  EXPECT_FALSE(b.cache.tree_open());
  EXPECT_EQ(diff(before, observe(b.cache)), "");
  EXPECT_EQ(verify(b.cache, b.ref), "");
  // One sequence only.
  {
    Built wide = build_cache(
        {{LayerKind::FullAttention, small_options(LayerKind::FullAttention, DType::F32, false, 2)}});
    const std::vector<std::int64_t> one{-1};
    EXPECT_THROW(wide.cache.begin_tree(one), rwd::InvalidArgument);
  }
  // A cache that dies first leaves an inert handle.
  rwd::TreeForward orphan = [] {
    Built c = tree_cache(DType::F32, false);
    const std::vector<std::int64_t> one{-1};
    return c.cache.begin_tree(one);
  }();
  EXPECT_FALSE(orphan.is_open());
  EXPECT_THROW(orphan.commit(0), rwd::StateError);
}

// The tree's updates live on its handle: they follow a move, and a handle
// that is not open (moved from, abandoned, committed, or whose cache died)
// refuses them with StateError and changes nothing.
TEST(Tree, UpdatesGoThroughTheOpenHandleOnly) {
  Built b = tree_cache(DType::F32, false);
  ASSERT_EQ(cache_step(b.cache, b.ref, 3, 1), "");
  const Observed before = observe(b.cache);
  Built other = tree_cache(DType::F32, false);
  const std::vector<std::int64_t> parents{-1, 0, 0};
  HostTensor k(DType::F32, {1, 2, 3, 3}), v(DType::F32, {1, 2, 3, 2}), x(DType::F32, {1, 4, 3});
  rwd::TreeForward tree = b.cache.begin_tree(parents);
  EXPECT_TRUE(tree.is_open_on(b.cache));
  EXPECT_FALSE(tree.is_open_on(other.cache));
  rwd::TreeForward moved = std::move(tree);
  EXPECT_FALSE(tree.is_open_on(b.cache));  // NOLINT: moved-from is specified
  EXPECT_THROW((void)tree.update(k.view(), v.view(), 0), rwd::StateError);
  EXPECT_TRUE(moved.is_open_on(b.cache));
  const rwd::TreeKeyValues kv = moved.update(k.view(), v.view(), 0);
  EXPECT_EQ(kv.nodes.keys.size(2), 3);
  moved.abandon();
  try {
    (void)moved.update(k.view(), v.view(), 0);
    ADD_FAILURE() << "an update of an abandoned tree";
  } catch (const rwd::StateError& e) {
    EXPECT_NE(std::string(e.what()).find("TreeForward::update: the tree is not open"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)moved.update_conv(x.view(), 4, 0), rwd::StateError);
  EXPECT_THROW((void)moved.recurrent_slots(3, 0), rwd::StateError);
  EXPECT_FALSE(moved.is_open_on(b.cache));
  EXPECT_EQ(diff(before, observe(b.cache)), "");
  EXPECT_EQ(verify(b.cache, b.ref), "");
  rwd::TreeForward orphan = [] {
    Built c = tree_cache(DType::F32, false);
    const std::vector<std::int64_t> one{-1};
    return c.cache.begin_tree(one);
  }();
  HostTensor k1(DType::F32, {1, 2, 1, 3}), v1(DType::F32, {1, 2, 1, 2});
  EXPECT_THROW((void)orphan.update(k1.view(), v1.view(), 0), rwd::StateError);
  EXPECT_THROW((void)orphan.recurrent_slots(3, 0), rwd::StateError);
}

// A static full layer without room for the path: commit throws
// CapacityError, the tree stays open and the cache unchanged.
TEST(Tree, CommitThatDoesNotFitLeavesTheTreeOpen) {
  std::vector<std::pair<LayerKind, LayerOptions>> spec{
      {LayerKind::FullAttention, small_options(LayerKind::FullAttention, DType::F32, true, 1)}};
  spec[0].second.static_capacity = 6;
  Built b = build_cache(spec);
  ASSERT_EQ(cache_step(b.cache, b.ref, 4, 3), "");
  const std::vector<std::int64_t> chain{-1, 0, 1, 2};
  rwd::TreeForward tree = b.cache.begin_tree(chain);
  const StepData st = b.ref.layers[0].make_step(4, 9);
  const HostTensor k = b.ref.layers[0].kv_input(st, true, false), v = b.ref.layers[0].kv_input(st, false, false);
  (void)tree.update(k.view(), v.view(), 0);
  const Observed before = observe(b.cache);
  EXPECT_THROW(tree.commit(3), rwd::CapacityError);  // 4 + 4 > 6 slots
  EXPECT_TRUE(tree.is_open());
  EXPECT_EQ(diff(before, observe(b.cache)), "");
  tree.commit(1);  // 4 + 2 fits
  b.ref.layers[0].apply_update(path_step(st, {0, 1}));
  EXPECT_EQ(verify(b.cache, b.ref), "");
}

}  // namespace
}  // namespace rwt
