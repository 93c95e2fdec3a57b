// libFuzzer target: the input bytes are decoded into a sequence of cache
// operations on a hybrid cache with every layer kind (f32 / f16 / bf16,
// dynamic or static sliding and chunked layers), and after each one the cache
// is compared with the naive replay reference of tests/conformance/reference.h:
// it either matches, or the operation threw the error the reference predicts
// and nothing changed. Any mismatch aborts with the operation log.
//
// Operations:
// - forwards of 1..8 tokens through every layer, part by part (keys / values,
//   side tensors, conv inputs, recurrent states), each part in one call or in
//   chunks, recurrent states by begin / next / commit (sometimes a dropped
//   update first) or by update_recurrent_state token by token. Every input is
//   one of: a fresh contiguous or permuted tensor, a broadcast (stride 0 on
//   the token dimension and possibly others), a reversed (negative stride)
//   view, or a view ALIASING the cache's own storage (keys_values(), side(),
//   conv_inputs(), get_conv_state(), get_recurrent_state(), a snapshot, a
//   view an earlier update returned, sliced with TensorView::slice, possibly
//   broadcast or reversed). The reference is fed the bytes the input view
//   held before the call.
// - forwards inside Cache::begin_forward, with refused whole-cache operations,
//   updates that pass the forward's q, early commits (StateError, forward kept
//   open), and abandons (abandon(), destroying the handle, moving it) at any
//   part, also with a recurrent update in flight: the cache must then equal
//   its state before begin_forward.
// - the same two under a memory budget slightly above the current
//   reservation: without begin_forward a part may be refused halfway through
//   the layers (the refused call changes nothing; whole-cache operations then
//   throw StateError; recovery by reset(), by finishing the forward, or by
//   carrying on out of step); with begin_forward either begin_forward is
//   refused and nothing changed, or every part of every layer goes through.
// - crops of any n (huge ones included), recording changes, batch select /
//   reorder / repeat, reset, shrink_to_fit; with header bit 16 each under a
//   budget of a few KiB over what is reserved, its refusals (like every
//   other refusal here) compared with memory() before, bytes reserved too.
// - read-only per-layer queries through cache.layer(i) (check_crop must throw
//   what the reference predicts for that layer alone), and views held across
//   later operations, re-read while the lifetime rule says they are valid.
// - hostile sizes: broadcast inputs of 2^59.. INT64_MAX tokens, zero and
//   negative token counts, huge recording depths, repeats and crop counts,
//   and fresh layers / caches with huge head counts, widths, channels,
//   recurrent shapes, batch, static capacity, window or chunk size: a
//   CapacityError or InvalidArgument (never std::bad_alloc), nothing changed.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "conformance/harness.h"
#include "fuzz_support.h"

namespace rwt {
namespace {

using rwd::Forward;

constexpr i64 kI64Max = std::numeric_limits<i64>::max();
constexpr i64 kI64Min = std::numeric_limits<i64>::min();
constexpr i64 kTokenLimit = i64{1} << 40;  // tokens per sequence (rewind/layer.h)

// Token counts no update may accept.
constexpr std::array<i64, 9> kHugeTokens{
    i64{1} << 59, (i64{1} << 59) + 1, i64{1} << 62, kI64Max, kI64Max - 1, kTokenLimit + 1, 0, -1, kI64Min};
// Option extents whose buffers need more than 2^48 bytes on their own.
constexpr std::array<i64, 8> kHugeExtents{i64{1} << 48,       (i64{1} << 48) + 1, i64{1} << 53, i64{1} << 59,
                                          (i64{1} << 59) + 1, i64{1} << 62,       kI64Max - 1,  kI64Max};
// Window / chunk sizes: huge, but nothing is allocated in proportion to them.
constexpr std::array<i64, 6> kHugeSpans{i64{1} << 40, i64{1} << 59, i64{1} << 62, kI64Max - 2, kI64Max - 1, kI64Max};
constexpr std::array<i64, 7> kHugeCrops{kI64Min,      kI64Min + 1,        kI64Max,        -(i64{1} << 62),
                                        i64{1} << 62, -(kTokenLimit + 1), kTokenLimit + 1};

// Counts of what the inputs exercised, printed at exit when
// REWIND_FUZZ_STATS is set (e.g. with -runs=0 over a corpus).
enum Stat {
  kForwardPlain,
  kForwardOpen,
  kForwardBudget,
  kForwardOpenBudget,
  kBeginRefused,
  kBudgetRefusal,
  kBudgetRefusalHalfLayer,
  kRecoverReset,
  kRecoverFinish,
  kRecoverOutOfStep,
  kAbandon,
  kAbandonInFlight,
  kEarlyCommit,
  kOpenProbe,
  kOvershoot,
  kCommit,
  kChunked,
  kInputFresh,
  kInputPermuted,
  kInputBroadcast,
  kInputReversed,
  kInputAliasSameLayer,
  kInputAliasOtherLayer,
  kInputAliasReturned,
  kRecFromCache,
  kDroppedUpdate,
  kHeldChecked,
  kQuery,
  kCheckCropRefused,
  kHuge,
  kHugeLayerBuilt,
  kHugeLayerRefused,
  kTwin,
  kWholeBudget,
  kWholeBudgetRefused,
  kStatCount
};
constexpr const char* kStatNames[kStatCount] = {"plain forwards",
                                                "forwards in begin_forward",
                                                "budgeted plain forwards",
                                                "budgeted begin_forward forwards",
                                                "begin_forward refused by the budget",
                                                "parts refused by the budget",
                                                "  of which with the layer half updated",
                                                "  recovered by reset()",
                                                "  recovered by finishing the forward",
                                                "  left out of step",
                                                "forwards abandoned",
                                                "  with a recurrent update in flight",
                                                "early commits refused",
                                                "whole-cache calls refused in a forward",
                                                "updates past the forward refused",
                                                "forwards committed",
                                                "parts updated in chunks",
                                                "inputs: fresh contiguous",
                                                "inputs: fresh permuted",
                                                "inputs: broadcast (stride 0)",
                                                "inputs: reversed (negative stride)",
                                                "inputs: aliasing the same layer",
                                                "inputs: aliasing another layer",
                                                "inputs: aliasing a returned view",
                                                "recurrent slots written from cache views",
                                                "recurrent updates dropped",
                                                "held views re-read",
                                                "per-layer query rounds",
                                                "layer(i).check_crop refusals matched",
                                                "hostile-size calls",
                                                "huge-option layers built (unused field or huge window)",
                                                "huge-option layers refused",
                                                "huge-window layers compared with full attention",
                                                "whole-cache calls under a budget",
                                                "  refused by the budget"};
FuzzStats<kStatCount>& stats() {
  static FuzzStats<kStatCount> s(kStatNames);
  return s;
}
void count(Stat k, unsigned long long by = 1) { stats().count(static_cast<std::size_t>(k), by); }

std::vector<std::pair<LayerKind, LayerOptions>> every_kind(DType dt, bool with_static) {
  std::vector<std::pair<LayerKind, LayerOptions>> spec;
  for (LayerKind k :
       {LayerKind::FullAttention, LayerKind::SlidingAttention, LayerKind::ChunkedAttention, LayerKind::LinearAttention,
        LayerKind::Conv, LayerKind::Hybrid, LayerKind::HybridSliding, LayerKind::SparseAttention, LayerKind::Moe}) {
    LayerOptions o = small_options(k, dt, false, 2);
    if (with_static && (k == LayerKind::SlidingAttention || k == LayerKind::ChunkedAttention)) o.static_capacity = 24;
    spec.push_back({k, o});
  }
  return spec;
}

std::string num(i64 v) { return std::to_string(v); }

// The mask sizes of an update of q tokens at length L (docs/semantics.md section 5).
MaskSizes mask_at(const RefLayer& r, i64 L, i64 q) {
  switch (r.attn()) {
    case Attn::Full: return {L + q, 0};
    case Attn::Sliding: return {std::min(L, r.W - 1) + q, std::max<i64>(0, L - r.W + 1)};
    case Attn::Chunked: {
      const i64 c0 = floor_div(L, r.C) * r.C;
      return {L - c0 + q, c0};
    }
    case Attn::None: break;
  }
  return {0, 0};
}

// crop(n) with n below -(L+1) removes everything, as crop(-(L+1)) does; the
// reference negates n, which INT64_MIN does not survive.
i64 ref_crop_n(i64 n, i64 L) { return n < -(L + 1) ? -(L + 1) : n; }

// ---- cheap fingerprints of the observable state (observe() of harness.h
// builds a string per field; these append everything to one buffer) ------------

void put(Bytes& out, i64 v) {
  unsigned char b[8];
  std::memcpy(b, &v, 8);
  out.insert(out.end(), b, b + 8);
}

void put_view(Bytes& out, const TensorView& v) {
  put(out, v.rank);
  put(out, static_cast<i64>(v.dtype));
  for (int d = 0; d < v.rank; ++d) put(out, v.size(d));
  for (int d = 0; d < v.rank; ++d)
    if (v.size(d) == 0) return;
  const std::size_t es = rwd::dtype_size(v.dtype);
  auto ext = [&](int d) { return d < v.rank ? v.size(d) : 1; };
  // The innermost extent is copied in one run when it is contiguous.
  const int inner = v.rank == 0 ? 0 : v.rank - 1;
  const bool run = v.rank > 0 && v.stride(inner) == 1;
  std::size_t at = out.size();
  out.resize(at + static_cast<std::size_t>(ext(0) * ext(1) * ext(2) * ext(3)) * es);
  const std::array<i64, 4> n{ext(0), ext(1), ext(2), ext(3)};
  std::array<i64, 4> i{0, 0, 0, 0};
  auto& last = i[static_cast<std::size_t>(inner)];
  const i64 count = run ? n[static_cast<std::size_t>(inner)] : 1;
  for (i[0] = 0; i[0] < n[0]; ++i[0])
    for (i[1] = 0; i[1] < n[1]; ++i[1])
      for (i[2] = 0; i[2] < n[2]; ++i[2])
        for (i[3] = 0; i[3] < n[3]; ++i[3]) {
          if (run && last != 0) continue;
          const std::size_t bytes = static_cast<std::size_t>(count) * es;
          std::memcpy(out.data() + at, v.ptr(i[0], i[1], i[2], i[3]), bytes);
          at += bytes;
        }
}

// Everything observe(layer) looks at, as bytes.
Bytes fingerprint(const Layer& l) {
  Bytes out;
  put(out, l.get_seq_length());
  if (l.is_stateless()) return out;
  put(out, l.batch_size());
  put(out, l.is_recording());
  put(out, l.recording_capacity());
  try {
    put(out, l.max_rollback());
  } catch (const rwd::StateError&) {
    put(out, -1);  // a half-updated layer
  }
  put(out, static_cast<i64>(l.memory().bytes_used));
  if (l.has_attention()) {
    const rwd::PositionRange r = l.stored_range();
    put(out, r.first);
    put(out, r.end);
    put_view(out, l.keys_values().keys);
    put_view(out, l.keys_values().values);
    put(out, l.get_mask_sizes(2).kv_length);
    put(out, l.get_mask_sizes(2).kv_offset);
    for (int s = 0; s < num_sides(l); ++s) put_view(out, l.side(s));
  }
  for (int s = 0; s < num_conv(l); ++s) {
    const rwd::PositionRange r = l.conv_range(s);
    put(out, r.first);
    put(out, r.end);
    put_view(out, l.conv_inputs(s));
    put_view(out, l.get_conv_state(s));
  }
  const i64 L = l.get_seq_length();
  for (int s = 0; s < num_rec(l); ++s) {
    put_view(out, l.get_recurrent_state(s));
    for (i64 p = L - 1; p >= 1 && p >= L - l.recording_capacity(); --p) {
      try {
        put_view(out, l.recurrent_snapshot(s, p));
      } catch (const rwd::IndexError&) {
        put(out, -p);
        break;
      }
    }
  }
  if (l.is_linear()) put(out, l.has_previous_state());
  return out;
}

// Per-layer fingerprints, then the cache's own answers.
std::vector<Bytes> fingerprint(const Cache& c) {
  std::vector<Bytes> out;
  for (int i = 0; i < c.num_layers(); ++i) out.push_back(fingerprint(c.layer(i)));
  Bytes own;
  put(own, c.get_seq_length());
  put(own, c.is_recording());
  put(own, static_cast<i64>(c.memory().bytes_used));
  try {
    put(own, c.max_rollback());
  } catch (const rwd::StateError&) {
    put(own, -1);  // out of step
  }
  out.push_back(std::move(own));
  return out;
}

// "" when equal, else which layer (or the cache's own answers) differs.
std::string print_diff(const std::vector<Bytes>& before, const std::vector<Bytes>& after) {
  for (std::size_t i = 0; i < before.size() && i < after.size(); ++i)
    if (before[i] != after[i])
      return i + 1 == before.size() ? "the cache's length, recording, bytes used or max_rollback"
                                    : "layer " + std::to_string(i);
  return before.size() == after.size() ? "" : "number of layers";
}

struct Held {  // a view the cache returned, with its bytes then
  TensorView view;
  int layer = 0;
  std::uint64_t stamp = 0;
  Bytes bytes;
  std::string what;
  bool returned = false;  // by an update (else by an accessor)
};

struct Source {
  TensorView view;
  std::string what;
  int layer = -1;
  bool returned = false;
};

struct Input {
  std::unique_ptr<HostTensor> owner;  // null for a view of the cache's storage
  TensorView view;
  std::string how;
};

enum class PartKind { KV, Side, Conv, Rec };
struct Part {
  PartKind kind;
  int s;
};

// One call's result, checked once the layer's step is in the reference.
struct Returned {
  std::string what;
  PartKind kind = PartKind::KV;
  std::size_t s = 0;
  bool is_keys = true;
  i64 from = 0, to = 0;
  std::vector<i64> shape;
  DType dtype = DType::F32;
  Bytes bytes;
};

struct Run {  // the forward in progress
  i64 q = 0;
  bool forward = false;  // inside begin_forward
  bool budget = false;   // a memory budget is set
  std::size_t cap = 0;
  std::optional<Forward>* handle = nullptr;
  const std::vector<Bytes>* before = nullptr;  // the cache at begin_forward
};

enum class Chunk { Done, Refused, Abandoned };

class Fuzzer {
 public:
  Fuzzer(ByteReader& in, DType dt, bool with_static, bool budget_whole)
      : in_(in), dt_(dt), budget_whole_(budget_whole), b_(build_cache(every_kind(dt, with_static))),
        gen_(static_cast<std::size_t>(b_.cache.num_layers()), 0) {}

  void run() {
    for (int step = 0; step < 64 && !in_.empty(); ++step) {
      check_held();
      const std::uint8_t op = next() % 16;
      switch (op) {
        case 0:
        case 1:
        case 2:
        case 3: op_forward(); break;
        case 4:
        case 5: op_crop(); break;
        case 6: {
          const i64 R = in_.range(0, 9);
          whole(
              "activate_past_recording(" + num(R) + ")", [&] { cache().activate_past_recording(R); }, step_expect(),
              [&] { ref().activate(R); });
          break;
        }
        case 7:
          whole(
              "deactivate_past_recording()", [&] { cache().deactivate_past_recording(); }, step_expect(),
              [&] { ref().deactivate(); });
          break;
        case 8: op_batch(); break;
        case 9: {
          const i64 B = ref().batch();
          if (B > 3) break;  // keep batches small
          const i64 r = in_.range(1, 2);
          const std::vector<i64> idx = ref().repeat_indices(r);
          whole(
              "batch_repeat_interleave(" + num(r) + ")", [&] { cache().batch_repeat_interleave(r); }, step_expect(),
              [&] { ref().batch_apply(idx); });
          break;
        }
        case 10:
          whole(
              "reset()", [&] { cache().reset(); }, {}, [&] { ref().reset(); });
          break;
        case 11:
          whole(
              "shrink_to_fit()", [&] { cache().shrink_to_fit(); }, {}, [] {});
          break;
        case 12:
        case 13: op_query(); break;
        case 14: op_huge(); break;
        default: op_huge_layer(); break;
      }
    }
    check_held();
  }

 private:
  ByteReader& in_;
  DType dt_;
  bool budget_whole_;  // whole-cache calls may run under a budget (header bit 16)
  Built b_;
  std::vector<std::uint64_t> gen_;  // per layer, bumped by every call that mutates it
  std::vector<Held> held_;
  std::string log_;
  std::uint64_t salt_ = 0;

  std::uint8_t next() { return in_.next(); }
  Cache& cache() { return b_.cache; }
  RefCache& ref() { return b_.ref; }
  int num_layers() { return b_.cache.num_layers(); }
  void bump(int i) { ++gen_[static_cast<std::size_t>(i)]; }
  void bump_all() {
    for (auto& g : gen_) ++g;
  }
  void note(const std::string& s) { log_ += "\n  " + s; }

  [[noreturn]] void fail(const std::string& what) const {
    std::fprintf(stderr, "cache/reference mismatch\noperations:%s\n=> %s\n", log_.c_str(), what.c_str());
    std::abort();
  }
  void check(const std::string& e) {
    if (!e.empty()) fail(e);
  }
  void same(const std::vector<Bytes>& before, const std::string& what) {
    if (std::string e = print_diff(before, fingerprint(cache())); !e.empty()) fail(what + " changed " + e);
  }
  // A refusal leaves every memory() figure (bytes reserved included, which
  // the fingerprint leaves out) as it was.
  void same_memory(const std::string& before, const std::string& what) {
    if (std::string now = memory_str(cache().memory()); now != before)
      fail(what + " changed memory(): " + before + " -> " + now);
  }
  // A call that must be refused with one of `kinds` and change nothing.
  template <class F>
  void refused(const std::string& what, F&& f, std::initializer_list<Err> kinds) {
    note(what);
    const std::vector<Bytes> before = fingerprint(cache());
    const std::string memory = memory_str(cache().memory());
    if (std::string e = expect_kinds(f, kinds); !e.empty()) fail(what + ": " + e);
    same(before, what);
    same_memory(memory, what);
  }

  // ---- views held across operations (the lifetime rule) -------------------

  void hold(const TensorView& v, int layer, const std::string& what, bool returned = false) {
    for (int d = 0; d < v.rank; ++d)
      if (v.size(d) < 1) return;
    if (held_.size() >= 16) held_.erase(held_.begin());
    held_.push_back({v, layer, gen_[static_cast<std::size_t>(layer)], gather(v), what, returned});
  }
  bool valid(const Held& h) const { return gen_[static_cast<std::size_t>(h.layer)] == h.stamp; }
  // Every held view whose layer was not mutated since must read what it read then.
  void check_held() {
    held_.erase(std::remove_if(held_.begin(), held_.end(), [&](const Held& h) { return !valid(h); }), held_.end());
    for (const Held& h : held_) {
      count(kHeldChecked);
      if (gather(h.view) != h.bytes)
        fail("a view of layer " + num(h.layer) + " (" + h.what +
             ") changed although no call mutated that layer since it was returned");
    }
  }

  // ---- inputs ----------------------------------------------------------------

  static void add_source(std::vector<Source>& out, const TensorView& v, std::string what, int rank, int layer,
                         bool returned = false) {
    if (v.rank != rank && v.rank != rank + 1) return;
    for (int d = 0; d < v.rank; ++d)
      if (v.size(d) < 1) return;
    out.push_back({v, std::move(what), layer, returned});
  }
  // Views of the cache's storage valid now, of rank `rank` or one more.
  std::vector<Source> sources(int rank) {
    std::vector<Source> out;
    for (int j = 0; j < num_layers(); ++j) {
      const Layer& l = cache().layer(j);
      if (l.is_stateless()) continue;
      const std::string tag = "layer " + num(j) + " ";
      if (l.has_attention()) {
        const rwd::KeyValueView kv = l.keys_values();
        add_source(out, kv.keys, tag + "keys_values().keys", rank, j);
        add_source(out, kv.values, tag + "keys_values().values", rank, j);
        for (int s = 0; s < num_sides(l); ++s) add_source(out, l.side(s), tag + "side(" + num(s) + ")", rank, j);
      }
      for (int s = 0; s < num_conv(l); ++s) {
        add_source(out, l.conv_inputs(s), tag + "conv_inputs(" + num(s) + ")", rank, j);
        add_source(out, l.get_conv_state(s), tag + "get_conv_state(" + num(s) + ")", rank, j);
      }
      for (int s = 0; s < num_rec(l); ++s) {
        add_source(out, l.get_recurrent_state(s), tag + "get_recurrent_state(" + num(s) + ")", rank, j);
        const RefLayer& rl = ref().layers[static_cast<std::size_t>(j)];
        const i64 p = l.get_seq_length() - 1;
        if (p >= 1 && p >= rl.rec_first && rl.L == l.get_seq_length())
          add_source(out, l.recurrent_snapshot(s, p), tag + "recurrent_snapshot(" + num(s) + ", " + num(p) + ")", rank,
                     j);
      }
    }
    for (const Held& h : held_)
      if (valid(h)) add_source(out, h.view, h.what, rank, h.layer, h.returned);
    return out;
  }

  // `v` cut down to `target`: extra dimensions indexed away (never the
  // batch), longer extents sliced, extents too short broadcast from one
  // element (stride 0), the token dimension possibly reversed.
  std::optional<TensorView> fit(TensorView v, const std::vector<i64>& target, int token_dim) {
    const int rank = static_cast<int>(target.size());
    while (v.rank > rank) {
      const int d = 1 + next() % (v.rank - 1);
      v = v.slice(d, next() % v.size(d), 1);
      for (int e = d; e + 1 < v.rank; ++e) {
        v.shape[static_cast<std::size_t>(e)] = v.shape[static_cast<std::size_t>(e + 1)];
        v.strides[static_cast<std::size_t>(e)] = v.strides[static_cast<std::size_t>(e + 1)];
      }
      v.shape[static_cast<std::size_t>(v.rank - 1)] = 1;
      v.strides[static_cast<std::size_t>(v.rank - 1)] = 0;
      --v.rank;
    }
    if (v.rank != rank) return std::nullopt;
    for (int d = 0; d < rank; ++d) {
      const i64 want = target[static_cast<std::size_t>(d)];
      if (v.size(d) >= want) {
        v = v.slice(d, in_.range(0, v.size(d) - want), want);
      } else {
        v = v.slice(d, next() % v.size(d), 1);
        v.shape[static_cast<std::size_t>(d)] = want;
        v.strides[static_cast<std::size_t>(d)] = 0;
      }
    }
    if (token_dim >= 0 && v.size(token_dim) > 1 && v.stride(token_dim) != 0 && in_.one_in(4)) {
      std::array<i64, 4> last{0, 0, 0, 0};
      last[static_cast<std::size_t>(token_dim)] = v.size(token_dim) - 1;
      v.data = v.ptr(last[0], last[1], last[2], last[3]);
      v.strides[static_cast<std::size_t>(token_dim)] = -v.stride(token_dim);
    }
    return v;
  }

  // A fresh tensor of `shape`: dimensions stored in a permuted order, some
  // broadcast (stride 0), some reversed (negative stride).
  Input fresh(const std::vector<i64>& shape, int token_dim, DType dt, int perm, unsigned zero, unsigned rev,
              std::uint64_t part) {
    const std::size_t r = shape.size();
    std::vector<std::size_t> order(r);
    std::iota(order.begin(), order.end(), std::size_t{0});
    for (int k = 0; k < perm; ++k) std::next_permutation(order.begin(), order.end());
    std::vector<i64> ext(r), st(r), strides(r);
    for (std::size_t d = 0; d < r; ++d) ext[d] = ((zero >> d) & 1u) != 0 ? 1 : shape[d];
    i64 running = 1;
    for (std::size_t k = r; k-- > 0;) {
      st[order[k]] = running;
      running *= ext[order[k]];
    }
    auto owner = std::make_unique<HostTensor>(dt, std::vector<i64>{running});
    const std::size_t es = rwd::dtype_size(dt);
    ++salt_;
    for (i64 e = 0; e < running; ++e)
      write_pattern(owner->bytes.data() + static_cast<std::size_t>(e) * es, dt, key_of(salt_, part, 0, 0, e));
    i64 offset = 0;
    std::string how = "fresh";
    for (std::size_t d = 0; d < r; ++d) {
      strides[d] = ((zero >> d) & 1u) != 0 ? 0 : st[d];
      if (((rev >> d) & 1u) != 0 && strides[d] != 0 && shape[d] > 1) {
        offset += (shape[d] - 1) * strides[d];
        strides[d] = -strides[d];
      }
    }
    if (perm > 0) how += " permuted";
    if (zero != 0) how += " broadcast";
    if (rev != 0) how += " reversed";
    (void)token_dim;
    Input in;
    in.view = raw_view(owner->bytes.data() + static_cast<std::size_t>(offset) * es, dt, shape, strides);
    in.owner = std::move(owner);
    in.how = how;
    return in;
  }

  // An input of `shape` for a part (token_dim -1: a recurrent state).
  Input make_input(const std::vector<i64>& shape, int token_dim, std::uint64_t part, int layer) {
    const int rank = static_cast<int>(shape.size());
    const int mode = next() % 8;
    if (mode >= 5) {
      std::vector<Source> src = sources(rank);
      if ((next() & 1) != 0) {  // half the time the layer's own storage (the input is staged by the layer)
        std::vector<Source> own;
        for (const Source& s : src)
          if (s.layer == layer) own.push_back(s);
        if (!own.empty()) src = std::move(own);
      }
      if (!src.empty()) {
        const Source& s = src[next() % src.size()];
        if (std::optional<TensorView> v = fit(s.view, shape, token_dim)) {
          count(s.returned ? kInputAliasReturned : s.layer == layer ? kInputAliasSameLayer : kInputAliasOtherLayer);
          return {nullptr, *v, "alias of " + s.what};
        }
      }
    }
    unsigned zero = 0, rev = 0;
    int perm = 0;
    if (mode == 2) perm = 1 + next() % 23;
    if (mode == 3) {  // broadcast: the token dimension (or some dimension of a state) and maybe others
      zero = next() & ((1u << rank) - 1);
      if (token_dim >= 0) zero |= 1u << token_dim;
      if (zero == 0) zero = 1u << (rank - 1);
    }
    if (mode == 4) rev = (next() & ((1u << rank) - 1)) | (token_dim >= 0 ? 1u << token_dim : 0u);
    count(zero != 0 ? kInputBroadcast : rev != 0 ? kInputReversed : perm != 0 ? kInputPermuted : kInputFresh);
    return fresh(shape, token_dim, dt_, perm, zero, rev, part);
  }

  // ---- whole-cache operations -----------------------------------------------

  // StateError while the layers are out of step, else nothing.
  std::vector<Expect> step_expect() {
    if (ref().in_step()) return {};
    return {Expect{Err::State, -1, {}}};
  }

  // A whole-cache call: refused as `xs` predicts (changing nothing), or
  // applied to the reference. In budget_whole_ inputs it may run under a
  // budget of what is reserved plus up to 3 KiB: then a CapacityError is
  // accepted too, and must change nothing, memory() included.
  template <class F, class A>
  void whole(const std::string& name, F&& f, const std::vector<Expect>& xs, A&& apply) {
    note(name);
    std::size_t cap = 0;
    if (budget_whole_) {
      const std::uint8_t k = next();
      if (k % 2 == 1) {
        cap = cache().memory().bytes_reserved + static_cast<std::size_t>(k / 2) * 24;
        note("set_memory_budget(" + std::to_string(cap) + ")");
        set_budget(cap);
        count(kWholeBudget);
      }
    }
    const std::vector<Bytes> before = fingerprint(cache());
    const std::string memory = memory_str(cache().memory());
    std::string by_budget;
    auto call = [&] {
      try {
        f();
      } catch (const rwd::CapacityError& e) {
        if (cap == 0) throw;
        by_budget = e.what();
      }
    };
    std::string e = expect_any_outcome(call, xs);
    if (cap != 0) {
      note("set_memory_budget(0)");
      set_budget(0);
    }
    if (!by_budget.empty()) {
      // Checks come before allocations: a predicted refusal is never pre-empted by the budget.
      if (!xs.empty()) fail(name + ": refused by the budget instead of the predicted error: " + by_budget);
      note("  -> refused by the budget");
      count(kWholeBudgetRefused);
      same(before, "budget-refused " + name);
      same_memory(memory, "budget-refused " + name);
      check(verify(cache(), ref()));
      return;
    }
    if (!e.empty()) fail(name + ": " + e);
    if (!xs.empty()) {
      same(before, "refused " + name);
      same_memory(memory, "refused " + name);
    } else {
      apply();
      bump_all();
    }
    check(verify(cache(), ref()));
  }

  void op_crop() {
    const i64 L = ref().seq_length();
    const std::uint8_t k = next();
    const i64 n = k < 24 ? in_.pick(kHugeCrops) : -(L + 2) + static_cast<i64>(k) % (L + 6);
    const i64 nr = ref_crop_n(n, L);
    whole(
        "crop(" + num(n) + ")", [&] { cache().crop(n); }, ref().crop_expect(nr), [&] { ref().crop(nr); });
  }

  void op_batch() {
    const i64 B = ref().batch();
    std::vector<i64> idx;
    std::vector<Expect> xs;
    if (in_.one_in(3)) {  // reorder: a rotation, sometimes of the wrong size or out of range
      for (i64 i = 0; i < B; ++i) idx.push_back(i);
      std::rotate(idx.begin(), idx.begin() + next() % B, idx.end());
      const int bad = next() % 6;
      if (bad == 0) idx.push_back(0);
      if (bad == 1) idx.back() = B;
      if (Expect x = ref().reorder_expect(idx); !x.ok()) xs.push_back(x);
      whole(
          "reorder_cache(" + shape_str(idx) + ")", [&] { cache().reorder_cache(idx); }, xs,
          [&] { ref().batch_apply(idx); });
      return;
    }
    idx.resize(static_cast<std::size_t>(in_.range(1, 3)));
    for (i64& i : idx) i = in_.range(-1, B);
    if (Expect x = ref().select_expect(idx); !x.ok()) xs.push_back(x);
    whole(
        "batch_select_indices(" + shape_str(idx) + ")", [&] { cache().batch_select_indices(idx); }, xs,
        [&] { ref().batch_apply(idx); });
  }

  // The whole-cache operations both probes below expect to be refused:
  // operation `which` in [0, kWholeOps) and its name.
  static constexpr int kWholeOps = 8;
  static const char* whole_op_name(int which) {
    static const char* names[kWholeOps] = {"crop(-1)",
                                           "check_crop(0)",
                                           "max_rollback()",
                                           "activate_past_recording(2)",
                                           "deactivate_past_recording()",
                                           "batch_select_indices({0})",
                                           "batch_repeat_interleave(1)",
                                           "reorder_cache(identity)"};
    return names[which];
  }
  void whole_op(int which) {
    switch (which) {
      case 0: cache().crop(-1); break;
      case 1: cache().check_crop(0); break;
      case 2: (void)cache().max_rollback(); break;
      case 3: cache().activate_past_recording(2); break;
      case 4: cache().deactivate_past_recording(); break;
      case 5: {
        const std::vector<i64> idx{0};
        cache().batch_select_indices(idx);
        break;
      }
      case 6: cache().batch_repeat_interleave(1); break;
      default: {
        std::vector<i64> idx(static_cast<std::size_t>(ref().batch()));
        std::iota(idx.begin(), idx.end(), i64{0});
        cache().reorder_cache(idx);
        break;
      }
    }
  }

  // Whole-cache operations on out-of-step layers: StateError, nothing changed.
  void probe_out_of_step() {
    for (int k = 0; k < 2; ++k) {
      const int which = static_cast<int>(next() % (kWholeOps + 1));
      const std::string name = which < kWholeOps ? whole_op_name(which) : "begin_forward(1)";
      refused(name + " on out-of-step layers",
              [&] {
                if (which < kWholeOps) {
                  whole_op(which);
                } else {
                  Forward f = cache().begin_forward(1);
                }
              },
              {Err::State});
    }
  }

  // Whole-cache operations inside an open forward: StateError, nothing changed.
  void probe_open_forward(i64 q) {
    const int which = static_cast<int>(next() % (kWholeOps + 5));
    count(kOpenProbe);
    const char* extra[] = {"reset()", "shrink_to_fit()", "begin_forward(q)", "set_memory_budget(0)",
                           "layer(j).check_crop(-1)"};
    const int j = static_cast<int>(next() % static_cast<unsigned>(num_layers()));
    const bool stateless = cache().layer(j).is_stateless();
    const std::string name = which < kWholeOps ? whole_op_name(which) : extra[which - kWholeOps];
    refused(name + " inside an open forward",
            [&] {
              switch (which - kWholeOps) {
                case 0: cache().reset(); break;
                case 1: cache().shrink_to_fit(); break;
                case 2: {
                  Forward f = cache().begin_forward(q);
                  break;
                }
                case 3: cache().set_memory_budget(0); break;
                case 4:
                  cache().layer(j).check_crop(-1);
                  if (stateless) throw rwd::StateError("(stateless layer: nothing to refuse)");
                  break;
                default: whole_op(which); break;  // which < kWholeOps
              }
            },
            {Err::State});
  }

  // ---- forwards ----------------------------------------------------------------

  std::vector<Part> parts_of(const RefLayer& r) const {
    std::vector<Part> parts;
    if (r.has_attention()) parts.push_back({PartKind::KV, 0});
    for (std::size_t s = 0; s < r.side_dims.size(); ++s) parts.push_back({PartKind::Side, static_cast<int>(s)});
    for (std::size_t s = 0; s < r.conv_ch.size(); ++s) parts.push_back({PartKind::Conv, static_cast<int>(s)});
    for (std::size_t s = 0; s < r.rec_shapes.size(); ++s) parts.push_back({PartKind::Rec, static_cast<int>(s)});
    return parts;
  }

  void set_budget(std::size_t bytes) {
    if (std::string e = expect_kinds([&] { cache().set_memory_budget(bytes); }, {Err::None}); !e.empty())
      fail("set_memory_budget(" + std::to_string(bytes) + ") with " + std::to_string(cache().memory().bytes_reserved) +
           " bytes reserved: " + e);
    if (cache().memory_budget() != bytes) fail("memory_budget() does not report the budget just set");
  }
  void lift_budget(Run& run) {
    if (!run.budget) return;
    note("set_memory_budget(0)");
    set_budget(0);
    run.budget = false;
  }

  // Runs f (one call that mutates layer i). true: it went through; false:
  // the budget refused it (only possible in a budgeted forward without
  // begin_forward), and it changed nothing.
  template <class F>
  bool attempt(int i, const std::string& what, const Run& run, F&& f) {
    Bytes before;
    std::string memory;
    if (run.budget) {
      before = fingerprint(cache().layer(i));
      memory = memory_str(cache().memory());
    }
    try {
      f();
    } catch (const rwd::CapacityError& e) {
      if (!run.budget || run.forward)
        fail("layer " + num(i) + " " + what + ": unexpected CapacityError" +
             (run.forward ? " inside an open forward (begin_forward reserved the room)" : "") + ": " + e.what());
      if (!names_layer(e.what(), i))
        fail(what + ": the budget refusal does not name layer " + num(i) + ": " + e.what());
      if (before != fingerprint(cache().layer(i)))
        fail("layer " + num(i) + " " + what + " refused by the budget, but changed the layer");
      same_memory(memory, "layer " + num(i) + " " + what + " refused by the budget");
      return false;
    } catch (const rwd::Error& e) {
      fail("layer " + num(i) + " " + what + ": unexpected " + err_name(classify(e)) + ": " + e.what());
    } catch (const std::exception& e) {
      fail("layer " + num(i) + " " + what + ": non-rewind exception: " + e.what());
    }
    bump(i);
    if (run.budget && cache().memory().bytes_reserved > run.cap)
      fail("after layer " + num(i) + " " + what + " the cache reserves " +
           std::to_string(cache().memory().bytes_reserved) + " bytes, over its budget of " + std::to_string(run.cap));
    return true;
  }

  void abandon(Run& run, const std::string& where) {
    std::optional<Forward>& f = *run.handle;
    const int how = next() % 3;
    count(kAbandon);
    note(std::string(how == 0   ? "abandon()"
                     : how == 1 ? "destroy the Forward handle"
                                : "move the handle, destroy it") +
         " " + where);
    if (how == 0) {
      f->abandon();
      if (f->is_open()) fail("Forward::abandon() left the handle open");
      check(expect_kinds([&] { f->commit(); }, {Err::State}));
      f.reset();
    } else if (how == 1) {
      f.reset();
    } else {
      {
        Forward g = std::move(*f);
        if (f->is_open() || !g.is_open()) fail("a moved Forward handle did not move the forward");
        if (std::string e = expect_kinds([&] { f->commit(); }, {Err::State}); !e.empty())
          fail("commit() on a moved-from Forward: " + e);
      }
      f.reset();
    }
    bump_all();
    if (cache().forward_open()) fail("the forward is still open after it was abandoned");
    if (std::string e = print_diff(*run.before, fingerprint(cache())); !e.empty())
      fail("an abandoned forward did not restore the cache: " + e + " differs from its state at begin_forward");
    check(verify(cache(), ref()));
    lift_budget(run);
  }

  // The budget refused a part of layer i (no begin_forward): check what the
  // contract says about the half-done forward, then recover.
  enum class Recovery { Retry, Stop };
  Recovery refused_by_budget(Run& run, int i, bool partial) {
    note("refused by the budget at layer " + num(i) + (partial ? " (layer half updated)" : ""));
    count(kBudgetRefusal);
    if (partial) count(kBudgetRefusalHalfLayer);
    for (int j = 0; j < num_layers(); ++j) {
      if (j == i && partial) continue;
      if (std::string e = verify(cache().layer(j), ref().layers[static_cast<std::size_t>(j)]); !e.empty())
        fail("after a budget refusal at layer " + num(i) + ", layer " + num(j) + ": " + e);
    }
    const bool out_of_step = partial || !ref().in_step();
    if (out_of_step)
      probe_out_of_step();
    else
      check(verify(cache(), ref()));
    const int r = next() % 3;
    if (r == 1) {
      count(kRecoverFinish);
      lift_budget(run);
      note("finish the forward");
      return Recovery::Retry;
    }
    if (r == 0 || partial) {
      count(kRecoverReset);
      note("reset()");
      const std::vector<Bytes> before = fingerprint(cache());
      const std::string memory = memory_str(cache().memory());
      try {
        cache().reset();
      } catch (const rwd::CapacityError&) {
        // Only the new layers count against the budget: a refusal is right
        // only when a new cache alone passes the cap (batch operations may
        // have left fewer rows than the options' batch_size a reset returns to).
        same(before, "refused reset");
        same_memory(memory, "refused reset");
        const std::size_t cap = cache().memory_budget();
        lift_budget(run);
        note("reset()");
        cache().reset();
        if (cache().memory().bytes_reserved <= cap)
          fail("reset() was refused under a budget of " + std::to_string(cap) +
               " bytes, but the reset cache reserves " + std::to_string(cache().memory().bytes_reserved));
      } catch (const rwd::Error& e) {
        fail(std::string("reset() after a half-done forward: ") + err_name(classify(e)) + ": " + e.what());
      }
      ref().reset();
      bump_all();
    } else {
      count(kRecoverOutOfStep);
      note("carry on with the layers out of step");
    }
    lift_budget(run);
    check(verify(cache(), ref()));
    return Recovery::Stop;
  }

  // An update of more tokens than the open forward has left for a part: StateError, nothing changed.
  void probe_overshoot(int i, const RefLayer& rl, const Part& p, i64 left, i64 q) {
    const i64 extra = left + in_.range(1, 2);
    count(kOvershoot);
    const std::string what = "layer " + num(i) + " part update of " + num(extra) + " tokens with " + num(left) +
                             " left";
    refused(what,
            [&] {
              switch (p.kind) {
                case PartKind::KV: {
                  const Input k = fresh({rl.B, rl.H, extra, rl.Dk}, 2, dt_, 0, 0, 0, kPartKeys);
                  const Input v = fresh({rl.B, rl.H, extra, rl.Dv}, 2, dt_, 0, 0, 0, kPartValues);
                  (void)cache().update(k.view, v.view, i);
                  break;
                }
                case PartKind::Side: {
                  const Input r = fresh({rl.B, extra, rl.side_dims[static_cast<std::size_t>(p.s)]}, 1, dt_, 0, 0, 0,
                                        kPartSide);
                  (void)cache().update_side(r.view, i, p.s);
                  break;
                }
                case PartKind::Conv: {
                  const Input x = fresh({rl.B, rl.conv_ch[static_cast<std::size_t>(p.s)], extra}, 2, dt_, 0, 0, 0,
                                        kPartConv);
                  (void)cache().update_conv_state(x.view, i, p.s);
                  break;
                }
                case PartKind::Rec: {
                  const i64 wrong = q > 1 && in_.one_in(2) ? in_.range(1, q - 1) : extra;
                  rwd::RecurrentUpdate u = cache().begin_recurrent_update(wrong, i, p.s);
                  break;
                }
              }
            },
            {Err::State});
  }

  // One call for `part` of layer i: qc tokens at length Lc, `done` of the
  // layer's q already in this part.
  Chunk run_chunk(Run& run, int i, const RefLayer& rl, const Part& p, i64 Lc, i64 done, i64 qc, bool copy_rec,
                  StepData& st, std::vector<Returned>& rets) {
    switch (p.kind) {
      case PartKind::KV: return chunk_kv(run, i, rl, Lc, done, qc, st, rets);
      case PartKind::Side: return chunk_side(run, i, rl, p, Lc, done, qc, st, rets);
      case PartKind::Conv: return chunk_conv(run, i, rl, p, Lc, done, qc, st, rets);
      case PartKind::Rec: break;
    }
    if (copy_rec) return chunk_rec_copy(run, i, rl, p, done, st);
    return chunk_rec_update(run, i, rl, p, Lc, done, qc, st);
  }

  Chunk chunk_kv(Run& run, int i, const RefLayer& rl, i64 Lc, i64 done, i64 qc, StepData& st,
                 std::vector<Returned>& rets) {
    const std::size_t es = rl.esize();
    const MaskSizes want = mask_at(rl, Lc, qc);
    const MaskSizes got = cache().get_mask_sizes(qc, i);
    if (got.kv_length != want.kv_length || got.kv_offset != want.kv_offset)
      fail("layer " + num(i) + ": get_mask_sizes(" + num(qc) + ") at L=" + num(Lc) + " = (" + num(got.kv_length) +
           ", " + num(got.kv_offset) + "), expected (" + num(want.kv_length) + ", " + num(want.kv_offset) + ")");
    const std::vector<i64> ks{rl.B, rl.H, qc, rl.Dk}, vs{rl.B, rl.H, qc, rl.Dv};
    const Input k = make_input(ks, 2, kPartKeys, i);
    const Input v = make_input(vs, 2, kPartValues, i);
    const Bytes kb = gather(k.view), vb = gather(v.view);
    note("layer " + num(i) + " update(" + num(qc) + "): keys " + k.how + ", values " + v.how);
    rwd::KeyValueView kv;
    if (!attempt(i, "update", run, [&] { kv = cache().update(k.view, v.view, i); })) return Chunk::Refused;
    const std::vector<Bytes> krows = token_rows(kb, ks, 2, es), vrows = token_rows(vb, vs, 2, es);
    for (i64 t = 0; t < qc; ++t) {
      st.keys[static_cast<std::size_t>(done + t)] = krows[static_cast<std::size_t>(t)];
      st.values[static_cast<std::size_t>(done + t)] = vrows[static_cast<std::size_t>(t)];
    }
    rets.push_back({"update keys", PartKind::KV, 0, true, want.kv_offset, Lc + qc, shape_of(kv.keys), kv.keys.dtype,
                    gather(kv.keys)});
    rets.push_back({"update values", PartKind::KV, 0, false, want.kv_offset, Lc + qc, shape_of(kv.values),
                    kv.values.dtype, gather(kv.values)});
    hold(kv.keys, i, "layer " + num(i) + " update keys", true);
    hold(kv.values, i, "layer " + num(i) + " update values", true);
    return Chunk::Done;
  }

  Chunk chunk_side(Run& run, int i, const RefLayer& rl, const Part& p, i64 Lc, i64 done, i64 qc, StepData& st,
                   std::vector<Returned>& rets) {
    const std::size_t es = rl.esize();
    const auto s = static_cast<std::size_t>(p.s);
    const std::vector<i64> shape{rl.B, qc, rl.side_dims[s]};
    const Input r = make_input(shape, 1, kPartSide + s, i);
    const Bytes rb = gather(r.view);
    note("layer " + num(i) + " update_side(" + num(qc) + ", side " + num(p.s) + "): " + r.how);
    TensorView out;
    if (!attempt(i, "update_side", run, [&] { out = cache().update_side(r.view, i, p.s); })) return Chunk::Refused;
    const std::vector<Bytes> rows = token_rows(rb, shape, 1, es);
    for (i64 t = 0; t < qc; ++t) st.sides[s][static_cast<std::size_t>(done + t)] = rows[static_cast<std::size_t>(t)];
    rets.push_back({"update_side " + num(p.s), PartKind::Side, s, false, mask_at(rl, Lc, qc).kv_offset, Lc + qc,
                    shape_of(out), out.dtype, gather(out)});
    hold(out, i, "layer " + num(i) + " update_side " + num(p.s), true);
    return Chunk::Done;
  }

  Chunk chunk_conv(Run& run, int i, const RefLayer& rl, const Part& p, i64 Lc, i64 done, i64 qc, StepData& st,
                   std::vector<Returned>& rets) {
    const std::size_t es = rl.esize();
    const auto s = static_cast<std::size_t>(p.s);
    const std::vector<i64> shape{rl.B, rl.conv_ch[s], qc};
    const Input x = make_input(shape, 2, kPartConv + s, i);
    const Bytes xb = gather(x.view);
    note("layer " + num(i) + " update_conv_state(" + num(qc) + ", state " + num(p.s) + "): " + x.how);
    TensorView out;
    if (!attempt(i, "update_conv_state", run, [&] { out = cache().update_conv_state(x.view, i, p.s); }))
      return Chunk::Refused;
    const std::vector<Bytes> rows = token_rows(xb, shape, 2, es);
    for (i64 t = 0; t < qc; ++t) st.conv[s][static_cast<std::size_t>(done + t)] = rows[static_cast<std::size_t>(t)];
    rets.push_back({"update_conv_state " + num(p.s), PartKind::Conv, s, false, Lc - rl.K + 1, Lc + qc, shape_of(out),
                    out.dtype, gather(out)});
    hold(out, i, "layer " + num(i) + " conv window " + num(p.s), true);
    return Chunk::Done;
  }

  // update_recurrent_state: one token's state copied in.
  Chunk chunk_rec_copy(Run& run, int i, const RefLayer& rl, const Part& p, i64 done, StepData& st) {
    const auto s = static_cast<std::size_t>(p.s);
    const Input x = make_input(rl.rec_state_shape(s), -1, kPartRec + s, i);
    const Bytes xb = gather(x.view);
    note("layer " + num(i) + " update_recurrent_state(state " + num(p.s) + "): " + x.how);
    if (!attempt(i, "update_recurrent_state", run, [&] { cache().update_recurrent_state(x.view, i, p.s); }))
      return Chunk::Refused;
    st.rec[s][static_cast<std::size_t>(done)] = xb;
    return Chunk::Done;
  }

  // begin_recurrent_update for qc tokens, sometimes dropped once uncommitted
  // first; previous() must read S(L) before and after the slots are written.
  Chunk chunk_rec_update(Run& run, int i, const RefLayer& rl, const Part& p, i64 Lc, i64 done, i64 qc, StepData& st) {
    const auto s = static_cast<std::size_t>(p.s);
    const std::vector<i64> shape = rl.rec_state_shape(s);
    const Bytes& prev_want = done == 0 ? rl.expect_rec(s, Lc) : st.rec[s][static_cast<std::size_t>(done - 1)];
    note("layer " + num(i) + " begin_recurrent_update(" + num(qc) + ", state " + num(p.s) + ")");
    std::optional<rwd::RecurrentUpdate> u;
    const bool drop_first = in_.one_in(8);
    const Bytes before = drop_first ? fingerprint(cache().layer(i)) : Bytes{};
    if (!attempt(i, "begin_recurrent_update", run, [&] { u.emplace(cache().begin_recurrent_update(qc, i, p.s)); }))
      return Chunk::Refused;
    if (drop_first) {  // a dropped update leaves S(L) and every snapshot as they were
      count(kDroppedUpdate);
      if (next() & 1) scatter(make_row(++salt_, kPartRec, 0, rl.B, rl.rec_numel[s], rl.rdtype()), u->next(1));
      u.reset();
      if (before != fingerprint(cache().layer(i)))
        fail("layer " + num(i) + ": a RecurrentUpdate dropped without commit changed the layer");
      note("dropped it, begin_recurrent_update again");
      if (!attempt(i, "begin_recurrent_update", run, [&] { u.emplace(cache().begin_recurrent_update(qc, i, p.s)); }))
        return Chunk::Refused;
    }
    if (u->num_tokens() != qc) fail("RecurrentUpdate::num_tokens() != q");
    if (std::string e = check_view("layer " + num(i) + " recurrent previous() " + num(p.s), u->previous(), rl.rdtype(),
                                   shape, prev_want);
        !e.empty())
      fail(e);
    write_rec_slots(*u, rl, s, Lc, done, qc, st);
    if (std::string e = check_view("layer " + num(i) + " recurrent previous() after writing next(t)", u->previous(),
                                   rl.rdtype(), shape, prev_want);
        !e.empty())
      fail(e);
    if (run.forward && in_.one_in(24)) {  // abandon with the update in flight: the handle goes stale
      count(kAbandonInFlight);
      abandon(run, "with a recurrent update of layer " + num(i) + " in flight");
      if (std::string e = expect_kinds([&] { u->commit(); }, {Err::State}); !e.empty())
        fail("RecurrentUpdate::commit after its forward was abandoned: " + e);
      return Chunk::Abandoned;
    }
    u->commit();
    bump(i);
    if (std::string e = expect_kinds([&] { u->commit(); }, {Err::State}); !e.empty())
      fail("RecurrentUpdate::commit called twice: " + e);
    return Chunk::Done;
  }

  // Slots next(1..qc) of recurrent state s, each written from S(L), the slot
  // before, a view of the cache's storage or fresh bytes; recorded in st.
  void write_rec_slots(rwd::RecurrentUpdate& u, const RefLayer& rl, std::size_t s, i64 Lc, i64 done, i64 qc,
                       StepData& st) {
    const std::vector<i64> shape = rl.rec_state_shape(s);
    for (i64 t = 1; t <= qc; ++t) {
      const TensorView slot = u.next(t);
      if (shape_of(slot) != shape || slot.dtype != rl.rdtype()) fail("RecurrentUpdate::next has the wrong shape");
      const int how = next() % 4;
      bool written = false;
      if (how == 1) {  // the kernel starts from S(L)
        rwd::copy_tensor(u.previous(), slot);
        written = true;
      } else if (how == 2 && t > 1) {  // from the slot of the token before, when it is another slot
        const TensorView before_slot = u.next(t - 1);
        if (before_slot.data != slot.data) {
          rwd::copy_tensor(before_slot, slot);
          written = true;
        }
      } else if (how == 3) {  // from any view of the cache's storage (never the fresh slots)
        std::vector<Source> src = sources(static_cast<int>(shape.size()));
        if (!src.empty()) {
          const Source& from = src[next() % src.size()];
          if (std::optional<TensorView> v = fit(from.view, shape, -1)) {
            rwd::copy_tensor(*v, slot);
            written = true;
            count(kRecFromCache);
          }
        }
      }
      if (!written) scatter(make_row(++salt_, kPartRec + s, Lc + t, rl.B, rl.rec_numel[s], rl.rdtype()), slot);
      st.rec[s][static_cast<std::size_t>(done + t - 1)] = gather(slot);
    }
  }

  std::string check_returned(const Returned& r, const RefLayer& ref_layer) {
    Bytes want;
    std::vector<i64> shape;
    const i64 n = r.to - r.from;
    switch (r.kind) {
      case PartKind::KV:
        want = ref_layer.expect_kv(r.is_keys, r.from, r.to);
        shape = {ref_layer.B, ref_layer.H, n, r.is_keys ? ref_layer.Dk : ref_layer.Dv};
        break;
      case PartKind::Side:
        want = ref_layer.expect_side(r.s, r.from, r.to);
        shape = {ref_layer.B, n, ref_layer.side_dims[r.s]};
        break;
      case PartKind::Conv:
        want = ref_layer.expect_conv(r.s, r.from, r.to);
        shape = {ref_layer.B, ref_layer.conv_ch[r.s], n};
        break;
      case PartKind::Rec: return "";
    }
    if (r.dtype != ref_layer.dtype()) return r.what + ": wrong dtype";
    if (r.shape != shape) return r.what + ": shape " + shape_str(r.shape) + ", expected " + shape_str(shape);
    if (r.bytes != want)
      return r.what + " (positions " + num(r.from) + ".." + num(r.to - 1) + ") differs from the reference";
    return "";
  }

  // Every part of layer i for run.q tokens. false: the forward stopped
  // (abandoned, or refused by the budget and not resumed).
  bool run_layer(Run& run, int i, RefLayer& rl) {
    const i64 q = run.q;
    const i64 L0 = rl.L;
    StepData st;
    st.q = q;
    if (rl.has_attention()) {
      st.keys.resize(static_cast<std::size_t>(q));
      st.values.resize(static_cast<std::size_t>(q));
    }
    st.sides.assign(rl.side_dims.size(), std::vector<Bytes>(static_cast<std::size_t>(q)));
    st.conv.assign(rl.conv_ch.size(), std::vector<Bytes>(static_cast<std::size_t>(q)));
    st.rec.assign(rl.rec_shapes.size(), std::vector<Bytes>(static_cast<std::size_t>(q)));
    std::vector<Returned> rets;
    bool partial = false;
    for (const Part& p : parts_of(rl)) {
      if (run.forward && in_.one_in(40)) {
        abandon(run, "halfway through layer " + num(i));
        return false;
      }
      const bool copy_rec = p.kind == PartKind::Rec && (next() & 1) != 0 && (!run.forward || q == 1);
      i64 done = 0;
      while (done < q) {
        const i64 left = q - done;
        i64 qc = left;
        if (copy_rec)
          qc = 1;
        else if ((p.kind != PartKind::Rec || !run.forward) && left > 1 && in_.one_in(4))
          qc = in_.range(1, left);
        if (qc < q && !copy_rec) count(kChunked);
        if (run.forward && in_.one_in(16)) probe_overshoot(i, rl, p, left, q);
        const Chunk c = run_chunk(run, i, rl, p, L0 + done, done, qc, copy_rec, st, rets);
        if (c == Chunk::Abandoned) return false;
        if (c == Chunk::Refused) {
          if (refused_by_budget(run, i, partial) == Recovery::Stop) return false;
          continue;  // budget lifted: the same chunk again
        }
        done += qc;
        partial = true;
      }
    }
    rl.apply_update(st);
    for (const Returned& r : rets)
      if (std::string e = check_returned(r, rl); !e.empty()) fail("layer " + num(i) + ": " + e);
    if (cache().get_seq_length(i) != L0 + q)
      fail("layer " + num(i) + ": get_seq_length = " + num(cache().get_seq_length(i)) + " after its update, expected " +
           num(L0 + q));
    return true;
  }

  // A static layer that cannot take run.q more tokens refuses the forward
  // (begin_forward, or its update), changing nothing.
  bool refused_by_a_full_static_layer(const Run& run) {
    const i64 q = run.q;
    for (int i = 0; i < num_layers(); ++i) {
      const RefLayer& rl = ref().layers[static_cast<std::size_t>(i)];
      if (rl.stateless()) continue;
      const Expect x = rl.update_expect(q);
      if (x.ok()) continue;
      if (run.forward) {
        refused("begin_forward(" + num(q) + ")", [&] { Forward f = cache().begin_forward(q); },
                {ref().in_step() ? Err::Capacity : Err::State});
      } else {
        const StepData st = rl.make_step(q, ++salt_);
        const HostTensor k = rl.kv_input(st, true, false), v = rl.kv_input(st, false, false);
        const std::vector<Bytes> before = fingerprint(cache());
        const std::string memory = memory_str(cache().memory());
        check(expect_outcome([&] { (void)cache().update(k.view(), v.view(), i); }, x));
        same(before, "refused update");
        same_memory(memory, "refused update");
      }
      return true;
    }
    return false;
  }

  // A cap a little above what is reserved for the forward, after (sometimes)
  // one below it that must be refused with the old cap kept.
  void set_forward_budget(Run& run) {
    const std::size_t reserved = cache().memory().bytes_reserved;
    if (reserved > 1 && in_.one_in(3)) {
      const std::size_t old = cache().memory_budget();
      const std::size_t below = std::max<std::size_t>(1,
                                                      reserved - 1 - next() % std::min<std::size_t>(reserved - 1, 64));
      note("set_memory_budget(" + std::to_string(below) + ") below the reservation");
      check(expect_kinds([&] { cache().set_memory_budget(below); }, {Err::Capacity}));
      if (cache().memory_budget() != old) fail("a refused set_memory_budget changed the budget");
    }
    run.cap = reserved + static_cast<std::size_t>(next()) * 24;
    note("set_memory_budget(" + std::to_string(run.cap) + "), " + std::to_string(reserved) + " reserved");
    set_budget(run.cap);
    run.budget = true;
  }

  // begin_forward(run.q) into handle, run pointing at it. false: refused
  // (out of step, or by the budget), nothing changed, the budget lifted.
  bool open_forward(Run& run, std::optional<Forward>& handle, std::vector<Bytes>& before_forward) {
    const i64 q = run.q;
    before_forward = fingerprint(cache());
    const std::string memory = memory_str(cache().memory());
    note("begin_forward(" + num(q) + ")");
    const i64 L = cache().get_seq_length();
    try {
      handle.emplace(cache().begin_forward(q));
    } catch (const rwd::Error& e) {
      const Err k = classify(e);
      if (!(k == Err::State && !ref().in_step()) && !(k == Err::Capacity && run.budget))
        fail("begin_forward(" + num(q) + "): unexpected " + err_name(k) + ": " + e.what());
      same(before_forward, "refused begin_forward");
      same_memory(memory, "refused begin_forward");
      if (k == Err::Capacity) count(kBeginRefused);
      lift_budget(run);
      check(verify(cache(), ref()));
      return false;
    } catch (const std::exception& e) {
      fail(std::string("begin_forward: non-rewind exception: ") + e.what());
    }
    if (!ref().in_step()) fail("begin_forward opened a forward on out-of-step layers");
    bump_all();
    if (!handle->is_open() || !cache().forward_open() || handle->num_tokens() != q || handle->start_length() != L)
      fail("begin_forward returned a handle that is not open, or with the wrong q / start length");
    run.handle = &handle;
    run.before = &before_forward;
    return true;
  }

  void op_forward() {
    const i64 q = in_.range(1, 8);
    const int mode = next() % 8;
    Run run;
    run.q = q;
    run.forward = mode == 2 || mode == 3 || mode >= 6;
    const bool budget = mode >= 4;
    count(run.forward ? (budget ? kForwardOpenBudget : kForwardOpen) : (budget ? kForwardBudget : kForwardPlain));
    note("forward(q=" + num(q) + (run.forward ? ", begin_forward" : "") + (budget ? ", memory budget" : "") + ")");

    if (refused_by_a_full_static_layer(run)) return;
    if (budget) set_forward_budget(run);

    std::optional<Forward> handle;
    std::vector<Bytes> before_forward;
    RefCache pending;
    if (run.forward) {
      if (!open_forward(run, handle, before_forward)) return;
      pending = ref();
    }
    RefCache& target = run.forward ? pending : ref();
    for (int i = 0; i < num_layers(); ++i) {
      RefLayer& rl = target.layers[static_cast<std::size_t>(i)];
      if (rl.stateless()) continue;
      if (run.forward) {
        const int probe = next() % 16;
        if (probe == 13) probe_open_forward(q);
        if (probe == 14) {
          note("early commit()");
          count(kEarlyCommit);
          check(expect_kinds([&] { handle->commit(); }, {Err::State}));
          if (!handle->is_open() || !cache().forward_open()) fail("a refused commit() closed the forward");
        }
        if (probe == 15) {
          abandon(run, "before layer " + num(i));
          return;
        }
        if (cache().get_seq_length(i) != rl.L) fail("layer " + num(i) + ": get_seq_length changed before its update");
      }
      if (!run_layer(run, i, rl)) return;
      check_held();
    }
    if (run.forward) {
      if (in_.one_in(6)) {
        abandon(run, "after every layer");
        return;
      }
      note("commit()");
      if (std::string e = expect_kinds([&] { handle->commit(); }, {Err::None}); !e.empty()) fail("commit(): " + e);
      if (handle->is_open() || cache().forward_open()) fail("commit() left the forward open");
      bump_all();
      ref() = std::move(pending);
      count(kCommit);
      check(expect_kinds([&] { handle->commit(); }, {Err::State}));
    }
    lift_budget(run);
    check(verify(cache(), ref()));
  }

  // ---- per-layer queries -------------------------------------------------------

  void op_query() {
    const int i = static_cast<int>(in_.range(-1, num_layers()));
    note("queries of layer(" + num(i) + ")");
    count(kQuery);
    if (i < 0 || i >= num_layers()) {
      refused("layer(" + num(i) + ") and per-layer calls out of range",
              [&] {
                const int which = next() % 4;
                if (which == 0) (void)cache().layer(i);
                if (which == 1) (void)cache().get_seq_length(i);
                if (which == 2) (void)cache().get_mask_sizes(1, i);
                rwd::RecurrentUpdate u = cache().begin_recurrent_update(1, i);
              },
              {Err::Index});
      return;
    }
    const Layer& l = cache().layer(i);
    const RefLayer& rl = ref().layers[static_cast<std::size_t>(i)];
    const std::string at = "layer " + num(i) + ": ";
    if (l.get_seq_length() != rl.L || cache().get_seq_length(i) != rl.L)
      fail(at + "get_seq_length() = " + num(l.get_seq_length()) + ", expected " + num(rl.L));
    if (l.max_rollback() != rl.max_rollback())
      fail(at + "max_rollback() = " + num(l.max_rollback()) + ", expected " + num(rl.max_rollback()));
    for (int k = 0; k < 2; ++k) {  // check_crop(n) throws what the reference predicts for this layer alone
      const std::uint8_t b = next();
      const i64 n = b < 40 ? in_.pick(kHugeCrops) : -(rl.L + 2) + static_cast<i64>(b) % (rl.L + 6);
      note("layer(" + num(i) + ").check_crop(" + num(n) + ")");
      const Expect x = rl.crop_expect(ref_crop_n(n, rl.L));
      if (std::string e = expect_outcome([&] { l.check_crop(n); }, x); !e.empty())
        fail(at + "check_crop(" + num(n) + "): " + e);
      if (!x.ok()) count(kCheckCropRefused);
    }
    const rwd::MemoryReport report = cache().memory();
    const rwd::LayerMemory m = l.memory();
    const rwd::LayerMemory& mr = report.layers[static_cast<std::size_t>(i)];
    if (m.kind != std::string(rwd::layer_kind_name(l.kind())) || m.kind != mr.kind ||
        m.bytes_reserved != mr.bytes_reserved || m.bytes_used != mr.bytes_used || m.bytes_used > m.bytes_reserved)
      fail(at + "memory() disagrees with Cache::memory() or uses more than it reserves");
    if (rl.stateless()) {
      check(expect_kinds([&] { (void)l.stored_range(); }, {Err::State}));
      return;
    }
    if (rl.has_attention()) {
      const rwd::PositionRange r = l.stored_range();
      if (r.first != rl.first || r.end != rl.L)
        fail(at + "stored_range() = [" + num(r.first) + ", " + num(r.end) + "), expected [" + num(rl.first) + ", " +
             num(rl.L) + ")");
      const i64 q = in_.range(1, 9);
      const MaskSizes ms = cache().get_mask_sizes(q, i), want = mask_at(rl, rl.L, q);
      if (ms.kv_length != want.kv_length || ms.kv_offset != want.kv_offset)
        fail(at + "get_mask_sizes(" + num(q) + ") differs from the reference");
    } else {
      check(expect_kinds([&] { (void)l.stored_range(); }, {Err::State}));
      check(expect_kinds([&] { (void)cache().get_mask_sizes(1, i); }, {Err::State}));
    }
    if (rl.linear()) {
      if (cache().has_previous_state(i) != (rl.L > 0)) fail(at + "has_previous_state() is wrong");
    } else {
      check(expect_kinds([&] { (void)cache().has_previous_state(i); }, {Err::State}));
    }
    for (std::size_t s = 0; s < rl.conv_ch.size(); ++s)
      check(check_view(at + "Cache::get_conv_state(" + num(static_cast<i64>(s)) + ")",
                       cache().get_conv_state(i, static_cast<int>(s)), rl.dtype(), {rl.B, rl.conv_ch[s], rl.K},
                       rl.expect_conv(s, rl.L - rl.K, rl.L)));
    for (std::size_t s = 0; s < rl.rec_shapes.size(); ++s)
      check(check_view(at + "Cache::get_recurrent_state(" + num(static_cast<i64>(s)) + ")",
                       cache().get_recurrent_state(i, static_cast<int>(s)), rl.rdtype(), rl.rec_state_shape(s),
                       rl.expect_rec(s, rl.L)));
    if (!rl.conv_ch.empty())
      check(expect_kinds([&] { (void)cache().get_conv_state(i, static_cast<int>(rl.conv_ch.size())); }, {Err::Index}));
    if (!rl.rec_shapes.empty()) check(expect_kinds([&] { (void)l.recurrent_snapshot(0, rl.L + 1); }, {Err::Index}));
    hold_one_view(i, l, rl);
  }

  // Keeps one view of layer i for later: it must read the same bytes until
  // layer i is mutated.
  void hold_one_view(int i, const Layer& l, const RefLayer& rl) {
    std::vector<Source> mine;
    if (rl.has_attention()) {
      mine.push_back({l.keys_values().keys, "keys_values().keys"});
      mine.push_back({l.keys_values().values, "keys_values().values"});
      for (int s = 0; s < num_sides(l); ++s) mine.push_back({l.side(s), "side(" + num(s) + ")"});
    }
    for (int s = 0; s < num_conv(l); ++s) {
      mine.push_back({l.conv_inputs(s), "conv_inputs(" + num(s) + ")"});
      mine.push_back({l.get_conv_state(s), "get_conv_state(" + num(s) + ")"});
    }
    for (int s = 0; s < num_rec(l); ++s) {
      mine.push_back({l.get_recurrent_state(s), "get_recurrent_state(" + num(s) + ")"});
      if (rl.L >= 1 && rl.rec_first <= rl.L - 1 && rl.L - 1 >= 1)
        mine.push_back({l.recurrent_snapshot(s, rl.L - 1), "recurrent_snapshot(" + num(s) + ", L-1)"});
    }
    if (!mine.empty()) {
      const Source& h = mine[next() % mine.size()];
      hold(h.view, i, "layer " + num(i) + " " + h.what);
    }
  }

  // ---- hostile sizes on the fuzzed cache --------------------------------------

  int pick_layer(bool (*want)(const RefLayer&)) {
    std::vector<int> fits;
    for (int i = 0; i < num_layers(); ++i)
      if (want(ref().layers[static_cast<std::size_t>(i)])) fits.push_back(i);
    return fits.empty() ? -1 : fits[next() % fits.size()];
  }

  // A [shape] view of `tokens` tokens along token_dim, broadcast from one
  // token (stride 0) of `owner`'s bytes.
  TensorView huge_view(HostTensor& owner, std::vector<i64> shape, int token_dim, i64 tokens) {
    shape[static_cast<std::size_t>(token_dim)] = 1;
    owner = HostTensor(dt_, shape);
    const std::size_t es = rwd::dtype_size(dt_);
    for (std::size_t e = 0; e * es < owner.bytes.size(); ++e)
      write_pattern(owner.bytes.data() + e * es, dt_, key_of(++salt_, 99, 0, 0, static_cast<i64>(e)));
    TensorView v = owner.view();
    v.shape[static_cast<std::size_t>(token_dim)] = tokens;
    v.strides[static_cast<std::size_t>(token_dim)] = 0;
    return v;
  }

  void op_huge() {
    const int which = next() % 11;
    count(kHuge);
    const i64 huge = in_.pick(kHugeTokens);
    const bool near = in_.one_in(6);
    HostTensor a, b2;  // the huge views' bytes, alive until the cache is verified
    if (which >= 4 && which <= 7)
      huge_cache_call(which, huge);
    else if (which == 9)
      huge_views();
    else
      huge_layer_update(which, huge, near, a, b2);
    check(verify(cache(), ref()));
  }

  // A layer's update (or recurrent state) of Q tokens, broadcast from one
  // token of a or b2: refused.
  void huge_layer_update(int which, i64 huge, bool near, HostTensor& a, HostTensor& b2) {
    // Q tokens for layer i: a huge count, or just past 2^40 tokens for that layer.
    auto tokens = [&](int i) { return near ? kTokenLimit + 1 - ref().layers[static_cast<std::size_t>(i)].L : huge; };
    i64 Q = huge;
    switch (which) {
      case 0: {  // update with a broadcast of Q tokens as keys, values or both
        const int i = pick_layer([](const RefLayer& r) { return r.has_attention(); });
        const RefLayer& rl = ref().layers[static_cast<std::size_t>(i)];
        Q = tokens(i);
        const int huge_side = next() % 3;
        const i64 qk = huge_side == 1 ? in_.range(1, 3) : Q, qv = huge_side == 0 ? in_.range(1, 3) : Q;
        const TensorView k = huge_view(a, {rl.B, rl.H, 1, rl.Dk}, 2, qk);
        const TensorView v = huge_view(b2, {rl.B, rl.H, 1, rl.Dv}, 2, qv);
        refused("layer " + num(i) + " update of " + num(qk) + " keys, " + num(qv) + " values (broadcast)",
                [&] { (void)cache().update(k, v, i); }, {Err::Capacity, Err::Invalid});
        break;
      }
      case 1: {
        const int i = pick_layer([](const RefLayer& r) { return !r.side_dims.empty(); });
        if (i < 0) break;
        const RefLayer& rl = ref().layers[static_cast<std::size_t>(i)];
        const int s = next() % static_cast<int>(rl.side_dims.size());
        Q = tokens(i);
        const TensorView r = huge_view(a, {rl.B, 1, rl.side_dims[static_cast<std::size_t>(s)]}, 1, Q);
        refused("layer " + num(i) + " update_side of " + num(Q) + " rows (broadcast)",
                [&] { (void)cache().update_side(r, i, s); }, {Err::Capacity, Err::Invalid});
        break;
      }
      case 2: {
        const int i = pick_layer([](const RefLayer& r) { return !r.conv_ch.empty(); });
        const RefLayer& rl = ref().layers[static_cast<std::size_t>(i)];
        const int s = next() % static_cast<int>(rl.conv_ch.size());
        Q = tokens(i);
        const TensorView x = huge_view(a, {rl.B, rl.conv_ch[static_cast<std::size_t>(s)], 1}, 2, Q);
        refused("layer " + num(i) + " update_conv_state of " + num(Q) + " inputs (broadcast)",
                [&] { (void)cache().update_conv_state(x, i, s); }, {Err::Capacity, Err::Invalid});
        break;
      }
      case 3: {
        const int i = pick_layer([](const RefLayer& r) { return !r.rec_shapes.empty(); });
        Q = tokens(i);
        refused("layer " + num(i) + " begin_recurrent_update(" + num(Q) + ")",
                [&] { rwd::RecurrentUpdate u = cache().begin_recurrent_update(Q, i, 0); },
                {Q < 1 ? Err::Invalid : Err::Capacity, Q < 1 ? Err::Invalid : Err::Invalid});
        break;
      }
      case 8: {  // a recurrent state of the wrong shape (huge, broadcast)
        const int i = pick_layer([](const RefLayer& r) { return !r.rec_shapes.empty(); });
        const RefLayer& rl = ref().layers[static_cast<std::size_t>(i)];
        std::vector<i64> shape = rl.rec_state_shape(0);
        const int d = static_cast<int>(next() % shape.size());
        const TensorView v = huge_view(a, shape, d, Q);
        refused("layer " + num(i) + " update_recurrent_state of shape with extent " + num(Q),
                [&] { cache().update_recurrent_state(v, i, 0); }, {Err::Invalid});
        break;
      }
      default: {  // zero and negative token counts, as raw views
        const int i = pick_layer([](const RefLayer& r) { return r.has_attention(); });
        const RefLayer& rl = ref().layers[static_cast<std::size_t>(i)];
        const i64 bad = in_.one_in(2) ? 0 : -in_.range(1, 1 << 7) * (in_.one_in(2) ? 1 : (i64{1} << 50));
        a = HostTensor(dt_, {rl.B, rl.H, 1, rl.Dk});
        b2 = HostTensor(dt_, {rl.B, rl.H, 1, rl.Dv});
        const TensorView k = raw_view(a.bytes.data(), dt_, {rl.B, rl.H, bad, rl.Dk}, {rl.H * rl.Dk, rl.Dk, 0, 1});
        const TensorView v = raw_view(b2.bytes.data(), dt_, {rl.B, rl.H, bad, rl.Dv}, {rl.H * rl.Dv, rl.Dv, 0, 1});
        refused("layer " + num(i) + " update of " + num(bad) + " tokens", [&] { (void)cache().update(k, v, i); },
                {Err::Invalid});
        break;
      }
    }
  }

  // Whole-cache calls with a huge count: refused.
  void huge_cache_call(int which, i64 huge) {
    switch (which) {
      case 4:
        refused("begin_forward(" + num(huge) + ")", [&] { Forward f = cache().begin_forward(huge); }, {Err::Invalid});
        break;
      case 5: {
        const int i = static_cast<int>(next() % static_cast<unsigned>(num_layers()));
        const bool attention = ref().layers[static_cast<std::size_t>(i)].has_attention();
        refused("get_mask_sizes(" + num(huge) + ", " + num(i) + ")", [&] { (void)cache().get_mask_sizes(huge, i); },
                {attention ? Err::Invalid : Err::State});
        break;
      }
      case 6: {
        const std::array<i64, 6> rs{-1, kTokenLimit + 1, i64{1} << 62, kI64Max, kI64Min, -(i64{1} << 40)};
        const i64 R = in_.pick(rs);
        refused("activate_past_recording(" + num(R) + ")", [&] { cache().activate_past_recording(R); },
                {ref().in_step() ? Err::Invalid : Err::State, ref().in_step() ? Err::Invalid : Err::Invalid});
        break;
      }
      default: {  // repeats whose batch would need more than 2^48 bytes
        const std::array<i64, 6> rs{i64{1} << 62, kI64Max, i64{1} << 40, i64{1} << 47, 0, -1};
        i64 r = in_.pick(rs);
        // Out of step, which of the two refusals comes first is not specified.
        refused("batch_repeat_interleave(" + num(r) + ")", [&] { cache().batch_repeat_interleave(r); },
                {ref().in_step() ? (r < 1 ? Err::Invalid : Err::Capacity) : Err::State,
                 ref().in_step() || r >= 1 ? Err::State : Err::Invalid});
        break;
      }
    }
  }

  // Views: more than 2^62 elements, negative extents, slices out of range.
  void huge_views() {
    float one = 1.0f;
    check(expect_kinds(
        [&] {
          (void)TensorView::contiguous(&one, DType::F32, {i64{1} << 40, i64{1} << 40, 1 << 20});
        },
        {Err::Invalid}));
    check(expect_kinds([&] { (void)TensorView::strided(&one, DType::F32, {2, -3}, {0, 0}); }, {Err::Invalid}));
    check(expect_kinds([&] { (void)TensorView::strided(&one, DType::F32, {2, 3}, {0}); }, {Err::Invalid}));
    const TensorView big = TensorView::strided(&one, DType::F32, {i64{1} << 40, i64{1} << 40, 1 << 20}, {0, 0, 0});
    check(expect_kinds([&] { (void)big.numel(); }, {Err::Invalid}));
    check(expect_kinds([&] { (void)big.slice(1, (i64{1} << 40) - 1, 2); }, {Err::Index}));
    check(expect_kinds([&] { (void)big.slice(4, 0, 1); }, {Err::Index}));
    if (big.slice(0, kTokenLimit - 1, 1).size(0) != 1) fail("TensorView::slice: wrong extent");
  }

  // ---- fresh layers and caches with huge options ---------------------------------

  struct HugeField {
    std::string what;
    bool used = false;   // the kind has a buffer that grows with the field
    bool maybe = false;  // the kind may or may not use it
  };

  // Sets option `field` of o to the huge extent v (fields 9 to 11 pick their
  // own huge values).
  HugeField set_huge_field(int field, i64 v, LayerKind kind, int path, LayerOptions& o) {
    const bool attention = kind == LayerKind::FullAttention || kind == LayerKind::SlidingAttention ||
                           kind == LayerKind::ChunkedAttention || kind == LayerKind::Hybrid ||
                           kind == LayerKind::HybridSliding || kind == LayerKind::SparseAttention;
    const bool conv = kind == LayerKind::LinearAttention || kind == LayerKind::Conv || kind == LayerKind::Hybrid ||
                      kind == LayerKind::HybridSliding;
    const bool rec = conv && kind != LayerKind::Conv;
    const bool stateful = attention || conv;
    const bool any_attention = attention || path == 2;  // path 2 adds a full-attention layer
    HugeField f;
    switch (field) {
      case 0:
        o.num_kv_heads = v;
        f.used = any_attention;
        f.what = "num_kv_heads";
        break;
      case 1:
        o.key_dim = v;
        f.used = any_attention;
        f.what = "key_dim";
        break;
      case 2:
        o.value_dim = v;
        f.used = any_attention;
        f.what = "value_dim";
        break;
      case 3:
        o.side_dims = in_.one_in(2) ? std::vector<i64>{v} : std::vector<i64>{4, v};
        f.used = kind == LayerKind::SparseAttention;
        f.maybe = attention && path == 0;  // a Layer of another attention kind may carry side tensors
        f.what = "side_dims";
        break;
      case 4:
        o.conv_channels = {3, v};
        f.used = conv;
        f.what = "conv_channels";
        break;
      case 5:
        o.conv_kernel_size = v;
        f.used = conv;
        f.what = "conv_kernel_size";
        break;
      case 6: {
        const int shape = next() % 3;
        o.recurrent_shapes = shape == 0   ? std::vector<std::vector<i64>>{{v}}
                             : shape == 1 ? std::vector<std::vector<i64>>{{2, 3}, {2, v}}
                                          : std::vector<std::vector<i64>>{{v, v, v}};
        f.used = rec;
        f.what = "recurrent_shapes";
        break;
      }
      case 7:
        o.static_capacity = v;
        f.used = any_attention;
        f.what = "static_capacity";
        break;
      case 8:
        o.batch_size = v;
        f.used = stateful || path == 2;
        f.what = "batch_size";
        break;
      case 9: {  // two factors, each modest, whose product passes 2^48 bytes
        const std::array<i64, 5> fs{i64{1} << 24, (i64{1} << 24) + 3, i64{1} << 31, i64{1} << 32, i64{1} << 40};
        o.num_kv_heads = in_.pick(fs);
        o.key_dim = in_.pick(fs);
        f.used = any_attention;
        f.what = "num_kv_heads x key_dim";
        break;
      }
      case 10:
        o.sliding_window = in_.pick(kHugeSpans);
        f.what = "sliding_window";
        break;
      default:
        o.chunk_size = in_.pick(kHugeSpans);
        f.what = "chunk_size";
        break;
    }
    return f;
  }

  // A fresh Layer (path 0) or Cache (path 1: of kind alone, 2: beside moe and
  // full attention) with options o. false: refused, as a huge `what` may be.
  bool build_huge(LayerKind kind, int path, const LayerOptions& o, const std::string& what, std::optional<Layer>& layer,
                  std::optional<Cache>& built) {
    try {
      if (path == 0) {
        layer.emplace(kind, o);
      } else if (path == 1) {
        built.emplace(std::vector<std::string>{std::string(rwd::layer_kind_name(kind))}, o);
      } else {
        built.emplace(std::vector<std::string>{"moe", std::string(rwd::layer_kind_name(kind)), "full_attention"}, o);
      }
    } catch (const rwd::CapacityError&) {
      count(kHugeLayerRefused);
      return false;
    } catch (const rwd::InvalidArgument&) {
      count(kHugeLayerRefused);
      return false;
    } catch (const rwd::Error& e) {
      fail("huge " + what + ": unexpected " + err_name(classify(e)) + ": " + e.what());
    } catch (const std::exception& e) {
      fail("huge " + what + ": non-rewind exception: " + e.what());
    }
    return true;
  }

  void op_huge_layer() {
    const LayerKind kind = kEveryLayerKind[next() % kEveryLayerKind.size()];
    LayerOptions o = small_options(kind, dt_, false, in_.range(1, 2));
    const int field = next() % 12;
    const int path = next() % 3;             // Layer, Cache of one type, Cache of several types
    if (path == 2 && o.num_kv_heads == 0) {  // the cache adds a full-attention layer
      o.num_kv_heads = 2;
      o.key_dim = 3;
    }
    const i64 v = in_.pick(kHugeExtents);
    const HugeField f = set_huge_field(field, v, kind, path, o);
    note("fresh " + std::string(rwd::layer_kind_name(kind)) + (path == 0 ? " Layer" : " Cache") + " with huge " +
         f.what);
    std::optional<Layer> layer;
    std::optional<Cache> built;
    if (!build_huge(kind, path, o, f.what, layer, built)) return;
    count(kHugeLayerBuilt);
    if (f.used && !f.maybe && field != 10 && field != 11)
      fail("a " + std::string(rwd::layer_kind_name(kind)) + " layer with " + f.what +
           " in the 2^48..2^63 range was built: its buffers need more than 2^48 bytes");
    if (layer &&
        ((field == 10 && kind == LayerKind::SlidingAttention) || (field == 11 && kind == LayerKind::ChunkedAttention)))
      huge_span_twin(*layer, o);
  }

  // A sliding layer whose window (or chunked layer whose chunk) is never
  // reached behaves as full attention: compare it with one.
  void huge_span_twin(Layer& a, const LayerOptions& o) {
    LayerOptions fo = o;
    fo.sliding_window = 0;
    fo.chunk_size = 0;
    Layer t(LayerKind::FullAttention, fo);
    count(kTwin);
    auto compare = [&](const std::string& after) {
      const std::string at = "huge-window layer vs full attention after " + after + ": ";
      if (a.get_seq_length() != t.get_seq_length() || a.max_rollback() != t.max_rollback())
        fail(at + "length or max_rollback differ");
      const rwd::PositionRange ra = a.stored_range(), rt = t.stored_range();
      if (ra.first != rt.first || ra.end != rt.end) fail(at + "stored_range differs");
      for (i64 q : {i64{1}, i64{3}, kTokenLimit}) {
        const MaskSizes ma = a.get_mask_sizes(q), mt = t.get_mask_sizes(q);
        if (ma.kv_length != mt.kv_length || ma.kv_offset != mt.kv_offset)
          fail(at + "get_mask_sizes(" + num(q) + ") = (" + num(ma.kv_length) + ", " + num(ma.kv_offset) +
               "), full attention (" + num(mt.kv_length) + ", " + num(mt.kv_offset) + ")");
      }
      if (gather(a.keys_values().keys) != gather(t.keys_values().keys) ||
          gather(a.keys_values().values) != gather(t.keys_values().values))
        fail(at + "keys / values differ");
    };
    auto both = [&](const std::string& what, auto&& f) {
      note("  " + what);
      std::string ea, et;
      try {
        f(a);
      } catch (const rwd::Error& e) {
        ea = err_name(classify(e));
      } catch (const std::exception& e) {
        fail(what + " on the huge-window layer: non-rewind exception: " + e.what());
      }
      try {
        f(t);
      } catch (const rwd::Error& e) {
        et = err_name(classify(e));
      }
      if (ea != et) fail(what + ": the huge-window layer threw '" + ea + "', full attention '" + et + "'");
      compare(what);
    };
    for (int k = 0; k < 6 && !in_.empty(); ++k) {
      const int op = next() % 4;
      if (op == 0) {
        const i64 R = in_.range(0, 9);
        both("activate_past_recording(" + num(R) + ")", [&](Layer& l) { l.activate_past_recording(R); });
      } else if (op == 1) {
        const i64 q = in_.range(1, 4);
        const Input k1 = make_input_fresh({o.batch_size, o.num_kv_heads, q, o.key_dim}, 2, kPartKeys);
        const i64 dv = o.value_dim == 0 ? o.key_dim : o.value_dim;
        const Input v1 = make_input_fresh({o.batch_size, o.num_kv_heads, q, dv}, 2, kPartValues);
        Bytes ka, kt;
        both("update(" + num(q) + ")", [&](Layer& l) {
          const rwd::KeyValueView kv = l.update(k1.view, v1.view);
          (&l == &a ? ka : kt) = gather(kv.keys);
        });
        if (ka != kt) fail("update(" + num(q) + "): the huge-window layer returned other keys than full attention");
      } else if (op == 2) {
        const i64 L = a.get_seq_length();
        const i64 n = -(L + 1) + in_.range(0, L + 2);
        both("crop(" + num(n) + ")", [&](Layer& l) { l.crop(n); });
      } else {
        both("deactivate_past_recording()", [&](Layer& l) { l.deactivate_past_recording(); });
      }
    }
  }

  Input make_input_fresh(const std::vector<i64>& shape, int token_dim, std::uint64_t part) {
    const int mode = next() % 3;
    const unsigned zero = mode == 1 ? 1u << token_dim : 0u;
    const unsigned rev = mode == 2 ? 1u << token_dim : 0u;
    return fresh(shape, token_dim, dt_, 0, zero, rev, part);
  }
};

}  // namespace
}  // namespace rwt

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static rwt::WarningCapture quiet;  // the deprecation warning of positive crops
  rwt::ByteReader in(data, size);
  const std::uint8_t header = in.next();
  const rwt::DType dt = header % 3 == 0 ? rwt::DType::F32 : header % 3 == 1 ? rwt::DType::F16 : rwt::DType::BF16;
  rwt::Fuzzer fuzzer(in, dt, (header & 8) != 0, (header & 16) != 0);
  fuzzer.run();
  return 0;
}
