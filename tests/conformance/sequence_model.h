// tests/conformance/sequence_model.h: drives a rwd::SequenceCache and, for
// every live sequence, one naive reference cache (reference.h's RefCache at
// batch size 1) side by side, and compares them after every operation.
//
// The oracle is independent of src/cache: a fork is a deep copy of the
// parent's RefCache, a batched forward advances each listed sequence's
// RefCache by its own tokens, a refused call must leave the oracle, the
// cache's memory figures and its list of sequences exactly as they were.
// Used by tests/conformance/sequences_test.cc (random interleavings) and
// fuzz/fuzz_sequences.cc (operations decoded from bytes, hostile inputs).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "conformance/harness.h"
#include "rewind/sequences.h"

namespace rwt::seqtest {

using rwd::BatchEntry;
using rwd::BatchRecurrentUpdate;
using rwd::BlockLayout;
using rwd::BlockSpan;
using rwd::PagedKeyValues;
using rwd::SeqId;
using rwd::SequenceBatch;
using rwd::SequenceCache;
using rwd::SequenceCacheOptions;
using rwd::SequenceMemory;

inline constexpr i64 kTokenLimit = i64{1} << 40;  // tokens per sequence (rewind/layer.h)

// ---- configuration ---------------------------------------------------------------

struct SeqSpec {
  std::string name;
  std::vector<LayerKind> kinds;
  DType dtype = DType::F32;
  i64 block_size = 16;
  i64 window = 4;  // W of sliding kinds
  i64 chunk = 4;   // C of the chunked kind
  i64 kernel = 3;  // K of the conv parts
};

// One LayerOptions for every kind of the list (SequenceCache builds every
// layer from one), batch size 1: 2 heads, key_dim 3, value_dim 2, side
// tensors {4, 1} (sparse layers only), conv channels {3, 2}, recurrent
// shapes {2, 3} and {4} (not for conv layers).
inline LayerOptions seq_options(const SeqSpec& s) {
  LayerOptions o;
  o.dtype = s.dtype;
  o.recurrent_dtype = s.dtype;
  o.batch_size = 1;
  o.num_kv_heads = 2;
  o.key_dim = 3;
  o.value_dim = 2;
  o.sliding_window = s.window;
  o.chunk_size = s.chunk;
  o.side_dims = {4, 1};
  o.conv_kernel_size = s.kernel;
  o.conv_channels = {3, 2};
  o.recurrent_shapes = {{2, 3}, {4}};
  return o;
}

inline std::vector<std::string> type_names(const std::vector<LayerKind>& kinds) {
  std::vector<std::string> out;
  for (LayerKind k : kinds) out.emplace_back(rwd::layer_kind_name(k));
  return out;
}

inline std::string id_str(SeqId id) {
  return "{" + std::to_string(id.slot) + "," + std::to_string(id.generation) + "}";
}

// Every element of `v` (row-major) equals `want`, without copying a host view.
inline bool view_equals(const TensorView& v, const Bytes& want) {
  if (!v.device.is_host()) return view_equals(to_host(v).view(), want);
  const std::size_t es = rwd::dtype_size(v.dtype);
  auto ext = [&](int d) { return d < v.rank ? v.size(d) : 1; };
  const i64 n = ext(0) * ext(1) * ext(2) * ext(3);
  if (static_cast<std::size_t>(n) * es != want.size()) return false;
  std::size_t off = 0;
  for (i64 a = 0; a < ext(0); ++a)
    for (i64 b = 0; b < ext(1); ++b)
      for (i64 c = 0; c < ext(2); ++c)
        for (i64 d = 0; d < ext(3); ++d) {
          if (std::memcmp(v.ptr(a, b, c, d), want.data() + off, es) != 0) return false;
          off += es;
        }
  return true;
}

// ---- expectations for one entry of a batch: history below L0 from the
// reference, positions L0.. from the step being applied ----------------------

inline const Bytes& kv_row(const RefLayer& rl, const StepData& st, bool keys, i64 p) {
  if (p < rl.L) return (keys ? rl.keys : rl.values)[static_cast<std::size_t>(p)];
  return (keys ? st.keys : st.values)[static_cast<std::size_t>(p - rl.L)];
}

// [1, H, to - from, D] of positions [from, to).
inline Bytes kv_expect(const RefLayer& rl, const StepData& st, bool keys, i64 from, i64 to) {
  const i64 D = keys ? rl.Dk : rl.Dv;
  const std::size_t run = static_cast<std::size_t>(D) * rl.esize();
  Bytes out;
  for (i64 h = 0; h < rl.H; ++h)
    for (i64 p = from; p < to; ++p) {
      const Bytes& r = kv_row(rl, st, keys, p);
      const std::size_t off = static_cast<std::size_t>(h) * run;
      out.insert(out.end(), r.begin() + static_cast<std::ptrdiff_t>(off),
                 r.begin() + static_cast<std::ptrdiff_t>(off + run));
    }
  return out;
}

// [1, to - from, D_s].
inline Bytes side_expect(const RefLayer& rl, const StepData& st, std::size_t s, i64 from, i64 to) {
  Bytes out;
  for (i64 p = from; p < to; ++p) {
    const Bytes& r = p < rl.L ? rl.sides[s][static_cast<std::size_t>(p)]
                              : st.sides[s][static_cast<std::size_t>(p - rl.L)];
    out.insert(out.end(), r.begin(), r.end());
  }
  return out;
}

// [1, channels, to - from], zeros before position 0.
inline Bytes conv_expect(const RefLayer& rl, const StepData& st, std::size_t s, i64 from, i64 to) {
  const std::size_t es = rl.esize();
  Bytes out;
  for (i64 c = 0; c < rl.conv_ch[s]; ++c)
    for (i64 p = from; p < to; ++p) {
      if (p < 0) {
        out.insert(out.end(), es, 0);
        continue;
      }
      const Bytes& r = p < rl.L ? rl.conv[s][static_cast<std::size_t>(p)]
                                : st.conv[s][static_cast<std::size_t>(p - rl.L)];
      const std::size_t off = static_cast<std::size_t>(c) * es;
      out.insert(out.end(), r.begin() + static_cast<std::ptrdiff_t>(off),
                 r.begin() + static_cast<std::ptrdiff_t>(off + es));
    }
  return out;
}

// ---- the model ---------------------------------------------------------------------

struct SeqState {
  SeqId id;
  RefCache ref;
  std::uint64_t tag = 0;    // which data stream this sequence's tokens come from
  std::uint64_t steps = 0;  // forwards it took tokens in
};

// Observable figures that a refused call must not change (the content is
// checked against the unchanged oracle).
struct Snapshot {
  SequenceMemory mem;
  std::vector<SeqId> seqs;
  std::size_t budget = 0;
  bool open = false;
};

struct ForwardOptions {
  bool strided = false;    // keys / values packed as [1, T, H, D] in memory
  int abandon_layer = -1;  // abandon the batch at this layer (num_layers: after the last one, before commit)
  int abandon_stage = 0;   // 0 before the layer, 1 after its attention part, 2 with a recurrent update in flight
  int abandon_how = 0;     // 0 abandon(), 1 destroy the handle, 2 move it into another and destroy that one
  // With a recurrent update in flight at the abandon: seq_rm the batch's
  // first sequence afterwards, then every call of the kept handle must be
  // refused (StateError), never reach the removed sequence's state.
  bool remove_after_abandon = false;
  // A replacement for the input of one call (layer, part: 0 keys, 1 values,
  // 2 + s side s, 100 + s conv s, shape wanted), or nullopt. The oracle takes
  // what the view holds just before the call.
  std::function<std::optional<TensorView>(int, int, const std::vector<i64>&)> input;
  // Called before each stateful layer's calls with the open batch (probes
  // that must be refused); returns "" or a failure.
  std::function<std::string(int, SequenceBatch&)> before_layer;
  // Writes S(L + t) into the slot of (layer, state, entry) itself (true), or
  // leaves it to the model (false).
  std::function<bool(int, int, std::size_t, i64, const TensorView&)> write_rec;
};

class SeqModel {
 public:
  explicit SeqModel(const SeqSpec& spec)
      : spec_(spec), options_(seq_options(spec)),
        cache(type_names(spec.kinds), options_, SequenceCacheOptions{spec.block_size}) {}

  const SeqSpec& spec() const { return spec_; }
  const LayerOptions& options() const { return options_; }
  int num_layers() const { return static_cast<int>(spec_.kinds.size()); }

  RefCache fresh_ref() const {
    RefCache r;
    for (int i = 0; i < num_layers(); ++i) r.layers.emplace_back(spec_.kinds[static_cast<std::size_t>(i)], options_, i);
    return r;
  }
  const RefLayer& proto(int i) const { return proto_.layers[static_cast<std::size_t>(i)]; }

  // ---- log and failures

  void note(const std::string& s) {
    log_.push_back(s);
    if (log_.size() > 400) log_.erase(log_.begin(), log_.begin() + 200);
  }
  std::string fail(const std::string& what) const {
    std::string out = "operations (most recent last):";
    const std::size_t from = log_.size() > 60 ? log_.size() - 60 : 0;
    for (std::size_t i = from; i < log_.size(); ++i) out += "\n  " + log_[i];
    return out + "\n=> " + what;
  }

  // ---- comparisons

  Snapshot snapshot() const {
    Snapshot s;
    s.mem = cache.memory();
    s.seqs = cache.sequences();
    s.budget = cache.memory_budget();
    s.open = cache.batch_open();
    return s;
  }
  // "" when the figures equal `before`.
  std::string same_as(const Snapshot& b) const {
    const Snapshot a = snapshot();
    auto n = [](auto v) { return std::to_string(v); };
    if (a.mem.bytes_reserved != b.mem.bytes_reserved)
      return "memory().bytes_reserved " + n(b.mem.bytes_reserved) + " -> " + n(a.mem.bytes_reserved);
    if (a.mem.bytes_used != b.mem.bytes_used)
      return "memory().bytes_used " + n(b.mem.bytes_used) + " -> " + n(a.mem.bytes_used);
    if (a.mem.blocks_in_use != b.mem.blocks_in_use)
      return "memory().blocks_in_use " + n(b.mem.blocks_in_use) + " -> " + n(a.mem.blocks_in_use);
    if (a.mem.blocks_free != b.mem.blocks_free)
      return "memory().blocks_free " + n(b.mem.blocks_free) + " -> " + n(a.mem.blocks_free);
    if (a.seqs != b.seqs) return "sequences()";
    if (a.budget != b.budget) return "memory_budget()";
    if (a.open != b.open) return "batch_open()";
    return "";
  }

  // block_spans: exactly the retained positions, each row where the
  // header's addressing rule puts it (read with BlockLayout::rows).
  std::string verify_block_spans(SeqId id, int i, const RefLayer& rl) const {
    auto n = [](i64 v) { return std::to_string(v); };
    const BlockLayout& bl = cache.block_layout(i);
    const i64 bs = cache.block_size();
    i64 pos = rl.first;
    for (const BlockSpan& sp : cache.block_spans(id, i)) {
      if (sp.num_tokens == 0) continue;
      if (sp.position != pos || sp.num_tokens < 0 || sp.blocks == nullptr)
        return "block_spans: a span covers [" + n(sp.position) + ", " + n(sp.position + sp.num_tokens) +
               ") where position " + n(pos) + " was expected (stored [" + n(rl.first) + ", " + n(rl.L) + "))";
      for (i64 p = sp.position; p < sp.position + sp.num_tokens; ++p) {
        if (p >= rl.L) return "block_spans cover position " + n(p) + " >= L = " + n(rl.L);
        const std::byte* block = sp.blocks[p / bs - sp.position / bs];
        const i64 row = p % bs;
        if (!view_equals(bl.rows(block, 0, row, 1), rl.keys[static_cast<std::size_t>(p)]))
          return "block_spans: keys row of position " + n(p) + " differs";
        if (!view_equals(bl.rows(block, 1, row, 1), rl.values[static_cast<std::size_t>(p)]))
          return "block_spans: values row of position " + n(p) + " differs";
        for (std::size_t s = 0; s < rl.side_dims.size(); ++s)
          if (!view_equals(bl.rows(block, 2 + static_cast<int>(s), row, 1), rl.sides[s][static_cast<std::size_t>(p)]))
            return "block_spans: side " + n(static_cast<i64>(s)) + " row of position " + n(p) + " differs";
      }
      pos += sp.num_tokens;
    }
    if (pos != rl.L)
      return "block_spans cover [" + n(rl.first) + ", " + n(pos) + "), expected [" + n(rl.first) + ", " + n(rl.L) + ")";
    return "";
  }

  std::string verify_layer(SeqId id, int i, const RefLayer& rl) const {
    auto n = [](i64 v) { return std::to_string(v); };
    if (rl.has_attention()) {
      const rwd::PositionRange r = cache.stored_range(id, i);
      if (r.first != rl.first || r.end != rl.L)
        return "stored_range = [" + n(r.first) + ", " + n(r.end) + "), expected [" + n(rl.first) + ", " + n(rl.L) + ")";
      const i64 kept = rl.L - rl.first;
      std::string e = check_view("keys()", cache.keys(id, i).view(), rl.dtype(), {1, rl.H, kept, rl.Dk},
                                 rl.expect_kv(true, rl.first, rl.L));
      if (!e.empty()) return e;
      e = check_view("values()", cache.values(id, i).view(), rl.dtype(), {1, rl.H, kept, rl.Dv},
                     rl.expect_kv(false, rl.first, rl.L));
      if (!e.empty()) return e;
      for (std::size_t s = 0; s < rl.side_dims.size(); ++s) {
        e = check_view("side(" + n(static_cast<i64>(s)) + ")", cache.side(id, i, static_cast<int>(s)).view(),
                       rl.dtype(), {1, kept, rl.side_dims[s]}, rl.expect_side(s, rl.first, rl.L));
        if (!e.empty()) return e;
      }
      e = verify_block_spans(id, i, rl);
      if (!e.empty()) return e;
      for (i64 q : {i64{1}, i64{3}, i64{9}}) {
        const MaskSizes got = cache.get_mask_sizes(id, q, i), want = rl.mask_sizes(q);
        if (got.kv_length != want.kv_length || got.kv_offset != want.kv_offset)
          return "get_mask_sizes(" + n(q) + ") = (" + n(got.kv_length) + ", " + n(got.kv_offset) + "), expected (" +
                 n(want.kv_length) + ", " + n(want.kv_offset) + ")";
      }
    }
    for (std::size_t s = 0; s < rl.conv_ch.size(); ++s) {
      const int si = static_cast<int>(s);
      const rwd::PositionRange r = cache.conv_range(id, i, si);
      // Positions below 0 are zero padding; how much of it is kept is not
      // specified, which real inputs are (docs/semantics.md 10.1).
      if (r.end != rl.L || std::max<i64>(0, r.first) != std::max<i64>(0, rl.conv_first) || r.first > rl.L - rl.K)
        return "conv_range(" + n(si) + ") = [" + n(r.first) + ", " + n(r.end) + "), expected [" + n(rl.conv_first) +
               ", " + n(rl.L) + ") (padding below 0 may differ)";
      std::string e = check_view("conv_inputs(" + n(si) + ")", cache.conv_inputs(id, i, si), rl.dtype(),
                                 {1, rl.conv_ch[s], r.size()}, rl.expect_conv(s, r.first, rl.L));
      if (!e.empty()) return e;
      e = check_view("get_conv_state(" + n(si) + ")", cache.get_conv_state(id, i, si), rl.dtype(),
                     {1, rl.conv_ch[s], rl.K}, rl.expect_conv(s, rl.L - rl.K, rl.L));
      if (!e.empty()) return e;
    }
    for (std::size_t s = 0; s < rl.rec_shapes.size(); ++s) {
      const int si = static_cast<int>(s);
      const std::vector<i64> shape = rl.rec_state_shape(s);
      std::string e = check_view("get_recurrent_state(" + n(si) + ")", cache.get_recurrent_state(id, i, si),
                                 rl.rdtype(), shape, rl.expect_rec(s, rl.L));
      if (!e.empty()) return e;
      for (i64 p = std::max<i64>(1, rl.rec_first); p <= rl.L; ++p) {
        e = check_view("recurrent_snapshot(" + n(si) + ", " + n(p) + ")", cache.recurrent_snapshot(id, i, si, p),
                       rl.rdtype(), shape, rl.expect_rec(s, p));
        if (!e.empty()) return e;
      }
      if (rl.rec_first - 1 >= 1) {
        const i64 p = rl.rec_first - 1;
        const std::string x = expect_kinds([&] { (void)cache.recurrent_snapshot(id, i, si, p); }, {Err::Index});
        if (!x.empty())
          return "recurrent_snapshot(" + n(si) + ", " + n(p) + ") below the held S(" + n(rl.rec_first) + ").." + "S(" +
                 n(rl.L) + "): " + x;
      }
    }
    return "";
  }

  std::string verify_seq(const SeqState& s) const {
    auto n = [](i64 v) { return std::to_string(v); };
    const RefCache& ref = s.ref;
    const SeqId id = s.id;
    try {
      if (!cache.contains(id)) return "contains() is false for a live sequence";
      const i64 L = ref.seq_length();
      if (cache.seq_length(id) != L) return "seq_length = " + n(cache.seq_length(id)) + ", expected " + n(L);
      if (cache.seq_pos_max(id) != L - 1) return "seq_pos_max = " + n(cache.seq_pos_max(id)) + ", expected " + n(L - 1);
      // seq_pos_min: the smallest position an attention layer holds, at
      // most L - 1 (L - 1 when none holds one); -1 when empty.
      i64 pmin = L - 1;
      for (const RefLayer& rl : ref.layers)
        if (rl.has_attention() && rl.first < rl.L) pmin = std::min(pmin, rl.first);
      if (cache.seq_pos_min(id) != pmin) return "seq_pos_min = " + n(cache.seq_pos_min(id)) + ", expected " + n(pmin);
      if (cache.max_rollback(id) != ref.max_rollback())
        return "max_rollback = " + n(cache.max_rollback(id)) + ", expected " + n(ref.max_rollback());
      bool recording = false;
      i64 R = 0;
      for (const RefLayer& rl : ref.layers)
        if (!rl.stateless()) {
          recording = rl.recording;
          R = rl.recording ? rl.R : 0;
          break;
        }
      if (cache.is_recording(id) != recording) return std::string("is_recording = ") + (recording ? "false" : "true");
      if (cache.recording_capacity(id) != R)
        return "recording_capacity = " + n(cache.recording_capacity(id)) + ", expected " + n(R);
      for (int i = 0; i < num_layers(); ++i) {
        const RefLayer& rl = ref.layers[static_cast<std::size_t>(i)];
        if (rl.stateless()) continue;
        if (std::string e = verify_layer(id, i, rl); !e.empty()) return "layer " + n(i) + ": " + e;
      }
    } catch (const rwd::Error& e) {
      return std::string("unexpected ") + err_name(classify(e)) + " while reading it: " + e.what();
    }
    return "";
  }

  // The block count, computed from the sequences' spans: for every attention
  // layer the distinct blocks that hold a retained position of some live
  // sequence.
  static void insert_blocks(std::set<const std::byte*>& out, const std::vector<BlockSpan>& spans, i64 first, i64 end,
                            i64 bs) {
    for (const BlockSpan& sp : spans) {
      const i64 from = std::max(sp.position, first), to = std::min(sp.position + sp.num_tokens, end);
      for (i64 b = from < to ? from / bs : 0; from < to && b <= (to - 1) / bs; ++b)
        out.insert(sp.blocks[b - sp.position / bs]);
    }
  }

  std::string verify_memory() const {
    auto n = [](auto v) { return std::to_string(v); };
    const SequenceMemory m = cache.memory();
    std::set<const std::byte*> all;
    std::size_t block_bytes = 0;
    const i64 bs = cache.block_size();
    for (int i = 0; i < num_layers(); ++i) {
      if (!proto(i).has_attention()) continue;
      std::set<const std::byte*> layer;
      for (const SeqState& s : live) {
        const rwd::PositionRange r = cache.stored_range(s.id, i);
        insert_blocks(layer, cache.block_spans(s.id, i), r.first, r.end, bs);
      }
      for (const Held& h : held)
        layer.insert(h.blocks[static_cast<std::size_t>(i)].begin(), h.blocks[static_cast<std::size_t>(i)].end());
      block_bytes += layer.size() * cache.block_layout(i).block_bytes;
      all.insert(layer.begin(), layer.end());
    }
    if (m.blocks_in_use != static_cast<i64>(all.size()))
      return "memory().blocks_in_use = " + n(m.blocks_in_use) + ", but the live sequences' retained positions sit in " +
             n(all.size()) + " distinct blocks";
    if (m.bytes_used < block_bytes)
      return "memory().bytes_used = " + n(m.bytes_used) + " < the " + n(block_bytes) + " bytes of the blocks in use";
    if (m.bytes_reserved < m.bytes_used)
      return "memory().bytes_reserved = " + n(m.bytes_reserved) + " < bytes_used = " + n(m.bytes_used);
    if (m.blocks_free < 0) return "memory().blocks_free < 0";
    if (cache.num_snapshots() != static_cast<i64>(held.size()))
      return "num_snapshots() = " + n(cache.num_snapshots()) + ", " + n(held.size()) + " handles are held";
    if (live.empty() && held.empty() && (m.blocks_in_use != 0 || m.bytes_used != 0))
      return "no sequence left, yet blocks_in_use = " + n(m.blocks_in_use) + ", bytes_used = " + n(m.bytes_used);
    return "";
  }

  std::string verify_all() const {
    try {
      if (cache.batch_open()) return "batch_open() outside a batch";
      if (cache.num_sequences() != static_cast<i64>(live.size()))
        return "num_sequences = " + std::to_string(cache.num_sequences()) + ", expected " + std::to_string(live.size());
      std::vector<SeqId> want;
      for (const SeqState& s : live) want.push_back(s.id);
      std::sort(want.begin(), want.end(), [](SeqId a, SeqId b) { return a.slot < b.slot; });
      if (cache.sequences() != want) return "sequences() differs from the live ids in slot order";
      for (const SeqId& r : removed)
        if (cache.contains(r)) return "contains(" + id_str(r) + ") is true for a removed sequence";
      for (const SeqState& s : live)
        if (std::string e = verify_seq(s); !e.empty()) return "sequence " + id_str(s.id) + ": " + e;
      return verify_memory();
    } catch (const rwd::Error& e) {
      return std::string("unexpected ") + err_name(classify(e)) + " in a read: " + e.what();
    }
  }
  std::string check() const {
    const std::string e = verify_all();
    return e.empty() ? "" : fail(e);
  }

  // ---- generic operation: predicted refusals (any of xs; empty: success,
  // then `apply` advances the oracle and returns "" or a failure); under a
  // budget a CapacityError is accepted too. A refusal changes nothing.

  template <class F, class A>
  std::string op(const std::string& name, F&& f, const std::vector<Expect>& xs, A&& apply) {
    note(name);
    const Snapshot before = snapshot();
    std::string refusal;
    try {
      f();
    } catch (const rwd::Error& e) {
      const Err got = classify(e);
      refusal = err_name(got);
      if (budget_ && got == Err::Capacity) {
        ++budget_refusals;
        last_capacity = e.what();
      }
      if (!(budget_ && got == Err::Capacity)) {
        if (xs.empty()) return fail(name + ": unexpected " + err_name(got) + ": " + e.what());
        std::string all;
        for (const Expect& x : xs) {
          const std::string m = match_error(e, x);
          if (m.empty()) {
            all.clear();
            break;
          }
          all += "\n  " + m;
        }
        if (!all.empty()) return fail(name + ": the error matches no predicted refusal:" + all);
      }
    } catch (const std::exception& e) {
      return fail(name + ": non-rewind exception: " + e.what());
    }
    if (refusal.empty() && !xs.empty())
      return fail(name + ": expected " + err_name(xs.front().kind) + ", nothing was thrown");
    if (!refusal.empty()) {
      note("  -> refused (" + refusal + ")");
      if (std::string d = same_as(before); !d.empty()) return fail(name + " was refused but changed " + d);
    } else if (std::string e = apply(); !e.empty()) {
      return fail(name + ": " + e);
    }
    return check();
  }

  // A call that must throw one of `kinds` and change nothing.
  template <class F>
  std::string refused(const std::string& name, F&& f, const std::vector<Err>& kinds, bool verify = true) {
    note(name);
    const Snapshot before = snapshot();
    if (std::string e = expect_kinds(f, kinds); !e.empty()) return fail(name + ": " + e);
    if (std::string d = same_as(before); !d.empty()) return fail(name + " was refused but changed " + d);
    return verify ? check() : "";
  }

  // ---- sequences

  std::string fresh_id(SeqId id) const {
    if (id.generation == 0) return "issued an id of generation 0";
    for (const SeqState& s : live)
      if (s.id == id) return "issued the id " + id_str(id) + " of a live sequence";
    for (const SeqId& r : removed)
      if (r == id) return "issued again the removed id " + id_str(id);
    return "";
  }

  std::string add() {
    SeqId id;
    return op(
        "add_sequence()", [&] { id = cache.add_sequence(); }, {},
        [&] {
          if (std::string e = fresh_id(id); !e.empty()) return e;
          live.push_back(SeqState{id, fresh_ref(), ++tags_, 0});
          note("  -> " + id_str(id));
          return std::string();
        });
  }

  std::string fork(std::size_t i) {
    const SeqId parent = live[i].id;
    SeqId id;
    return op(
        "fork(" + id_str(parent) + ") [L=" + std::to_string(live[i].ref.seq_length()) + "]",
        [&] { id = cache.fork(parent); }, {},
        [&] {
          if (std::string e = fresh_id(id); !e.empty()) return e;
          live.push_back(SeqState{id, live[i].ref, ++tags_, 0});
          note("  -> " + id_str(id));
          return std::string();
        });
  }

  std::string remove(std::size_t i) {
    const SeqId id = live[i].id;
    bool result = false;
    std::string e = op(
        "seq_rm(" + id_str(id) + ")", [&] { result = cache.seq_rm(id); }, {},
        [&] {
          if (!result) return std::string("seq_rm of a live sequence returned false");
          removed.push_back(id);
          live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
          return std::string();
        });
    if (!e.empty()) return e;
    return remove_again(removed.size() - 1);
  }

  // seq_rm of an id already removed: false, nothing changes.
  std::string remove_again(std::size_t k) {
    const SeqId id = removed[k];
    bool result = true;
    const Snapshot before = snapshot();
    std::string e = op(
        "seq_rm(" + id_str(id) + ") again", [&] { result = cache.seq_rm(id); }, {},
        [&] { return result ? std::string("seq_rm of a removed id returned true") : same_as(before); });
    return e;
  }

  std::string keep(std::size_t i) {
    const SeqId id = live[i].id;
    return op(
        "seq_keep(" + id_str(id) + ")", [&] { cache.seq_keep(id); }, {},
        [&] {
          for (std::size_t j = 0; j < live.size(); ++j)
            if (j != i) removed.push_back(live[j].id);
          SeqState kept = std::move(live[i]);
          live.clear();
          live.push_back(std::move(kept));
          return std::string();
        });
  }

  // ---- snapshots: the oracle of a snapshot is a copy of its sequence's
  // reference without rollback history (deactivate), of a restore into a
  // recording sequence that copy recording again with the same R.

  static i64 recording_bound(const RefCache& r) {
    for (const RefLayer& l : r.layers)
      if (!l.stateless()) return l.recording ? l.R : -1;
    return -1;
  }
  static RefCache without_history(RefCache r) {
    r.deactivate();
    return r;
  }

  std::string take_snapshot(std::size_t i) {
    const SeqId id = live[i].id;
    rwd::SequenceSnapshot h;
    return op(
        "snapshot(" + id_str(id) + ") [L=" + std::to_string(live[i].ref.seq_length()) + "] -> snapshot " +
            std::to_string(held.size()),
        [&] { h = cache.snapshot(id); }, {},
        [&] {
          Held k{h, without_history(live[i].ref), {}};
          if (!h.valid() || h.length() != k.ref.seq_length())
            return "the handle is " + std::string(h.valid() ? "valid" : "invalid") + " with length " +
                   std::to_string(h.length()) + ", expected a valid one of length " +
                   std::to_string(k.ref.seq_length());
          k.blocks.resize(static_cast<std::size_t>(num_layers()));
          for (int l = 0; l < num_layers(); ++l) {
            const RefLayer& rl = k.ref.layers[static_cast<std::size_t>(l)];
            if (rl.has_attention())
              insert_blocks(k.blocks[static_cast<std::size_t>(l)], cache.block_spans(id, l), rl.first, rl.L,
                            cache.block_size());
          }
          held.push_back(std::move(k));
          return std::string();
        });
  }

  std::string restore_new(std::size_t k) {
    SeqId id;
    return op(
        "restore(snapshot " + std::to_string(k) + ")", [&] { id = cache.restore(held[k].handle); }, {},
        [&] {
          if (std::string e = fresh_id(id); !e.empty()) return e;
          live.push_back(SeqState{id, held[k].ref, ++tags_, 0});
          note("  -> " + id_str(id));
          return std::string();
        });
  }

  std::string restore_into(std::size_t i, std::size_t k) {
    const SeqId id = live[i].id;
    return op(
        "restore(" + id_str(id) + ", snapshot " + std::to_string(k) + ")", [&] { cache.restore(id, held[k].handle); },
        {},
        [&] {
          RefCache r = held[k].ref;
          if (const i64 R = recording_bound(live[i].ref); R >= 0) r.activate(R);
          live[i].ref = std::move(r);
          live[i].tag = ++tags_;
          live[i].steps = 0;
          return std::string();
        });
  }

  // export_snapshot (of a live sequence, or of held snapshot k when k <
  // held.size()) then import_snapshot: a new sequence.
  std::string export_import(std::size_t i, std::size_t k) {
    const bool of_held = k < held.size();
    const SeqId from = live[i].id;
    SeqId id;
    return op(
        std::string("import_snapshot(export_snapshot(") + (of_held ? "snapshot " + std::to_string(k) : id_str(from)) +
            "))",
        [&] {
          const rwd::Snapshot plain = of_held ? cache.export_snapshot(held[k].handle) : cache.export_snapshot(from);
          id = cache.import_snapshot(plain);
        },
        {},
        [&] {
          if (std::string e = fresh_id(id); !e.empty()) return e;
          live.push_back(SeqState{id, of_held ? held[k].ref : without_history(live[i].ref), ++tags_, 0});
          note("  -> " + id_str(id));
          return std::string();
        });
  }

  std::string drop_snapshot(std::size_t k) {
    note("drop snapshot " + std::to_string(k));
    held.erase(held.begin() + static_cast<std::ptrdiff_t>(k));
    return check();
  }

  // ---- per-sequence rollback and recording

  std::string crop(std::size_t i, i64 n) {
    const SeqId id = live[i].id;
    RefCache& ref = live[i].ref;
    const i64 L = ref.seq_length();
    const i64 rn = n < -(L + 1) ? -(L + 1) : n;  // the reference negates n (INT64_MIN would not survive)
    const std::vector<Expect> xs = ref.crop_expect(rn);
    const std::string tail = ") [L=" + std::to_string(L) + ", max_rollback=" + std::to_string(ref.max_rollback()) + "]";
    std::string e = op(
        "check_crop(" + id_str(id) + ", " + std::to_string(n) + tail, [&] { cache.check_crop(id, n); }, xs,
        [] { return std::string(); });
    if (!e.empty()) return e;
    return op(
        "crop(" + id_str(id) + ", " + std::to_string(n) + tail, [&] { cache.crop(id, n); }, xs,
        [&] {
          live[i].ref.crop(rn);
          return std::string();
        });
  }

  std::string activate(std::size_t i, i64 R) {
    const SeqId id = live[i].id;
    std::vector<Expect> xs;
    if (R < 0 || R > kTokenLimit) xs.push_back(Expect{Err::Invalid, -1, {}});
    return op(
        "activate_past_recording(" + id_str(id) + ", " + std::to_string(R) + ")",
        [&] { cache.activate_past_recording(id, R); }, xs,
        [&] {
          live[i].ref.activate(R);
          return std::string();
        });
  }

  std::string deactivate(std::size_t i) {
    const SeqId id = live[i].id;
    return op(
        "deactivate_past_recording(" + id_str(id) + ")", [&] { cache.deactivate_past_recording(id); }, {},
        [&] {
          live[i].ref.deactivate();
          return std::string();
        });
  }

  std::string shrink() {
    return op(
        "shrink_to_fit()", [&] { cache.shrink_to_fit(); }, {},
        [&] {
          const SequenceMemory m = cache.memory();
          return m.blocks_free == 0 ? std::string()
                                    : "blocks_free = " + std::to_string(m.blocks_free) + " after shrink_to_fit";
        });
  }

  // Sets (bytes > 0) or lifts (0) the memory budget; below what is reserved
  // it must be refused, keeping the old one.
  std::string set_budget(std::size_t bytes) {
    const std::size_t reserved = cache.memory().bytes_reserved;
    if (bytes != 0 && bytes < reserved)
      return refused(
          "set_memory_budget(" + std::to_string(bytes) + ") below the " + std::to_string(reserved) + " bytes reserved",
          [&] { cache.set_memory_budget(bytes); }, {Err::Capacity});
    note("set_memory_budget(" + std::to_string(bytes) + "), " + std::to_string(reserved) + " reserved");
    try {
      cache.set_memory_budget(bytes);
    } catch (const rwd::Error& e) {
      return fail(std::string("set_memory_budget: unexpected ") + err_name(classify(e)) + ": " + e.what());
    }
    if (cache.memory_budget() != bytes) return fail("memory_budget() does not return the budget just set");
    budget_ = bytes != 0;
    return check();
  }
  bool budget_set() const { return budget_; }
  std::uint64_t budget_refusals = 0;  // CapacityErrors accepted under a budget
  std::string last_capacity;          // the message of the last of them

  // Every per-sequence call with an id that names no live sequence (removed,
  // or never issued by this cache): IndexError, and seq_rm returns false;
  // nothing changes.
  std::string stale_calls(SeqId id) {
    const std::string tag = "(" + id_str(id) + ", no live sequence)";
    const std::vector<Err> index{Err::Index};
    std::string e;
    auto call = [&](const std::string& what, auto&& f) {
      if (e.empty()) e = refused(what + tag, f, index, false);
    };
    call("seq_length", [&] { (void)cache.seq_length(id); });
    call("seq_pos_max", [&] { (void)cache.seq_pos_max(id); });
    call("seq_pos_min", [&] { (void)cache.seq_pos_min(id); });
    call("crop(-1)", [&] { cache.crop(id, -1); });
    call("crop(0)", [&] { cache.crop(id, 0); });
    call("check_crop(-1)", [&] { cache.check_crop(id, -1); });
    call("max_rollback", [&] { (void)cache.max_rollback(id); });
    call("activate_past_recording(2)", [&] { cache.activate_past_recording(id, 2); });
    call("deactivate_past_recording", [&] { cache.deactivate_past_recording(id); });
    call("is_recording", [&] { (void)cache.is_recording(id); });
    call("recording_capacity", [&] { (void)cache.recording_capacity(id); });
    call("fork", [&] { (void)cache.fork(id); });
    call("seq_keep", [&] { cache.seq_keep(id); });
    call("begin_batch", [&] {
      const BatchEntry en[1] = {{id, 1}};
      SequenceBatch b = cache.begin_batch(en);
    });
    if (!live.empty())
      call("begin_batch with a live sequence", [&] {
        const BatchEntry en[2] = {{live.front().id, 1}, {id, 1}};
        SequenceBatch b = cache.begin_batch(en);
      });
    for (int i = 0; i < num_layers() && e.empty(); ++i) {
      const RefLayer& rl = proto(i);
      const std::string at = " layer " + std::to_string(i);
      if (rl.has_attention()) {
        call("get_mask_sizes" + at, [&] { (void)cache.get_mask_sizes(id, 1, i); });
        call("keys" + at, [&] { (void)cache.keys(id, i); });
        call("values" + at, [&] { (void)cache.values(id, i); });
        call("stored_range" + at, [&] { (void)cache.stored_range(id, i); });
        call("block_spans" + at, [&] { (void)cache.block_spans(id, i); });
        if (!rl.side_dims.empty()) call("side" + at, [&] { (void)cache.side(id, i, 0); });
      }
      if (!rl.conv_ch.empty()) {
        call("get_conv_state" + at, [&] { (void)cache.get_conv_state(id, i, 0); });
        call("conv_inputs" + at, [&] { (void)cache.conv_inputs(id, i, 0); });
        call("conv_range" + at, [&] { (void)cache.conv_range(id, i, 0); });
      }
      if (!rl.rec_shapes.empty()) {
        call("get_recurrent_state" + at, [&] { (void)cache.get_recurrent_state(id, i, 0); });
        call("recurrent_snapshot" + at, [&] { (void)cache.recurrent_snapshot(id, i, 0, 0); });
      }
    }
    if (!e.empty()) return e;
    if (cache.contains(id)) return fail("contains(" + id_str(id) + ") is true");
    bool result = true;
    const Snapshot before = snapshot();
    return op(
        "seq_rm" + tag, [&] { result = cache.seq_rm(id); }, {},
        [&] { return result ? std::string("seq_rm returned true") : same_as(before); });
  }

  // ---- batched forwards

  // Packs entry rows (st[e] rows of `part`) into one input of `shape`.
  HostTensor pack(const std::vector<StepData>& st, const std::vector<i64>& offsets, int part, std::size_t s,
                  const std::vector<i64>& shape, bool strided) const {
    const std::size_t es = rwd::dtype_size(options_.dtype);
    HostTensor t(options_.dtype, shape);
    const i64 T = part == 2 ? shape[1] : shape[2];
    if (strided && part < 2) t.strides = {T * shape[1] * shape[3], shape[3], shape[1] * shape[3], 1};
    const TensorView v = t.view();
    for (std::size_t e = 0; e < st.size(); ++e)
      for (i64 k = 0; k < st[e].q; ++k) {
        const i64 col = offsets[e] + k;
        const auto uk = static_cast<std::size_t>(k);
        if (part < 2) {  // keys / values [1, H, T, D]
          const Bytes& row = part == 0 ? st[e].keys[uk] : st[e].values[uk];
          const std::size_t run = static_cast<std::size_t>(shape[3]) * es;
          for (i64 h = 0; h < shape[1]; ++h)
            std::memcpy(v.ptr(0, h, col, 0), row.data() + static_cast<std::size_t>(h) * run, run);
        } else if (part == 2) {  // side [1, T, D]
          std::memcpy(v.ptr(0, col, 0), st[e].sides[s][uk].data(), static_cast<std::size_t>(shape[2]) * es);
        } else {  // conv [1, C, T]
          for (i64 c = 0; c < shape[1]; ++c)
            std::memcpy(v.ptr(0, c, col), st[e].conv[s][uk].data() + static_cast<std::size_t>(c) * es, es);
        }
      }
    return t;
  }

  // One entry's PagedKeyValues against the mask the oracle announced and
  // the content it predicts (read back with BlockLayout::gather).
  std::string check_paged(const std::string& what, int layer, const PagedKeyValues& pk, i64 q, const MaskSizes& want,
                          int part, const std::vector<i64>& shape, const Bytes& expect) const {
    auto n = [](i64 v) { return std::to_string(v); };
    if (q == 0) {
      if (pk.kv_length != 0 || !pk.spans.empty())
        return what + ": an entry of 0 tokens got kv_length " + n(pk.kv_length) + " and " +
               n(static_cast<i64>(pk.spans.size())) + " spans";
      return "";
    }
    if (pk.kv_offset != want.kv_offset || pk.kv_length != want.kv_length)
      return what + ": (kv_length, kv_offset) = (" + n(pk.kv_length) + ", " + n(pk.kv_offset) + "), expected (" +
             n(want.kv_length) + ", " + n(want.kv_offset) + ")";
    i64 pos = pk.kv_offset;
    for (const BlockSpan& sp : pk.spans) {
      if (sp.num_tokens == 0) continue;
      if (sp.position != pos || sp.num_tokens < 0 || sp.blocks == nullptr)
        return what + ": spans are not consecutive from kv_offset (span at " + n(sp.position) + ", expected " + n(pos) +
               ")";
      pos += sp.num_tokens;
    }
    if (pos != pk.kv_offset + pk.kv_length)
      return what + ": spans cover [" + n(pk.kv_offset) + ", " + n(pos) + "), expected [" + n(pk.kv_offset) + ", " +
             n(pk.kv_offset + pk.kv_length) + ")";
    rwd::Tensor dst = shape.size() == 4 ? rwd::Tensor(options_.dtype, {shape[0], shape[1], shape[2], shape[3]})
                                        : rwd::Tensor(options_.dtype, {shape[0], shape[1], shape[2]});
    cache.block_layout(layer).gather(pk.spans, part, pk.kv_offset, dst.view());
    return check_view(what + " (gathered)", dst.view(), options_.dtype, shape, expect);
  }

  std::string forward(const std::vector<std::pair<std::size_t, i64>>& plan, const ForwardOptions& fo = {}) {
    auto n = [](i64 v) { return std::to_string(v); };
    std::vector<BatchEntry> entries;
    std::string name = "forward {";
    i64 T = 0;
    bool invalid = plan.empty();
    std::set<std::size_t> seen;
    for (const auto& [idx, q] : plan) {
      entries.push_back({live[idx].id, q});
      name += (name.back() == '{' ? "" : ", ") + id_str(live[idx].id) + ": " + n(q);
      if (q < 0 || !seen.insert(idx).second) invalid = true;
      if (q > 0) T += q;
    }
    name += "}";
    if (fo.abandon_layer >= 0)
      name += " abandoned at layer " + n(fo.abandon_layer) + " stage " + n(fo.abandon_stage) + " how " +
              n(fo.abandon_how);
    if (fo.strided) name += " strided";
    if (invalid || T == 0)
      return refused("begin_batch " + name + " (an empty list, a sequence twice, a negative count or no token)",
                     [&] { SequenceBatch b = cache.begin_batch(entries); }, {Err::Invalid});
    note(name);
    const std::size_t E = plan.size();
    std::vector<RefCache> saved;
    if (fo.abandon_layer >= 0)
      for (const auto& pe : plan) saved.push_back(live[pe.first].ref);
    const Snapshot before = snapshot();

    std::optional<SequenceBatch> batch;
    try {
      batch.emplace(cache.begin_batch(entries));
    } catch (const rwd::CapacityError& e) {
      if (!budget_) return fail("begin_batch: unexpected CapacityError: " + std::string(e.what()));
      ++budget_refusals;
      last_capacity = e.what();
      note("  -> refused by the budget");
      if (std::string d = same_as(before); !d.empty()) return fail("a refused begin_batch changed " + d);
      return check();
    } catch (const rwd::Error& e) {
      return fail(std::string("begin_batch: unexpected ") + err_name(classify(e)) + ": " + e.what());
    }
    if (!batch->is_open() || !cache.batch_open()) return fail("begin_batch returned a batch that is not open");
    if (batch->num_tokens() != T) return fail("num_tokens() = " + n(batch->num_tokens()) + ", expected " + n(T));
    if (batch->entries().size() != E) return fail("entries() has the wrong size");
    std::vector<i64> offsets(E);
    for (std::size_t e = 0, at = 0; e < E; ++e) {
      offsets[e] = static_cast<i64>(at);
      at += static_cast<std::size_t>(std::max<i64>(0, plan[e].second));
      if (batch->offset(e) != offsets[e])
        return fail("offset(" + n(static_cast<i64>(e)) + ") = " + n(batch->offset(e)) + ", expected " + n(offsets[e]));
      if (!(batch->entries()[e].seq == entries[e].seq) || batch->entries()[e].num_tokens != entries[e].num_tokens)
        return fail("entries() differs from the list given to begin_batch");
    }

    auto abandon_now = [&](const char* where, std::optional<BatchRecurrentUpdate>* in_flight) -> std::string {
      note(std::string("  abandon ") + where);
      switch (fo.abandon_how) {
        case 0:
          batch->abandon();
          if (batch->is_open()) return fail("is_open() after abandon()");
          batch->abandon();  // no-op
          if (std::string x = expect_kinds([&] { batch->commit(); }, {Err::State}); !x.empty())
            return fail("commit() after abandon(): " + x);
          break;
        case 1: batch.reset(); break;
        default: {
          SequenceBatch other(std::move(*batch));
          if (batch->is_open()) return fail("a moved-from SequenceBatch is still open");
          if (!other.is_open()) return fail("the SequenceBatch moved into is not open");
          break;  // `other` abandons as it goes
        }
      }
      if (cache.batch_open()) return fail("batch_open() after the batch was abandoned");
      auto stale_handle = [&](const char* after) -> std::string {
        if (in_flight == nullptr || !in_flight->has_value()) return "";
        for (std::size_t e = 0; e < E; ++e) {
          if (std::string x = expect_kinds([&] { (void)(*in_flight)->previous(e); }, {Err::State}); !x.empty())
            return fail(std::string("BatchRecurrentUpdate::previous ") + after + ": " + x);
          if (std::string x = expect_kinds([&] { (void)(*in_flight)->next(e, 1); }, {Err::State}); !x.empty())
            return fail(std::string("BatchRecurrentUpdate::next ") + after + ": " + x);
        }
        if (std::string x = expect_kinds([&] { (*in_flight)->commit(); }, {Err::State}); !x.empty())
          return fail(std::string("BatchRecurrentUpdate::commit ") + after + ": " + x);
        return "";
      };
      if (std::string x = stale_handle("after its batch was abandoned"); !x.empty()) return x;
      for (std::size_t e = 0; e < E; ++e) live[plan[e].first].ref = std::move(saved[e]);
      const SequenceMemory m = cache.memory();
      if (m.blocks_in_use != before.mem.blocks_in_use || m.bytes_used != before.mem.bytes_used)
        return fail("abandon did not restore the memory figures: blocks_in_use " + n(before.mem.blocks_in_use) +
                    " -> " + n(m.blocks_in_use) + ", bytes_used " + std::to_string(before.mem.bytes_used) + " -> " +
                    std::to_string(m.bytes_used));
      if (fo.remove_after_abandon && in_flight != nullptr && in_flight->has_value()) {
        if (std::string x = remove(plan[0].first); !x.empty()) return x;
        if (std::string x = stale_handle("after its batch was abandoned and a sequence removed"); !x.empty()) return x;
      }
      return check();
    };

    const std::size_t es = rwd::dtype_size(options_.dtype);
    for (int i = 0; i <= num_layers(); ++i) {
      if (fo.abandon_layer >= 0 && std::min(fo.abandon_layer, num_layers()) == i &&
          (fo.abandon_stage == 0 || i == num_layers() || proto(i).stateless()))
        return abandon_now("before the layer", nullptr);
      if (i == num_layers()) break;
      const RefLayer& pl = proto(i);
      if (pl.stateless()) continue;
      if (fo.before_layer)
        if (std::string x = fo.before_layer(i, *batch); !x.empty()) return fail("layer " + n(i) + ": " + x);
      std::vector<StepData> st(E);
      std::vector<MaskSizes> masks(E);
      std::vector<RefLayer*> rls(E);
      for (std::size_t e = 0; e < E; ++e) {
        SeqState& s = live[plan[e].first];
        rls[e] = &s.ref.layers[static_cast<std::size_t>(i)];
        const i64 q = plan[e].second;
        if (q > 0) {
          st[e] = rls[e]->make_step(q, mix64((s.tag << 32) ^ (s.steps << 8) ^ static_cast<std::uint64_t>(i)));
          if (pl.has_attention()) masks[e] = rls[e]->mask_sizes(q);
        }
      }
      // A replacement input: its bytes become the entries' rows.
      auto take_input = [&](int part, const std::vector<i64>& shape, int token_dim,
                            const std::function<void(std::size_t, std::size_t, Bytes &&)>& set_row,
                            TensorView& in) -> bool {
        if (!fo.input) return false;
        const std::optional<TensorView> v = fo.input(i, part, shape);
        if (!v) return false;
        std::vector<Bytes> rows = token_rows(gather(*v), shape, token_dim, es);
        for (std::size_t e = 0; e < E; ++e)
          for (i64 k = 0; k < plan[e].second; ++k)
            set_row(e, static_cast<std::size_t>(k), std::move(rows[static_cast<std::size_t>(offsets[e] + k)]));
        in = *v;
        return true;
      };
      try {
        if (pl.has_attention()) {
          const std::vector<i64> ks{1, pl.H, T, pl.Dk}, vs{1, pl.H, T, pl.Dv};
          const HostTensor kt = pack(st, offsets, 0, 0, ks, fo.strided), vt = pack(st, offsets, 1, 0, vs, fo.strided);
          TensorView kin = kt.view(), vin = vt.view();
          (void)take_input(
              0, ks, 2, [&](std::size_t e, std::size_t k, Bytes&& r) { st[e].keys[k] = std::move(r); }, kin);
          (void)take_input(
              1, vs, 2, [&](std::size_t e, std::size_t k, Bytes&& r) { st[e].values[k] = std::move(r); }, vin);
          const std::span<const PagedKeyValues> out = cache.update(kin, vin, i);
          if (out.size() != E)
            return fail("layer " + n(i) + ": update returned " + n(static_cast<i64>(out.size())) +
                        " entries for a batch of " + n(static_cast<i64>(E)));
          for (std::size_t e = 0; e < E; ++e) {
            const i64 q = plan[e].second, from = masks[e].kv_offset, to = rls[e]->L + q;
            const std::string at = "layer " + n(i) + " update, entry " + n(static_cast<i64>(e));
            std::string x = check_paged(at + " keys", i, out[e], q, masks[e], 0, {1, pl.H, to - from, pl.Dk},
                                        q > 0 ? kv_expect(*rls[e], st[e], true, from, to) : Bytes{});
            if (x.empty() && q > 0)
              x = check_paged(at + " values", i, out[e], q, masks[e], 1, {1, pl.H, to - from, pl.Dv},
                              kv_expect(*rls[e], st[e], false, from, to));
            if (!x.empty()) return fail(x);
          }
          for (std::size_t s = 0; s < pl.side_dims.size(); ++s) {
            const std::vector<i64> ss{1, T, pl.side_dims[s]};
            const HostTensor t = pack(st, offsets, 2, s, ss, false);
            TensorView in = t.view();
            (void)take_input(
                2 + static_cast<int>(s), ss, 1,
                [&](std::size_t e, std::size_t k, Bytes&& r) { st[e].sides[s][k] = std::move(r); }, in);
            const std::span<const PagedKeyValues> so = cache.update_side(in, i, static_cast<int>(s));
            if (so.size() != E) return fail("layer " + n(i) + ": update_side returned the wrong number of entries");
            for (std::size_t e = 0; e < E; ++e) {
              const i64 q = plan[e].second, from = masks[e].kv_offset, to = rls[e]->L + q;
              const std::string x = check_paged(
                  "layer " + n(i) + " update_side " + n(static_cast<i64>(s)) + ", entry " + n(static_cast<i64>(e)), i,
                  so[e], q, masks[e], 2 + static_cast<int>(s), {1, to - from, pl.side_dims[s]},
                  q > 0 ? side_expect(*rls[e], st[e], s, from, to) : Bytes{});
              if (!x.empty()) return fail(x);
            }
          }
          if (fo.abandon_layer == i && fo.abandon_stage == 1) return abandon_now("after the attention part", nullptr);
        }
        for (std::size_t s = 0; s < pl.conv_ch.size(); ++s) {
          const std::vector<i64> cs{1, pl.conv_ch[s], T};
          const HostTensor t = pack(st, offsets, 3, s, cs, false);
          TensorView in = t.view();
          (void)take_input(
              100 + static_cast<int>(s), cs, 2,
              [&](std::size_t e, std::size_t k, Bytes&& r) { st[e].conv[s][k] = std::move(r); }, in);
          const std::span<const TensorView> w = cache.update_conv_state(in, i, static_cast<int>(s));
          if (w.size() != E) return fail("layer " + n(i) + ": update_conv_state returned the wrong number of entries");
          for (std::size_t e = 0; e < E; ++e) {
            const i64 q = plan[e].second, L0 = rls[e]->L;
            const std::string at = "layer " + n(i) + " conv window " + n(static_cast<i64>(s)) + ", entry " +
                                   n(static_cast<i64>(e));
            if (q == 0) {
              bool empty = w[e].data == nullptr;
              for (int d = 0; d < w[e].rank; ++d) empty = empty || w[e].size(d) == 0;
              if (!empty) return fail(at + ": an entry of 0 tokens got a non-empty window " + w[e].describe());
              continue;
            }
            const std::string x = check_view(at, w[e], pl.dtype(), {1, pl.conv_ch[s], pl.K - 1 + q},
                                             conv_expect(*rls[e], st[e], s, L0 - pl.K + 1, L0 + q));
            if (!x.empty()) return fail(x);
          }
        }
        for (std::size_t s = 0; s < pl.rec_shapes.size(); ++s) {
          const int si = static_cast<int>(s);
          std::optional<BatchRecurrentUpdate> u;
          u.emplace(cache.begin_recurrent_update(i, si));
          const std::string at = "layer " + n(i) + " recurrent " + n(si);
          // num_entries() counts every entry of the batch, 0 tokens included.
          if (u->num_entries() != E)
            return fail(at + ": num_entries() = " + n(static_cast<i64>(u->num_entries())) + ", expected " +
                        n(static_cast<i64>(E)) + " (the batch's entries)");
          const std::vector<i64> shape = rls[0]->rec_state_shape(s);
          for (std::size_t e = 0; e < E; ++e) {
            const i64 q = plan[e].second;
            if (u->num_tokens(e) != q) return fail(at + ": num_tokens(" + n(static_cast<i64>(e)) + ") != q");
            if (std::string x = check_view(at + " previous(" + n(static_cast<i64>(e)) + ")", u->previous(e),
                                           pl.rdtype(), shape, rls[e]->expect_rec(s, rls[e]->L));
                !x.empty())
              return fail(x);
            for (i64 t : {i64{0}, q + 1})
              if (std::string x = expect_kinds([&] { (void)u->next(e, t); }, {Err::Index}); !x.empty())
                return fail(at + " next(" + n(static_cast<i64>(e)) + ", " + n(t) + "): " + x);
            for (i64 t = 1; t <= q; ++t) {
              const TensorView slot = u->next(e, t);
              if (shape_of(slot) != shape || slot.dtype != pl.rdtype())
                return fail(at + ": next(" + n(static_cast<i64>(e)) + ", " + n(t) + ") has shape " +
                            shape_str(shape_of(slot)));
              Bytes& want = st[e].rec[s][static_cast<std::size_t>(t - 1)];
              if (fo.write_rec && fo.write_rec(i, si, e, t, slot))
                want = gather(slot);
              else
                scatter(want, slot);
            }
          }
          if (std::string x = expect_kinds([&] { (void)u->next(E, 1); }, {Err::Index}); !x.empty())
            return fail(at + " next(entry past the batch): " + x);
          for (std::size_t e = 0; e < E; ++e)  // the fresh slots never alias S(L)
            if (std::string x = check_view(at + " previous(" + n(static_cast<i64>(e)) + ") after writing the slots",
                                           u->previous(e), pl.rdtype(), shape, rls[e]->expect_rec(s, rls[e]->L));
                !x.empty())
              return fail(x);
          if (fo.abandon_layer == i && fo.abandon_stage >= 2)
            return abandon_now("with a recurrent update in flight", &u);
          u->commit();
        }
        if (fo.abandon_layer == i && fo.abandon_stage >= 1) return abandon_now("after the layer", nullptr);
      } catch (const rwd::Error& e) {
        return fail("layer " + n(i) + ": unexpected " + err_name(classify(e)) + ": " + e.what());
      } catch (const std::exception& e) {
        return fail("layer " + n(i) + ": non-rewind exception: " + e.what());
      }
      for (std::size_t e = 0; e < E; ++e)
        if (plan[e].second > 0) rls[e]->apply_update(st[e]);
    }
    try {
      batch->commit();
    } catch (const rwd::Error& e) {
      return fail(std::string("commit: unexpected ") + err_name(classify(e)) + ": " + e.what());
    }
    if (batch->is_open() || cache.batch_open()) return fail("the batch is still open after commit()");
    if (std::string x = expect_kinds([&] { batch->commit(); }, {Err::State}); !x.empty())
      return fail("commit() of a committed batch: " + x);
    for (const auto& [idx, q] : plan)
      if (q > 0) ++live[idx].steps;
    return check();
  }

  // The content and figures of one sequence as bytes (to compare two caches).
  Bytes fingerprint(SeqId id) const {
    Bytes out;
    auto put = [&](i64 v) {
      unsigned char b[8];
      std::memcpy(b, &v, 8);
      out.insert(out.end(), b, b + 8);
    };
    auto put_view = [&](const TensorView& v) {
      for (i64 s : shape_of(v)) put(s);
      const Bytes b = gather(v);
      out.insert(out.end(), b.begin(), b.end());
    };
    put(cache.seq_length(id));
    put(cache.max_rollback(id));
    put(cache.recording_capacity(id));
    for (int i = 0; i < num_layers(); ++i) {
      const RefLayer& rl = proto(i);
      if (rl.has_attention()) {
        const rwd::PositionRange r = cache.stored_range(id, i);
        put(r.first);
        put(r.end);
        put_view(cache.keys(id, i).view());
        put_view(cache.values(id, i).view());
        for (std::size_t s = 0; s < rl.side_dims.size(); ++s) put_view(cache.side(id, i, static_cast<int>(s)).view());
      }
      for (std::size_t s = 0; s < rl.conv_ch.size(); ++s) {
        const rwd::PositionRange r = cache.conv_range(id, i, static_cast<int>(s));
        put(r.first);
        put(r.end);
        put_view(cache.conv_inputs(id, i, static_cast<int>(s)));
      }
      for (std::size_t s = 0; s < rl.rec_shapes.size(); ++s) {
        put_view(cache.get_recurrent_state(id, i, static_cast<int>(s)));
        const i64 L = cache.seq_length(id);
        for (i64 p = L - 1; p >= 1; --p) {
          try {
            put_view(cache.recurrent_snapshot(id, i, static_cast<int>(s), p));
          } catch (const rwd::IndexError&) {
            put(-p);
            break;
          }
        }
      }
    }
    return out;
  }

 private:
  SeqSpec spec_;
  LayerOptions options_;
  RefCache proto_ = fresh_ref();
  std::vector<std::string> log_;
  std::uint64_t tags_ = 0;
  bool budget_ = false;

 public:
  struct Held {
    rwd::SequenceSnapshot handle;
    RefCache ref;
    std::vector<std::set<const std::byte*>> blocks;  // per layer, the blocks it shares
  };
  SequenceCache cache;
  std::vector<SeqState> live;
  std::vector<SeqId> removed;
  std::vector<Held> held;  // declared after the cache: handles go first
};

}  // namespace rwt::seqtest
