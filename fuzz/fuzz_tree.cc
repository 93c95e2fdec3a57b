// libFuzzer target: tree speculation (Cache::begin_tree) on a cache of every
// layer kind, driven by the input bytes: chain forwards, trees of any shape
// up to 24 nodes whose every node view is checked against the naive
// reference, commits of any node (the reference takes the path as a chain),
// abandons (explicit, or by destroying the handle before any layer or after
// the first layer took its update), hostile calls (malformed trees, wrong
// shapes, updates twice, per-layer and whole-cache calls inside a tree,
// commits of incomplete trees, bad leaves, node keys and values that are
// views of the cache's own retained rows), crops of every depth and
// recording changes, trees opened and committed under a memory budget
// (refusals of begin_tree and commit must leave memory() exactly as it
// was), and recurrent slots kept past their tree's commit or abandon (every
// call on them then throws StateError). Any mismatch aborts.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "conformance/tree_model.h"
#include "fuzz_support.h"

namespace rwt {
namespace {

// Paths this target adds (REWIND_FUZZ_STATS=1 prints them).
// (begin_tree is never refused by the budget: a tree's scratch is not
// counted, rewind/cache.h.)
enum Path : std::size_t { kBudgetTree, kBudgetRefusedCommit, kStaleSlotsRefused, kNumPaths };
const char* const kPathNames[kNumPaths] = {"trees under a budget", "commit refused by the budget",
                                           "stale recurrent slots refused"};
FuzzStats<kNumPaths> stats(kPathNames);

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "tree / reference mismatch\n%s\n", what.c_str());
  std::abort();
}
void check(const std::string& e) {
  if (!e.empty()) die(e);
}
// "" when neither the observable state nor any memory() figure changed.
struct Before {
  explicit Before(const Cache& c) : observed(observe(c)), memory(memory_str(c.memory())) {}
  std::string changed(const Cache& c) const {
    if (std::string d = diff(observed, observe(c)); !d.empty()) return d;
    if (std::string m = memory_str(c.memory()); m != memory) return "memory() from " + memory + " to " + m;
    return "";
  }
  Observed observed;
  std::string memory;
};
template <typename F>
void refused(const char* what, F&& f, Cache& cache) {
  const Before before(cache);
  try {
    f();
  } catch (const rwd::Error&) {
    if (std::string d = before.changed(cache); !d.empty()) die(std::string(what) + " was refused but changed " + d);
    return;
  }
  die(std::string(what) + " was accepted");
}

// Slots of a tree that ended: every call throws StateError (never reads the
// tree's freed scratch), whatever happened to the cache since.
void check_stale(std::vector<rwd::TreeRecurrentSlots>& stale) {
  for (const rwd::TreeRecurrentSlots& s : stale) {
    for (int call = 0; call < 2; ++call) {
      try {
        (void)(call == 0 ? s.previous(0) : s.next(s.num_nodes() - 1));
        die("TreeRecurrentSlots of an ended tree returned a view");
      } catch (const rwd::StateError&) {
      } catch (const rwd::Error& e) {
        die(std::string("TreeRecurrentSlots of an ended tree threw other than StateError: ") + e.what());
      }
    }
    stats.count(kStaleSlotsRefused);
  }
  // The newest few are enough (each is checked at every later step).
  if (stale.size() > 12) stale.erase(stale.begin(), stale.end() - 12);
}

// Calls the open tree of parents.size() nodes must refuse, changing nothing.
void refuse_calls_inside_a_tree(Built& b, rwd::TreeForward& tree, const std::vector<std::int64_t>& parents, DType dt) {
  const auto n = static_cast<i64>(parents.size());
  refused(
      "crop inside a tree", [&] { b.cache.crop(-1); }, b.cache);
  refused(
      "begin_forward inside a tree", [&] { (void)b.cache.begin_forward(1); }, b.cache);
  refused(
      "begin_tree inside a tree", [&] { (void)b.cache.begin_tree(parents); }, b.cache);
  refused(
      "commit of an incomplete tree", [&] { tree.commit(0); }, b.cache);
  HostTensor k(dt, {1, 2, n + 1, 3}), v(dt, {1, 2, n + 1, 2});
  refused(
      "TreeForward::update of N + 1 rows", [&] { (void)tree.update(k.view(), v.view(), 0); }, b.cache);
}

// The tree abandoned by destroying its handle, before any layer or after the
// first took its update: the cache is as before_all saw it.
void abandon_by_destruction(ByteReader& in, Built& b, std::optional<rwd::TreeForward>& tree,
                            const std::vector<StepData>& data, std::uint64_t salt,
                            std::vector<rwd::TreeRecurrentSlots>& stale, const Before& before_all) {
  if (in.one_in(2)) {
    const RefLayer& rl = b.ref.layers[0];
    const HostTensor k = rl.kv_input(data[0], true, false), v = rl.kv_input(data[0], false, false);
    (void)tree->update(k.view(), v.view(), 0);
  }
  // Layer 3 (linear attention) hands out its slots before the abandon on
  // every other tree (no input byte read, so older seeds keep their paths).
  if (salt % 2 == 0) stale.push_back(tree->recurrent_slots(3, 0));
  tree.reset();
  if (std::string d = before_all.changed(b.cache); !d.empty()) die("abandoned tree changed " + d);
  check(verify(b.cache, b.ref));
}

// One tree round of run(): a random tree, hostile calls inside it, every
// node's update checked, then an abandon (explicit or by the handle's
// destruction) or a commit (refused or not) checked against the reference.
void tree_round(ByteReader& in, Built& b, DType dt, std::uint64_t& salt, std::vector<rwd::TreeRecurrentSlots>& stale) {
  if (b.ref.seq_length() > 120) return;
  const i64 n = in.range(1, 24);
  std::vector<std::int64_t> parents{-1};
  for (i64 i = 1; i < n; ++i) parents.push_back(in.next() % 4 == 0 ? i - 1 : in.range(0, i - 1));
  // A budget between what is reserved and a few KiB more: begin_tree
  // and commit refuse at any of their allocations.
  const bool budget = in.one_in(4);
  if (budget) {
    b.cache.set_memory_budget(b.cache.memory().bytes_reserved + static_cast<std::size_t>(in.range(0, 255)) * 24);
    stats.count(kBudgetTree);
  }
  const Before before_all(b.cache);
  std::optional<rwd::TreeForward> tree;
  try {
    tree.emplace(b.cache.begin_tree(parents));
  } catch (const rwd::CapacityError&) {
    if (std::string d = before_all.changed(b.cache); !d.empty()) die("refused begin_tree changed " + d);
    return;
  }
  check_stale(stale);  // a new tree open does not revive old slots
  // Hostile calls inside the tree: refused, nothing changes.
  if (in.one_in(3)) refuse_calls_inside_a_tree(b, *tree, parents, dt);
  std::vector<StepData> data;
  for (const RefLayer& rl : b.ref.layers) data.push_back(rl.make_step(n, ++salt));
  const int how = in.next() % 6;
  if (how == 0) {
    abandon_by_destruction(in, b, tree, data, salt, stale, before_all);
    return;
  }
  std::vector<rwd::TreeRecurrentSlots> kept;
  check(tree_updates(b.cache, b.ref, *tree, data, &kept));
  if (in.one_in(4)) {  // a part given twice
    refused(
        "TreeForward::update_conv twice",
        [&] {
          const HostTensor x = b.ref.layers[4].conv_input(data[4], 0);
          (void)tree->update_conv(x.view(), 4, 0);
        },
        b.cache);
    refused(
        "commit of a node outside the tree", [&] { tree->commit(n); }, b.cache);
  }
  if (how == 1) {
    tree->abandon();
    if (std::string d = before_all.changed(b.cache); !d.empty()) die("abandon changed " + d);
    check(verify(b.cache, b.ref));
    stale.insert(stale.end(), kept.begin(), kept.end());
    check_stale(stale);
    return;
  }
  const i64 leaf = in.range(0, n - 1);
  const std::vector<std::int64_t> path = tree->path(leaf);
  const Before at_commit(b.cache);  // inside the tree (max_rollback refuses there)
  try {
    tree->commit(leaf);
  } catch (
      const rwd::CapacityError&) {  // a static layer without room, or the budget: nothing changed, the tree stays open
    if (std::string d = at_commit.changed(b.cache); !d.empty()) die("refused commit changed " + d);
    if (!tree->is_open()) die("a refused commit closed the tree");
    if (budget) stats.count(kBudgetRefusedCommit);
    tree->abandon();
    if (std::string d = before_all.changed(b.cache); !d.empty()) die("abandon after a refused commit changed " + d);
    stale.insert(stale.end(), kept.begin(), kept.end());
    return;
  }
  stale.insert(stale.end(), kept.begin(), kept.end());
  refused(
      "commit of a committed tree", [&] { tree->commit(leaf); }, b.cache);
  for (std::size_t li = 0; li < b.ref.layers.size(); ++li)
    if (!b.ref.layers[li].stateless()) b.ref.layers[li].apply_update(path_step(data[li], path));
  check(verify(b.cache, b.ref));
}

void run(ByteReader& in) {
  const std::uint8_t cfg = in.next();
  const DType dt = cfg % 3 == 0 ? DType::F32 : cfg % 3 == 1 ? DType::F16 : DType::BF16;
  Built b = tree_cache(dt, (cfg / 3) % 2 == 1);
  i64 R = -1;
  if ((cfg / 6) % 3 != 0) {
    R = (cfg / 18) % 7;
    b.cache.activate_past_recording(R);
    b.ref.activate(R);
  }
  std::uint64_t salt = cfg;
  std::vector<rwd::TreeRecurrentSlots> stale;  // slots of trees that ended
  for (int step = 0; step < 24 && !in.empty(); ++step) {
    check_stale(stale);
    b.cache.set_memory_budget(0);  // a budget holds for one tree only
    const std::uint8_t op = in.next() % 9;
    if (op == 0) {
      if (b.ref.seq_length() > 120) continue;
      check(cache_step(b.cache, b.ref, in.range(1, 6), ++salt));
      continue;
    }
    if (op == 1) {
      if (R < 0) continue;  // without recording a filled window refuses any crop (tested elsewhere)
      const i64 k = in.range(0, std::min<i64>(b.ref.max_rollback(), 200));
      b.cache.crop(-k);
      b.ref.crop(-k);
      check(verify(b.cache, b.ref));
      continue;
    }
    if (op == 3 && in.one_in(2)) {  // recording changes
      if (in.one_in(2)) {
        R = in.range(0, 6);
        b.cache.activate_past_recording(R);
        b.ref.activate(R);
      } else {
        R = -1;
        b.cache.deactivate_past_recording();
        b.ref.deactivate();
      }
      check(verify(b.cache, b.ref));
      continue;
    }
    if (op == 3) {  // node inputs that alias the cache: layer 0's own retained keys and values
      const rwd::KeyValueView own = b.cache.layer(0).keys_values();
      const i64 n = std::min<i64>(own.keys.size(2), in.range(1, 8));
      if (n < 1) continue;
      const rwd::KeyValueView input{own.keys.slice(2, 0, n), own.values.slice(2, 0, n)};
      const Bytes want_k = gather(input.keys), want_v = gather(input.values);
      const Observed before = observe(b.cache);
      std::vector<std::int64_t> chain{-1};
      for (i64 i = 1; i < n; ++i) chain.push_back(i - 1);
      rwd::TreeForward tree = b.cache.begin_tree(chain);
      const rwd::TreeKeyValues kv = tree.update(input.keys, input.values, 0);
      if (gather(kv.nodes.keys) != want_k || gather(kv.nodes.values) != want_v)
        die("TreeForward::update of the cache's own rows stored other values");
      tree.abandon();
      if (std::string d = diff(before, observe(b.cache)); !d.empty())
        die("a tree of the cache's own rows changed " + d);
      check(verify(b.cache, b.ref));
      continue;
    }
    if (op == 2) {  // malformed trees
      std::vector<std::int64_t> parents{in.next() % 2 ? -1 : 0};
      const i64 n = in.range(1, 6);
      for (i64 i = 1; i < n; ++i) parents.push_back(in.range(-1, i));
      bool ok = parents[0] == -1;
      for (i64 i = 1; i < n; ++i)
        ok = ok && parents[static_cast<std::size_t>(i)] >= 0 && parents[static_cast<std::size_t>(i)] < i;
      if (!ok)
        refused(
            "begin_tree of a malformed tree", [&] { (void)b.cache.begin_tree(parents); }, b.cache);
      continue;
    }
    tree_round(in, b, dt, salt, stale);
  }
}

}  // namespace
}  // namespace rwt

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  rwt::ByteReader in(data, size);
  rwt::run(in);
  return 0;
}
