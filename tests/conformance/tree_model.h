// tests/conformance/tree_model.h: drives a tree (Cache::begin_tree) over a
// cache and checks every node's view against the naive reference; shared by
// tests/conformance/tree_test.cc and fuzz/fuzz_tree.cc.
#pragma once

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "conformance/harness.h"
#include "rewind/cache.h"

namespace rwt {

inline Built tree_cache(DType dt, bool is_static) {
  std::vector<std::pair<LayerKind, LayerOptions>> spec;
  for (LayerKind k : kEveryLayerKind) {
    LayerOptions o = small_options(k, dt, is_static, 1);
    if (is_static && (k == LayerKind::FullAttention || k == LayerKind::Hybrid || k == LayerKind::SparseAttention))
      o.static_capacity = 256;
    spec.push_back({k, o});
  }
  return build_cache(spec);
}

// The chain data of a path: rows `path` of the tree's data.
inline StepData path_step(const StepData& tree, const std::vector<std::int64_t>& path) {
  StepData st;
  st.q = static_cast<i64>(path.size());
  for (std::int64_t n : path) {
    const auto i = static_cast<std::size_t>(n);
    if (!tree.keys.empty()) {
      st.keys.push_back(tree.keys[i]);
      st.values.push_back(tree.values[i]);
    }
  }
  st.sides.resize(tree.sides.size());
  for (std::size_t s = 0; s < tree.sides.size(); ++s)
    for (std::int64_t n : path) st.sides[s].push_back(tree.sides[s][static_cast<std::size_t>(n)]);
  st.conv.resize(tree.conv.size());
  for (std::size_t s = 0; s < tree.conv.size(); ++s)
    for (std::int64_t n : path) st.conv[s].push_back(tree.conv[s][static_cast<std::size_t>(n)]);
  st.rec.resize(tree.rec.size());
  for (std::size_t s = 0; s < tree.rec.size(); ++s)
    for (std::int64_t n : path) st.rec[s].push_back(tree.rec[s][static_cast<std::size_t>(n)]);
  return st;
}

inline i64 first_visible(const RefLayer& rl, i64 position) {
  const LayerOptions& o = rl.options();
  switch (rl.kind()) {
    case LayerKind::SlidingAttention:
    case LayerKind::HybridSliding: return std::max<i64>(0, position - o.sliding_window + 1);
    case LayerKind::ChunkedAttention: return position / o.chunk_size * o.chunk_size;
    default: return 0;
  }
}

// Runs every layer's tree update with the data of `st` (one row per node)
// and checks what each returns against the reference (before the tree).
// The recurrent slots taken go to `keep` when given (to be tried once the
// tree ended).
inline std::string tree_updates(Cache& cache, const RefCache& ref, rwd::TreeForward& tree,
                                const std::vector<StepData>& data,
                                std::vector<rwd::TreeRecurrentSlots>* keep = nullptr) {
  const i64 n = tree.num_nodes(), L = tree.start_length();
  for (int li = 0; li < cache.num_layers(); ++li) {
    const RefLayer& rl = ref.layers[static_cast<std::size_t>(li)];
    const StepData& st = data[static_cast<std::size_t>(li)];
    const std::string at = "layer " + std::to_string(li) + ": ";
    if (rl.has_attention()) {
      const HostTensor k = rl.kv_input(st, true, false), v = rl.kv_input(st, false, false);
      const rwd::TreeKeyValues kv = tree.update(k.view(), v.view(), li);
      const i64 from = first_visible(rl, L);
      if (kv.committed_first != from) return at + "committed_first " + std::to_string(kv.committed_first);
      if (std::string e = check_view(at + "committed keys", kv.committed.keys, rl.dtype(), {1, rl.H, L - from, rl.Dk},
                                     rl.expect_kv(true, from, L));
          !e.empty())
        return e;
      if (std::string e = check_view(at + "committed values", kv.committed.values, rl.dtype(),
                                     {1, rl.H, L - from, rl.Dv}, rl.expect_kv(false, from, L));
          !e.empty())
        return e;
      if (std::string e = check_view(at + "node keys", kv.nodes.keys, rl.dtype(), {1, rl.H, n, rl.Dk}, k.bytes);
          !e.empty())
        return e;
      for (i64 i = 0; i < n; ++i)
        if (kv.first_visible[static_cast<std::size_t>(i)] != first_visible(rl, tree.position(i)))
          return at + "first_visible of node " + std::to_string(i);
      for (std::size_t s = 0; s < rl.side_dims.size(); ++s) {
        const HostTensor r = rl.side_input(st, s);
        const rwd::TreeRows rows = tree.update_side(r.view(), li, static_cast<int>(s));
        if (std::string e = check_view(at + "committed side", rows.committed, rl.dtype(),
                                       {1, L - from, rl.side_dims[s]}, rl.expect_side(s, from, L));
            !e.empty())
          return e;
      }
    }
    for (std::size_t s = 0; s < rl.conv_ch.size(); ++s) {
      const HostTensor x = rl.conv_input(st, s);
      const TensorView w = tree.update_conv(x.view(), li, static_cast<int>(s));
      const i64 C = rl.conv_ch[s], K = rl.K;
      const std::size_t es = rl.esize();
      for (i64 node = 0; node < n; ++node) {
        // Column K - 1 - j: position P - j along the node's path.
        std::vector<Bytes> columns(static_cast<std::size_t>(K));
        i64 on_path = node;
        const i64 P = tree.position(node);
        for (i64 j = 0; j < K; ++j) {
          columns[static_cast<std::size_t>(K - 1 - j)] = on_path >= 0 ? st.conv[s][static_cast<std::size_t>(on_path)]
                                                                      : rl.expect_conv(s, P - j, P - j + 1);
          if (on_path >= 0) on_path = tree.parent(on_path);
        }
        Bytes want;
        for (i64 c = 0; c < C; ++c)
          for (i64 col = 0; col < K; ++col) {
            const Bytes& b = columns[static_cast<std::size_t>(col)];
            want.insert(want.end(), b.begin() + c * static_cast<i64>(es), b.begin() + (c + 1) * static_cast<i64>(es));
          }
        if (std::string e = check_view(at + "conv window of node " + std::to_string(node), w.slice(0, node, 1),
                                       rl.dtype(), {1, C, K}, want);
            !e.empty())
          return e;
      }
    }
    for (std::size_t s = 0; s < rl.rec_shapes.size(); ++s) {
      const rwd::TreeRecurrentSlots slots = tree.recurrent_slots(li, static_cast<int>(s));
      if (keep) keep->push_back(slots);
      if (std::string e = check_view(at + "S(L)", slots.previous(0), rl.rdtype(), rl.rec_state_shape(s),
                                     rl.expect_rec(s, L));
          !e.empty())
        return e;
      for (i64 node = 0; node < n; ++node) {
        if (node > 0 && slots.previous(node).data != slots.next(tree.parent(node)).data)
          return at + "previous(" + std::to_string(node) + ") is not its parent's slot";
        scatter(rl.rec_token_input(st, s, node).bytes, slots.next(node));
      }
    }
  }
  return "";
}

}  // namespace rwt
