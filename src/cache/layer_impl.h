// Layer::Impl: the parts of one layer and the logic that keeps them in step.
// Shared by layer.cc and cache.cc (which needs the two-phase operations that
// make whole-cache changes and forwards transactional).
#pragma once

#include <cstdint>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cache/layer_kinds.h"
#include "cache/recurrent_state.h"
#include "cache/token_track.h"
#include "rewind/error.h"
#include "rewind/layer.h"
#include "rewind/snapshot.h"

namespace rwd {

namespace detail {
// Runs fn(); what it throws for lack of memory becomes a CapacityError whose
// message starts with prefix() (built only then): a budget refusal, any
// CapacityError, and std::bad_alloc from a container (so every error stays
// an rwd::Error).
template <typename Prefix, typename Fn>
decltype(auto) budgeted(Prefix&& prefix, Fn&& fn) {
  try {
    return fn();
  } catch (const BudgetExceeded& e) {
    throw CapacityError(prefix() + ": " + e.what() + "; nothing was changed");
  } catch (const CapacityError& e) {
    throw CapacityError(prefix() + ": " + e.what());
  } catch (const std::bad_alloc&) {
    throw CapacityError(prefix() + ": the system could not allocate memory; nothing was changed");
  }
}
}  // namespace detail

// transformers' message when has_previous_state meets no linear layer
// (docs/semantics.md section 8); raised by Layer and by Cache.
inline constexpr const char* kHasPreviousOnAttention =
    "`has_previous_state` can only be called on LinearAttention layers, and the current Cache seem to "
    "only contain Attention layers.";

// The crop refusals users search for (docs/semantics.md section 8), kept
// verbatim; raised by Layer and by SequenceCache.
inline constexpr const char* kNotTracking =
    "`crop` was called, but the current layer does not track past states. Call "
    "`activate_past_recording` before `crop` to be able to rollback the cache.";
inline constexpr const char* kNotTrackingSliding =
    "`crop` was called, but the current layer does not track past states, and the sliding window "
    "size was already reached. Call `activate_past_recording` before `crop` to be able to rollback "
    "the cache.";
inline constexpr const char* kLinearPositive =
    "Linear attention layers can only be cropped by passing a negative int, to specify how many "
    "tokens to remove";
inline constexpr const char* kSlidingPositive =
    "Once the sliding window size has been reached, `DynamicSlidingWindowLayer` can only be cropped "
    "by passing a negative int, to specify how many tokens to remove";

struct Layer::Impl {
  LayerKind kind = LayerKind::Mlp;
  LayerOptions options;
  int index = -1;
  std::int64_t batch = 1;
  bool recording = false;
  std::int64_t history = 0;                // R while recording
  std::uint64_t generation = 0;            // bumped by crop, recording, batch ops, reset, abandon (stale handles)
  detail::MemoryBudget* budget = nullptr;  // the owning cache's, or none
  std::shared_ptr<Storage> storage;        // of every state byte (options.storage or the default)
  Device device{};                         // storage->device(), kept for the per-update input check

  bool attention = false;
  detail::TokenTrack keys, values;
  std::vector<detail::TokenTrack> sides;
  std::vector<detail::TokenTrack> convs;
  std::vector<detail::RecurrentState> recurrents;

  // Builds an empty layer; throws InvalidArgument for missing options.
  Impl(LayerKind k, const LayerOptions& o, int layer_index, detail::MemoryBudget* memory_budget = nullptr);
  Impl() = default;
  // The constructor's two halves, each checking the options it reads: the
  // attention parts (keys, values, side tensors) and the linear parts (conv
  // and recurrent states).
  void build_attention_parts(const LayerOptions& o);
  void build_linear_parts(const LayerOptions& o);
  // Throws InvalidArgument "<where()>: <what>" unless `ok`.
  void require_option(bool ok, const std::string& what) const;

  // "layer 3 (sliding_attention)".
  std::string where() const;
  // Inputs may be host memory or this layer's device (docs/semantics.md 17).
  // Throws InvalidArgument naming `what` otherwise.
  void check_device(const TensorView& input, const char* what) const {  // no string unless it throws
    const Device d = device;
    if (!input.device.is_host() && input.device != d) {
      throw InvalidArgument(where() + ": " + what + " is on " + input.device.describe() +
                            "; this layer's state is on " + d.describe() + ", and inputs may be host memory or " +
                            d.describe());
    }
  }
  bool linear() const { return !convs.empty() || !recurrents.empty(); }
  bool stateless() const { return !attention && !linear(); }
  std::int64_t length() const;
  // Throws StateError when parts are at different lengths.
  void check_in_step(const char* operation) const;
  bool in_step() const;
  // received_only false: ignores the placeholders of final-state-only
  // updates (the deepest rollback landing on held states).
  std::int64_t max_rollback(bool received_only = true) const;
  void check_crop(std::int64_t n) const;
  void apply_crop(std::int64_t n) noexcept;

  template <typename Fn>
  void for_tracks(Fn&& fn) {
    if (attention) {
      fn(keys);
      fn(values);
      for (auto& s : sides) fn(s);
    }
    for (auto& c : convs) fn(c);
  }
  template <typename Fn>
  void for_tracks(Fn&& fn) const {
    if (attention) {
      fn(keys);
      fn(values);
      for (const auto& s : sides) fn(s);
    }
    for (const auto& c : convs) fn(c);
  }

  // Two-phase recording change: `prepare` allocates (may throw), `commit`
  // cannot fail.
  struct RecordingPlan {
    std::vector<detail::RecurrentState> recurrents;
  };
  RecordingPlan prepare_recording(bool on, std::int64_t R) const;
  void commit_recording(bool on, std::int64_t R, RecordingPlan plan) noexcept;

  // ---- forward transactions (Cache::begin_forward) ----
  struct ForwardPlan {
    std::vector<detail::PositionBuffer::Plan> tracks;               // for_tracks order
    std::vector<std::optional<detail::RecurrentState>> recurrents;  // with room, where needed
  };
  struct SavedState {
    std::vector<PositionRange> tracks;  // [first, end) per track
    struct Recurrent {
      std::int64_t length, held, unknown_first, unknown_end;
      std::vector<std::int32_t> table;
    };
    std::vector<Recurrent> recurrents;
  };
  // Checks and allocates room for q tokens in every part; changes nothing.
  // `operation` names the caller's call in messages.
  ForwardPlan plan_forward(std::int64_t q, const char* operation = "begin_forward") const;
  // Applies the plan (cannot fail) and opens the forward: every part may
  // then take q tokens, no more, without allocating.
  void open_forward(std::int64_t q, ForwardPlan plan) noexcept;
  // Throws StateError naming every part not at L + q.
  void check_forward_complete() const;
  void close_forward() noexcept {
    forward = false;
    forward_start = forward_end = -1;
  }
  // Restores every part to its state at open_forward.
  void abandon_forward() noexcept;
  bool forward = false;             // a forward is open
  mutable SavedState saved;         // what abandon restores (capacity kept between forwards)
  std::int64_t forward_start = -1;  // L at begin_forward while a forward is open
  std::int64_t forward_end = -1;    // L + q while a forward is open
  // Throws StateError: `operation` is not allowed while a forward is open.
  [[noreturn]] void refuse_during_forward(const std::string& operation) const;
  // Throws StateError when an update of q tokens to a part now at `length`
  // would pass the open forward's L + q.
  void check_forward_room(std::int64_t part_length, std::int64_t q, const std::string& part) const;

  // A new Impl holding batch rows `rows` of every stored tensor; throws
  // (messages name `operation`).
  std::unique_ptr<Impl> gathered(std::span<const std::int64_t> rows, const char* operation = "a batch operation") const;
  void check_batch_rows(std::span<const std::int64_t> rows, const char* operation) const;
  // A new, empty Impl with the same options, index, budget and recording; throws.
  std::unique_ptr<Impl> fresh() const;
  // Counts every buffer against `b` from now on.
  void attach_budget(detail::MemoryBudget* b) noexcept;
  // Best effort: dynamic buffers shrunk to what they retain.
  void shrink_to_fit() noexcept;

  // Runs fn(); a budget refusal inside gets this layer's name in front.
  template <typename Fn>
  decltype(auto) budgeted(const char* operation, Fn&& fn) const {
    return detail::budgeted([&] { return where() + ": " + operation; }, std::forward<Fn>(fn));
  }

  // ---- snapshots (rewind/snapshot.h) ----
  // Copies this layer's state at its length L into `out` (the attention rows
  // [keep_first(L, 0), L), the last K conv inputs, S(L)); `with_attention`
  // false leaves the attention part out (SequenceCache keeps it in blocks).
  // REQUIRES in step, batch 1, no open forward. Throws CapacityError.
  // Attention rows start at max(from_position, keep_first(L, 0)).
  void capture(LayerSnapshot& out, bool with_attention = true, std::int64_t from_position = 0) const;
  // A fresh Impl (same options, budget and recording, generation bumped)
  // holding the state `s` describes at length L. REQUIRES
  // check_layer_snapshot(s, L, ...) passed for this layer. Throws
  // CapacityError (static capacity, budget, system).
  std::unique_ptr<Impl> restored(const LayerSnapshot& s, std::int64_t L, bool with_attention = true) const;
  // Loads `s` at length L into this new, empty Impl (what restored() does
  // after fresh()). REQUIRES as restored(). Throws CapacityError.
  void load_snapshot(const LayerSnapshot& s, std::int64_t L, bool with_attention);

  detail::TokenTrack& conv(int state, const char* operation);
  const detail::TokenTrack& conv(int state, const char* operation) const;
  detail::RecurrentState& recurrent(int state, const char* operation);
  const detail::RecurrentState& recurrent(int state, const char* operation) const;
  detail::TokenTrack& side(int s, const char* operation);
  const detail::TokenTrack& side(int s, const char* operation) const;
  void check_attention(const char* operation) const;
};

std::vector<std::int64_t> repeat_rows(std::int64_t batch, std::int64_t repeats);

// The refusals of crop(n) in an attention part of `rule` at length L that
// retains positions from `first` (docs/semantics.md sections 3 and 4), all
// but the depth check: a positive crop a filled sliding window or a chunked
// part past position 0 cannot do, and any crop of a filled window that does
// not record (checked first, for any n: transformers >= 5.15 names the
// missing recording before the sign). where() starts the chunked message,
// context() builds the bracketed suffix of the verbatim ones; both run only
// when one is thrown (crop runs every decode step). Shared by Layer and
// SequenceCache.
template <typename Where, typename Context>
void check_attention_crop(const detail::RetentionRule& rule, std::int64_t first, std::int64_t L, bool recording,
                          std::int64_t n, Where&& where, Context&& context) {
  if (!recording && rule.window_filled(L)) throw RollbackError(kNotTrackingSliding + context());
  if (n > 0) {
    if (rule.window_filled(L)) throw RollbackError(kSlidingPositive + context());
    if (rule.kind == detail::RetentionRule::Kind::Chunked && first > 0) {
      throw RollbackError(where() + ": crop(" + std::to_string(n) + ") keeps the first " + std::to_string(n) +
                          " tokens, but this chunked layer no longer holds positions [0, " + std::to_string(first) +
                          "); crop with a negative int to remove tokens from the end");
    }
  }
}

// crop(n) asks to remove more of the L tokens than the `depth` that can go
// exactly now; `where` names the layer (and the sequence).
[[noreturn]] void throw_crop_too_deep(const std::string& where, std::int64_t n, std::int64_t L, std::int64_t depth);

namespace detail {
// Throws InvalidArgument, naming `where`, unless `s` can restore a layer of
// `kind` built with `options` (batch 1) at length L: same kind, every part
// of that kind present with this layer's shapes and dtypes, attention rows
// [first, L) with first <= rule.keep_first(L, 0) (all the positions the
// layer needs), nothing else present.
void check_layer_snapshot(const LayerSnapshot& s, std::int64_t L, LayerKind kind, const LayerOptions& options,
                          const RetentionRule& rule, const std::string& where);
// Throws InvalidArgument, the message starting with `operation`, unless `s`
// has `num_layers` layers and a length in [0, 2^40] (what every restore
// checks before its layers).
void check_snapshot_frame(const Snapshot& s, std::size_t num_layers, const std::string& operation);

// Bytes [lo, hi) an input view may touch (saturating: a view whose span
// cannot be computed is treated as touching everything). Inputs that
// overlap memory a call writes are copied first.
struct ByteSpan {
  std::uintptr_t lo;
  std::uintptr_t hi;
};
ByteSpan byte_span(const TensorView& v);
}  // namespace detail

}  // namespace rwd
