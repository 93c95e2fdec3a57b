// rewind/sequences.h: many sequences in one cache.
//
// A SequenceCache keeps the inference state of any number of independent
// sequences of one model: each has its own length, recording bound R and
// rollback with exactly the single-sequence semantics of Cache
// (docs/semantics.md; docs/sequences.md for what is added here).
//
// Storage:
//  - Attention keys, values and side tensors live in fixed-size blocks of
//    `block_size` positions from one pool per layer (a block holds its
//    positions' rows of every attention part of the layer). A sequence
//    addresses its blocks through a short list of block runs; sliding and
//    chunked layers return blocks that left the window to the pool, full
//    layers grow by whole blocks without moving history.
//  - fork() shares the parent's attention blocks copy-on-write: it costs
//    O(layers + runs), not O(length). The first write into a partly filled
//    shared block copies that block's rows (at most block_size - 1).
//  - Conv inputs and recurrent states are per sequence (a fork copies the
//    K + R inputs and the R + 1 snapshots it holds: a cost independent of the
//    length). No state slot is ever shared between live sequences.
//
// Updates happen inside a batched forward (begin_batch): one call per layer
// updates every sequence of the batch, each with its own number of tokens
// (0 included). Batch invariance: every sequence's stored state after a
// batched forward is bit-identical to what a forward of that sequence alone
// would give, whatever else is in the batch.
//
// Every operation is transactional: checked and allocated (for every layer
// and sequence) before anything changes, or it throws and changes nothing.
// One memory budget covers the blocks, conv inputs and recurrent states.
//
// Views returned by the cache (block spans, conv windows, recurrent slots,
// states) stay valid until the next call that mutates the cache.
//
// Conventions: see rewind/layer.h ("REQUIRES" is the caller's duty, "Throws
// E when" is checked and changes nothing). Thread safety: none inside; one
// owner per cache.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "rewind/cache.h"
#include "rewind/error.h"

namespace rwd {

// Names one sequence of a SequenceCache. Generations come from one
// process-wide counter, so an id is never valid again once its sequence is
// removed (its slot is reused under a new generation) and never names a
// sequence of another cache: a stale or foreign id is refused, never aliased.
struct SeqId {
  std::uint32_t slot = 0;
  std::uint64_t generation = 0;  // 0 in a default-constructed id: never valid
  friend bool operator==(const SeqId&, const SeqId&) = default;
};
// "sequence 3 (generation 2)", for messages.
std::string to_string(SeqId id);

// One sequence's share of a batched forward: `num_tokens` new tokens (>= 0).
struct BatchEntry {
  SeqId seq;
  std::int64_t num_tokens = 0;
};

// Consecutive positions of one sequence's attention storage, in consecutive
// blocks: positions [position, position + num_tokens). blocks[0] holds the
// block_size positions from floor(position / block_size) * block_size on, so
// position p is row (p % block_size) of blocks[(p / block_size) -
// (position / block_size)]. BlockLayout gives the rows' addresses.
struct BlockSpan {
  std::int64_t position = 0;
  std::int64_t num_tokens = 0;
  std::byte* const* blocks = nullptr;
};

// What one sequence's new queries attend to in one attention layer:
// positions [kv_offset, kv_offset + kv_length) in order, covered by `spans`
// (which cover nothing else). Same range as get_mask_sizes announces.
struct PagedKeyValues {
  std::int64_t kv_offset = 0;
  std::int64_t kv_length = 0;
  std::span<const BlockSpan> spans;
};

// Where one attention layer's parts sit in its blocks: block_size rows of
// keys [H, key_dim], then block_size rows of values [H, value_dim], then
// block_size rows of each side tensor [D], each part 64-byte aligned.
// Part index: 0 keys, 1 values, 2 + s side tensor s.
struct BlockLayout {
  std::int64_t block_size = 0;
  DType dtype = DType::F32;
  std::int64_t num_kv_heads = 0;
  std::int64_t key_dim = 0;
  std::int64_t value_dim = 0;
  std::vector<std::int64_t> side_dims;
  std::vector<std::size_t> part_offsets;  // bytes from the block's start
  std::size_t block_bytes = 0;
  Device device{};  // where the blocks are (the cache's storage); rows() views carry it

  int num_parts() const { return 2 + static_cast<int>(side_dims.size()); }
  // Elements of one position's row of `part`.
  std::int64_t row_elements(int part) const;
  // Rows [row, row + n) of `part` in `block`: [1, H, n, D] for keys and
  // values, [1, n, D] for a side tensor. REQUIRES 0 <= row <= row + n <=
  // block_size, a valid part and a block of this layer.
  TensorView rows(const std::byte* block, int part, std::int64_t row, std::int64_t n) const;
  // Walks positions [first, first + n), read through `spans` (in position
  // order), one call per stretch inside one block: fn(block, row, count, at)
  // says that rows [row, row + count) of `block` hold positions first + at
  // .. first + at + count - 1. Stops at the first position the spans do not
  // hold (a gap or their end) and returns it: first + n when all are held.
  template <typename Fn>
  std::int64_t for_each_block_rows(std::span<const BlockSpan> spans, std::int64_t first, std::int64_t n,
                                   Fn&& fn) const {
    std::int64_t p = first;
    for (const BlockSpan& s : spans) {
      if (p >= first + n) break;
      const std::int64_t span_end = s.position + s.num_tokens;
      if (span_end <= p) continue;
      if (s.position > p) break;  // a gap
      const std::int64_t block0 = s.position / block_size;
      const std::int64_t stop = span_end < first + n ? span_end : first + n;
      while (p < stop) {
        const std::int64_t row = p % block_size;
        const std::int64_t count = block_size - row < stop - p ? block_size - row : stop - p;
        fn(static_cast<const std::byte*>(s.blocks[p / block_size - block0]), row, count, p - first);
        p += count;
      }
    }
    return p;
  }
  // Copies positions [first, first + dst's token extent) of `part`, read
  // through `spans`, into `dst` ([1, H, n, D] or [1, n, D], this dtype).
  // Throws InvalidArgument when dst's rank, shape or dtype does not match,
  // the part is out of range, or the spans do not cover those positions.
  void gather(std::span<const BlockSpan> spans, int part, std::int64_t first, const TensorView& dst) const;
};

struct SequenceCacheOptions {
  std::int64_t block_size = 16;  // positions per attention block, 1..65536
};

// Bytes and blocks of a SequenceCache.
struct SequenceMemory {
  std::size_t bytes_reserved = 0;  // every allocation, free blocks included
  std::size_t bytes_used = 0;      // blocks in use, retained conv inputs, held states
  std::int64_t blocks_in_use = 0;  // attention blocks some sequence holds (all layers)
  std::int64_t blocks_free = 0;    // allocated, ready for reuse
};

// One layer of a SequenceCache whose layers differ in shapes (a hybrid whose
// conv layers and linear-attention layers have different kernels, ...).
struct SequenceLayer {
  LayerKind kind = LayerKind::FullAttention;
  LayerOptions options;
};

class SequenceBatch;
class BatchRecurrentUpdate;
namespace detail {
struct SnapshotHold;
}

// An immutable snapshot of one sequence of a SequenceCache
// (SequenceCache::snapshot), owned by the user. Copies share it; the last
// copy to go releases what it holds (its share of attention blocks, its
// copied conv and recurrent states). A snapshot whose cache was destroyed
// becomes empty (valid() false). REQUIRES: copies are destroyed on the
// thread that owns the cache (destroying one changes the cache's
// bookkeeping).
class SequenceSnapshot {
 public:
  SequenceSnapshot() = default;  // empty
  // True when it holds a snapshot of a live cache.
  bool valid() const;
  // The sequence length it was taken at; 0 when empty, which includes a
  // snapshot whose cache was destroyed.
  std::int64_t length() const;

 private:
  friend class SequenceCache;
  std::shared_ptr<detail::SnapshotHold> hold_;
};

class SequenceCache {
 public:
  // One layer per entry of `layer_types` (transformers' strings), each built
  // with `options` as Cache does. Throws InvalidArgument for what Cache's
  // constructor refuses, and for options.batch_size != 1 (each sequence is
  // one row), static_capacity != 0 (paged storage grows by blocks; cap it
  // with set_memory_budget) or a block_size outside 1..65536.
  SequenceCache(const std::vector<std::string>& layer_types, const LayerOptions& options,
                SequenceCacheOptions cache_options = {});
  // One layer per entry, each with its own kind and options (what Layer's
  // constructor accepts, plus the rules above). Throws InvalidArgument for an
  // empty list or what Layer's constructor refuses (the message names the
  // layer), and for batch_size != 1, static_capacity != 0 or a bad block_size.
  explicit SequenceCache(std::vector<SequenceLayer> layers, SequenceCacheOptions cache_options = {});
  ~SequenceCache();
  SequenceCache(SequenceCache&&) noexcept;
  SequenceCache& operator=(SequenceCache&&) noexcept;
  SequenceCache(const SequenceCache&) = delete;
  SequenceCache& operator=(const SequenceCache&) = delete;

  int num_layers() const;
  LayerKind layer_kind(int layer_idx) const;  // Throws IndexError for a bad index.
  // The options layer `layer_idx` was built with. Throws IndexError.
  const LayerOptions& layer_options(int layer_idx) const;
  std::int64_t block_size() const;
  // Block geometry of an attention layer. Throws IndexError / StateError
  // (no attention).
  const BlockLayout& block_layout(int layer_idx) const;

  // ---- sequences (llama.cpp's memory API names where they match) ----
  // A new empty sequence (L = 0, zero states, not recording). Throws
  // CapacityError past 2^31 live sequences or when the budget or the system
  // refuses its state slots, StateError while a batch is open.
  SeqId add_sequence();
  // A new sequence holding exactly `parent`'s state: its tokens (attention
  // blocks shared copy-on-write), conv inputs, recurrent states and
  // snapshots, recording bound and rollback depth. From then on the two are
  // independent: an update or crop of one never changes the other. Cost
  // O(layers + block runs), independent of the length (llama.cpp's seq_cp
  // into a new sequence). Throws IndexError for an invalid id, StateError
  // while a batch is open, CapacityError (budget, system).
  SeqId fork(SeqId parent);
  // Removes the sequence and releases what only it held (llama.cpp's
  // seq_rm of all its positions). Returns false and changes nothing when
  // `id` names no live sequence of this cache (already removed, or never
  // issued by it): removing twice is harmless. Throws StateError while a
  // batch is open.
  bool seq_rm(SeqId id);
  // Removes every sequence but `id` (seq_keep). Throws IndexError for an
  // invalid id, StateError while a batch is open.
  void seq_keep(SeqId id);
  // True when `id` names a live sequence of this cache.
  bool contains(SeqId id) const;
  std::int64_t num_sequences() const;
  std::vector<SeqId> sequences() const;  // live ones, in slot order

  // Tokens seen (as Cache::get_seq_length: 0 in a model whose layers keep
  // no state, moe / mlp only, whatever was fed). seq_pos_max is L - 1; seq_pos_min the smallest position
  // whose keys some attention layer still holds, at most L - 1 (L - 1 for a
  // model without attention: only the state after the last token is kept,
  // as llama.cpp's recurrent memory reports). Both are -1 when the sequence
  // is empty. Throw IndexError for an invalid id.
  std::int64_t seq_length(SeqId id) const;
  std::int64_t seq_pos_max(SeqId id) const;
  std::int64_t seq_pos_min(SeqId id) const;

  // ---- rollback, per sequence: Cache's contract for one sequence ----
  // crop(n) as Cache::crop for this sequence only; every other sequence,
  // forks included, is unchanged. Throws IndexError for an invalid id,
  // RollbackError, StateError while a batch is open; nothing changes then.
  void crop(SeqId id, std::int64_t n);
  void check_crop(SeqId id, std::int64_t n) const;  // throws what crop would
  // Largest k for which crop(id, -k) is exact now. Throws IndexError,
  // StateError while a batch is open.
  std::int64_t max_rollback(SeqId id) const;
  // Throws InvalidArgument unless 0 <= R <= 2^40, CapacityError (budget,
  // system), IndexError, StateError while a batch is open.
  void activate_past_recording(SeqId id, std::int64_t max_tokens);
  void deactivate_past_recording(SeqId id);
  bool is_recording(SeqId id) const;
  std::int64_t recording_capacity(SeqId id) const;  // R, 0 when not recording

  // ---- batched forwards ----
  // Mask sizes of `layer_idx` for q new tokens of `id` (docs/semantics.md
  // section 5). Throws IndexError, StateError (no attention),
  // InvalidArgument unless 1 <= q <= 2^40.
  MaskSizes get_mask_sizes(SeqId id, std::int64_t q, int layer_idx) const;
  // Opens a forward of entries[i].num_tokens tokens for each listed
  // sequence; packed inputs of the per-layer calls hold the entries' tokens
  // one after the other (entry i's at offsets [offset(i), offset(i) + q_i)).
  // Reserves, for every layer and sequence, the blocks (and the
  // copy-on-write copy of a shared partial block), conv room and recurrent
  // slots the tokens need. Until commit or abandon, the whole-state
  // operations above throw StateError. Throws InvalidArgument for an empty
  // list, a sequence listed twice, a negative count or a batch of no token,
  // IndexError for an invalid id, CapacityError past 2^40 tokens in a
  // sequence or when the budget or the system refuses, StateError when a
  // batch is open; nothing changes then.
  SequenceBatch begin_batch(std::span<const BatchEntry> entries);
  bool batch_open() const;

  // Writes the batch's keys [1, H, T, key_dim] and values [1, H, T,
  // value_dim] (T = the batch's total tokens, any strides, the layer's
  // dtype) and returns, per entry, what its new queries attend to (kv_length
  // 0 and no span for an entry of 0 tokens). Throws StateError without an
  // open batch, on a layer without attention or when this layer was already
  // updated in this batch; InvalidArgument for shapes or dtype; IndexError;
  // nothing is written then.
  std::span<const PagedKeyValues> update(const TensorView& keys, const TensorView& values, int layer_idx);
  // Same for side tensor `side`, rows [1, T, D]: per entry, the positions
  // its keys range covers.
  std::span<const PagedKeyValues> update_side(const TensorView& rows, int layer_idx, int side = 0);
  // Appends x [1, channels, T] to conv state `state` and returns, per entry,
  // its window [1, channels, K - 1 + q] (Layer::update_conv_state's layout;
  // an empty view for an entry of 0 tokens). Errors as update.
  std::span<const TensorView> update_conv_state(const TensorView& x, int layer_idx, int state = 0);
  // Zero-copy update of recurrent state `state` for every entry of the
  // batch (Layer::begin_recurrent_update per sequence). Throws as update.
  BatchRecurrentUpdate begin_recurrent_update(int layer_idx, int state = 0);

  // ---- per-sequence reads ----
  // Retained keys / values / side rows of `id` in `layer_idx`, positions
  // stored_range(), copied out ([1, H, n, D] / [1, n, D]).
  // Throw IndexError, StateError for a layer without attention,
  // CapacityError when the copy cannot be allocated.
  Tensor keys(SeqId id, int layer_idx) const;
  Tensor values(SeqId id, int layer_idx) const;
  Tensor side(SeqId id, int layer_idx, int side = 0) const;
  PositionRange stored_range(SeqId id, int layer_idx) const;
  // The sequence's retained positions as block spans (what the next update
  // builds on). Valid until the next mutation. Inside an open batch, the
  // attention reads (keys, values, side, stored_range, block_spans) of a
  // batched sequence already cover the batch's new positions, whose rows
  // hold what the layer's update wrote (undefined before it).
  std::vector<BlockSpan> block_spans(SeqId id, int layer_idx) const;
  // Conv and recurrent reads: Layer's contract for this sequence's state;
  // they throw IndexError for a bad state index, StateError on a layer
  // without conv / recurrent states.
  TensorView get_conv_state(SeqId id, int layer_idx, int state = 0) const;  // [1, C, K]
  TensorView conv_inputs(SeqId id, int layer_idx, int state = 0) const;     // [1, C, n]
  PositionRange conv_range(SeqId id, int layer_idx, int state = 0) const;
  TensorView get_recurrent_state(SeqId id, int layer_idx, int state = 0) const;  // [1, shape...]
  TensorView recurrent_snapshot(SeqId id, int layer_idx, int state, std::int64_t pos) const;

  // ---- snapshots (docs/sequences.md; rewind/snapshot.h) ----
  // A snapshot of `id` at its current length: its attention blocks are
  // shared copy-on-write, not copied, and its conv inputs and recurrent
  // states copied, so the cost is independent of the length. Rollback
  // history is not included. The snapshot's blocks count in memory() and
  // the budget until the last copy of the handle goes. Throws IndexError,
  // StateError while a batch is open, CapacityError (budget, system).
  SequenceSnapshot snapshot(SeqId id);
  // A new sequence holding the snapshot's state (not recording): decoding
  // it is bit-identical to continuing the sequence the snapshot was taken
  // from. Same cost as snapshot(). Throws InvalidArgument for an empty
  // snapshot or one of another cache, StateError while a batch is open,
  // CapacityError.
  SeqId restore(const SequenceSnapshot& snapshot);
  // Replaces the state of `id` with the snapshot's; `id` keeps its
  // recording bound R, with no history yet. Throws IndexError and what
  // restore(snapshot) throws; nothing changes then.
  void restore(SeqId id, const SequenceSnapshot& snapshot);
  // Plain-data copies (for serialize_snapshot or Cache::restore): the
  // state of `id` now (attention rows from max(from_position, keep_first),
  // as Cache::snapshot), or of a snapshot. Throws IndexError /
  // InvalidArgument (empty or foreign snapshot, from_position outside [0,
  // L]), StateError while a batch is open, CapacityError when the copy
  // cannot be allocated.
  Snapshot export_snapshot(SeqId id, std::int64_t from_position = 0) const;
  Snapshot export_snapshot(const SequenceSnapshot& snapshot) const;
  // A new sequence (not recording) holding `s` (from export_snapshot,
  // Cache::snapshot or deserialize_snapshot), its attention rows copied
  // into fresh blocks. Throws InvalidArgument when `s` does not fit this
  // cache (as Cache::restore; the message names the layer), StateError while
  // a batch is open, CapacityError; nothing changes then.
  SeqId import_snapshot(const Snapshot& s);
  // Snapshots held now (handles alive).
  std::int64_t num_snapshots() const;

  // ---- memory ----
  // Every refusal above (budget included, at any layer) leaves all of
  // these figures exactly as they were.
  SequenceMemory memory() const;
  // Caps the bytes the cache may reserve (0: no cap). Throws CapacityError
  // when more is reserved already, StateError while a batch is open.
  void set_memory_budget(std::size_t bytes);
  std::size_t memory_budget() const;
  // Releases the free blocks of every pool. Throws StateError while a batch
  // is open.
  void shrink_to_fit();

  struct Impl;  // defined in src/cache; not exported (cmake/rewind.map)

 private:
  friend class SequenceBatch;
  friend class BatchRecurrentUpdate;
  Impl& state() const;  // throws StateError on a moved-from cache
  void init(const Cache& probe, std::int64_t block_size);
  // Library-internal access to a sequence's per-layer linear state.
  [[gnu::visibility("hidden")]] static Layer::Impl& layer_impl(const Layer& layer);
  [[gnu::visibility("hidden")]] static std::unique_ptr<Layer> make_layer(std::unique_ptr<Layer::Impl> impl);
  [[gnu::visibility("hidden")]] static detail::SnapshotHold& hold_of(const SequenceSnapshot& snapshot,
                                                                     const Impl& cache, const char* operation);
  std::unique_ptr<Impl> impl_;
};

// An open batched forward (SequenceCache::begin_batch). Move-only.
// Destroying it open abandons it; a handle whose cache died is inert.
class SequenceBatch {
 public:
  SequenceBatch(SequenceBatch&& other) noexcept;
  SequenceBatch& operator=(SequenceBatch&& other) noexcept;
  SequenceBatch(const SequenceBatch&) = delete;
  SequenceBatch& operator=(const SequenceBatch&) = delete;
  ~SequenceBatch();

  bool is_open() const { return cache_ != nullptr; }
  std::span<const BatchEntry> entries() const { return entries_; }
  std::int64_t num_tokens() const { return total_; }  // T
  // Offset of entry i's tokens in the packed inputs. REQUIRES i < entries().size().
  std::int64_t offset(std::size_t i) const { return offsets_[i]; }
  // Keeps every entry's tokens. Throws StateError naming the first layer (in
  // model order) and part that did not receive its tokens, and for a conv or
  // recurrent part the sequence (the batch stays open then), or when the
  // handle is not open.
  void commit();
  // Restores every sequence of the batch exactly. No-op when not open.
  void abandon() noexcept;

 private:
  friend class SequenceCache;
  SequenceBatch() = default;
  SequenceCache::Impl* cache_ = nullptr;
  std::vector<BatchEntry> entries_;
  std::vector<std::int64_t> offsets_;
  std::int64_t total_ = 0;
};

// Recurrent slots of every entry of a batch (Layer's RecurrentUpdate per
// sequence). Move-only. It belongs to the batch it was taken in: once that
// batch ends (commit, abandon, and then whatever happens to its sequences:
// seq_rm, restore, another batch), previous, next and commit throw
// StateError instead of reaching the sequences' states. REQUIRES: the cache
// outlives the handle.
class BatchRecurrentUpdate {
 public:
  BatchRecurrentUpdate(BatchRecurrentUpdate&&) noexcept;
  BatchRecurrentUpdate& operator=(BatchRecurrentUpdate&&) noexcept;
  BatchRecurrentUpdate(const BatchRecurrentUpdate&) = delete;
  BatchRecurrentUpdate& operator=(const BatchRecurrentUpdate&) = delete;
  ~BatchRecurrentUpdate();

  // The batch's entries (those of 0 tokens included), as in entries().
  std::size_t num_entries() const { return index_.size(); }
  std::int64_t num_tokens(std::size_t entry) const;  // q of the entry; IndexError for a bad entry
  // S(L) of entry `entry` [1, shape...]; next(entry, t) the slot for
  // S(L + t), 1 <= t <= q. Throw IndexError for a bad entry or t,
  // StateError once the batch ended.
  TensorView previous(std::size_t entry) const;
  TensorView next(std::size_t entry, std::int64_t t) const;
  // Commits every entry's new states. Throws StateError as
  // RecurrentUpdate::commit does, and once the batch ended.
  void commit();

 private:
  friend class SequenceCache;
  BatchRecurrentUpdate() = default;
  // Throws StateError unless the batch this handle was taken in is still open.
  void check_open(const char* operation) const;
  SequenceCache::Impl* cache_ = nullptr;
  std::uint64_t batch_ = 0;  // the batch's serial (SequenceCache::Impl::batch_serial)
  int layer_ = 0;
  std::vector<RecurrentUpdate> updates_;  // entries with q >= 1
  std::vector<std::int32_t> index_;       // entry -> updates_ index, -1 for q = 0
  std::vector<TensorView> previous_;      // S(L) per entry
};

}  // namespace rwd
