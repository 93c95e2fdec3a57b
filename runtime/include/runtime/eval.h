// runtime/eval.h: bits per byte of a text under a model (teacher forcing).
//
// The text is cut into consecutive segments of `context` bytes (the last
// may be shorter; context 0 keeps the whole text as one sequence). Each
// segment is fed as its own sequence, BOS then its bytes, through a fresh
// cache in forwards of `chunk` tokens, exactly as generation feeds a
// prompt: so with segments longer than a sliding window and several chunks
// per segment, sliding eviction and the carry-over of recurrent and conv
// states between forwards are exercised. Every byte of the text is
// predicted once, from BOS and the bytes before it in its segment; the
// result is the mean of -log2 softmax(logits)[byte] over all bytes.
//
// Because the forward is batch invariant (runtime/model.h), the result does
// not depend on `chunk`, bit for bit; it depends on `context`.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>

#include "runtime/model.h"

namespace rwd::runtime {

struct EvalOptions {
  std::int64_t chunk = 128;   // tokens per forward, >= 1
  std::int64_t context = 0;   // bytes per segment, 0 = the whole text
  // Called after every forward with (bytes scored so far, total bytes).
  std::function<void(std::int64_t, std::int64_t)> on_progress;
};

struct EvalResult {
  std::int64_t bytes = 0;     // bytes scored (the text's length)
  std::int64_t segments = 0;  // sequences fed
  std::int64_t forwards = 0;
  double bits = 0.0;          // sum of -log2 p(byte)
  double seconds = 0.0;
  double bits_per_byte() const { return bytes > 0 ? bits / static_cast<double>(bytes) : 0.0; }
};

// -log2 softmax(logits)[target], the softmax in double (max subtracted).
// REQUIRES: n >= 1, 0 <= target < n.
double negative_log2_prob(const float* logits, std::int64_t n, std::int64_t target);

// Scores `text` as described above. Throws InvalidArgument for an empty
// text, chunk < 1 or context < 0.
EvalResult evaluate_text(const Model& model, std::string_view text, const EvalOptions& options = {});

}  // namespace rwd::runtime
