// rewind/layer.h: one model layer's inference state, with exact rollback.
//
// A Layer holds what one decoder layer needs to run its next forward: the
// attention keys / values it attends to (full, sliding-window or chunked
// retention), per-token side tensors that ride with those keys, the inputs of
// short causal convolutions, and recurrent (SSM / gated-delta) states. Which
// of those parts it has follows from its LayerKind (transformers'
// `layer_types` strings).
//
// Every part counts tokens. `crop(-k)` removes the k most recent tokens from
// every part, exactly, or throws and changes nothing (docs/semantics.md is
// the full contract). With `activate_past_recording(R)` a layer keeps enough
// history to remove up to R tokens. Its sliding, chunked, conv and recurrent
// parts keep only what that needs, so their memory stays bounded however
// long the sequence grows; full attention keeps every token.
//
// Storage is token-major: position p of a keys part lives in one row of
// [B, H, D] elements, so an update of q tokens is one copy of q rows and
// crop(-k) only moves an index.
//
// Views returned by the layer point into its storage and stay valid until the
// next call that mutates this layer (an update, begin_recurrent_update or
// its commit, crop, recording change, batch operation, reset, shrink_to_fit,
// or a Cache's begin_forward / commit / abandon).
// Builds with REWIND_DEBUG_VIEWS under AddressSanitizer mark rows and states
// that no valid view may read, so reading a stale view is reported.
//
// Conventions of every rewind header: "REQUIRES: x" is the caller's duty and
// is not checked (breaking it is undefined behaviour); "Throws E when x"
// is a checked precondition: the call throws E and changes nothing.
//
// Inputs may alias the layer's own storage (a view this layer returned can
// be appended again, as std::vector::push_back(v[0]) can): such an input is
// copied before the layer moves or overwrites anything.
//
// Thread safety: none inside. One owner per layer (and per Cache); distinct
// layers / caches may be used from distinct threads.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "rewind/dtype.h"
#include "rewind/storage.h"
#include "rewind/tensor.h"

namespace rwd {

enum class LayerKind : std::uint8_t {
  FullAttention,     // "full_attention"
  SlidingAttention,  // "sliding_attention"
  ChunkedAttention,  // "chunked_attention"
  LinearAttention,   // "linear_attention": conv states + recurrent states
  Conv,              // "conv": conv states only (LFM2 short conv)
  Hybrid,            // "hybrid": linear attention + full attention
  HybridSliding,     // "hybrid_sliding": linear attention + sliding window
  SparseAttention,   // "deepseek_sparse_attention": full attention + indexer keys
  Moe,               // "moe": no state
  Mlp,               // "mlp": no state
};

// Maps a transformers `layer_types` string to its kind.
// Throws InvalidArgument listing the accepted names for anything else.
LayerKind parse_layer_kind(std::string_view name);
// The transformers string of a kind ("sliding_attention", ...).
std::string_view layer_kind_name(LayerKind kind);

// Shapes and policies of a layer. Fields a kind does not use are ignored;
// fields it needs are validated by the Layer constructor.
struct LayerOptions {
  DType dtype = DType::F32;     // keys, values, side tensors, conv inputs
  std::int64_t batch_size = 1;  // B of every stored tensor, 1..2^24

  // Attention parts (full / sliding / chunked / hybrid / sparse):
  // keys are [B, num_kv_heads, L, key_dim], values [B, num_kv_heads, L, value_dim].
  std::int64_t num_kv_heads = 0;
  std::int64_t key_dim = 0;
  std::int64_t value_dim = 0;       // 0: same as key_dim
  std::int64_t sliding_window = 0;  // W, sliding kinds (W > 2^40 never evicts)
  std::int64_t chunk_size = 0;      // C, chunked kind (C > 2^40 never evicts)
  // 0: dynamic storage that grows. > 0: static storage of exactly this many
  // token slots per attention / side tensor, allocated once. A static full
  // layer holds at most that many tokens; a static sliding or chunked layer
  // reuses its slots and holds any number of tokens as long as what it must
  // retain plus one update fits.
  std::int64_t static_capacity = 0;
  // Per-token side tensors riding with the keys: one entry per tensor, its
  // row width D (stored as [B, L, D]). Kind SparseAttention needs >= 1 entry.
  std::vector<std::int64_t> side_dims;

  // Linear-attention parts (linear / conv / hybrid kinds):
  std::int64_t conv_kernel_size = 0;        // K
  std::vector<std::int64_t> conv_channels;  // one conv state per entry, [B, channels, K]
  // One recurrent state per entry, its per-sequence shape (rank 1..3), e.g.
  // {num_v_heads, head_k_dim, head_v_dim}; stored as [B, shape...].
  std::vector<std::vector<std::int64_t>> recurrent_shapes;
  DType recurrent_dtype = DType::F32;

  // Where every state byte of the layer lives (rewind/storage.h); null:
  // default_storage(). Inputs may be host memory or this storage's device;
  // the views returned are on its device.
  std::shared_ptr<Storage> storage;
};

struct KeyValueView {
  TensorView keys;    // [B, H, n, key_dim]
  TensorView values;  // [B, H, n, value_dim]
};

struct MaskSizes {
  std::int64_t kv_length = 0;  // number of keys the next update returns
  std::int64_t kv_offset = 0;  // absolute position of the first of them
};

// Bytes held by one layer.
struct LayerMemory {
  std::string kind;                // layer_kind_name
  std::size_t bytes_reserved = 0;  // allocated capacity
  std::size_t bytes_used = 0;      // occupied by retained tokens / states
};

// What a layer retains, in bytes, when recording R tokens (Layer::retention_bytes).
struct RetentionBytes {
  std::size_t bounded = 0;    // sliding W-1+R, chunked up to C-1+R, conv K+R inputs, recurrent R+1 states
  std::size_t per_token = 0;  // each token of unbounded history (full attention and its side tensors)
};

// Positions [first, end) a part retains right now.
struct PositionRange {
  std::int64_t first = 0;
  std::int64_t end = 0;
  std::int64_t size() const { return end - first; }
};

class Layer;

// Zero-copy write of recurrent states, from Layer::begin_recurrent_update.
// The kernel reads S(L) from previous() and writes S(L+t) into next(t) for
// t = 1..q, straight into cache-owned slots; commit() then advances the
// state's length by q and keeps the newest states as snapshots: S(L+q) and
// the ones before it, at most R + 1 in all.
// next(t) never aliases previous() nor any held snapshot: dropping the handle
// without commit() leaves S(L) and every snapshot exactly as they were.
// Without recording (R = 0) next(2), ..., next(q) are the slot of next(1):
// the kernel must support updating S in place after the first token. With
// R >= 1, next(t) never aliases next(t - 1). Move-only.
// REQUIRES: the layer outlives the handle.
class RecurrentUpdate {
 public:
  RecurrentUpdate(RecurrentUpdate&&) noexcept;
  RecurrentUpdate& operator=(RecurrentUpdate&&) noexcept;
  RecurrentUpdate(const RecurrentUpdate&) = delete;
  RecurrentUpdate& operator=(const RecurrentUpdate&) = delete;
  ~RecurrentUpdate();

  std::int64_t num_tokens() const { return q_; }
  // S(L): [B, shape...]. Throws StateError on a stale handle (see commit).
  TensorView previous() const;
  // Slot for S(L+t). Throws IndexError unless 1 <= t <= q, StateError on a
  // stale handle.
  TensorView next(std::int64_t t) const;
  // Advances the state by q tokens. Throws StateError when called twice, or
  // when this state was advanced, or the layer cropped, re-batched, reset,
  // its recording changed or its forward abandoned, since
  // begin_recurrent_update.
  void commit();

 private:
  friend class Layer;
  RecurrentUpdate(Layer* layer, int state, std::int64_t q, std::uint64_t generation, std::uint64_t version);
  Layer* layer_ = nullptr;
  int state_ = 0;
  std::int64_t q_ = 0;
  std::uint64_t generation_ = 0;
  std::uint64_t version_ = 0;
};

class Layer {
 public:
  // Builds an empty layer (L = 0). `index` names the layer in messages
  // ("layer 3"); Cache sets it. Throws InvalidArgument when an option the
  // kind needs is missing or out of range (message names the option),
  // CapacityError when the shapes need more than 2^48 bytes.
  Layer(LayerKind kind, const LayerOptions& options, int index = -1);
  ~Layer();
  Layer(Layer&&) noexcept;
  Layer& operator=(Layer&&) noexcept;
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  LayerKind kind() const;
  const LayerOptions& options() const;
  bool has_attention() const;  // full / sliding / chunked / hybrid / sparse
  bool is_linear() const;      // linear / conv / hybrid kinds
  bool is_stateless() const;   // moe / mlp
  // Index used in error messages ("layer 3"); set by Cache. -1 when standalone.
  void set_index(int index);
  int index() const;

  // Tokens seen (the position of the next token). 0 for moe / mlp.
  std::int64_t get_seq_length() const;
  // Batch size of every stored tensor.
  std::int64_t batch_size() const;

  // ---- attention ----
  // Range the next update of q tokens returns (docs/semantics.md section 5).
  // Throws StateError on a layer without attention, InvalidArgument unless
  // 1 <= q <= 2^40.
  MaskSizes get_mask_sizes(std::int64_t q) const;
  // Appends q tokens, keys [B, H, q, key_dim] and values [B, H, q, value_dim]
  // (any strides, including 0, the layer's dtype), and returns every key /
  // value the new queries attend to, positions [kv_offset, L + q). Throws
  // InvalidArgument on rank / shape / dtype / batch mismatch, CapacityError
  // when a static layer, the memory budget or the system cannot hold the
  // tokens (sizes past 2^48 bytes or 2^40 tokens included), StateError when
  // keys and values are at different lengths or the update would pass what
  // an open forward allows; nothing is written then.
  KeyValueView update(const TensorView& keys, const TensorView& values);
  // Appends q rows [B, q, D] to side tensor `side` and returns the rows of
  // the positions the keys range covers: [B, n, D]. Same errors as update,
  // plus IndexError for a bad `side`.
  TensorView update_side(const TensorView& rows, int side = 0);
  // Retained keys / values / side rows, positions stored_range(). For
  // inspection; what the next forward needs is what update returns.
  KeyValueView keys_values() const;
  TensorView side(int side) const;
  // Positions the attention part retains; throws StateError without attention.
  PositionRange stored_range() const;

  // ---- linear attention ----
  // Appends x [B, channels, q] to conv state `state` and returns the window
  // [B, channels, K - 1 + q]: the K - 1 inputs before the new ones (zeros
  // before position 0) followed by the q new inputs. Throws StateError with
  // the transformers message on a layer without conv states, IndexError for
  // a bad `state`, and what update throws for a bad input.
  //
  // Layout: the window is token-major, like all per-token storage: element
  // (b, c, t) lives at data + t * (B * channels) + b * channels + c, i.e.
  // strides [channels, 1, B * channels]. A depthwise causal conv reads it
  // cheaply with the time loop outside and the channel loop inside (each
  // window row is `channels` contiguous values, so the inner loop vectorises
  // across channels): out[b, c, j] = sum_i w[c, i] * window[b, c, j + i].
  // Channel-major input (x contiguous as [B, channels, q]) is accepted as is.
  TensorView update_conv_state(const TensorView& x, int state = 0);
  // The last K inputs [B, channels, K] (zeros before position 0), same layout.
  TensorView get_conv_state(int state = 0) const;
  // Retained conv inputs [B, channels, n] and their positions (may start
  // below 0: the zero padding before the first token).
  TensorView conv_inputs(int state = 0) const;
  PositionRange conv_range(int state = 0) const;
  // Starts a zero-copy update of recurrent state `state` by q tokens. Throws
  // StateError / IndexError for a layer without that state, InvalidArgument
  // for q < 1, CapacityError when L + q > 2^40, StateError inside an open forward
  // unless the state is still at the forward's start and q is the forward's
  // whole q, CapacityError when the fresh slots cannot be allocated (outside
  // a forward: begin_forward reserves them). Growing the slots moves the
  // state's snapshots: views of them become stale.
  RecurrentUpdate begin_recurrent_update(std::int64_t q, int state = 0);
  // Convenience over begin/commit for one token (transformers'
  // update_recurrent_state): copies new_state [B, shape...] in as S(L+1).
  // Throws InvalidArgument for a shape or dtype mismatch, and what
  // begin_recurrent_update(1) throws.
  void update_recurrent_state(const TensorView& new_state, int state = 0);
  // Advances recurrent state `state` by q tokens given only final_state
  // [B, shape...], the state after the last of them: transformers' Gated
  // DeltaNet calls update_recurrent_state so after a multi-token forward.
  // S(L+1)..S(L+q-1) were never received, so no crop may land on them:
  // until a rollback below L+1 removes them (or a reset, or a full
  // rollback), crop(n) whose landing length lies in [L+1, L+q-1] throws
  // RollbackError ("... never received ...") and changes nothing, and
  // max_rollback() is at most the tokens appended after this update
  // (0 right after it). Crops that land at L + q or later, at 0, or at L
  // or below where the history holds it, stay exact. A second such update
  // while the first's placeholders are still held widens the refused range
  // to cover both. q == 1 is update_recurrent_state. Throws InvalidArgument
  // for a shape or dtype mismatch, and what begin_recurrent_update(q)
  // throws; nothing changes then. final_state may be a view of this layer.
  void update_recurrent_state_final(const TensorView& final_state, std::int64_t q, int state = 0);
  // S(L): [B, shape...] (zeros when L = 0).
  TensorView get_recurrent_state(int state = 0) const;
  // S(pos) for a snapshot still held, pos in [L - held + 1, L]; throws
  // IndexError naming the held range otherwise.
  TensorView recurrent_snapshot(int state, std::int64_t pos) const;
  // True once the linear part has seen a token. Throws StateError with the
  // transformers message on a layer without linear parts.
  bool has_previous_state() const;

  // ---- rollback ----
  // crop(n), docs/semantics.md section 3: n < 0 removes |n| tokens; n == 0
  // shrinks to the minimal working state; n > 0 (deprecated) keeps the first
  // n tokens. Throws RollbackError (too deep, not recording, positive crop a
  // part cannot do) or StateError (parts out of step, or a forward of the
  // owning Cache open); nothing changes then.
  void crop(std::int64_t n);
  // Throws exactly what crop(n) would throw, changes nothing.
  void check_crop(std::int64_t n) const;
  // Largest k such that crop(-j) is exact now for every 1 <= j <= k; L
  // means any k. 0 for a part that cannot roll back (not recording). After
  // update_recurrent_state_final a deeper crop may still be exact (see
  // there); check_crop says.
  std::int64_t max_rollback() const;
  // Keeps enough history to remove up to R tokens exactly. Can be called
  // again to change R (a smaller R drops history now). Throws
  // InvalidArgument unless 0 <= R <= 2^40, StateError when the parts are out
  // of step or a forward is open, CapacityError when a static sliding
  // (chunked) layer's slots cannot hold W - 1 + R + 1 (C - 1 + R + 1) tokens
  // or the budget or the system refuses the recurrent snapshot slots.
  void activate_past_recording(std::int64_t max_tokens);
  // Stops recording and drops the history (crop then raises where
  // docs/semantics.md section 4 says). Throws StateError and CapacityError
  // (recurrent slots) as activate_past_recording does.
  void deactivate_past_recording();
  bool is_recording() const;
  std::int64_t recording_capacity() const;  // R, 0 when not recording

  // ---- batch ----
  // Keeps batch rows `indices` (any order, repeats allowed) of every stored
  // tensor; B becomes indices.size(). Throws IndexError for an index outside
  // [0, B), InvalidArgument for an empty list, StateError when the parts are
  // out of step, CapacityError when the copy cannot be allocated.
  void batch_select_indices(std::span<const std::int64_t> indices);
  // Repeats every batch row `repeats` times in place (beam expansion).
  // Throws InvalidArgument for repeats < 1, and what batch_select_indices
  // throws.
  void batch_repeat_interleave(std::int64_t repeats);
  // Reorders batch rows: row i becomes old row beam_idx[i]. Throws
  // InvalidArgument unless beam_idx has B entries, and what
  // batch_select_indices throws.
  void reorder_cache(std::span<const std::int64_t> beam_idx);
  // Back to the state of a new layer with the same options (L = 0, zero
  // states, no history, B = options().batch_size); the recording setting
  // (on with the same R, or off) stays. Throws CapacityError when the
  // budget or the system refuses the new buffers; nothing changes then.
  void reset();
  // A deep, independent copy: every part with its retained tokens, states
  // and rollback history, the recording setting, the index. Its buffers
  // count against no cache budget (Cache(std::vector<Layer>) attaches one).
  // Throws StateError when the parts are out of step, CapacityError when the
  // copy cannot be allocated.
  Layer clone() const;

  LayerMemory memory() const;
  // The retention rule in bytes (docs/semantics.md section 4): after any
  // update with recording R, memory().bytes_used <= bounded + per_token * L,
  // except that a conv part still holds its K zero rows before position 0
  // while R < L <= K + R (up to K rows more). Equality for sliding, conv and
  // recurrent parts once L >= W-1+R (resp. L > K+R, L >= R). Throws
  // InvalidArgument unless 0 <= R <= 2^40, CapacityError when a figure
  // passes 2^48 bytes.
  RetentionBytes retention_bytes(std::int64_t R) const;
  // Best effort: releases the slack of dynamic buffers (full attention keeps
  // up to 2x what it holds after growing by doubling); recurrent slots are
  // kept. Changes no content.
  void shrink_to_fit();

  struct Impl;  // defined in src/cache

 private:
  friend class RecurrentUpdate;
  friend class Cache;
  friend class EncoderDecoderCache;
  friend class SequenceCache;
  // For SequenceCache's per-sequence states; not exported from librewind.so.
  [[gnu::visibility("hidden")]] explicit Layer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace rwd
