// libFuzzer target: tree speculation (Cache::begin_tree) on a cache of every
// layer kind, driven by the input bytes: chain forwards, trees of any shape
// up to 24 nodes whose every node view is checked against the naive
// reference, commits of any node (the reference takes the path as a chain),
// abandons (explicit, or by destroying the handle before any layer or after
// the first layer took its update), hostile calls (malformed trees, wrong
// shapes, updates twice, per-layer and whole-cache calls inside a tree,
// commits of incomplete trees, bad leaves, node keys and values that are
// views of the cache's own retained rows), crops of every depth and
// recording changes. Any mismatch aborts.
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

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "tree / reference mismatch\n%s\n", what.c_str());
  std::abort();
}
void check(const std::string& e) {
  if (!e.empty()) die(e);
}
template <typename F>
void refused(const char* what, F&& f, Cache& cache) {
  const Observed before = observe(cache);
  try {
    f();
  } catch (const rwd::Error&) {
    if (std::string d = diff(before, observe(cache)); !d.empty()) die(std::string(what) + " was refused but changed " + d);
    return;
  }
  die(std::string(what) + " was accepted");
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
  for (int step = 0; step < 24 && !in.empty(); ++step) {
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
      const rwd::TreeKeyValues kv = b.cache.update_tree(input.keys, input.values, 0);
      if (gather(kv.nodes.keys) != want_k || gather(kv.nodes.values) != want_v)
        die("update_tree of the cache's own rows stored other values");
      tree.abandon();
      if (std::string d = diff(before, observe(b.cache)); !d.empty()) die("a tree of the cache's own rows changed " + d);
      check(verify(b.cache, b.ref));
      continue;
    }
    if (op == 2) {  // malformed trees
      std::vector<std::int64_t> parents{in.next() % 2 ? -1 : 0};
      const i64 n = in.range(1, 6);
      for (i64 i = 1; i < n; ++i) parents.push_back(in.range(-1, i));
      bool ok = parents[0] == -1;
      for (i64 i = 1; i < n; ++i) ok = ok && parents[static_cast<std::size_t>(i)] >= 0 && parents[static_cast<std::size_t>(i)] < i;
      if (!ok) refused("begin_tree of a malformed tree", [&] { (void)b.cache.begin_tree(parents); }, b.cache);
      continue;
    }
    // A tree.
    if (b.ref.seq_length() > 120) continue;
    const i64 n = in.range(1, 24);
    std::vector<std::int64_t> parents{-1};
    for (i64 i = 1; i < n; ++i) parents.push_back(in.next() % 4 == 0 ? i - 1 : in.range(0, i - 1));
    const Observed before = observe(b.cache);
    std::optional<rwd::TreeForward> tree;
    try {
      tree.emplace(b.cache.begin_tree(parents));
    } catch (const rwd::CapacityError&) {
      if (std::string d = diff(before, observe(b.cache)); !d.empty()) die("refused begin_tree changed " + d);
      continue;
    }
    // Hostile calls inside the tree: refused, nothing changes.
    if (in.one_in(3)) {
      refused("crop inside a tree", [&] { b.cache.crop(-1); }, b.cache);
      refused("begin_forward inside a tree", [&] { (void)b.cache.begin_forward(1); }, b.cache);
      refused("begin_tree inside a tree", [&] { (void)b.cache.begin_tree(parents); }, b.cache);
      refused("commit of an incomplete tree", [&] { tree->commit(0); }, b.cache);
      HostTensor k(dt, {1, 2, n + 1, 3}), v(dt, {1, 2, n + 1, 2});
      refused("update_tree of N + 1 rows", [&] { (void)b.cache.update_tree(k.view(), v.view(), 0); }, b.cache);
    }
    std::vector<StepData> data;
    for (const RefLayer& rl : b.ref.layers) data.push_back(rl.make_step(n, ++salt));
    const int how = in.next() % 6;
    if (how == 0) {  // abandoned by destroying the handle, before any layer or after the first took its update
      if (in.one_in(2)) {
        const RefLayer& rl = b.ref.layers[0];
        const HostTensor k = rl.kv_input(data[0], true, false), v = rl.kv_input(data[0], false, false);
        (void)b.cache.update_tree(k.view(), v.view(), 0);
      }
      tree.reset();
      if (std::string d = diff(before, observe(b.cache)); !d.empty()) die("abandoned tree changed " + d);
      check(verify(b.cache, b.ref));
      continue;
    }
    check(tree_updates(b.cache, b.ref, *tree, data));
    if (in.one_in(4)) {  // a part given twice
      refused("update_tree_conv twice", [&] {
        const HostTensor x = b.ref.layers[4].conv_input(data[4], 0);
        (void)b.cache.update_tree_conv(x.view(), 4, 0);
      }, b.cache);
      refused("commit of a node outside the tree", [&] { tree->commit(n); }, b.cache);
    }
    if (how == 1) {
      tree->abandon();
      if (std::string d = diff(before, observe(b.cache)); !d.empty()) die("abandon changed " + d);
      check(verify(b.cache, b.ref));
      continue;
    }
    const i64 leaf = in.range(0, n - 1);
    const std::vector<std::int64_t> path = tree->path(leaf);
    try {
      tree->commit(leaf);
    } catch (const rwd::CapacityError&) {  // a static layer without room: nothing changed, the tree stays open
      if (std::string d = diff(before, observe(b.cache)); !d.empty()) die("refused commit changed " + d);
      if (!tree->is_open()) die("a refused commit closed the tree");
      tree->abandon();
      continue;
    }
    for (std::size_t li = 0; li < b.ref.layers.size(); ++li)
      if (!b.ref.layers[li].stateless()) b.ref.layers[li].apply_update(path_step(data[li], path));
    check(verify(b.cache, b.ref));
  }
}

}  // namespace
}  // namespace rwt

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  rwt::ByteReader in(data, size);
  rwt::run(in);
  return 0;
}
