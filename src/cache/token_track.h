// A per-token part of a layer: keys, values, a side tensor or a conv state's
// inputs. Each track is a PositionBuffer plus the retention rule of its layer
// kind, which decides what an update returns, what must be kept for the next
// forward, and how deep a rollback can go.
#pragma once

#include <cstdint>
#include <string>

#include "cache/position_buffer.h"
#include "rewind/tensor.h"

namespace rwd::detail {

// What a part must retain, as a function of its length. `size` is W, C or K.
struct RetentionRule {
  enum class Kind { Full, Sliding, Chunked, Conv };
  Kind kind = Kind::Full;
  std::int64_t size = 0;

  // First position an update at length L returns (docs/semantics.md section 5).
  std::int64_t visible_first(std::int64_t L) const;
  // First position to keep at length `end` when rollbacks of up to R tokens
  // must stay exact (R = 0: the minimal working state).
  std::int64_t keep_first(std::int64_t end, std::int64_t R) const;
  // True for a sliding window that has seen W tokens: it can neither keep
  // the first n tokens nor roll back without recording.
  bool window_filled(std::int64_t L) const { return kind == Kind::Sliding && L >= size; }
  // Largest exact rollback of a part retaining positions [first, end) (end
  // means any depth).
  std::int64_t max_rollback(std::int64_t first, std::int64_t end) const;
  std::int64_t max_rollback(const PositionBuffer& buffer) const { return max_rollback(buffer.first(), buffer.end()); }
  // The same for an attention part, recording or not (a filled window that
  // does not record cannot roll back at all).
  std::int64_t max_rollback(std::int64_t first, std::int64_t end, bool recording) const {
    return !recording && window_filled(end) ? 0 : max_rollback(first, end);
  }
  // Rows a part holds again once recording R refills it, plus one update
  // token: W-1+R+1 (sliding), C-1+R+1 (chunked), K+R+1 (conv); 0 for full
  // attention, whose history only grows.
  std::int64_t refill_rows(std::int64_t R) const {
    return kind == Kind::Full ? 0 : kind == Kind::Conv ? size + R + 1 : size + R;
  }
  // Position of an empty part: 0, or -K for conv inputs (zero padding rows).
  std::int64_t origin() const { return kind == Kind::Conv ? -size : 0; }
  // Zero rows an empty part holds (the conv padding).
  std::int64_t padding_rows() const { return kind == Kind::Conv ? size : 0; }
};

// How a track's rows map to the user-facing tensor: keys / values
// [B, H, n, D], side tensors [B, n, D], conv inputs [B, C, n].
struct TrackShape {
  enum class Layout { Heads, Rows, Channels };
  Layout layout = Layout::Heads;
  std::int64_t batch = 1;
  std::int64_t heads = 1;  // H for Heads, unused otherwise
  std::int64_t width = 1;  // D for Heads / Rows, C for Channels
  DType dtype = DType::F32;

  std::size_t entry_bytes() const {  // one batch entry of one position
    return static_cast<std::size_t>((layout == Layout::Heads ? heads : 1) * width) * dtype_size(dtype);
  }
  std::size_t row_bytes() const { return static_cast<std::size_t>(batch) * entry_bytes(); }
  // The view of n positions starting at row pointer `data`.
  TensorView view(std::byte* data, std::int64_t n) const;
  // Which input dimension counts tokens (2 for Heads and Channels, 1 for Rows).
  int token_dim() const { return layout == Layout::Rows ? 1 : 2; }
  int rank() const { return layout == Layout::Heads ? 4 : 3; }
  // "[B=2, H=8, q, D=64]", for messages.
  std::string expected(const char* token_name) const;
};

struct TokenTrack {
  TrackShape shape;
  RetentionRule rule;
  PositionBuffer buffer;

  TokenTrack() = default;
  TokenTrack(TrackShape s, RetentionRule r, std::int64_t static_slots, std::shared_ptr<Storage> storage,
             MemoryBudget* budget);

  std::int64_t length() const { return buffer.end(); }
  TensorView view(std::int64_t first, std::int64_t n) const {
    TensorView v = shape.view(buffer.row(first), n);
    v.device = buffer.device();
    return v;
  }
  TensorView retained() const { return view(buffer.first(), buffer.stored()); }
  // Writes the q positions of `input` (shape checked by the caller) after
  // the end; returns the range [visible_first(L), L + q) and evicts what a
  // rollback of up to R tokens no longer needs. REQUIRES buffer.has_room(q)
  // (plan_append + apply first) and `input` not aliasing the buffer.
  TensorView append(const TensorView& input, std::int64_t q, std::int64_t R);
  // Back to empty (conv: zero padding rows).
  void clear() noexcept {
    buffer.clear(rule.padding_rows());
    protect();
  }
  // Debug aid: rows no valid view covers become unreadable.
  void protect() const noexcept { buffer.protect(rule.visible_first(length())); }
  TokenTrack gathered(std::span<const std::int64_t> rows) const;
  // Empties the track and makes it hold positions [first, first + n),
  // returning their rows for the caller to fill (a restored snapshot).
  // Throws CapacityError when a static buffer has fewer than n slots or the
  // budget or the system refuses; the track is empty then.
  TensorView load(std::int64_t first, std::int64_t n);
};

}  // namespace rwd::detail
