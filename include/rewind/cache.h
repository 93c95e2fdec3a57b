// rewind/cache.h: the whole model's inference state.
//
// A Cache holds one Layer per model layer, built from transformers'
// `layer_types` strings (so a config.json maps directly) or from Layer
// objects. Per-layer operations take the layer index; whole-cache operations
// (crop, recording, batch operations, reset) are transactional: every layer
// is checked (and any memory allocated) before any layer changes, so an error
// leaves the whole cache untouched.
//
// Typical speculative-decoding round (docs/semantics.md has the contract):
//   cache.activate_past_recording(8);        // once, before the first forward
//   ... forward K + 1 tokens through every layer (update / update_conv_state /
//       begin_recurrent_update) ...
//   cache.crop(-(K - accepted));             // also when that is 0
//
// Thread safety: none inside; one owner per cache. Separate caches may be
// used concurrently.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "rewind/layer.h"

namespace rwd {

namespace detail {
struct MemoryBudget;
}

struct MemoryReport {
  std::vector<LayerMemory> layers;
  std::size_t bytes_reserved = 0;  // sum over layers
  std::size_t bytes_used = 0;
};

class Cache {
 public:
  // One layer per entry of `layer_types`, each built with `options`.
  // Throws InvalidArgument for an unknown type (message lists the accepted
  // names and the entry's index) or an option a kind needs and lacks.
  Cache(const std::vector<std::string>& layer_types, const LayerOptions& options);
  // Takes ownership of ready-made layers (they may differ in shapes).
  // REQUIRES: layers are empty (L = 0), else throws StateError.
  explicit Cache(std::vector<Layer> layers);
  ~Cache();
  Cache(Cache&&) noexcept;
  Cache& operator=(Cache&&) noexcept;
  Cache(const Cache&) = delete;
  Cache& operator=(const Cache&) = delete;

  int num_layers() const { return static_cast<int>(layers_.size()); }
  // Throws IndexError for an index outside [0, num_layers()).
  Layer& layer(int layer_idx);
  const Layer& layer(int layer_idx) const;

  // Sequence length of `layer_idx` (default: the first layer that has
  // state; 0 when none has).
  std::int64_t get_seq_length() const;
  std::int64_t get_seq_length(int layer_idx) const;
  MaskSizes get_mask_sizes(std::int64_t query_length, int layer_idx) const;

  // Per-layer forwards; see Layer for shapes, results and errors.
  KeyValueView update(const TensorView& keys, const TensorView& values, int layer_idx);
  TensorView update_side(const TensorView& rows, int layer_idx, int side = 0);
  TensorView update_conv_state(const TensorView& x, int layer_idx, int state = 0);
  RecurrentUpdate begin_recurrent_update(int layer_idx, std::int64_t q, int state = 0);
  void update_recurrent_state(const TensorView& new_state, int layer_idx, int state = 0);
  TensorView get_recurrent_state(int layer_idx, int state = 0) const;
  TensorView get_conv_state(int layer_idx, int state = 0) const;
  // For `layer_idx`, or (default) the last linear layer. Throws StateError
  // with the transformers message when the cache has no linear layer.
  bool has_previous_state() const;
  bool has_previous_state(int layer_idx) const;

  // Transactional crop of every layer (docs/semantics.md section 3).
  void crop(std::int64_t n);
  // Throws what crop(n) would, changes nothing.
  void check_crop(std::int64_t n) const;
  // Smallest max_rollback over stateful layers (the cache's L when none).
  std::int64_t max_rollback() const;
  void activate_past_recording(std::int64_t max_tokens);
  void deactivate_past_recording();
  bool is_recording() const;

  // Transactional batch operations over every layer (see Layer).
  void batch_select_indices(std::span<const std::int64_t> indices);
  void batch_repeat_interleave(std::int64_t repeats);
  void reorder_cache(std::span<const std::int64_t> beam_idx);
  void reset();

  MemoryReport memory() const;
  // Caps the bytes this cache may reserve (0: no cap, the default). An
  // operation that would allocate past the cap throws CapacityError before
  // allocating and changes nothing; growth counts old and new buffer while
  // both exist. Throws CapacityError, keeping the old cap, when more than
  // `bytes` are already reserved.
  void set_memory_budget(std::size_t bytes);
  std::size_t memory_budget() const;

 private:
  friend class EncoderDecoderCache;
  // Batch rows to keep, per layer (layers may differ in batch size).
  using RowsFor = std::function<std::vector<std::int64_t>(const Layer::Impl&)>;
  static RowsFor select_rows(std::span<const std::int64_t> indices);
  static RowsFor repeat_rows_for(std::int64_t repeats);
  static RowsFor reorder_rows(std::span<const std::int64_t> beam_idx);
  // Two phases that make whole-cache changes transactional: build every
  // layer's new state (may throw), then swap them all in (cannot fail).
  std::vector<std::unique_ptr<Layer::Impl>> prepare_gather(const char* operation, const RowsFor& rows_for) const;
  std::vector<std::unique_ptr<Layer::Impl>> prepare_reset() const;
  void commit_layers(std::vector<std::unique_ptr<Layer::Impl>> next) noexcept;
  // Prepares every layer's recording change (may throw), then commits all.
  void set_recording(bool on, std::int64_t max_tokens);
  void check_index(int layer_idx) const;
  // Declared before layers_ so that it outlives them: buffers release their
  // bytes into it when destroyed.
  std::unique_ptr<detail::MemoryBudget> budget_;  // null until a budget is set
  std::vector<Layer> layers_;
};

// Encoder-decoder state: a self-attention cache that rolls back like any
// other, and a cross-attention cache written once from the encoder output
// and never cropped.
class EncoderDecoderCache {
 public:
  EncoderDecoderCache(Cache self_attention, Cache cross_attention);
  Cache& self_attention_cache() { return self_; }
  Cache& cross_attention_cache() { return cross_; }
  const Cache& self_attention_cache() const { return self_; }
  const Cache& cross_attention_cache() const { return cross_; }

  // Writes the encoder keys / values of `layer_idx` once and returns them;
  // later calls return the stored ones unchanged (the inputs are ignored),
  // as transformers' `is_updated` does.
  KeyValueView update_cross_attention(const TensorView& keys, const TensorView& values,
                                      int layer_idx);
  bool is_cross_attention_updated(int layer_idx) const;

  std::int64_t get_seq_length() const { return self_.get_seq_length(); }
  // Crops the self-attention part only; the cross-attention part is kept.
  void crop(std::int64_t n) { self_.crop(n); }
  // Batch operations apply to both parts, transactionally.
  void batch_select_indices(std::span<const std::int64_t> indices);
  void batch_repeat_interleave(std::int64_t repeats);
  void reorder_cache(std::span<const std::int64_t> beam_idx);
  // Both parts back to new.
  void reset();

 private:
  void gather_both(const char* operation, const Cache::RowsFor& rows_for);
  Cache self_;
  Cache cross_;
};

}  // namespace rwd
