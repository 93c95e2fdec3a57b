// tests/cache/harness.h: drives a real rewind layer / cache and the naive
// reference (reference.h) side by side, and compares them.
#pragma once

#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "conformance/reference.h"
#include "rewind/warnings.h"

namespace rwt {

using rwd::Cache;
using rwd::Layer;

// Every layer kind the library has, in LayerKind's order.
inline const std::vector<LayerKind> kEveryLayerKind = {LayerKind::FullAttention,
                                                       LayerKind::SlidingAttention,
                                                       LayerKind::ChunkedAttention,
                                                       LayerKind::LinearAttention,
                                                       LayerKind::Conv,
                                                       LayerKind::Hybrid,
                                                       LayerKind::HybridSliding,
                                                       LayerKind::SparseAttention,
                                                       LayerKind::Moe,
                                                       LayerKind::Mlp};

// ---- standard small shapes (W = 4, C = 4, K = 3, 2 heads, dims 3 / 2) --------

inline LayerOptions small_options(LayerKind kind, DType dt = DType::F32, bool is_static = false, i64 batch = 2) {
  LayerOptions o;
  o.dtype = dt;
  o.recurrent_dtype = dt;
  o.batch_size = batch;
  switch (kind) {
    case LayerKind::FullAttention:
    case LayerKind::SlidingAttention:
    case LayerKind::ChunkedAttention:
    case LayerKind::Hybrid:
    case LayerKind::HybridSliding:
    case LayerKind::SparseAttention:
      o.num_kv_heads = 2;
      o.key_dim = 3;
      o.value_dim = 2;
      break;
    default: break;
  }
  if (kind == LayerKind::SlidingAttention || kind == LayerKind::HybridSliding) o.sliding_window = 4;
  if (kind == LayerKind::ChunkedAttention) o.chunk_size = 4;
  if (kind == LayerKind::SparseAttention) o.side_dims = {4, 1};
  if (kind == LayerKind::LinearAttention || kind == LayerKind::Conv || kind == LayerKind::Hybrid ||
      kind == LayerKind::HybridSliding) {
    o.conv_kernel_size = 3;
    o.conv_channels = {3, 2};
    if (kind != LayerKind::Conv) o.recurrent_shapes = {{2, 3}, {4}};
  }
  if (is_static) o.static_capacity = kind == LayerKind::FullAttention ? 16 : 24;
  return o;
}

// ---- a target: a standalone layer, or layer `idx` driven through the Cache API --

struct Target {
  Layer* layer = nullptr;
  Cache* cache = nullptr;
  int idx = 0;

  static Target of(Layer& l) { return Target{&l, nullptr, 0}; }
  static Target of(Cache& c, int i) { return Target{nullptr, &c, i}; }

  const Layer& get() const { return cache ? cache->layer(idx) : *layer; }
  MaskSizes mask(i64 q) const { return cache ? cache->get_mask_sizes(q, idx) : layer->get_mask_sizes(q); }
  rwd::KeyValueView update(const TensorView& k, const TensorView& v) const {
    return cache ? cache->update(k, v, idx) : layer->update(k, v);
  }
  TensorView update_side(int s, const TensorView& rows) const {
    return cache ? cache->update_side(rows, idx, s) : layer->update_side(rows, s);
  }
  TensorView update_conv(int s, const TensorView& x) const {
    return cache ? cache->update_conv_state(x, idx, s) : layer->update_conv_state(x, s);
  }
  rwd::RecurrentUpdate begin(int s, i64 q) const {
    return cache ? cache->begin_recurrent_update(q, idx, s) : layer->begin_recurrent_update(q, s);
  }
  void update_rec(int s, const TensorView& states) const {
    if (cache)
      cache->update_recurrent_state(states, idx, s);
    else
      layer->update_recurrent_state(states, s);
  }
};

// ---- comparisons ---------------------------------------------------------------

inline std::string check_view(const std::string& what, const TensorView& v, DType dt, const std::vector<i64>& shape,
                              const Bytes& want) {
  if (v.dtype != dt)
    return what + ": dtype " + std::string(rwd::dtype_name(v.dtype)) + ", expected " + std::string(rwd::dtype_name(dt));
  if (shape_of(v) != shape) return what + ": shape " + shape_str(shape_of(v)) + ", expected " + shape_str(shape);
  const Bytes got = gather(v);
  if (got.size() != want.size())
    return what + ": " + std::to_string(got.size()) + " bytes, expected " + std::to_string(want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i]) {
      const std::size_t e = i / rwd::dtype_size(dt);
      // Decode the row-major index of the first differing element.
      std::vector<i64> idx(shape.size());
      std::size_t rem = e;
      for (std::size_t d = shape.size(); d-- > 0;) {
        idx[d] = static_cast<i64>(rem % static_cast<std::size_t>(shape[d]));
        rem /= static_cast<std::size_t>(shape[d]);
      }
      return what + ": element " + shape_str(idx) + " of " + shape_str(shape) + " differs";
    }
  return "";
}

// Outputs of one update, for comparing two layers with each other.
using StepOutputs = std::vector<std::pair<std::string, Bytes>>;

struct UpdateStyle {
  bool strided = false;         // keys / values given as a transposed (non-contiguous) view
  bool copy_recurrent = false;  // update_recurrent_state (token by token) instead of begin / commit
};

// Runs one update of st.q tokens through every part of the layer (mask sizes,
// keys / values, side rows, conv states, recurrent states) and checks each
// result against the reference, which is then advanced. Returns "" or the
// first mismatch.
inline std::string do_update(const Target& t, RefLayer& ref, const StepData& st, UpdateStyle style = {},
                             StepOutputs* out = nullptr) {
  const i64 L0 = ref.L;
  const i64 q = st.q;
  // The reference keeps the full history, so the expectations can be read
  // from it after the step. (On a mismatch the caller stops using it.)
  const MaskSizes mask_before = ref.has_attention() ? ref.mask_sizes(q) : MaskSizes{};
  ref.apply_update(st);
  const RefLayer& next = ref;
  std::string err;
  auto note = [&](const std::string& what, const Bytes& got) {
    if (out) out->push_back({what, got});
  };
  try {
    if (ref.has_attention()) {
      const MaskSizes ms = t.mask(q);
      const MaskSizes want = mask_before;
      if (ms.kv_length != want.kv_length || ms.kv_offset != want.kv_offset)
        return "get_mask_sizes(" + std::to_string(q) + ") at L=" + std::to_string(L0) + " = (" +
               std::to_string(ms.kv_length) + ", " + std::to_string(ms.kv_offset) + "), expected (" +
               std::to_string(want.kv_length) + ", " + std::to_string(want.kv_offset) + ")";
      const HostTensor k = ref.kv_input(st, true, style.strided);
      const HostTensor v = ref.kv_input(st, false, style.strided);
      const rwd::KeyValueView kv = t.update(k.view(), v.view());
      const i64 from = want.kv_offset, to = L0 + q;
      err = check_view("update keys (positions " + std::to_string(from) + ".." + std::to_string(to - 1) + ")", kv.keys,
                       ref.dtype(), {ref.B, ref.H, to - from, ref.Dk}, next.expect_kv(true, from, to));
      if (!err.empty()) return err;
      err = check_view("update values", kv.values, ref.dtype(), {ref.B, ref.H, to - from, ref.Dv},
                       next.expect_kv(false, from, to));
      if (!err.empty()) return err;
      note("keys", gather(kv.keys));
      note("values", gather(kv.values));
      for (std::size_t s = 0; s < ref.side_dims.size(); ++s) {
        const HostTensor r = ref.side_input(st, s);
        const TensorView got = t.update_side(static_cast<int>(s), r.view());
        err = check_view("update_side " + std::to_string(s), got, ref.dtype(), {ref.B, to - from, ref.side_dims[s]},
                         next.expect_side(s, from, to));
        if (!err.empty()) return err;
        note("side", gather(got));
      }
    }
    for (std::size_t s = 0; s < ref.conv_ch.size(); ++s) {
      const HostTensor x = ref.conv_input(st, s);
      const TensorView got = t.update_conv(static_cast<int>(s), x.view());
      err = check_view("update_conv_state " + std::to_string(s), got, ref.dtype(),
                       {ref.B, ref.conv_ch[s], ref.K - 1 + q}, next.expect_conv(s, L0 - ref.K + 1, L0 + q));
      if (!err.empty()) return err;
      note("conv", gather(got));
    }
    for (std::size_t s = 0; s < ref.rec_shapes.size(); ++s) {
      const auto shape = ref.rec_state_shape(s);
      if (style.copy_recurrent) {  // one token at a time
        for (i64 j = 0; j < q; ++j) {
          const HostTensor in = ref.rec_token_input(st, s, j);
          t.update_rec(static_cast<int>(s), in.view());
        }
        continue;
      }
      rwd::RecurrentUpdate u = t.begin(static_cast<int>(s), q);
      if (u.num_tokens() != q) return "RecurrentUpdate::num_tokens() != q";
      err = check_view("recurrent previous() " + std::to_string(s), u.previous(), ref.rdtype(), shape,
                       ref.expect_rec(s, L0));
      if (!err.empty()) return err;
      note("previous", gather(u.previous()));
      for (i64 j = 1; j <= q; ++j) {
        const TensorView slot = u.next(j);
        if (shape_of(slot) != shape || slot.dtype != ref.rdtype())
          return "recurrent next(" + std::to_string(j) + ") has shape " + shape_str(shape_of(slot)) + ", expected " +
                 shape_str(shape);
        scatter(next.expect_rec(s, L0 + j), slot);
      }
      u.commit();
    }
  } catch (const rwd::Error& e) {
    return std::string("unexpected ") + err_name(classify(e)) + " during update of " + std::to_string(q) +
           " at L=" + std::to_string(L0) + ": " + e.what();
  } catch (const std::exception& e) {
    return std::string("unexpected non-rewind exception during update: ") + e.what();
  }
  return "";
}

inline std::string do_update(const Target& t, RefLayer& ref, i64 q, std::uint64_t salt, UpdateStyle style = {},
                             StepOutputs* out = nullptr) {
  return do_update(t, ref, ref.make_step(q, salt), style, out);
}

// Compares every observable part of `layer` with the reference.
inline std::string verify(const Layer& layer, const RefLayer& ref) {
  auto num = [](i64 v) { return std::to_string(v); };
  try {
    if (layer.get_seq_length() != ref.L)
      return "get_seq_length() = " + num(layer.get_seq_length()) + ", expected " + num(ref.L);
    if (ref.stateless()) return "";
    if (layer.batch_size() != ref.B) return "batch_size() = " + num(layer.batch_size()) + ", expected " + num(ref.B);
    if (layer.is_recording() != ref.recording)
      return std::string("is_recording() = ") + (layer.is_recording() ? "true" : "false");
    if (layer.recording_capacity() != (ref.recording ? ref.R : 0))
      return "recording_capacity() = " + num(layer.recording_capacity()) + ", expected " +
             num(ref.recording ? ref.R : 0);
    if (layer.max_rollback() != ref.max_rollback())
      return "max_rollback() = " + num(layer.max_rollback()) + ", expected " + num(ref.max_rollback()) +
             " (L=" + num(ref.L) + ")";
    if (ref.has_attention()) {
      const rwd::PositionRange r = layer.stored_range();
      if (r.first != ref.first || r.end != ref.L)
        return "stored_range() = [" + num(r.first) + ", " + num(r.end) + "), expected [" + num(ref.first) + ", " +
               num(ref.L) + ")";
      const rwd::KeyValueView kv = layer.keys_values();
      const i64 n = ref.L - ref.first;
      std::string e = check_view("keys_values().keys", kv.keys, ref.dtype(), {ref.B, ref.H, n, ref.Dk},
                                 ref.expect_kv(true, ref.first, ref.L));
      if (!e.empty()) return e;
      e = check_view("keys_values().values", kv.values, ref.dtype(), {ref.B, ref.H, n, ref.Dv},
                     ref.expect_kv(false, ref.first, ref.L));
      if (!e.empty()) return e;
      for (std::size_t s = 0; s < ref.side_dims.size(); ++s) {
        e = check_view("side(" + num(static_cast<i64>(s)) + ")", layer.side(static_cast<int>(s)), ref.dtype(),
                       {ref.B, n, ref.side_dims[s]}, ref.expect_side(s, ref.first, ref.L));
        if (!e.empty()) return e;
      }
      for (i64 q : {1, 3}) {
        const MaskSizes ms = layer.get_mask_sizes(q);
        const MaskSizes want = ref.mask_sizes(q);
        if (ms.kv_length != want.kv_length || ms.kv_offset != want.kv_offset)
          return "get_mask_sizes(" + num(q) + ") = (" + num(ms.kv_length) + ", " + num(ms.kv_offset) + "), expected (" +
                 num(want.kv_length) + ", " + num(want.kv_offset) + ")";
      }
    }
    for (std::size_t s = 0; s < ref.conv_ch.size(); ++s) {
      const int si = static_cast<int>(s);
      const rwd::PositionRange r = layer.conv_range(si);
      // Positions below 0 are zero padding; how much of it a layer keeps is
      // not specified, which real inputs it keeps is (10.1).
      if (r.end != ref.L || std::max<i64>(0, r.first) != std::max<i64>(0, ref.conv_first) || r.first > ref.L - ref.K)
        return "conv_range(" + num(s) + ") = [" + num(r.first) + ", " + num(r.end) + "), expected [" +
               num(ref.conv_first) + ", " + num(ref.L) + ") (padding below 0 may differ)";
      std::string e = check_view("conv_inputs(" + num(s) + ")", layer.conv_inputs(si), ref.dtype(),
                                 {ref.B, ref.conv_ch[s], r.size()}, ref.expect_conv(s, r.first, ref.L));
      if (!e.empty()) return e;
      e = check_view("get_conv_state(" + num(s) + ")", layer.get_conv_state(si), ref.dtype(),
                     {ref.B, ref.conv_ch[s], ref.K}, ref.expect_conv(s, ref.L - ref.K, ref.L));
      if (!e.empty()) return e;
    }
    for (std::size_t s = 0; s < ref.rec_shapes.size(); ++s) {
      const int si = static_cast<int>(s);
      const auto shape = ref.rec_state_shape(s);
      std::string e = check_view("get_recurrent_state(" + num(s) + ")", layer.get_recurrent_state(si), ref.rdtype(),
                                 shape, ref.expect_rec(s, ref.L));
      if (!e.empty()) return e;
      for (i64 p = std::max<i64>(1, ref.rec_first); p <= ref.L; ++p) {
        e = check_view("recurrent_snapshot(" + num(s) + ", " + num(p) + ")", layer.recurrent_snapshot(si, p),
                       ref.rdtype(), shape, ref.expect_rec(s, p));
        if (!e.empty()) return e;
      }
      // The snapshot just below the held range must be gone (beyond L is
      // checked once, in the recurrent tests).
      std::vector<i64> not_held;
      if (ref.rec_first - 1 >= 1) not_held.push_back(ref.rec_first - 1);
      for (i64 p : not_held) {
        try {
          (void)layer.recurrent_snapshot(si, p);
          return "recurrent_snapshot(" + num(s) + ", " + num(p) + ") did not throw (held S(" + num(ref.rec_first) +
                 ")..S(" + num(ref.L) + "))";
        } catch (const rwd::IndexError&) {
        }
      }
    }
    if (ref.linear() && layer.has_previous_state() != (ref.L > 0))
      return "has_previous_state() = " + std::string(layer.has_previous_state() ? "true" : "false");
  } catch (const rwd::Error& e) {
    return std::string("verify: unexpected ") + err_name(classify(e)) + ": " + e.what();
  }
  return "";
}

inline std::string verify(const Cache& cache, const RefCache& ref) {
  if (cache.num_layers() != static_cast<int>(ref.layers.size())) return "num_layers differs";
  for (int i = 0; i < cache.num_layers(); ++i) {
    const std::string e = verify(cache.layer(i), ref.layers[static_cast<std::size_t>(i)]);
    if (!e.empty()) return "layer " + std::to_string(i) + ": " + e;
  }
  if (cache.get_seq_length() != ref.seq_length())
    return "Cache::get_seq_length() = " + std::to_string(cache.get_seq_length()) + ", expected " +
           std::to_string(ref.seq_length());
  if (cache.is_recording() != ref.recording())
    return std::string("Cache::is_recording() = ") + (cache.is_recording() ? "true" : "false");
  if (!ref.in_step()) {
    try {
      (void)cache.max_rollback();
      return "Cache::max_rollback() answered although the layers are out of step";
    } catch (const rwd::StateError&) {
      return "";
    }
  }
  if (cache.max_rollback() != ref.max_rollback())
    return "Cache::max_rollback() = " + std::to_string(cache.max_rollback()) + ", expected " +
           std::to_string(ref.max_rollback());
  return "";
}

// ---- observable state (model-free), to prove that a refused call changed nothing --

using Observed = std::vector<std::pair<std::string, std::string>>;

inline std::string bytes_str(const TensorView& v) {
  const Bytes b = gather(v);
  return shape_str(shape_of(v)) + std::string(rwd::dtype_name(v.dtype)) + std::string(b.begin(), b.end());
}

inline int num_sides(const Layer& l) {
  return l.kind() == LayerKind::SparseAttention ? static_cast<int>(l.options().side_dims.size()) : 0;
}
inline int num_conv(const Layer& l) { return l.is_linear() ? static_cast<int>(l.options().conv_channels.size()) : 0; }
inline int num_rec(const Layer& l) {
  return l.is_linear() && l.kind() != LayerKind::Conv ? static_cast<int>(l.options().recurrent_shapes.size()) : 0;
}

inline Observed observe(const Layer& l, const std::string& pre = "") {
  Observed o;
  auto add = [&](const std::string& k, const std::string& v) { o.push_back({pre + k, v}); };
  auto n = [](i64 v) { return std::to_string(v); };
  add("L", n(l.get_seq_length()));
  if (l.is_stateless()) return o;
  add("B", n(l.batch_size()));
  add("recording", n(l.is_recording()) + "/" + n(l.recording_capacity()));
  add("max_rollback", n(l.max_rollback()));
  add("bytes_used", n(static_cast<i64>(l.memory().bytes_used)));
  if (l.has_attention()) {
    const auto r = l.stored_range();
    add("stored_range", n(r.first) + "," + n(r.end));
    add("keys", bytes_str(l.keys_values().keys));
    add("values", bytes_str(l.keys_values().values));
    add("mask(2)", n(l.get_mask_sizes(2).kv_length) + "," + n(l.get_mask_sizes(2).kv_offset));
    for (int s = 0; s < num_sides(l); ++s) add("side" + n(s), bytes_str(l.side(s)));
  }
  for (int s = 0; s < num_conv(l); ++s) {
    const auto r = l.conv_range(s);
    add("conv_range" + n(s), n(r.first) + "," + n(r.end));
    add("conv_inputs" + n(s), bytes_str(l.conv_inputs(s)));
    add("conv_state" + n(s), bytes_str(l.get_conv_state(s)));
  }
  for (int s = 0; s < num_rec(l); ++s) {
    add("rec_state" + n(s), bytes_str(l.get_recurrent_state(s)));
    for (i64 p = l.get_seq_length(); p >= 1 && p >= l.get_seq_length() - 40; --p) {
      try {
        add("snapshot" + n(s) + "@" + n(p), bytes_str(l.recurrent_snapshot(s, p)));
      } catch (const rwd::IndexError&) {
        add("snapshot" + n(s) + "@" + n(p), "not held");
        break;
      }
    }
  }
  if (l.is_linear()) add("has_previous_state", n(l.has_previous_state()));
  return o;
}

inline Observed observe(const Cache& c) {
  Observed o;
  o.push_back({"cache L", std::to_string(c.get_seq_length())});
  std::string rollback;
  try {
    rollback = std::to_string(c.max_rollback());
  } catch (const rwd::StateError&) {
    rollback = "refused: layers out of step";  // a cache whose layers were updated one by one
  }
  o.push_back({"cache max_rollback", rollback});
  o.push_back({"cache recording", std::to_string(c.is_recording())});
  o.push_back({"cache bytes_used", std::to_string(c.memory().bytes_used)});
  for (int i = 0; i < c.num_layers(); ++i) {
    Observed l = observe(c.layer(i), "layer " + std::to_string(i) + " ");
    o.insert(o.end(), l.begin(), l.end());
  }
  return o;
}

// Every figure of memory() (totals and each layer's), to compare before and
// after a refusal (observe() holds bytes_used only).
inline std::string memory_str(const rwd::MemoryReport& m) {
  std::string s = "reserved " + std::to_string(m.bytes_reserved) + " used " + std::to_string(m.bytes_used);
  for (std::size_t i = 0; i < m.layers.size(); ++i) {
    s += "; layer " + std::to_string(i) + " " + m.layers[i].kind + " reserved " +
         std::to_string(m.layers[i].bytes_reserved) + " used " + std::to_string(m.layers[i].bytes_used);
  }
  return s;
}

// "" when equal, else the first field that differs.
inline std::string diff(const Observed& before, const Observed& after) {
  for (std::size_t i = 0; i < before.size() && i < after.size(); ++i) {
    if (before[i].first != after[i].first) return "field " + before[i].first + " vs " + after[i].first;
    if (before[i].second != after[i].second) {
      std::string b = before[i].second, a = after[i].second;
      if (b.size() > 40) b = b.substr(0, 40) + "...";
      if (a.size() > 40) a = a.substr(0, 40) + "...";
      return before[i].first + " changed";
    }
  }
  if (before.size() != after.size()) return "number of observed fields changed";
  return "";
}

// ---- calls that must throw ---------------------------------------------------------

// Runs f; "" when it threw what `x` says (or nothing when x.ok()).
template <class F>
std::string expect_outcome(F&& f, const Expect& x) {
  try {
    f();
  } catch (const rwd::Error& e) {
    if (x.ok()) return std::string("unexpected ") + err_name(classify(e)) + ": " + e.what();
    return match_error(e, x);
  } catch (const std::exception& e) {
    return std::string("non-rewind exception: ") + e.what();
  }
  if (!x.ok()) return std::string("expected ") + err_name(x.kind) + ", nothing was thrown";
  return "";
}

// Runs f; "" when it threw an error matching any of `xs` (nothing when xs is empty).
template <class F>
std::string expect_any_outcome(F&& f, const std::vector<Expect>& xs) {
  try {
    f();
  } catch (const rwd::Error& e) {
    if (xs.empty()) return std::string("unexpected ") + err_name(classify(e)) + ": " + e.what();
    std::string all;
    for (const Expect& x : xs) {
      const std::string m = match_error(e, x);
      if (m.empty()) return "";
      all += "\n  layer " + std::to_string(x.layer) + ": " + m;
    }
    return "error matches no refusing layer:" + all;
  } catch (const std::exception& e) {
    return std::string("non-rewind exception: ") + e.what();
  }
  if (!xs.empty())
    return std::string("expected ") + err_name(xs.front().kind) + " (layer " + std::to_string(xs.front().layer) +
           "), nothing was thrown";
  return "";
}

// Expect of a given type naming `layer` (any message).
inline Expect err(Err kind, int layer = -1, std::vector<Alt> alts = {}) {
  Expect x;
  x.kind = kind;
  x.layer = layer;
  x.alts = std::move(alts);
  return x;
}

// ---- building layers and caches with their references --------------------------

struct Built {
  Cache cache;
  RefCache ref;
};

inline Built build_cache(const std::vector<std::pair<LayerKind, LayerOptions>>& spec) {
  std::vector<Layer> layers;
  RefCache ref;
  int i = 0;
  for (const auto& [kind, opt] : spec) {
    layers.emplace_back(kind, opt);
    ref.layers.emplace_back(kind, opt, i++);
  }
  return Built{Cache(std::move(layers)), std::move(ref)};
}

// One forward through every layer of a cache (each layer all its parts).
inline std::string cache_step(Cache& cache, RefCache& ref, i64 q, std::uint64_t salt, UpdateStyle style = {}) {
  for (int i = 0; i < cache.num_layers(); ++i) {
    RefLayer& rl = ref.layers[static_cast<std::size_t>(i)];
    if (rl.stateless()) continue;
    const std::string e = do_update(Target::of(cache, i), rl, q, salt * 131 + static_cast<std::uint64_t>(i), style);
    if (!e.empty()) return "layer " + std::to_string(i) + ": " + e;
  }
  return "";
}

// A fresh layer with the same options and recording, fed positions [0, L) of
// `ref`'s history in one update (the "replay" the contract compares with).
struct Replayed {
  Layer layer;
  RefLayer ref;
  std::string error;
};
inline Replayed replay(const RefLayer& src) {
  Replayed r{Layer(src.kind(), src.options()), RefLayer(src.kind(), src.options(), src.index()), ""};
  r.layer.set_index(src.index());
  if (src.recording) {
    r.layer.activate_past_recording(src.R);
    r.ref.activate(src.R);
  }
  if (src.B != src.options().batch_size) r.error = "replay needs the configured batch size";
  if (src.L > 0 && r.error.empty()) r.error = do_update(Target::of(r.layer), r.ref, src.history_step());
  return r;
}

// Silences (and counts) rewind's warnings for the lifetime of the object.
class WarningCapture {
 public:
  WarningCapture() {
    previous_ = rwd::set_warning_handler([this](const std::string& m) { messages.push_back(m); });
  }
  ~WarningCapture() { rwd::set_warning_handler(previous_); }
  WarningCapture(const WarningCapture&) = delete;
  WarningCapture& operator=(const WarningCapture&) = delete;
  std::vector<std::string> messages;

 private:
  rwd::WarningHandler previous_;
};

}  // namespace rwt
