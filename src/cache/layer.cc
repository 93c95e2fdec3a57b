#include <algorithm>
#include <cstring>
#include <limits>
#include <utility>

#include "cache/layer_impl.h"
#include "cache/warnings.h"

namespace rwd {
namespace {

using detail::RetentionRule;
using detail::TokenTrack;
using detail::TrackShape;

// The messages users already search for (docs/semantics.md section 8).
constexpr const char* kNotTracking =
    "`crop` was called, but the current layer does not track past states. Call "
    "`activate_past_recording` before `crop` to be able to rollback the cache.";
constexpr const char* kNotTrackingSliding =
    "`crop` was called, but the current layer does not track past states, and the sliding window "
    "size was already reached. Call `activate_past_recording` before `crop` to be able to rollback "
    "the cache.";
constexpr const char* kLinearPositive =
    "Linear attention layers can only be cropped by passing a negative int, to specify how many "
    "tokens to remove";
constexpr const char* kSlidingPositive =
    "Once the sliding window size has been reached, `DynamicSlidingWindowLayer` can only be cropped "
    "by passing a negative int, to specify how many tokens to remove";
constexpr const char* kConvOnNonLinear = "Cannot call `update_conv_state` on a non-LinearAttention layer!";


bool kind_has_attention(LayerKind k) {
  switch (k) {
    case LayerKind::FullAttention:
    case LayerKind::SlidingAttention:
    case LayerKind::ChunkedAttention:
    case LayerKind::Hybrid:
    case LayerKind::HybridSliding:
    case LayerKind::SparseAttention: return true;
    default: return false;
  }
}

bool kind_is_linear(LayerKind k) {
  return k == LayerKind::LinearAttention || k == LayerKind::Conv || k == LayerKind::Hybrid ||
         k == LayerKind::HybridSliding;
}

std::string num(std::int64_t v) { return std::to_string(v); }

// Multiplies sizes, throwing CapacityError instead of overflowing.
std::size_t checked_bytes(std::initializer_list<std::int64_t> factors, std::size_t element,
                          const std::string& where) {
  constexpr std::uint64_t kLimit = std::uint64_t{1} << 48;
  std::uint64_t total = element;
  for (std::int64_t f : factors) {
    const auto factor = static_cast<std::uint64_t>(f);
    if (factor != 0 && total > kLimit / factor) {
      throw CapacityError(where + ": the requested sizes need more than 2^48 bytes");
    }
    total *= factor;
  }
  return static_cast<std::size_t>(total);
}

}  // namespace

// ---- construction ----------------------------------------------------------

Layer::Impl::Impl(LayerKind k, const LayerOptions& o, int layer_index, detail::MemoryBudget* memory_budget)
    : kind(k), options(o), index(layer_index), batch(o.batch_size), budget(memory_budget) {
  auto require = [&](bool ok, const std::string& what) {
    if (!ok) throw InvalidArgument(where() + ": " + what);
  };
  require(o.batch_size >= 1, "option batch_size must be >= 1, got " + num(o.batch_size));
  require(o.static_capacity >= 0, "option static_capacity must be >= 0, got " + num(o.static_capacity));
  attention = kind_has_attention(k);
  if (attention) {
    require(o.num_kv_heads >= 1, "option num_kv_heads must be >= 1, got " + num(o.num_kv_heads));
    require(o.key_dim >= 1, "option key_dim must be >= 1, got " + num(o.key_dim));
    require(o.value_dim >= 0, "option value_dim must be >= 0 (0: same as key_dim), got " + num(o.value_dim));
    RetentionRule rule;
    if (k == LayerKind::SlidingAttention || k == LayerKind::HybridSliding) {
      require(o.sliding_window >= 1, "option sliding_window must be >= 1, got " + num(o.sliding_window));
      rule = {RetentionRule::Kind::Sliding, o.sliding_window};
      require(o.static_capacity == 0 || o.static_capacity >= o.sliding_window,
              "static_capacity " + num(o.static_capacity) + " cannot hold the window: it must be >= sliding_window (" +
                  num(o.sliding_window) + ")");
    } else if (k == LayerKind::ChunkedAttention) {
      require(o.chunk_size >= 1, "option chunk_size must be >= 1, got " + num(o.chunk_size));
      rule = {RetentionRule::Kind::Chunked, o.chunk_size};
      require(o.static_capacity == 0 || o.static_capacity >= o.chunk_size,
              "static_capacity " + num(o.static_capacity) + " cannot hold a chunk: it must be >= chunk_size (" +
                  num(o.chunk_size) + ")");
    }
    if (k == LayerKind::SparseAttention) {
      require(!o.side_dims.empty(), "deepseek_sparse_attention needs at least one side tensor (option side_dims)");
    }
    const std::int64_t vdim = o.value_dim == 0 ? o.key_dim : o.value_dim;
    checked_bytes({o.batch_size, o.num_kv_heads, std::max(o.key_dim, vdim), std::max<std::int64_t>(o.static_capacity, 1)},
                  dtype_size(o.dtype), where());
    TrackShape ks{TrackShape::Layout::Heads, o.batch_size, o.num_kv_heads, o.key_dim, o.dtype};
    TrackShape vs{TrackShape::Layout::Heads, o.batch_size, o.num_kv_heads, vdim, o.dtype};
    keys = TokenTrack(ks, rule, o.static_capacity, budget);
    values = TokenTrack(vs, rule, o.static_capacity, budget);
    for (std::size_t i = 0; i < o.side_dims.size(); ++i) {
      require(o.side_dims[i] >= 1, "side_dims[" + num(static_cast<std::int64_t>(i)) + "] must be >= 1, got " +
                                       num(o.side_dims[i]));
      TrackShape ss{TrackShape::Layout::Rows, o.batch_size, 1, o.side_dims[i], o.dtype};
      sides.emplace_back(ss, rule, o.static_capacity, budget);
    }
  }
  if (kind_is_linear(k)) {
    const bool conv_only = k == LayerKind::Conv;
    require(!o.conv_channels.empty() || (!conv_only && !o.recurrent_shapes.empty()),
            conv_only ? "a conv layer needs at least one conv state (option conv_channels)"
                      : "a linear-attention layer needs at least one conv or recurrent state "
                        "(options conv_channels, recurrent_shapes)");
    if (!o.conv_channels.empty()) {
      require(o.conv_kernel_size >= 1, "option conv_kernel_size must be >= 1, got " + num(o.conv_kernel_size));
    }
    for (std::size_t i = 0; i < o.conv_channels.size(); ++i) {
      require(o.conv_channels[i] >= 1, "conv_channels[" + num(static_cast<std::int64_t>(i)) + "] must be >= 1, got " +
                                           num(o.conv_channels[i]));
      checked_bytes({o.batch_size, o.conv_channels[i], o.conv_kernel_size}, dtype_size(o.dtype), where());
      TrackShape cs{TrackShape::Layout::Channels, o.batch_size, 1, o.conv_channels[i], o.dtype};
      convs.emplace_back(cs, RetentionRule{RetentionRule::Kind::Conv, o.conv_kernel_size}, 0, budget);
    }
    if (!conv_only) {
      for (std::size_t i = 0; i < o.recurrent_shapes.size(); ++i) {
        const auto& shape = o.recurrent_shapes[i];
        require(!shape.empty() && shape.size() <= 3,
                "recurrent_shapes[" + num(static_cast<std::int64_t>(i)) + "] must have 1 to 3 dimensions, got " +
                    num(static_cast<std::int64_t>(shape.size())));
        for (std::int64_t e : shape) {
          require(e >= 1, "recurrent_shapes[" + num(static_cast<std::int64_t>(i)) + "] has extent " + num(e) +
                              "; extents must be >= 1");
        }
        std::int64_t per_sequence = 1;
        for (std::int64_t e : shape) per_sequence *= std::min<std::int64_t>(e, std::int64_t{1} << 24);
        checked_bytes({o.batch_size, per_sequence}, dtype_size(o.recurrent_dtype), where());
        recurrents.emplace_back(shape, o.recurrent_dtype, o.batch_size, 1, budget);
      }
    }
  }
}

std::string Layer::Impl::where() const {
  return (index >= 0 ? "layer " + num(index) : std::string("standalone layer")) + " (" +
         std::string(layer_kind_name(kind)) + ")";
}

// ---- queries ---------------------------------------------------------------

std::int64_t Layer::Impl::length() const {
  if (attention) return keys.length();
  if (!convs.empty()) return convs.front().length();
  if (!recurrents.empty()) return recurrents.front().length;
  return 0;
}

void Layer::Impl::check_in_step(const char* operation) const {
  const std::int64_t L = length();
  auto mismatch = [&](const std::string& part, std::int64_t n) {
    throw StateError(where() + ": " + operation + " needs every part of the layer at the same length, but " +
                     (attention ? "keys hold " : "its first part holds ") + num(L) + " tokens and " + part +
                     " holds " + num(n) + " (an update of this layer is half done)");
  };
  if (attention && values.length() != L) mismatch("values", values.length());
  for (std::size_t i = 0; i < sides.size(); ++i)
    if (sides[i].length() != L) mismatch("side tensor " + num(static_cast<std::int64_t>(i)), sides[i].length());
  for (std::size_t i = 0; i < convs.size(); ++i)
    if (convs[i].length() != L) mismatch("conv state " + num(static_cast<std::int64_t>(i)), convs[i].length());
  for (std::size_t i = 0; i < recurrents.size(); ++i)
    if (recurrents[i].length != L)
      mismatch("recurrent state " + num(static_cast<std::int64_t>(i)), recurrents[i].length);
}

namespace {
bool is_sliding(const Layer::Impl& l) {
  return l.attention && l.keys.rule.kind == RetentionRule::Kind::Sliding;
}
}  // namespace

std::int64_t Layer::Impl::max_rollback() const {
  if (stateless()) return 0;
  const std::int64_t L = length();
  if (!recording && (linear() || (is_sliding(*this) && L >= keys.rule.size))) return 0;
  std::int64_t depth = L;
  if (attention) {
    depth = std::min(depth, keys.rule.max_rollback(keys.buffer));
    for (const auto& s : sides) depth = std::min(depth, s.rule.max_rollback(s.buffer));
  }
  for (const auto& c : convs) depth = std::min(depth, c.rule.max_rollback(c.buffer));
  for (const auto& r : recurrents) depth = std::min(depth, r.max_rollback());
  return depth;
}

void Layer::Impl::check_crop(std::int64_t n) const {
  if (stateless()) return;
  check_in_step("crop");
  const std::int64_t L = length();
  auto context = [&]() {
    std::string c = " [" + where() + ": L=" + num(L);
    if (is_sliding(*this)) c += ", W=" + num(keys.rule.size);
    if (!convs.empty()) c += ", K=" + num(convs.front().rule.size);
    return c + ", crop(" + num(n) + ")]";
  };
  if (n > 0) {
    if (linear()) throw RollbackError(kLinearPositive + context());
    if (is_sliding(*this) && L >= keys.rule.size) throw RollbackError(kSlidingPositive + context());
    if (attention && keys.rule.kind == RetentionRule::Kind::Chunked && keys.buffer.first() > 0) {
      throw RollbackError(where() + ": crop(" + num(n) + ") keeps the first " + num(n) +
                          " tokens, but this chunked layer no longer holds positions [0, " +
                          num(keys.buffer.first()) + "); crop with a negative int to remove tokens from the end");
    }
    return;
  }
  if (linear() && !recording) throw RollbackError(kNotTracking + context());
  if (is_sliding(*this) && L >= keys.rule.size && !recording) throw RollbackError(kNotTrackingSliding + context());
  if (n == 0) return;
  if (n == std::numeric_limits<std::int64_t>::min() || -n >= L) return;  // full rollback
  const std::int64_t k = -n;
  const std::int64_t depth = max_rollback();
  if (k > depth) {
    throw RollbackError(where() + ": crop(" + num(n) + ") asks to remove " + num(k) + " of " + num(L) +
                        " tokens, but at most " + num(depth) +
                        " can be removed exactly now (max_rollback); record more history with "
                        "activate_past_recording(R) before the tokens are appended, or remove all " +
                        num(L) + " tokens");
  }
}

void Layer::Impl::apply_crop(std::int64_t n) noexcept {
  if (stateless()) return;
  const std::int64_t L = length();
  auto for_tracks = [&](auto&& fn) {
    if (attention) {
      fn(keys);
      fn(values);
      for (auto& s : sides) fn(s);
    }
    for (auto& c : convs) fn(c);
  };
  std::int64_t remove = 0;
  if (n > 0) {
    remove = std::max<std::int64_t>(0, L - n);
  } else if (n == 0) {
    for_tracks([](TokenTrack& t) { t.buffer.evict_before(t.rule.keep_first(t.length(), 0)); });
    for (auto& r : recurrents) r.drop_history();
  } else {
    remove = n == std::numeric_limits<std::int64_t>::min() ? L : std::min(-n, L);
  }
  if (remove > 0 && remove >= L) {
    for_tracks([](TokenTrack& t) { t.clear(); });
    for (auto& r : recurrents) r.clear();
  } else if (remove > 0) {
    for_tracks([&](TokenTrack& t) { t.buffer.truncate(t.length() - remove); });
    for (auto& r : recurrents) r.rollback(remove);
  }
  ++generation;
}

// ---- recording -------------------------------------------------------------

Layer::Impl::RecordingPlan Layer::Impl::prepare_recording(bool on, std::int64_t R) const {
  RecordingPlan plan;
  if (on && R < 0) {
    throw InvalidArgument(where() + ": activate_past_recording(" + num(R) +
                          ") needs a non-negative number of tokens to keep");
  }
  if (stateless()) return plan;
  check_in_step(on ? "activate_past_recording" : "deactivate_past_recording");
  const std::int64_t history_tokens = on ? R : 0;
  if (attention && keys.buffer.is_static() && keys.rule.kind != RetentionRule::Kind::Full) {
    const std::int64_t needed = keys.rule.size + history_tokens;  // retained (W-1+R or C-1+R) plus one update
    if (needed > keys.buffer.slots()) {
      throw CapacityError(where() + ": activate_past_recording(" + num(R) + ") needs " + num(needed) +
                          " token slots (window or chunk " + num(keys.rule.size) + " - 1 + R + 1), but static_capacity is " +
                          num(keys.buffer.slots()));
    }
  }
  const std::int64_t slots = history_tokens + 1;
  for (const auto& r : recurrents) {
    if (r.slots == slots) continue;
    checked_bytes({slots, static_cast<std::int64_t>(r.state_bytes())}, 1, where());
    plan.recurrents.push_back(budgeted("activate_past_recording", [&] { return r.resized(slots); }));
  }
  return plan;
}

void Layer::Impl::commit_recording(bool on, std::int64_t R, RecordingPlan plan) noexcept {
  recording = on;
  history = on ? R : 0;
  if (stateless()) return;
  if (!plan.recurrents.empty()) recurrents = std::move(plan.recurrents);
  auto evict = [&](TokenTrack& t) { t.buffer.evict_before(t.rule.keep_first(t.length(), history)); };
  if (attention) {
    evict(keys);
    evict(values);
    for (auto& s : sides) evict(s);
  }
  for (auto& c : convs) evict(c);
  ++generation;
}

// ---- batch -----------------------------------------------------------------

void Layer::Impl::check_batch_rows(std::span<const std::int64_t> rows, const char* operation) const {
  if (rows.empty()) throw InvalidArgument(where() + ": " + operation + " needs at least one batch index");
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] < 0 || rows[i] >= batch) {
      throw IndexError(where() + ": " + operation + " index " + num(rows[i]) + " (entry " +
                       num(static_cast<std::int64_t>(i)) + ") is outside the batch [0, " + num(batch) + ")");
    }
  }
}

std::unique_ptr<Layer::Impl> Layer::Impl::gathered(std::span<const std::int64_t> rows) const {
  check_in_step("a batch operation");
  return budgeted("a batch operation", [&] { return gathered_unchecked(rows); });
}

std::unique_ptr<Layer::Impl> Layer::Impl::gathered_unchecked(std::span<const std::int64_t> rows) const {
  auto out = std::make_unique<Impl>();
  out->kind = kind;
  out->options = options;
  out->index = index;
  out->batch = static_cast<std::int64_t>(rows.size());
  out->recording = recording;
  out->history = history;
  out->generation = generation + 1;
  out->budget = budget;
  out->attention = attention;
  if (attention) {
    out->keys = keys.gathered(rows);
    out->values = values.gathered(rows);
    for (const auto& s : sides) out->sides.push_back(s.gathered(rows));
  }
  for (const auto& c : convs) out->convs.push_back(c.gathered(rows));
  for (const auto& r : recurrents) out->recurrents.push_back(r.gathered(rows));
  return out;
}

std::unique_ptr<Layer::Impl> Layer::Impl::fresh() const {
  return budgeted("reset", [&] { return fresh_unchecked(); });
}

std::unique_ptr<Layer::Impl> Layer::Impl::fresh_unchecked() const {
  auto out = std::make_unique<Impl>(kind, options, index, budget);
  out->commit_recording(recording, history, out->prepare_recording(recording, history));
  out->generation = generation + 1;
  return out;
}

void Layer::Impl::attach_budget(detail::MemoryBudget* b) noexcept {
  budget = b;
  if (attention) {
    keys.buffer.attach(b);
    values.buffer.attach(b);
    for (auto& s : sides) s.buffer.attach(b);
  }
  for (auto& c : convs) c.buffer.attach(b);
  for (auto& r : recurrents) r.ring.attach(b);
}

std::vector<std::int64_t> repeat_rows(std::int64_t batch, std::int64_t repeats) {
  std::vector<std::int64_t> rows;
  rows.reserve(static_cast<std::size_t>(batch * repeats));
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t r = 0; r < repeats; ++r) rows.push_back(b);
  return rows;
}

// ---- accessors with checks -------------------------------------------------

void Layer::Impl::check_attention(const char* operation) const {
  if (!attention) {
    throw StateError(where() + ": " + operation + " needs an attention layer; " +
                     std::string(layer_kind_name(kind)) + " layers hold no keys");
  }
}

const TokenTrack& Layer::Impl::conv(int state, const char* operation) const {
  if (convs.empty()) {
    throw StateError(std::string(kConvOnNonLinear) + " [" + where() + ": " + operation + " on a layer without conv states]");
  }
  if (state < 0 || static_cast<std::size_t>(state) >= convs.size()) {
    throw IndexError(where() + ": " + operation + " conv state " + num(state) + " is outside [0, " +
                     num(static_cast<std::int64_t>(convs.size())) + ")");
  }
  return convs[static_cast<std::size_t>(state)];
}

const detail::RecurrentState& Layer::Impl::recurrent(int state, const char* operation) const {
  if (recurrents.empty()) {
    throw StateError(where() + ": " + operation + " needs a recurrent state; this " +
                     std::string(layer_kind_name(kind)) + " layer has none");
  }
  if (state < 0 || static_cast<std::size_t>(state) >= recurrents.size()) {
    throw IndexError(where() + ": " + operation + " recurrent state " + num(state) + " is outside [0, " +
                     num(static_cast<std::int64_t>(recurrents.size())) + ")");
  }
  return recurrents[static_cast<std::size_t>(state)];
}

const TokenTrack& Layer::Impl::side(int s, const char* operation) const {
  check_attention(operation);
  if (s < 0 || static_cast<std::size_t>(s) >= sides.size()) {
    throw IndexError(where() + ": " + operation + " side tensor " + num(s) + " is outside [0, " +
                     num(static_cast<std::int64_t>(sides.size())) + ")");
  }
  return sides[static_cast<std::size_t>(s)];
}

namespace {

// Checks `input` against a track's expected shape; returns q.
std::int64_t check_tokens(const Layer::Impl& l, const TokenTrack& track, const TensorView& input,
                          const char* what) {
  const TrackShape& s = track.shape;
  auto fail = [&](const std::string& why) {
    throw InvalidArgument(l.where() + ": " + what + " " + input.describe() + " " + why + "; expected " +
                          s.expected("q") + " " + std::string(dtype_name(s.dtype)));
  };
  if (input.rank != s.rank()) fail("has rank " + num(input.rank));
  if (input.dtype != s.dtype) fail("has the wrong dtype");
  if (input.size(0) != s.batch) fail("has batch size " + num(input.size(0)));
  const std::int64_t q = input.size(s.token_dim());
  if (q < 1) fail("has no tokens");
  switch (s.layout) {
    case TrackShape::Layout::Heads:
      if (input.size(1) != s.heads || input.size(3) != s.width) fail("has the wrong shape");
      break;
    case TrackShape::Layout::Rows:
      if (input.size(2) != s.width) fail("has the wrong shape");
      break;
    case TrackShape::Layout::Channels:
      if (input.size(1) != s.width) fail("has the wrong shape");
      break;
  }
  if (input.data == nullptr) fail("has no data");
  return q;
}

void check_room(const Layer::Impl& l, const TokenTrack& track, std::int64_t q, const char* what) {
  if (track.buffer.can_append(q)) return;
  throw CapacityError(l.where() + ": " + what + " of " + num(q) + " tokens needs " +
                      num(track.buffer.rows_needed(q)) + " token slots (" + num(track.buffer.stored()) +
                      " retained + " + num(q) + " new), but static_capacity is " + num(track.buffer.slots()));
}

}  // namespace

// ---- Layer -----------------------------------------------------------------

Layer::Layer(LayerKind kind, const LayerOptions& options, int index)
    : impl_(std::make_unique<Impl>(kind, options, index)) {}
Layer::~Layer() = default;
Layer::Layer(Layer&&) noexcept = default;
Layer& Layer::operator=(Layer&&) noexcept = default;

LayerKind Layer::kind() const { return impl_->kind; }
const LayerOptions& Layer::options() const { return impl_->options; }
bool Layer::has_attention() const { return impl_->attention; }
bool Layer::is_linear() const { return impl_->linear(); }
bool Layer::is_stateless() const { return impl_->stateless(); }
void Layer::set_index(int index) { impl_->index = index; }
int Layer::index() const { return impl_->index; }
std::int64_t Layer::get_seq_length() const { return impl_->length(); }
std::int64_t Layer::batch_size() const { return impl_->batch; }

MaskSizes Layer::get_mask_sizes(std::int64_t q) const {
  impl_->check_attention("get_mask_sizes");
  if (q < 1) throw InvalidArgument(impl_->where() + ": get_mask_sizes(" + num(q) + ") needs a query length >= 1");
  const std::int64_t L = impl_->keys.length();
  const std::int64_t first = impl_->keys.rule.visible_first(L);
  return {L + q - first, first};
}

KeyValueView Layer::update(const TensorView& keys, const TensorView& values) {
  Impl& l = *impl_;
  l.check_attention("update");
  const std::int64_t q = check_tokens(l, l.keys, keys, "keys");
  const std::int64_t qv = check_tokens(l, l.values, values, "values");
  if (q != qv) {
    throw InvalidArgument(l.where() + ": update got " + num(q) + " key tokens but " + num(qv) + " value tokens");
  }
  if (l.values.length() != l.keys.length()) l.check_in_step("update");
  check_room(l, l.keys, q, "update");
  // Reserve both before writing either, so an allocation failure changes nothing.
  l.budgeted("update", [&] {
    l.keys.buffer.reserve_append(q);
    l.values.buffer.reserve_append(q);
  });
  return {l.keys.append(keys, q, l.history), l.values.append(values, q, l.history)};
}

TensorView Layer::update_side(int side, const TensorView& rows) {
  Impl& l = *impl_;
  auto& track = const_cast<TokenTrack&>(l.side(side, "update_side"));
  const std::int64_t q = check_tokens(l, track, rows, "side rows");
  check_room(l, track, q, "update_side");
  l.budgeted("update_side", [&] { track.buffer.reserve_append(q); });
  return track.append(rows, q, l.history);
}

KeyValueView Layer::keys_values() const {
  impl_->check_attention("keys_values");
  return {impl_->keys.retained(), impl_->values.retained()};
}

TensorView Layer::side(int s) const { return impl_->side(s, "side").retained(); }

PositionRange Layer::stored_range() const {
  impl_->check_attention("stored_range");
  return {impl_->keys.buffer.first(), impl_->keys.buffer.end()};
}

TensorView Layer::update_conv_state(int state, const TensorView& x) {
  Impl& l = *impl_;
  auto& track = const_cast<TokenTrack&>(l.conv(state, "update_conv_state"));
  const std::int64_t q = check_tokens(l, track, x, "conv input");
  l.budgeted("update_conv_state", [&] { track.buffer.reserve_append(q); });
  return track.append(x, q, l.history);
}

TensorView Layer::get_conv_state(int state) const {
  const TokenTrack& t = impl_->conv(state, "get_conv_state");
  return t.view(t.length() - t.rule.size, t.rule.size);
}

TensorView Layer::conv_inputs(int state) const { return impl_->conv(state, "conv_inputs").retained(); }

PositionRange Layer::conv_range(int state) const {
  const TokenTrack& t = impl_->conv(state, "conv_range");
  return {t.buffer.first(), t.buffer.end()};
}

RecurrentUpdate Layer::begin_recurrent_update(int state, std::int64_t q) {
  impl_->recurrent(state, "begin_recurrent_update");
  if (q < 1) {
    throw InvalidArgument(impl_->where() + ": begin_recurrent_update(" + num(q) + ") needs at least one token");
  }
  return RecurrentUpdate(this, state, q, impl_->generation,
                         impl_->recurrents[static_cast<std::size_t>(state)].version);
}

void Layer::update_recurrent_state(int state, const TensorView& new_state) {
  const auto& r = impl_->recurrent(state, "update_recurrent_state");
  const TensorView expected = r.view(r.length);
  if (new_state.rank != expected.rank || new_state.shape != expected.shape || new_state.dtype != r.dtype ||
      new_state.data == nullptr) {
    throw InvalidArgument(impl_->where() + ": update_recurrent_state got " + new_state.describe() + "; expected " +
                          expected.describe());
  }
  RecurrentUpdate u = begin_recurrent_update(state, 1);
  copy_tensor(new_state, u.next(1));
  u.commit();
}

TensorView Layer::get_recurrent_state(int state) const {
  const auto& r = impl_->recurrent(state, "get_recurrent_state");
  return r.view(r.length);
}

TensorView Layer::recurrent_snapshot(int state, std::int64_t pos) const {
  const auto& r = impl_->recurrent(state, "recurrent_snapshot");
  if (pos < r.oldest() || pos > r.length) {
    throw IndexError(impl_->where() + ": recurrent_snapshot(" + num(pos) + ") is not held; snapshots S(" +
                     num(r.oldest()) + ")..S(" + num(r.length) + ") are");
  }
  return r.view(pos);
}

bool Layer::has_previous_state() const {
  if (!impl_->linear()) throw StateError(std::string(kHasPreviousOnAttention) + " [" + impl_->where() + "]");
  if (!impl_->convs.empty()) return impl_->convs.front().length() > 0;
  return impl_->recurrents.front().length > 0;
}

void Layer::crop(std::int64_t n) {
  impl_->check_crop(n);
  if (n > 0) detail::warn_positive_crop_once();
  impl_->apply_crop(n);
}

void Layer::check_crop(std::int64_t n) const { impl_->check_crop(n); }
std::int64_t Layer::max_rollback() const { return impl_->max_rollback(); }

void Layer::activate_past_recording(std::int64_t max_tokens) {
  impl_->commit_recording(true, max_tokens, impl_->prepare_recording(true, max_tokens));
}

void Layer::deactivate_past_recording() { impl_->commit_recording(false, 0, impl_->prepare_recording(false, 0)); }
bool Layer::is_recording() const { return impl_->recording; }
std::int64_t Layer::recording_capacity() const { return impl_->history; }

void Layer::batch_select_indices(std::span<const std::int64_t> indices) {
  impl_->check_batch_rows(indices, "batch_select_indices");
  impl_ = impl_->gathered(indices);
}

void Layer::batch_repeat_interleave(std::int64_t repeats) {
  if (repeats < 1) {
    throw InvalidArgument(impl_->where() + ": batch_repeat_interleave(" + num(repeats) + ") needs repeats >= 1");
  }
  const auto rows = repeat_rows(impl_->batch, repeats);
  impl_ = impl_->gathered(rows);
}

void Layer::reorder_cache(std::span<const std::int64_t> beam_idx) {
  if (static_cast<std::int64_t>(beam_idx.size()) != impl_->batch) {
    throw InvalidArgument(impl_->where() + ": reorder_cache got " + num(static_cast<std::int64_t>(beam_idx.size())) +
                          " indices for a batch of " + num(impl_->batch));
  }
  impl_->check_batch_rows(beam_idx, "reorder_cache");
  impl_ = impl_->gathered(beam_idx);
}

void Layer::reset() { impl_ = impl_->fresh(); }

LayerMemory Layer::memory() const {
  LayerMemory m;
  m.kind = std::string(layer_kind_name(impl_->kind));
  auto add = [&](const TokenTrack& t) {
    m.bytes_reserved += t.buffer.bytes_reserved();
    m.bytes_used += t.buffer.bytes_used();
  };
  if (impl_->attention) {
    add(impl_->keys);
    add(impl_->values);
    for (const auto& s : impl_->sides) add(s);
  }
  for (const auto& c : impl_->convs) add(c);
  for (const auto& r : impl_->recurrents) {
    m.bytes_reserved += r.bytes_reserved();
    m.bytes_used += r.bytes_used();
  }
  return m;
}

// ---- RecurrentUpdate ---------------------------------------------------------

RecurrentUpdate::RecurrentUpdate(Layer* layer, int state, std::int64_t q, std::uint64_t generation,
                                 std::uint64_t version)
    : layer_(layer), state_(state), q_(q), generation_(generation), version_(version) {}
RecurrentUpdate::RecurrentUpdate(RecurrentUpdate&& o) noexcept
    : layer_(std::exchange(o.layer_, nullptr)), state_(o.state_), q_(o.q_), generation_(o.generation_),
      version_(o.version_) {}
RecurrentUpdate& RecurrentUpdate::operator=(RecurrentUpdate&& o) noexcept {
  layer_ = std::exchange(o.layer_, nullptr);
  state_ = o.state_;
  q_ = o.q_;
  generation_ = o.generation_;
  version_ = o.version_;
  return *this;
}
RecurrentUpdate::~RecurrentUpdate() = default;

namespace {
const detail::RecurrentState& live_state(Layer* layer, const Layer::Impl* impl, int state, std::uint64_t generation,
                                         std::uint64_t version, const char* operation) {
  if (layer == nullptr) {
    throw StateError(std::string("RecurrentUpdate::") + operation + ": the update was already committed or moved from");
  }
  if (impl->generation != generation || impl->recurrents[static_cast<std::size_t>(state)].version != version) {
    throw StateError(impl->where() + ": RecurrentUpdate::" + operation +
                     ": the layer changed since begin_recurrent_update; begin a new update");
  }
  return impl->recurrents[static_cast<std::size_t>(state)];
}
}  // namespace

TensorView RecurrentUpdate::previous() const {
  const auto& r = live_state(layer_, layer_ ? layer_->impl_.get() : nullptr, state_, generation_, version_, "previous");
  return r.view(r.length);
}

TensorView RecurrentUpdate::next(std::int64_t t) const {
  const auto& r = live_state(layer_, layer_ ? layer_->impl_.get() : nullptr, state_, generation_, version_, "next");
  if (t < 1 || t > q_) {
    throw IndexError(layer_->impl_->where() + ": RecurrentUpdate::next(" + num(t) + ") is outside [1, " + num(q_) + "]");
  }
  return r.view(r.length + t);
}

void RecurrentUpdate::commit() {
  live_state(layer_, layer_ ? layer_->impl_.get() : nullptr, state_, generation_, version_, "commit");
  Layer::Impl& impl = *layer_->impl_;
  impl.recurrents[static_cast<std::size_t>(state_)].advance(q_);
  layer_ = nullptr;
}

}  // namespace rwd
