// Library-internal: the state behind SequenceCache (rewind/sequences.h),
// shared by its three source files: sequence_cache.cc (construction,
// sequences, rollback, reads, memory), sequence_batch.cc (batched
// forwards: SequenceBatch, BatchRecurrentUpdate) and sequence_snapshot.cc
// (snapshots, export and import).
#pragma once

#include "rewind/sequences.h"

#include <algorithm>
#include <atomic>
#include <concepts>
#include <limits>
#include <new>
#include <string>
#include <utility>

#include "aligned_memory.h"
#include "cache/layer_impl.h"
#include "cache/paged_attention.h"
#include "cache/warnings.h"
#include "tensor_copy.h"

namespace rwd {
namespace detail::seq {

inline std::string num(std::int64_t v) { return std::to_string(v); }

// One counter for every cache of the process: an id names one sequence of
// one cache, ever.
inline std::atomic<std::uint64_t> g_next_generation{1};

constexpr std::int64_t kMaxBlockSize = 65536;
constexpr std::int64_t kMaxSequences = std::int64_t{1} << 31;

inline std::size_t round64(std::size_t bytes) { return (bytes + 63) / 64 * 64; }

// An operation's name for messages: a string, or a callable building it
// only when a message needs it (crop and fork run every decode step).
inline std::string name_of(const std::string& name) { return name; }
inline std::string name_of(const char* name) { return name; }
template <std::invocable Fn>
std::string name_of(const Fn& name) {
  return name();
}

// detail::budgeted with the operation's name in front.
template <typename Name, typename Fn>
decltype(auto) budgeted(const Name& operation, Fn&& fn) {
  return detail::budgeted([&] { return name_of(operation); }, std::forward<Fn>(fn));
}

// ---- the cache's state ----

struct LayerState {
  LayerKind kind = LayerKind::Mlp;
  LayerOptions options;               // what the layer was built with (batch 1)
  std::unique_ptr<PagedLayer> paged;  // attention layers
  bool linear = false;
  LayerKind linear_kind = LayerKind::LinearAttention;  // how the per-sequence linear Layer is built
  std::vector<std::int64_t> conv_channels;
  std::size_t num_recurrent = 0;
  // The open batch's bookkeeping and results (valid until the next mutation).
  bool views_built = false;
  bool kv_done = false;
  std::vector<bool> sides_done;
  std::vector<PagedKeyValues> views;
  std::vector<BlockSpan> spans;
  std::vector<TensorView> windows;
};

struct Sequence {
  std::uint64_t generation = 0;
  std::uint32_t slot = 0;
  std::int64_t length = 0;
  bool recording = false;
  std::int64_t history = 0;
  bool in_batch = false;
  std::vector<PagedPart> parts;                // per layer (unused without attention)
  std::vector<std::unique_ptr<Layer>> linear;  // per layer, null without linear parts

  SeqId id() const { return {slot, generation}; }
  std::int64_t retained_history() const { return recording ? history : 0; }
};

}  // namespace detail::seq

// The sequence cache's source files name these unqualified.
using detail::PagedLayer;
using detail::PagedPart;
using detail::RetentionRule;
using detail::seq::budgeted;
using detail::seq::g_next_generation;
using detail::seq::kMaxBlockSize;
using detail::seq::kMaxSequences;
using detail::seq::LayerState;
using detail::seq::name_of;
using detail::seq::num;
using detail::seq::round64;
using detail::seq::Sequence;

// A snapshot: a sequence nobody can name, kept until its last handle goes.
namespace detail {
struct SnapshotHold {
  SequenceCache::Impl* cache = nullptr;  // null once the cache is gone
  std::unique_ptr<Sequence> seq;
  std::int64_t length = 0;
  ~SnapshotHold();
};
}  // namespace detail

struct SequenceCache::Impl {
  detail::MemoryBudget budget;  // declared first: everything below releases into it
  std::int64_t block_size = 16;
  std::vector<LayerState> layers;

  struct Slot {
    std::uint64_t generation = 0;
    std::unique_ptr<Sequence> seq;
  };
  std::vector<Slot> slots;
  std::vector<std::uint32_t> free_slots;  // capacity == slots.size(): seq_rm never allocates
  std::int64_t live = 0;

  bool keeps_tokens = false;  // some layer has attention, conv or recurrent state

  // The open batch, and a serial per batch ever opened (handles taken in a
  // batch compare it to tell whether their batch is still the open one).
  SequenceBatch* open = nullptr;
  std::uint64_t batch_serial = 0;
  struct Active {
    Sequence* seq;
    std::int64_t q;
    std::int64_t offset;
  };
  std::vector<Active> active;
  std::vector<std::vector<Layer::Impl::ForwardPlan>> plans;  // begin_batch's scratch

  // Live snapshots, and those whose last handle went while a batch was open
  // (a batch's saved ranges name holder entries that must not move until
  // it closes). Capacities are reserved by snapshot(): dropping never allocates.
  std::vector<detail::SnapshotHold*> holds;
  std::vector<std::unique_ptr<Sequence>> deferred;

  ~Impl() {
    if (open) abandon_batch();
    for (detail::SnapshotHold* h : holds) {
      release_parts(*h->seq);
      h->seq.reset();
      h->cache = nullptr;
    }
    holds.clear();
    for (auto& slot : slots)
      if (slot.seq) release_parts(*slot.seq);
    slots.clear();  // linear layers release into the budget before the pools die
  }

  // ---- lookups and checks ----
  void check_layer(int layer_idx) const {
    if (layer_idx < 0 || layer_idx >= static_cast<int>(layers.size())) {
      throw IndexError("layer index " + num(layer_idx) + " is outside [0, " +
                       num(static_cast<std::int64_t>(layers.size())) + ")");
    }
  }
  std::string where(int layer_idx) const {
    return "layer " + num(layer_idx) + " (" +
           std::string(layer_kind_name(layers[static_cast<std::size_t>(layer_idx)].kind)) + ")";
  }
  Sequence* find(SeqId id) const {
    if (id.generation == 0 || id.slot >= slots.size()) return nullptr;
    const Slot& s = slots[id.slot];
    return s.seq && s.generation == id.generation ? s.seq.get() : nullptr;
  }
  Sequence& lookup(SeqId id) const {
    Sequence* s = find(id);
    if (!s) throw IndexError(to_string(id) + " is not a live sequence of this cache (removed, or never issued by it)");
    return *s;
  }
  template <typename Name>
  void refuse_in_batch(const Name& operation) const {
    if (open) {
      throw StateError(name_of(operation) + " while a batch is open (begin_batch); commit() or abandon() it first");
    }
  }
  const PagedLayer& attention(int layer_idx, const char* operation) const {
    check_layer(layer_idx);
    const auto& l = layers[static_cast<std::size_t>(layer_idx)];
    if (!l.paged) throw StateError(where(layer_idx) + ": " + operation + " needs an attention layer");
    return *l.paged;
  }
  Layer& linear(const Sequence& s, int layer_idx, const char* operation) const {
    check_layer(layer_idx);
    const auto& l = s.linear[static_cast<std::size_t>(layer_idx)];
    if (!l) throw StateError(where(layer_idx) + ": " + operation + " needs a layer with conv or recurrent states");
    return *l;
  }

  // ---- sequences ----
  std::unique_ptr<Sequence> make_sequence(const Sequence* parent) {
    auto s = std::make_unique<Sequence>();
    s->parts.resize(layers.size());
    s->linear.resize(layers.size());
    for (std::size_t i = 0; i < layers.size(); ++i) {
      const LayerState& l = layers[i];
      if (!l.linear) continue;
      std::unique_ptr<Layer::Impl> impl;
      if (parent) {
        const std::int64_t row0 = 0;
        impl = layer_impl(*parent->linear[i])
                   .gathered(std::span<const std::int64_t>(&row0, 1), "copying its conv and recurrent states");
      } else {
        impl = std::make_unique<Layer::Impl>(l.linear_kind, l.options, static_cast<int>(i), &budget);
        impl->kind = l.kind;  // messages name the model's layer kind
      }
      s->linear[i] = make_layer(std::move(impl));
    }
    if (parent) {
      for (std::size_t i = 0; i < layers.size(); ++i)
        if (layers[i].paged) layers[i].paged->prepare_fork(parent->parts[i], s->parts[i]);
      s->length = parent->length;
      s->recording = parent->recording;
      s->history = parent->history;
    }
    return s;
  }
  SeqId place(std::unique_ptr<Sequence> s) noexcept {
    std::uint32_t slot;
    if (!free_slots.empty()) {
      slot = free_slots.back();
      free_slots.pop_back();
    } else {
      slot = static_cast<std::uint32_t>(slots.size());
      slots.emplace_back();  // capacity reserved by reserve_slot
    }
    s->slot = slot;
    s->generation = g_next_generation.fetch_add(1, std::memory_order_relaxed);
    slots[slot].generation = s->generation;
    slots[slot].seq = std::move(s);
    ++live;
    return slots[slot].seq->id();
  }
  void reserve_slot() {
    if (live >= kMaxSequences) throw CapacityError("a cache holds at most 2^31 live sequences");
    if (free_slots.empty()) {
      slots.reserve(slots.size() + 1);
      free_slots.reserve(slots.size() + 1);
    }
  }
  void release_parts(Sequence& s) noexcept {
    for (std::size_t i = 0; i < layers.size(); ++i)
      if (layers[i].paged) layers[i].paged->release(s.parts[i]);
  }
  void remove(Sequence& s) noexcept {
    release_parts(s);
    const std::uint32_t slot = s.slot;
    slots[slot].seq.reset();
    free_slots.push_back(slot);  // capacity reserved by reserve_slot
    --live;
  }

  // A refused operation gives back the blocks it acquired: between
  // mark_pools() and restore_pools() they return to the free lists
  // unconditionally, and restore_pools() trims each list back to its size
  // at the mark, so memory() is exactly as before the operation.
  void mark_pools() noexcept {
    for (auto& l : layers)
      if (l.paged) l.paged->pool().mark();
  }
  void restore_pools() noexcept {
    for (auto& l : layers)
      if (l.paged) l.paged->pool().restore_mark();
  }
  void unmark_pools() noexcept {
    for (auto& l : layers)
      if (l.paged) l.paged->pool().unmark();
  }

  // ---- rollback ----
  std::int64_t attention_max_rollback(const Sequence& s, std::size_t i) const {
    const PagedPart& part = s.parts[i];
    return std::clamp<std::int64_t>(layers[i].paged->rule().max_rollback(part.first, part.end, s.recording), 0,
                                    s.length);
  }
  std::int64_t max_rollback(const Sequence& s) const {
    bool any = false;
    std::int64_t depth = 0;
    auto take = [&](std::int64_t d) {
      depth = any ? std::min(depth, d) : d;
      any = true;
    };
    for (std::size_t i = 0; i < layers.size(); ++i) {
      if (s.linear[i]) take(layer_impl(*s.linear[i]).max_rollback());
      if (layers[i].paged) take(attention_max_rollback(s, i));
    }
    return depth;
  }
  void check_crop(const Sequence& s, std::int64_t n) const {
    const std::int64_t L = s.length;
    for (std::size_t i = 0; i < layers.size(); ++i) {
      if (s.linear[i]) layer_impl(*s.linear[i]).check_crop(n);
      if (!layers[i].paged) continue;
      const RetentionRule& rule = layers[i].paged->rule();
      auto at = [&] { return to_string(s.id()) + ", " + where(static_cast<int>(i)); };
      auto context = [&] {
        std::string c = " [" + at() + ": L=" + num(L);
        if (rule.kind == RetentionRule::Kind::Sliding) c += ", W=" + num(rule.size);
        return c + ", crop(" + num(n) + ")]";
      };
      check_attention_crop(rule, s.parts[i].first, L, s.recording, n, at, context);
      if (n >= 0 || n == std::numeric_limits<std::int64_t>::min() || -n >= L) continue;
      const std::int64_t depth = attention_max_rollback(s, i);
      if (-n > depth) throw_crop_too_deep(at(), n, L, depth);
    }
  }
  void apply_crop(Sequence& s, std::int64_t n) noexcept {
    const std::int64_t L = s.length;
    std::int64_t next = L;
    if (n > 0) {
      next = std::min(n, L);
    } else if (n < 0) {
      next = n == std::numeric_limits<std::int64_t>::min() ? 0 : L - std::min(-n, L);
    }
    for (std::size_t i = 0; i < layers.size(); ++i) {
      if (s.linear[i]) layer_impl(*s.linear[i]).apply_crop(n);
      if (!layers[i].paged) continue;
      PagedLayer& p = *layers[i].paged;
      PagedPart& part = s.parts[i];
      if (n == 0) {
        p.shrink(part, p.rule().keep_first(part.end, 0), part.end);
      } else if (next == 0) {
        p.release(part);
      } else {
        p.shrink(part, part.first, next);
      }
    }
    s.length = next;
  }
  void set_recording(Sequence& s, bool on, std::int64_t R) {
    const std::string operation = on ? "activate_past_recording(" + num(R) + ")"
                                     : std::string("deactivate_past_recording");
    refuse_in_batch(operation);
    std::vector<Layer::Impl::RecordingPlan> recording_plans(layers.size());
    for (std::size_t i = 0; i < layers.size(); ++i)
      if (s.linear[i]) recording_plans[i] = layer_impl(*s.linear[i]).prepare_recording(on, R);
    const std::int64_t history = on ? R : 0;
    for (std::size_t i = 0; i < layers.size(); ++i) {
      if (s.linear[i]) layer_impl(*s.linear[i]).commit_recording(on, R, std::move(recording_plans[i]));
      if (layers[i].paged) {
        PagedLayer& p = *layers[i].paged;
        p.shrink(s.parts[i], p.rule().keep_first(s.parts[i].end, history), s.parts[i].end);
      }
    }
    s.recording = on;
    s.history = history;
  }

  // ---- batches ----
  void check_batch(const char* operation) const {
    if (!open) throw StateError(std::string(operation) + " needs an open batch (begin_batch)");
  }
  // begin_batch's steps, in order; each leaves the cache as it found it when
  // it throws. The entries' sequences (their in_batch marks set), and in
  // `total` the batch's token count.
  std::vector<Sequence*> batch_sequences(std::span<const BatchEntry> entries, std::int64_t& total);
  // Phase 1: every allocation of the batch, for every entry and layer.
  void reserve_batch(std::span<const BatchEntry> entries, const std::vector<Sequence*>& seqs);
  // Phase 2 (cannot fail): opens the reserved forwards, filling `batch`.
  void open_batch(std::span<const BatchEntry> entries, const std::vector<Sequence*>& seqs, SequenceBatch& batch);
  void close_batch() noexcept {
    ++batch_serial;
    for (const Active& a : active) a.seq->in_batch = false;
    active.clear();
    if (open) open->cache_ = nullptr;
    open = nullptr;
    for (auto& s : deferred) release_parts(*s);
    deferred.clear();
  }

  // ---- snapshots ----
  void drop(detail::SnapshotHold& h) noexcept {
    const auto it = std::find(holds.begin(), holds.end(), &h);
    if (it != holds.end()) {
      *it = holds.back();
      holds.pop_back();
    }
    if (open) {
      deferred.push_back(std::move(h.seq));  // capacity reserved
    } else {
      release_parts(*h.seq);
      h.seq.reset();
    }
  }
  // A new sequence holding exactly what `parent` holds (fork, restore).
  std::unique_ptr<Sequence> copy_of(const Sequence& parent) {
    auto s = make_sequence(&parent);  // copies conv / recurrent state, reserves the block tables
    for (std::size_t i = 0; i < layers.size(); ++i)
      if (layers[i].paged) layers[i].paged->commit_fork(parent.parts[i], s->parts[i]);
    return s;
  }
  // Runs fn(s) on a sequence not placed yet; releases its blocks when fn throws.
  template <typename Fn>
  void or_release(Sequence& s, Fn&& fn) {
    try {
      fn(s);
    } catch (...) {
      release_parts(s);
      throw;
    }
  }
  // Puts `fresh` in the place of `old` (same id); `old` goes.
  void replace(Sequence& old, std::unique_ptr<Sequence> fresh) noexcept {
    fresh->slot = old.slot;
    fresh->generation = old.generation;
    release_parts(old);
    slots[fresh->slot].seq = std::move(fresh);
  }
  void check_snapshot(const Snapshot& snap, const std::string& operation) const {
    detail::check_snapshot_frame(snap, layers.size(), operation);
    for (std::size_t i = 0; i < layers.size(); ++i) {
      const LayerState& l = layers[i];
      detail::check_layer_snapshot(snap.layers[i], snap.length, l.kind, l.options,
                                   l.paged ? l.paged->rule() : RetentionRule{},
                                   operation + ": " + where(static_cast<int>(i)));
    }
  }
  Snapshot export_of(const Sequence& s, std::int64_t from_position = 0) const {
    Snapshot out;
    const std::int64_t L = s.length;
    out.length = L;
    out.layers.resize(layers.size());
    std::vector<BlockSpan> spans;
    for (std::size_t i = 0; i < layers.size(); ++i) {
      LayerSnapshot& ls = out.layers[i];
      ls.kind = layers[i].kind;
      if (s.linear[i]) layer_impl(*s.linear[i]).capture(ls, false);
      if (!layers[i].paged) continue;
      const PagedLayer& p = *layers[i].paged;
      const BlockLayout& b = p.layout();
      const std::int64_t first = std::max(from_position, p.rule().keep_first(L, 0));
      const std::int64_t n = L - first;
      spans.clear();
      p.spans(s.parts[i], first, spans);
      ls.first = first;
      ls.keys = Tensor(b.dtype, {1, b.num_kv_heads, n, b.key_dim});
      ls.values = Tensor(b.dtype, {1, b.num_kv_heads, n, b.value_dim});
      b.gather(spans, 0, first, ls.keys.view());
      b.gather(spans, 1, first, ls.values.view());
      for (std::size_t k = 0; k < b.side_dims.size(); ++k) {
        ls.sides.emplace_back(b.dtype, std::initializer_list<std::int64_t>{1, n, b.side_dims[k]});
        b.gather(spans, 2 + static_cast<int>(k), first, ls.sides.back().view());
      }
    }
    return out;
  }
  // A new sequence holding `snap` (checked by check_snapshot).
  std::unique_ptr<Sequence> import(const Snapshot& snap) {
    auto s = std::make_unique<Sequence>();
    s->parts.resize(layers.size());
    s->linear.resize(layers.size());
    const std::int64_t L = snap.length;
    or_release(*s, [&](Sequence& seq) {
      for (std::size_t i = 0; i < layers.size(); ++i) {
        const LayerState& l = layers[i];
        const LayerSnapshot& ls = snap.layers[i];
        if (l.linear) {
          auto impl = std::make_unique<Layer::Impl>(l.linear_kind, l.options, static_cast<int>(i), &budget);
          impl->kind = l.kind;
          impl->load_snapshot(ls, L, false);
          seq.linear[i] = make_layer(std::move(impl));
        }
        if (!l.paged) continue;
        PagedLayer& p = *l.paged;
        PagedPart& part = seq.parts[i];
        const std::int64_t first = p.rule().keep_first(L, 0);
        const std::int64_t n = L - first;
        part.first = part.end = first;
        if (n == 0) continue;
        p.reserve(part, n);
        p.open(part);
        p.write(part, 0, ls.keys.view(), 2, first - ls.first, first, n);
        p.write(part, 1, ls.values.view(), 2, first - ls.first, first, n);
        for (std::size_t k = 0; k < ls.sides.size(); ++k)
          p.write(part, 2 + static_cast<int>(k), ls.sides[k].view(), 1, first - ls.first, first, n);
        p.commit(part, 0);
      }
    });
    s->length = L;
    return s;
  }
  void abandon_batch() noexcept {
    for (const Active& a : active) {
      if (a.q == 0) continue;
      for (std::size_t i = 0; i < layers.size(); ++i) {
        if (layers[i].paged) layers[i].paged->abandon(a.seq->parts[i]);
        if (a.seq->linear[i]) layer_impl(*a.seq->linear[i]).abandon_forward();
      }
    }
    close_batch();
  }
  // Per entry, the spans of what its new queries attend to (built once per
  // layer and batch: update and update_side return the same).
  std::span<const PagedKeyValues> views(std::size_t layer_idx) {
    LayerState& l = layers[layer_idx];
    if (l.views_built) return l.views;
    const PagedLayer& p = *l.paged;
    l.views.clear();
    l.spans.clear();  // capacity reserved by begin_batch: the spans below never move
    for (const Active& a : active) {
      if (a.q == 0) {
        l.views.push_back({});
        continue;
      }
      const PagedPart& part = a.seq->parts[layer_idx];
      const std::int64_t from = p.rule().visible_first(part.end - a.q);
      const std::size_t start = l.spans.size();
      p.spans(part, from, l.spans);
      l.views.push_back(
          {from, part.end - from, std::span<const BlockSpan>(l.spans.data() + start, l.spans.size() - start)});
    }
    l.views_built = true;
    return l.views;
  }
  // True when `input` overlaps a block that this batch writes in `layer_idx`.
  bool aliases_written_blocks(std::size_t layer_idx, const TensorView& input) const {
    const PagedLayer& p = *layers[layer_idx].paged;
    const detail::ByteSpan span = detail::byte_span(input);
    for (const Active& a : active) {
      const PagedPart& part = a.seq->parts[layer_idx];
      if (a.q > 0 && p.overlaps(part, part.end - a.q, a.q, span.lo, span.hi)) return true;
    }
    return false;
  }
  // A copy of `input` when it aliases what the call writes (a view of the
  // cache's own blocks passed back in), else `input` itself.
  TensorView staged(const TensorView& input, bool aliases, Tensor& copy, int layer_idx, const char* operation) const {
    if (!aliases) return input;
    copy = budgeted(where(layer_idx) + ": " + operation, [&] { return detail::copy_of(input); });
    return copy.view();
  }
  // Writes one attention part of every entry; `input` is the packed batch.
  void write_part(std::size_t layer_idx, int part_index, const TensorView& input, int token_dim) const {
    const PagedLayer& p = *layers[layer_idx].paged;
    for (const Active& a : active) {
      if (a.q == 0) continue;
      const PagedPart& part = a.seq->parts[layer_idx];
      p.write(part, part_index, input, token_dim, a.offset, part.end - a.q, a.q);
    }
  }
  std::int64_t total_tokens() const { return open ? open->total_ : 0; }
  void check_input(const TensorView& v, int layer_idx, const char* what, std::initializer_list<std::int64_t> shape,
                   int token_dim) const {
    const std::int64_t T = total_tokens();
    const LayerOptions& options = layers[static_cast<std::size_t>(layer_idx)].options;
    const DType dtype = options.dtype;
    if (const Device d = options.storage->device(); !v.device.is_host() && v.device != d) {
      throw InvalidArgument(where(layer_idx) + ": " + what + " is on " + v.device.describe() +
                            "; this layer's state is on " + d.describe() + ", and inputs may be host memory or " +
                            d.describe());
    }
    bool ok = v.rank == static_cast<int>(shape.size()) && v.dtype == dtype;
    int d = 0;
    for (std::int64_t extent : shape) {
      ok = ok && (d == token_dim ? v.size(d) == T : v.size(d) == extent);
      ++d;
    }
    if (ok) return;
    std::string expected = "[";
    d = 0;
    for (std::int64_t extent : shape) {
      expected += (d ? ", " : "") + (d == token_dim ? "T=" + num(T) : num(extent));
      ++d;
    }
    throw InvalidArgument(where(layer_idx) + ": " + what + " " + v.describe() + " must be " + expected + "] " +
                          std::string(dtype_name(dtype)) + " (T: the batch's tokens)");
  }
};

}  // namespace rwd
