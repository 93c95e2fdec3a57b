#include "cache/token_track.h"

#include <algorithm>

#include "tensor_copy.h"

namespace rwd::detail {
namespace {

std::int64_t floor_to(std::int64_t x, std::int64_t m) { return x / m * m; }  // x >= 0

}  // namespace

std::int64_t RetentionRule::visible_first(std::int64_t L) const {
  switch (kind) {
    case Kind::Full: return 0;
    case Kind::Sliding: return std::max<std::int64_t>(0, L - size + 1);
    case Kind::Chunked: return floor_to(L, size);
    case Kind::Conv: return L - size + 1;
  }
  return 0;
}

std::int64_t RetentionRule::keep_first(std::int64_t end, std::int64_t R) const {
  switch (kind) {
    case Kind::Full: return 0;
    case Kind::Sliding: return std::max<std::int64_t>(0, end - (size - 1 + R));
    case Kind::Chunked: return floor_to(std::max<std::int64_t>(0, end - R), size);
    case Kind::Conv: {
      // The zero padding before position 0 is kept until real inputs go, so
      // that "nothing evicted" keeps meaning "any rollback is exact".
      const std::int64_t first = end - size - R;
      return first > 0 ? first : -size;
    }
  }
  return 0;
}

std::int64_t RetentionRule::max_rollback(std::int64_t first, std::int64_t L) const {
  std::int64_t depth = L;
  switch (kind) {
    case Kind::Full: break;
    case Kind::Sliding: depth = first == 0 ? L : L - first - (size - 1); break;
    case Kind::Chunked: depth = first == 0 ? L : L - first; break;
    case Kind::Conv: depth = first == -size ? L : L - first - size; break;
  }
  return std::clamp<std::int64_t>(depth, 0, L);
}

TensorView TrackShape::view(std::byte* data, std::int64_t n) const {
  const std::int64_t row = batch * (layout == Layout::Heads ? heads : 1) * width;
  switch (layout) {
    case Layout::Heads:
      return TensorView::strided(data, dtype, {batch, heads, n, width}, {heads * width, width, row, 1});
    case Layout::Rows: return TensorView::strided(data, dtype, {batch, n, width}, {width, row, 1});
    case Layout::Channels: return TensorView::strided(data, dtype, {batch, width, n}, {width, 1, row});
  }
  return {};
}

std::string TrackShape::expected(const char* token_name) const {
  const std::string b = "B=" + std::to_string(batch);
  const std::string t(token_name);
  switch (layout) {
    case Layout::Heads:
      return "[" + b + ", H=" + std::to_string(heads) + ", " + t + ", D=" + std::to_string(width) + "]";
    case Layout::Rows: return "[" + b + ", " + t + ", D=" + std::to_string(width) + "]";
    case Layout::Channels: return "[" + b + ", C=" + std::to_string(width) + ", " + t + "]";
  }
  return {};
}

TokenTrack::TokenTrack(TrackShape s, RetentionRule r, std::int64_t static_slots, std::shared_ptr<Storage> storage,
                       MemoryBudget* budget)
    : shape(s), rule(r), buffer(s.row_bytes(), r.origin(), static_slots, std::move(storage), budget) {
  clear();
}

TensorView TokenTrack::append(const TensorView& input, std::int64_t q, std::int64_t R) {
  const std::int64_t L = buffer.end();
  copy_view(input, view(L, q));
  buffer.commit_append(q);
  const std::int64_t first = rule.visible_first(L);
  TensorView out = view(first, L + q - first);
  buffer.evict_before(rule.keep_first(L + q, R));
  buffer.protect(first);
  return out;
}

TokenTrack TokenTrack::gathered(std::span<const std::int64_t> rows) const {
  TokenTrack out;
  out.shape = shape;
  out.shape.batch = static_cast<std::int64_t>(rows.size());
  out.rule = rule;
  out.buffer = buffer.gathered(rows, shape.entry_bytes());
  return out;
}

TensorView TokenTrack::load(std::int64_t first, std::int64_t n) {
  buffer.place_at(first);
  if (!buffer.can_append(n)) {
    throw CapacityError("restoring " + std::to_string(n) + " positions needs " + std::to_string(n) +
                        " token slots, but static_capacity is " + std::to_string(buffer.slots()));
  }
  buffer.apply(buffer.plan_append(n), n);
  buffer.commit_append(n);
  return view(first, n);
}

}  // namespace rwd::detail
