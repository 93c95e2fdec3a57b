// rewind/encoder_decoder_cache.h: the state of an encoder-decoder model
// (transformers' EncoderDecoderCache), built from two Caches.
//
// Conventions: see rewind/layer.h. Thread safety: none inside; one owner.
#pragma once

#include <cstdint>
#include <span>

#include "rewind/cache.h"

namespace rwd {

// Encoder-decoder state: a self-attention cache that rolls back like any
// other, and a cross-attention cache written once from the encoder output
// and never cropped.
class EncoderDecoderCache {
 public:
  // Takes ownership of both parts (any layers, each built as a Cache is).
  EncoderDecoderCache(Cache self_attention, Cache cross_attention);
  Cache& self_attention_cache() { return self_; }
  Cache& cross_attention_cache() { return cross_; }
  const Cache& self_attention_cache() const { return self_; }
  const Cache& cross_attention_cache() const { return cross_; }

  // Writes the encoder keys / values of `layer_idx` once and returns them;
  // later calls return the stored ones unchanged (the inputs are ignored),
  // as transformers' `is_updated` does. Throws IndexError for a bad
  // layer_idx, and what Layer::update throws on the first call.
  KeyValueView update_cross_attention(const TensorView& keys, const TensorView& values, int layer_idx);
  // True once layer_idx holds its encoder keys. Throws IndexError.
  bool is_cross_attention_updated(int layer_idx) const;

  std::int64_t get_seq_length() const { return self_.get_seq_length(); }
  // Crops the self-attention part only; the cross-attention part is kept.
  void crop(std::int64_t n) { self_.crop(n); }
  // Batch operations apply to both parts, transactionally: they throw what
  // Cache's do (only the self-attention part must be in step) and change
  // nothing then.
  void batch_select_indices(std::span<const std::int64_t> indices);
  void batch_repeat_interleave(std::int64_t repeats);
  void reorder_cache(std::span<const std::int64_t> beam_idx);
  // Both parts back to new. Throws CapacityError as Cache::reset does
  // (nothing changes then).
  void reset();

 private:
  Cache self_;
  Cache cross_;
};

}  // namespace rwd
