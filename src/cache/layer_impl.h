// Layer::Impl: the parts of one layer and the logic that keeps them in step.
// Shared by layer.cc and cache.cc (which needs the two-phase operations that
// make whole-cache changes transactional).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cache/recurrent_state.h"
#include "cache/token_track.h"
#include "rewind/error.h"
#include "rewind/layer.h"

namespace rwd {

// transformers' message when has_previous_state meets no linear layer
// (docs/semantics.md section 8); raised by Layer and by Cache.
inline constexpr const char* kHasPreviousOnAttention =
    "`has_previous_state` can only be called on LinearAttention layers, and the current Cache seem to "
    "only contain Attention layers.";

struct Layer::Impl {
  LayerKind kind = LayerKind::Mlp;
  LayerOptions options;
  int index = -1;
  std::int64_t batch = 1;
  bool recording = false;
  std::int64_t history = 0;       // R while recording
  std::uint64_t generation = 0;   // bumped by crop, recording, batch ops, reset (stale handles)
  detail::MemoryBudget* budget = nullptr;  // the owning cache's, or none

  bool attention = false;
  detail::TokenTrack keys, values;
  std::vector<detail::TokenTrack> sides;
  std::vector<detail::TokenTrack> convs;
  std::vector<detail::RecurrentState> recurrents;

  // Builds an empty layer; throws InvalidArgument for missing options.
  Impl(LayerKind k, const LayerOptions& o, int layer_index, detail::MemoryBudget* memory_budget = nullptr);
  Impl() = default;

  // "layer 3 (sliding_attention)".
  std::string where() const;
  bool linear() const { return !convs.empty() || !recurrents.empty(); }
  bool stateless() const { return !attention && !linear(); }
  std::int64_t length() const;
  // Throws StateError when parts are at different lengths.
  void check_in_step(const char* operation) const;
  std::int64_t max_rollback() const;
  void check_crop(std::int64_t n) const;
  void apply_crop(std::int64_t n) noexcept;

  // Two-phase recording change: `prepare` allocates (may throw), `commit`
  // cannot fail.
  struct RecordingPlan {
    std::vector<detail::RecurrentState> recurrents;
  };
  RecordingPlan prepare_recording(bool on, std::int64_t R) const;
  void commit_recording(bool on, std::int64_t R, RecordingPlan plan) noexcept;

  // A new Impl holding batch rows `rows` of every stored tensor; throws.
  std::unique_ptr<Impl> gathered(std::span<const std::int64_t> rows) const;
  std::unique_ptr<Impl> gathered_unchecked(std::span<const std::int64_t> rows) const;
  void check_batch_rows(std::span<const std::int64_t> rows, const char* operation) const;
  // A new, empty Impl with the same options, index, budget and recording; throws.
  std::unique_ptr<Impl> fresh() const;
  std::unique_ptr<Impl> fresh_unchecked() const;
  // Counts every buffer against `b` from now on.
  void attach_budget(detail::MemoryBudget* b) noexcept;

  // Runs fn(); a budget refusal inside gets this layer's name in front.
  template <typename Fn>
  decltype(auto) budgeted(const char* operation, Fn&& fn) const {
    try {
      return fn();
    } catch (const detail::BudgetExceeded& e) {
      throw CapacityError(where() + ": " + operation + ": " + e.what() + "; nothing was changed");
    }
  }

  const detail::TokenTrack& conv(int state, const char* operation) const;
  const detail::RecurrentState& recurrent(int state, const char* operation) const;
  const detail::TokenTrack& side(int s, const char* operation) const;
  void check_attention(const char* operation) const;
};

std::vector<std::int64_t> repeat_rows(std::int64_t batch, std::int64_t repeats);

}  // namespace rwd
