#include "rewind/sequences.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <new>
#include <string>
#include <type_traits>
#include <utility>

#include "aligned_memory.h"
#include "cache/layer_impl.h"
#include "cache/paged_attention.h"
#include "cache/warnings.h"
#include "tensor_copy.h"

namespace rwd {
namespace {

using detail::PagedLayer;
using detail::PagedPart;
using detail::RetentionRule;

std::string num(std::int64_t v) { return std::to_string(v); }

// One counter for every cache of the process: an id names one sequence of
// one cache, ever.
std::atomic<std::uint64_t> g_next_generation{1};

constexpr std::int64_t kMaxBlockSize = 65536;
constexpr std::int64_t kMaxSequences = std::int64_t{1} << 31;

std::size_t round64(std::size_t bytes) { return (bytes + 63) / 64 * 64; }

// An operation's name for messages: a string, or a callable building it
// only when a message needs it (crop and fork run every decode step).
std::string name_of(const std::string& name) { return name; }
std::string name_of(const char* name) { return name; }
template <typename Fn>
  requires std::is_invocable_v<Fn>
std::string name_of(const Fn& name) {
  return name();
}

// detail::budgeted with the operation's name in front.
template <typename Name, typename Fn>
decltype(auto) budgeted(const Name& operation, Fn&& fn) {
  return detail::budgeted([&] { return name_of(operation); }, std::forward<Fn>(fn));
}

}  // namespace

std::string to_string(SeqId id) {
  return "sequence " + std::to_string(id.slot) + " (generation " + std::to_string(id.generation) + ")";
}

// ---- BlockLayout ---------------------------------------------------------------

std::int64_t BlockLayout::row_elements(int part) const {
  if (part == 0) return num_kv_heads * key_dim;
  if (part == 1) return num_kv_heads * value_dim;
  return side_dims[static_cast<std::size_t>(part - 2)];
}

TensorView BlockLayout::rows(const std::byte* block, int part, std::int64_t row, std::int64_t n) const {
  const std::int64_t width = row_elements(part);
  std::byte* base = const_cast<std::byte*>(block) + part_offsets[static_cast<std::size_t>(part)] +
                    static_cast<std::size_t>(row * width) * dtype_size(dtype);
  if (part < 2) {
    const std::int64_t d = part == 0 ? key_dim : value_dim;
    return TensorView::strided(base, dtype, {1, num_kv_heads, n, d}, {width, d, width, 1});
  }
  return TensorView::strided(base, dtype, {1, n, width}, {width, width, 1});
}

void BlockLayout::gather(std::span<const BlockSpan> spans, int part, std::int64_t first, const TensorView& dst) const {
  if (part < 0 || part >= num_parts()) {
    throw InvalidArgument("BlockLayout::gather: part " + num(part) + " is outside [0, " + num(num_parts()) + ")");
  }
  const bool heads = part < 2;
  const int token_dim = heads ? 2 : 1;
  const std::int64_t width = heads ? (part == 0 ? key_dim : value_dim) : row_elements(part);
  const bool shape_ok = dst.dtype == dtype && dst.rank == (heads ? 4 : 3) && dst.size(0) == 1 &&
                        (heads ? dst.size(1) == num_kv_heads && dst.size(3) == width : dst.size(2) == width);
  if (!shape_ok) {
    throw InvalidArgument("BlockLayout::gather: destination " + dst.describe() + " does not match part " + num(part) +
                          (heads ? " [1, H=" + num(num_kv_heads) + ", n, D=" + num(width) + "]"
                                 : " [1, n, D=" + num(width) + "]") +
                          " " + std::string(dtype_name(dtype)));
  }
  const std::int64_t n = dst.size(token_dim);
  const std::int64_t p = for_each_block_rows(
      spans, first, n, [&](const std::byte* block, std::int64_t row, std::int64_t count, std::int64_t at) {
        copy_tensor(rows(block, part, row, count), dst.slice(token_dim, at, count));
      });
  if (p < first + n) {
    throw InvalidArgument("BlockLayout::gather: the spans do not cover position " + num(p) + " of [" + num(first) +
                          ", " + num(first + n) + ")");
  }
}

// ---- the cache's state -------------------------------------------------------------

namespace {

struct LayerState {
  LayerKind kind = LayerKind::Mlp;
  LayerOptions options;  // what the layer was built with (batch 1)
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

}  // namespace

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
      throw IndexError("layer index " + num(layer_idx) + " is outside [0, " + num(static_cast<std::int64_t>(layers.size())) + ")");
    }
  }
  std::string where(int layer_idx) const {
    return "layer " + num(layer_idx) + " (" + std::string(layer_kind_name(layers[static_cast<std::size_t>(layer_idx)].kind)) + ")";
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
        impl = layer_impl(*parent->linear[i]).gathered(std::span<const std::int64_t>(&row0, 1),
                                                       "copying its conv and recurrent states");
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
    const std::string operation = on ? "activate_past_recording(" + num(R) + ")" : std::string("deactivate_past_recording");
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
                                   l.paged ? l.paged->rule() : RetentionRule{}, operation + ": " + where(static_cast<int>(i)));
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
      l.views.push_back({from, part.end - from, std::span<const BlockSpan>(l.spans.data() + start, l.spans.size() - start)});
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
    const DType dtype = layers[static_cast<std::size_t>(layer_idx)].options.dtype;
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

Layer::Impl& SequenceCache::layer_impl(const Layer& layer) { return *layer.impl_; }
std::unique_ptr<Layer> SequenceCache::make_layer(std::unique_ptr<Layer::Impl> impl) {
  return std::unique_ptr<Layer>(new Layer(std::move(impl)));
}

// ---- construction ------------------------------------------------------------------

namespace {

void check_sequence_options(const LayerOptions& options, const std::string& where) {
  if (options.batch_size != 1) {
    throw InvalidArgument("SequenceCache: " + where + "options.batch_size is " + num(options.batch_size) +
                          ", but each sequence is one batch row: it must be 1");
  }
  if (options.static_capacity != 0) {
    throw InvalidArgument("SequenceCache: " + where + "options.static_capacity is " + num(options.static_capacity) +
                          ", but paged storage grows by blocks: it must be 0 (cap memory with set_memory_budget)");
  }
}

void check_block_size(std::int64_t block_size) {
  if (block_size < 1 || block_size > kMaxBlockSize) {
    throw InvalidArgument("SequenceCache: block_size " + num(block_size) + " is outside [1, 65536]");
  }
}

}  // namespace

// Builds the per-layer state from a Cache of the same layers (which has
// validated their kinds and options).
void SequenceCache::init(const Cache& probe, std::int64_t block_size) {
  Impl& c = *impl_;
  c.block_size = block_size;
  c.layers.resize(static_cast<std::size_t>(probe.num_layers()));
  for (int i = 0; i < probe.num_layers(); ++i) {
    const Layer::Impl& model = layer_impl(probe.layer(i));
    const LayerOptions& options = model.options;
    LayerState& l = c.layers[static_cast<std::size_t>(i)];
    l.kind = model.kind;
    l.options = options;
    if (model.attention) {
      BlockLayout layout;
      layout.block_size = block_size;
      layout.dtype = options.dtype;
      layout.num_kv_heads = options.num_kv_heads;
      layout.key_dim = options.key_dim;
      layout.value_dim = options.value_dim == 0 ? options.key_dim : options.value_dim;
      for (const auto& s : model.sides) layout.side_dims.push_back(s.shape.width);
      std::size_t offset = 0;
      for (int k = 0; k < layout.num_parts(); ++k) {
        layout.part_offsets.push_back(offset);
        const std::size_t bytes = detail::checked_mul(
            detail::checked_mul(layout.block_size, layout.row_elements(k), "a block"), dtype_size(layout.dtype), "a block");
        offset = round64(offset + bytes);
      }
      layout.block_bytes = offset;
      l.paged = std::make_unique<PagedLayer>(model.keys.rule, std::move(layout), &c.budget);
      l.sides_done.assign(model.sides.size(), false);
    }
    if (!model.stateless()) c.keeps_tokens = true;
    if (model.linear()) {
      l.linear = true;
      l.linear_kind = model.kind == LayerKind::Conv ? LayerKind::Conv : LayerKind::LinearAttention;
      for (const auto& conv : model.convs) l.conv_channels.push_back(conv.shape.width);
      l.num_recurrent = model.recurrents.size();
    }
  }
}

SequenceCache::SequenceCache(const std::vector<std::string>& layer_types, const LayerOptions& options,
                             SequenceCacheOptions cache_options)
    : impl_(std::make_unique<Impl>()) {
  check_sequence_options(options, "");
  check_block_size(cache_options.block_size);
  // The single-sequence cache validates the types and options (same messages).
  init(Cache(layer_types, options), cache_options.block_size);
}

SequenceCache::SequenceCache(std::vector<SequenceLayer> layers, SequenceCacheOptions cache_options)
    : impl_(std::make_unique<Impl>()) {
  check_block_size(cache_options.block_size);
  if (layers.empty()) throw InvalidArgument("SequenceCache needs at least one layer");
  std::vector<Layer> built;
  built.reserve(layers.size());
  for (std::size_t i = 0; i < layers.size(); ++i) {
    check_sequence_options(layers[i].options, "layer " + std::to_string(i) + ": ");
    built.emplace_back(layers[i].kind, layers[i].options, static_cast<int>(i));
  }
  init(Cache(std::move(built)), cache_options.block_size);
}

SequenceCache::~SequenceCache() = default;
SequenceCache::SequenceCache(SequenceCache&&) noexcept = default;
SequenceCache& SequenceCache::operator=(SequenceCache&&) noexcept = default;

SequenceCache::Impl& SequenceCache::state() const {
  if (!impl_) throw StateError("this SequenceCache was moved from");
  return *impl_;
}

int SequenceCache::num_layers() const { return static_cast<int>(state().layers.size()); }
LayerKind SequenceCache::layer_kind(int layer_idx) const {
  state().check_layer(layer_idx);
  return state().layers[static_cast<std::size_t>(layer_idx)].kind;
}
const LayerOptions& SequenceCache::layer_options(int layer_idx) const {
  state().check_layer(layer_idx);
  return state().layers[static_cast<std::size_t>(layer_idx)].options;
}
std::int64_t SequenceCache::block_size() const { return state().block_size; }
const BlockLayout& SequenceCache::block_layout(int layer_idx) const {
  return state().attention(layer_idx, "block_layout").layout();
}

// ---- sequences ---------------------------------------------------------------------

SeqId SequenceCache::add_sequence() {
  Impl& c = state();
  c.refuse_in_batch("add_sequence");
  return budgeted("add_sequence", [&] {
    auto s = c.make_sequence(nullptr);
    c.reserve_slot();
    return c.place(std::move(s));
  });
}

SeqId SequenceCache::fork(SeqId parent) {
  Impl& c = state();
  c.refuse_in_batch([&] { return "fork(" + to_string(parent) + ")"; });
  const Sequence& p = c.lookup(parent);
  return budgeted([&] { return "fork(" + to_string(parent) + ")"; }, [&] {
    c.reserve_slot();
    return c.place(c.copy_of(p));
  });
}

bool SequenceCache::seq_rm(SeqId id) {
  Impl& c = state();
  c.refuse_in_batch([&] { return "seq_rm(" + to_string(id) + ")"; });
  Sequence* s = c.find(id);
  if (!s) return false;
  c.remove(*s);
  return true;
}

void SequenceCache::seq_keep(SeqId id) {
  Impl& c = state();
  c.refuse_in_batch([&] { return "seq_keep(" + to_string(id) + ")"; });
  c.lookup(id);
  for (auto& slot : c.slots)
    if (slot.seq && slot.generation != id.generation) c.remove(*slot.seq);
}

bool SequenceCache::contains(SeqId id) const { return state().find(id) != nullptr; }
std::int64_t SequenceCache::num_sequences() const { return state().live; }
std::vector<SeqId> SequenceCache::sequences() const {
  std::vector<SeqId> out;
  for (const auto& slot : state().slots)
    if (slot.seq) out.push_back(slot.seq->id());
  return out;
}

std::int64_t SequenceCache::seq_length(SeqId id) const { return state().lookup(id).length; }
std::int64_t SequenceCache::seq_pos_max(SeqId id) const { return state().lookup(id).length - 1; }
std::int64_t SequenceCache::seq_pos_min(SeqId id) const {
  const Impl& c = state();
  const Sequence& s = c.lookup(id);
  if (s.length == 0) return -1;
  std::int64_t first = s.length - 1;
  for (std::size_t i = 0; i < c.layers.size(); ++i)
    if (c.layers[i].paged && s.parts[i].first < s.parts[i].end) first = std::min(first, s.parts[i].first);
  return first;
}

// ---- rollback ----------------------------------------------------------------------

void SequenceCache::crop(SeqId id, std::int64_t n) {
  Impl& c = state();
  c.refuse_in_batch([&] { return "crop(" + to_string(id) + ", " + num(n) + ")"; });
  Sequence& s = c.lookup(id);
  c.check_crop(s, n);
  if (n > 0) detail::warn_positive_crop_once();
  c.apply_crop(s, n);
}

void SequenceCache::check_crop(SeqId id, std::int64_t n) const {
  const Impl& c = state();
  c.refuse_in_batch([&] { return "check_crop(" + to_string(id) + ", " + num(n) + ")"; });
  c.check_crop(c.lookup(id), n);
}

std::int64_t SequenceCache::max_rollback(SeqId id) const {
  const Impl& c = state();
  c.refuse_in_batch([&] { return "max_rollback(" + to_string(id) + ")"; });
  return c.max_rollback(c.lookup(id));
}

void SequenceCache::activate_past_recording(SeqId id, std::int64_t max_tokens) {
  Impl& c = state();
  if (max_tokens < 0 || max_tokens > detail::kMaxTokens) {
    throw InvalidArgument("activate_past_recording(" + to_string(id) + ", " + num(max_tokens) +
                          ") needs a number of tokens to keep in [0, 2^40]");
  }
  c.set_recording(c.lookup(id), true, max_tokens);
}

void SequenceCache::deactivate_past_recording(SeqId id) {
  Impl& c = state();
  c.set_recording(c.lookup(id), false, 0);
}

bool SequenceCache::is_recording(SeqId id) const { return state().lookup(id).recording; }
std::int64_t SequenceCache::recording_capacity(SeqId id) const { return state().lookup(id).retained_history(); }

// ---- batches -----------------------------------------------------------------------

MaskSizes SequenceCache::get_mask_sizes(SeqId id, std::int64_t q, int layer_idx) const {
  const Impl& c = state();
  const Sequence& s = c.lookup(id);
  const PagedLayer& p = c.attention(layer_idx, "get_mask_sizes");
  if (q < 1 || q > detail::kMaxTokens) {
    throw InvalidArgument(c.where(layer_idx) + ": get_mask_sizes(" + num(q) + ") needs a query length in [1, 2^40]");
  }
  const std::int64_t first = p.rule().visible_first(s.length);
  return {s.length + q - first, first};
}

SequenceBatch SequenceCache::begin_batch(std::span<const BatchEntry> entries) {
  Impl& c = state();
  c.refuse_in_batch("begin_batch");
  if (entries.empty()) throw InvalidArgument("begin_batch needs at least one entry");
  if (entries.size() > static_cast<std::size_t>(detail::kMaxBatch)) {
    throw CapacityError("begin_batch got " + std::to_string(entries.size()) + " entries; at most 2^24 are allowed");
  }
  std::vector<Sequence*> seqs;
  std::int64_t total = 0;
  budgeted("begin_batch", [&] { seqs.reserve(entries.size()); });
  for (std::size_t e = 0; e < entries.size(); ++e) {
    Sequence& s = c.lookup(entries[e].seq);
    const std::int64_t q = entries[e].num_tokens;
    const std::string entry = "begin_batch: entry " + std::to_string(e) + " (" + to_string(s.id()) + ")";
    if (q < 0) throw InvalidArgument(entry + " asks for " + num(q) + " tokens; a count must be >= 0");
    if (detail::passes_token_limit(s.length, q)) {
      throw CapacityError(entry + ": " + num(q) + " tokens at length " + num(s.length) +
                          " pass the limit of 2^40 tokens per sequence; nothing was changed");
    }
    if (detail::passes_token_limit(total, q)) {
      throw CapacityError("begin_batch: the batch passes 2^40 tokens in all; nothing was changed");
    }
    total += q;
    seqs.push_back(&s);
  }
  for (std::size_t e = 0; e < seqs.size(); ++e) {
    if (seqs[e]->in_batch) {
      for (std::size_t k = 0; k < e; ++k) seqs[k]->in_batch = false;
      throw InvalidArgument("begin_batch lists " + to_string(seqs[e]->id()) + " twice (entry " + std::to_string(e) +
                            "); each sequence may appear once");
    }
    seqs[e]->in_batch = true;
  }
  auto clear_marks = [&] {
    for (Sequence* s : seqs) s->in_batch = false;
  };
  if (total == 0) {
    clear_marks();
    throw InvalidArgument("begin_batch: every entry has 0 tokens; a batch needs at least one token");
  }
  // Phase 1: every allocation, for every entry and layer.
  const std::size_t L = c.layers.size();
  // Progress: entries before `at_entry` hold every layer's reservation,
  // entry `at_entry` those of the layers before `at_layer`.
  std::size_t at_entry = 0, at_layer = 0;
  c.mark_pools();
  try {
    budgeted("begin_batch", [&] {
      c.active.reserve(entries.size());
      c.plans.resize(std::max(c.plans.size(), entries.size()));
      for (std::size_t i = 0; i < L; ++i) {
        LayerState& l = c.layers[i];
        l.views.reserve(entries.size());
        l.windows.reserve(entries.size());
        if (!l.paged) continue;
        std::size_t spans = 0;
        for (Sequence* s : seqs) spans += s->parts[i].runs.size() + 1;
        l.spans.reserve(spans);
      }
      for (at_entry = 0; at_entry < seqs.size(); ++at_entry) {
        const std::int64_t q = entries[at_entry].num_tokens;
        if (q == 0) continue;
        Sequence& s = *seqs[at_entry];
        c.plans[at_entry].resize(L);
        for (at_layer = 0; at_layer < L; ++at_layer) {
          if (s.linear[at_layer]) {
            c.plans[at_entry][at_layer] = layer_impl(*s.linear[at_layer]).plan_forward(q, "begin_batch");
          }
          if (c.layers[at_layer].paged) c.layers[at_layer].paged->reserve(s.parts[at_layer], q);
        }
        at_layer = 0;
      }
    });
  } catch (...) {
    for (std::size_t e = 0; e <= at_entry && e < seqs.size(); ++e) {
      if (entries[e].num_tokens == 0) continue;
      const std::size_t held = e < at_entry ? L : at_layer;
      for (std::size_t i = 0; i < held; ++i)
        if (c.layers[i].paged) c.layers[i].paged->unreserve(seqs[e]->parts[i]);
    }
    c.restore_pools();
    for (auto& p : c.plans) p.clear();
    clear_marks();
    throw;
  }
  c.unmark_pools();
  // Phase 2: cannot fail.
  SequenceBatch batch;
  batch.cache_ = &c;
  batch.entries_.assign(entries.begin(), entries.end());
  batch.offsets_.reserve(entries.size());
  std::int64_t offset = 0;
  for (std::size_t e = 0; e < seqs.size(); ++e) {
    const std::int64_t q = entries[e].num_tokens;
    batch.offsets_.push_back(offset);
    c.active.push_back({seqs[e], q, offset});
    offset += q;
    if (q == 0) continue;
    for (std::size_t i = 0; i < L; ++i) {
      if (seqs[e]->linear[i]) layer_impl(*seqs[e]->linear[i]).open_forward(q, std::move(c.plans[e][i]));
      if (c.layers[i].paged) c.layers[i].paged->open(seqs[e]->parts[i]);
    }
    c.plans[e].clear();
  }
  batch.total_ = total;
  for (auto& l : c.layers) {
    l.views_built = false;
    l.kv_done = false;
    std::fill(l.sides_done.begin(), l.sides_done.end(), false);
  }
  c.open = &batch;
  return batch;
}

bool SequenceCache::batch_open() const { return state().open != nullptr; }

std::span<const PagedKeyValues> SequenceCache::update(const TensorView& keys, const TensorView& values, int layer_idx) {
  Impl& c = state();
  c.check_batch("update");
  c.attention(layer_idx, "update");
  const auto i = static_cast<std::size_t>(layer_idx);
  LayerState& l = c.layers[i];
  if (l.kv_done) throw StateError(c.where(layer_idx) + ": update was already called in this batch");
  const BlockLayout& layout = l.paged->layout();
  c.check_input(keys, layer_idx, "keys", {1, layout.num_kv_heads, 0, layout.key_dim}, 2);
  c.check_input(values, layer_idx, "values", {1, layout.num_kv_heads, 0, layout.value_dim}, 2);
  // Stage both before writing either: writing keys may overwrite what a
  // values view reads.
  Tensor keys_copy, values_copy;
  const TensorView k = c.staged(keys, c.aliases_written_blocks(i, keys), keys_copy, layer_idx, "update");
  const TensorView v = c.staged(values, c.aliases_written_blocks(i, values), values_copy, layer_idx, "update");
  c.write_part(i, 0, k, 2);
  c.write_part(i, 1, v, 2);
  l.kv_done = true;
  return c.views(i);
}

std::span<const PagedKeyValues> SequenceCache::update_side(const TensorView& rows, int layer_idx, int side) {
  Impl& c = state();
  c.check_batch("update_side");
  c.attention(layer_idx, "update_side");
  const auto i = static_cast<std::size_t>(layer_idx);
  LayerState& l = c.layers[i];
  if (side < 0 || side >= static_cast<int>(l.sides_done.size())) {
    throw IndexError(c.where(layer_idx) + ": side tensor " + num(side) + " is outside [0, " +
                     num(static_cast<std::int64_t>(l.sides_done.size())) + ")");
  }
  if (l.sides_done[static_cast<std::size_t>(side)]) {
    throw StateError(c.where(layer_idx) + ": update_side(" + num(side) + ") was already called in this batch");
  }
  c.check_input(rows, layer_idx, "side rows", {1, 0, l.paged->layout().side_dims[static_cast<std::size_t>(side)]}, 1);
  Tensor copy;
  c.write_part(i, 2 + side, c.staged(rows, c.aliases_written_blocks(i, rows), copy, layer_idx, "update_side"), 1);
  l.sides_done[static_cast<std::size_t>(side)] = true;
  return c.views(i);
}

std::span<const TensorView> SequenceCache::update_conv_state(const TensorView& x, int layer_idx, int state_idx) {
  Impl& c = state();
  c.check_batch("update_conv_state");
  c.check_layer(layer_idx);
  const auto i = static_cast<std::size_t>(layer_idx);
  LayerState& l = c.layers[i];
  if (!l.linear || l.conv_channels.empty()) {
    throw StateError(c.where(layer_idx) + ": update_conv_state needs a layer with conv states");
  }
  if (state_idx < 0 || state_idx >= static_cast<int>(l.conv_channels.size())) {
    throw IndexError(c.where(layer_idx) + ": conv state " + num(state_idx) + " is outside [0, " +
                     num(static_cast<std::int64_t>(l.conv_channels.size())) + ")");
  }
  const std::int64_t channels = l.conv_channels[static_cast<std::size_t>(state_idx)];
  c.check_input(x, layer_idx, "conv input", {1, channels, 0}, 2);
  // Each sequence stages what aliases its own storage; an input that
  // aliases another sequence of the batch is copied here, once.
  const detail::ByteSpan span = detail::byte_span(x);
  bool aliases = false;
  for (const auto& a : c.active) {
    if (a.q == 0) continue;
    const auto& track = layer_impl(*a.seq->linear[i]).convs[static_cast<std::size_t>(state_idx)];
    aliases = aliases || track.buffer.allocation().overlaps(span.lo, span.hi);
  }
  Tensor copy;
  const TensorView source = c.staged(x, aliases, copy, layer_idx, "update_conv_state");
  l.windows.clear();
  for (const auto& a : c.active) {
    if (a.q == 0) {
      l.windows.push_back(TensorView::strided(nullptr, x.dtype, {1, channels, 0}, {0, 0, 0}));
      continue;
    }
    l.windows.push_back(a.seq->linear[i]->update_conv_state(source.slice(2, a.offset, a.q), state_idx));
  }
  return l.windows;
}

BatchRecurrentUpdate SequenceCache::begin_recurrent_update(int layer_idx, int state_idx) {
  Impl& c = state();
  c.check_batch("begin_recurrent_update");
  c.check_layer(layer_idx);
  const auto i = static_cast<std::size_t>(layer_idx);
  const LayerState& l = c.layers[i];
  if (!l.linear || l.num_recurrent == 0) {
    throw StateError(c.where(layer_idx) + ": begin_recurrent_update needs a layer with recurrent states");
  }
  if (state_idx < 0 || state_idx >= static_cast<int>(l.num_recurrent)) {
    throw IndexError(c.where(layer_idx) + ": recurrent state " + num(state_idx) + " is outside [0, " +
                     num(static_cast<std::int64_t>(l.num_recurrent)) + ")");
  }
  BatchRecurrentUpdate out;
  out.cache_ = &c;
  out.batch_ = c.batch_serial;
  out.layer_ = layer_idx;
  budgeted([&] { return c.where(layer_idx) + ": begin_recurrent_update"; }, [&] {
    out.updates_.reserve(c.active.size());
    out.index_.reserve(c.active.size());
    out.previous_.reserve(c.active.size());
  });
  for (const auto& a : c.active) {
    Layer& layer = *a.seq->linear[i];
    if (a.q > 0) {
      out.index_.push_back(static_cast<std::int32_t>(out.updates_.size()));
      out.updates_.push_back(layer.begin_recurrent_update(a.q, state_idx));
      out.previous_.push_back(out.updates_.back().previous());
    } else {
      out.index_.push_back(-1);
      out.previous_.push_back(layer.get_recurrent_state(state_idx));
    }
  }
  return out;
}

// ---- reads -------------------------------------------------------------------------

namespace {
Tensor gather_part(const SequenceCache::Impl& c, const Sequence& s, std::size_t i, int part_index) {
  const PagedLayer& p = *c.layers[i].paged;
  const PagedPart& part = s.parts[i];
  const BlockLayout& layout = p.layout();
  const std::int64_t n = part.end - part.first;
  Tensor out = budgeted("reading " + c.where(static_cast<int>(i)), [&] {
    if (part_index < 2) {
      return Tensor(layout.dtype, {1, layout.num_kv_heads, n, part_index == 0 ? layout.key_dim : layout.value_dim});
    }
    return Tensor(layout.dtype, {1, n, layout.row_elements(part_index)});
  });
  std::vector<BlockSpan> spans;
  p.spans(part, part.first, spans);
  layout.gather(spans, part_index, part.first, out.view());
  return out;
}
}  // namespace

Tensor SequenceCache::keys(SeqId id, int layer_idx) const {
  const Impl& c = state();
  const Sequence& s = c.lookup(id);
  c.attention(layer_idx, "keys");
  return gather_part(c, s, static_cast<std::size_t>(layer_idx), 0);
}

Tensor SequenceCache::values(SeqId id, int layer_idx) const {
  const Impl& c = state();
  const Sequence& s = c.lookup(id);
  c.attention(layer_idx, "values");
  return gather_part(c, s, static_cast<std::size_t>(layer_idx), 1);
}

Tensor SequenceCache::side(SeqId id, int layer_idx, int side_idx) const {
  const Impl& c = state();
  const Sequence& s = c.lookup(id);
  const PagedLayer& p = c.attention(layer_idx, "side");
  if (side_idx < 0 || side_idx >= static_cast<int>(p.layout().side_dims.size())) {
    throw IndexError(c.where(layer_idx) + ": side tensor " + num(side_idx) + " is outside [0, " +
                     num(static_cast<std::int64_t>(p.layout().side_dims.size())) + ")");
  }
  return gather_part(c, s, static_cast<std::size_t>(layer_idx), 2 + side_idx);
}

PositionRange SequenceCache::stored_range(SeqId id, int layer_idx) const {
  const Impl& c = state();
  const Sequence& s = c.lookup(id);
  c.attention(layer_idx, "stored_range");
  const PagedPart& part = s.parts[static_cast<std::size_t>(layer_idx)];
  return {part.first, part.end};
}

std::vector<BlockSpan> SequenceCache::block_spans(SeqId id, int layer_idx) const {
  const Impl& c = state();
  const Sequence& s = c.lookup(id);
  const PagedLayer& p = c.attention(layer_idx, "block_spans");
  std::vector<BlockSpan> out;
  const PagedPart& part = s.parts[static_cast<std::size_t>(layer_idx)];
  budgeted("block_spans", [&] { p.spans(part, part.first, out); });
  return out;
}

TensorView SequenceCache::get_conv_state(SeqId id, int layer_idx, int state_idx) const {
  const Impl& c = state();
  return c.linear(c.lookup(id), layer_idx, "get_conv_state").get_conv_state(state_idx);
}
TensorView SequenceCache::conv_inputs(SeqId id, int layer_idx, int state_idx) const {
  const Impl& c = state();
  return c.linear(c.lookup(id), layer_idx, "conv_inputs").conv_inputs(state_idx);
}
PositionRange SequenceCache::conv_range(SeqId id, int layer_idx, int state_idx) const {
  const Impl& c = state();
  return c.linear(c.lookup(id), layer_idx, "conv_range").conv_range(state_idx);
}
TensorView SequenceCache::get_recurrent_state(SeqId id, int layer_idx, int state_idx) const {
  const Impl& c = state();
  return c.linear(c.lookup(id), layer_idx, "get_recurrent_state").get_recurrent_state(state_idx);
}
TensorView SequenceCache::recurrent_snapshot(SeqId id, int layer_idx, int state_idx, std::int64_t pos) const {
  const Impl& c = state();
  return c.linear(c.lookup(id), layer_idx, "recurrent_snapshot").recurrent_snapshot(state_idx, pos);
}

// ---- memory ------------------------------------------------------------------------

// ---- snapshots ---------------------------------------------------------------------

detail::SnapshotHold::~SnapshotHold() {
  if (cache) cache->drop(*this);
}

bool SequenceSnapshot::valid() const { return hold_ && hold_->cache; }
std::int64_t SequenceSnapshot::length() const { return valid() ? hold_->length : 0; }

detail::SnapshotHold& SequenceCache::hold_of(const SequenceSnapshot& snapshot, const Impl& cache, const char* operation) {
  if (!snapshot.hold_) throw InvalidArgument(std::string(operation) + ": the snapshot is empty (default-constructed)");
  if (snapshot.hold_->cache != &cache) {
    throw InvalidArgument(std::string(operation) +
                          ": the snapshot belongs to another SequenceCache (or to one that was destroyed)");
  }
  return *snapshot.hold_;
}

SequenceSnapshot SequenceCache::snapshot(SeqId id) {
  Impl& c = state();
  auto name = [&] { return "snapshot(" + to_string(id) + ")"; };
  c.refuse_in_batch(name);
  const Sequence& parent = c.lookup(id);
  return budgeted(name, [&] {
    SequenceSnapshot out;
    out.hold_ = std::make_shared<detail::SnapshotHold>();
    c.holds.reserve(c.holds.size() + 1);
    c.deferred.reserve(c.holds.size() + 1);
    std::unique_ptr<Sequence> s = c.copy_of(parent);
    c.or_release(*s, [&](Sequence& seq) { c.set_recording(seq, false, 0); });  // no history: the state at L
    out.hold_->length = s->length;
    out.hold_->seq = std::move(s);
    out.hold_->cache = &c;
    c.holds.push_back(out.hold_.get());  // capacity reserved
    return out;
  });
}

SeqId SequenceCache::restore(const SequenceSnapshot& snapshot) {
  Impl& c = state();
  c.refuse_in_batch("restore");
  const detail::SnapshotHold& h = hold_of(snapshot, c, "restore");
  return budgeted("restore", [&] {
    c.reserve_slot();
    return c.place(c.copy_of(*h.seq));
  });
}

void SequenceCache::restore(SeqId id, const SequenceSnapshot& snapshot) {
  Impl& c = state();
  auto name = [&] { return "restore(" + to_string(id) + ")"; };
  c.refuse_in_batch(name);
  Sequence& old = c.lookup(id);
  const detail::SnapshotHold& h = hold_of(snapshot, c, "restore");
  budgeted(name, [&] {
    std::unique_ptr<Sequence> s = c.copy_of(*h.seq);
    if (old.recording) c.or_release(*s, [&](Sequence& seq) { c.set_recording(seq, true, old.history); });
    c.replace(old, std::move(s));
  });
}

Snapshot SequenceCache::export_snapshot(SeqId id, std::int64_t from_position) const {
  const Impl& c = state();
  auto name = [&] { return "export_snapshot(" + to_string(id) + ", " + num(from_position) + ")"; };
  c.refuse_in_batch(name);
  const Sequence& s = c.lookup(id);
  if (from_position < 0 || from_position > s.length) {
    throw InvalidArgument(name() + ": the first position must be in [0, L = " + num(s.length) + "]");
  }
  return budgeted(name, [&] { return c.export_of(s, from_position); });
}

Snapshot SequenceCache::export_snapshot(const SequenceSnapshot& snapshot) const {
  const Impl& c = state();
  c.refuse_in_batch("export_snapshot");
  const detail::SnapshotHold& h = hold_of(snapshot, c, "export_snapshot");
  return budgeted("export_snapshot", [&] { return c.export_of(*h.seq); });
}

SeqId SequenceCache::import_snapshot(const Snapshot& s) {
  Impl& c = state();
  c.refuse_in_batch("import_snapshot");
  c.check_snapshot(s, "import_snapshot");
  c.mark_pools();
  try {
    SeqId id = budgeted("import_snapshot", [&] {
      c.reserve_slot();
      return c.place(c.import(s));
    });
    c.unmark_pools();
    return id;
  } catch (...) {
    c.restore_pools();
    throw;
  }
}

std::int64_t SequenceCache::num_snapshots() const { return static_cast<std::int64_t>(state().holds.size()); }

SequenceMemory SequenceCache::memory() const {
  const Impl& c = state();
  SequenceMemory m;
  m.bytes_reserved = c.budget.reserved;
  for (const auto& l : c.layers) {
    if (!l.paged) continue;
    m.blocks_in_use += l.paged->pool().in_use();
    m.blocks_free += l.paged->pool().free_count();
    m.bytes_used += static_cast<std::size_t>(l.paged->pool().in_use()) * l.paged->pool().block_bytes();
  }
  auto count_linear = [&](const Sequence& s) {
    for (const auto& layer : s.linear)
      if (layer) m.bytes_used += layer->memory().bytes_used;
  };
  for (const auto& slot : c.slots)
    if (slot.seq) count_linear(*slot.seq);
  for (const detail::SnapshotHold* h : c.holds) count_linear(*h->seq);
  for (const auto& s : c.deferred) count_linear(*s);
  return m;
}

void SequenceCache::set_memory_budget(std::size_t bytes) {
  Impl& c = state();
  c.refuse_in_batch("set_memory_budget");
  if (bytes != 0 && c.budget.reserved > bytes) {
    throw CapacityError("set_memory_budget(" + std::to_string(bytes) + "): " + std::to_string(c.budget.reserved) +
                        " bytes are already reserved; the budget stays " + std::to_string(c.budget.limit));
  }
  c.budget.limit = bytes;
}

std::size_t SequenceCache::memory_budget() const { return state().budget.limit; }

void SequenceCache::shrink_to_fit() {
  Impl& c = state();
  c.refuse_in_batch("shrink_to_fit");
  for (auto& l : c.layers)
    if (l.paged) l.paged->pool().trim();
  for (auto& slot : c.slots) {
    if (!slot.seq) continue;
    for (auto& layer : slot.seq->linear)
      if (layer) layer_impl(*layer).shrink_to_fit();
  }
}

// ---- SequenceBatch -----------------------------------------------------------------

SequenceBatch::SequenceBatch(SequenceBatch&& other) noexcept
    : cache_(std::exchange(other.cache_, nullptr)),
      entries_(std::move(other.entries_)),
      offsets_(std::move(other.offsets_)),
      total_(other.total_) {
  if (cache_) cache_->open = this;
}

SequenceBatch& SequenceBatch::operator=(SequenceBatch&& other) noexcept {
  if (this != &other) {
    abandon();
    cache_ = std::exchange(other.cache_, nullptr);
    entries_ = std::move(other.entries_);
    offsets_ = std::move(other.offsets_);
    total_ = other.total_;
    if (cache_) cache_->open = this;
  }
  return *this;
}

SequenceBatch::~SequenceBatch() { abandon(); }

void SequenceBatch::commit() {
  if (!cache_) throw StateError("SequenceBatch::commit: the batch is not open (committed, abandoned or moved from)");
  SequenceCache::Impl& c = *cache_;
  // The first layer (in model order) that misses a part is named.
  for (std::size_t i = 0; i < c.layers.size(); ++i) {
    const LayerState& l = c.layers[i];
    if (l.paged && !l.kv_done) {
      throw StateError("SequenceBatch::commit: " + c.where(static_cast<int>(i)) +
                       " did not receive its keys and values (update); the batch stays open");
    }
    for (std::size_t s = 0; s < l.sides_done.size(); ++s) {
      if (!l.sides_done[s]) {
        throw StateError("SequenceBatch::commit: " + c.where(static_cast<int>(i)) + " did not receive side tensor " +
                         std::to_string(s) + " (update_side); the batch stays open");
      }
    }
    if (!l.linear) continue;
    for (const auto& a : c.active) {
      if (a.q == 0) continue;
      try {
        SequenceCache::layer_impl(*a.seq->linear[i]).check_forward_complete();
      } catch (const StateError& e) {
        throw StateError("SequenceBatch::commit: " + to_string(a.seq->id()) + ": " + e.what() +
                         "; the batch stays open");
      }
    }
  }
  for (const auto& a : c.active) {
    if (a.q == 0) continue;
    for (std::size_t i = 0; i < c.layers.size(); ++i) {
      if (c.layers[i].paged) c.layers[i].paged->commit(a.seq->parts[i], a.seq->retained_history());
      if (a.seq->linear[i]) SequenceCache::layer_impl(*a.seq->linear[i]).close_forward();
    }
    if (c.keeps_tokens) a.seq->length += a.q;  // Cache::get_seq_length: 0 when no layer keeps tokens
  }
  c.close_batch();
}

void SequenceBatch::abandon() noexcept {
  if (cache_) cache_->abandon_batch();
}

// ---- BatchRecurrentUpdate ----------------------------------------------------------

BatchRecurrentUpdate::BatchRecurrentUpdate(BatchRecurrentUpdate&&) noexcept = default;
BatchRecurrentUpdate& BatchRecurrentUpdate::operator=(BatchRecurrentUpdate&&) noexcept = default;
BatchRecurrentUpdate::~BatchRecurrentUpdate() = default;

void BatchRecurrentUpdate::check_open(const char* operation) const {
  // Compared before anything is dereferenced: after the batch ended, a
  // sequence (and its layers) may be gone.
  if (cache_ == nullptr || cache_->open == nullptr || cache_->batch_serial != batch_) {
    throw StateError(std::string("BatchRecurrentUpdate::") + operation + ": the handle of layer " +
                     std::to_string(layer_) +
                     " belongs to a batch that was committed or abandoned; take a new one "
                     "with begin_recurrent_update in the open batch");
  }
}

std::int64_t BatchRecurrentUpdate::num_tokens(std::size_t entry) const {
  if (entry >= index_.size()) {
    throw IndexError("BatchRecurrentUpdate: entry " + std::to_string(entry) + " is outside [0, " +
                     std::to_string(index_.size()) + ")");
  }
  return index_[entry] < 0 ? 0 : updates_[static_cast<std::size_t>(index_[entry])].num_tokens();
}

TensorView BatchRecurrentUpdate::previous(std::size_t entry) const {
  check_open("previous");
  num_tokens(entry);  // checks the entry
  return previous_[entry];
}

TensorView BatchRecurrentUpdate::next(std::size_t entry, std::int64_t t) const {
  check_open("next");
  const std::int64_t q = num_tokens(entry);
  if (q == 0) {
    throw IndexError("BatchRecurrentUpdate::next(" + std::to_string(entry) + ", " + std::to_string(t) +
                     "): the entry has 0 tokens, so no slot to write");
  }
  return updates_[static_cast<std::size_t>(index_[entry])].next(t);
}

void BatchRecurrentUpdate::commit() {
  check_open("commit");
  for (auto& u : updates_) u.commit();
}

}  // namespace rwd
