#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <new>
#include <string_view>
#include <utility>

#include "aligned_memory.h"
#include "cache/layer_impl.h"
#include "cache/warnings.h"
#include "tensor_copy.h"

namespace rwd {
namespace {

using detail::RetentionRule;
using detail::TokenTrack;
using detail::TrackShape;

// The messages users already search for (docs/semantics.md section 8).
constexpr const char* kConvOnNonLinear = "Cannot call `update_conv_state` on a non-LinearAttention layer!";

using detail::kind_has_attention;
using detail::kind_is_linear;

std::string num(std::int64_t v) { return std::to_string(v); }

// Multiplies sizes, throwing CapacityError instead of overflowing.
std::size_t checked_bytes(std::initializer_list<std::int64_t> factors, std::size_t element, const std::string& where) {
  std::size_t total = element;
  for (std::int64_t f : factors) total = detail::checked_mul(static_cast<std::int64_t>(total), f, where);
  return total;
}

}  // namespace

// ---- layer kind names (the one table) ------------------------------------

namespace {

struct KindName {
  LayerKind kind;
  std::string_view name;
};
constexpr std::array<KindName, 10> kKindNames{{
    {LayerKind::FullAttention, "full_attention"},
    {LayerKind::SlidingAttention, "sliding_attention"},
    {LayerKind::ChunkedAttention, "chunked_attention"},
    {LayerKind::LinearAttention, "linear_attention"},
    {LayerKind::Conv, "conv"},
    {LayerKind::Hybrid, "hybrid"},
    {LayerKind::HybridSliding, "hybrid_sliding"},
    {LayerKind::SparseAttention, "deepseek_sparse_attention"},
    {LayerKind::Moe, "moe"},
    {LayerKind::Mlp, "mlp"},
}};

std::string accepted_kind_names() {
  std::string all;
  for (const auto& k : kKindNames) all += (all.empty() ? "" : ", ") + std::string(k.name);
  return all;
}

}  // namespace

LayerKind parse_layer_kind(std::string_view name) {
  for (const auto& k : kKindNames)
    if (k.name == name) return k.kind;
  throw InvalidArgument("unknown layer type '" + std::string(name) + "'; accepted: " + accepted_kind_names());
}

std::string_view layer_kind_name(LayerKind kind) {
  for (const auto& k : kKindNames)
    if (k.kind == kind) return k.name;
  return "unknown";
}

// ---- construction ----------------------------------------------------------

Layer::Impl::Impl(LayerKind k, const LayerOptions& o, int layer_index, detail::MemoryBudget* memory_budget)
    : kind(k), options(o), index(layer_index), batch(o.batch_size), budget(memory_budget),
      storage(o.storage ? o.storage : default_storage()), device(storage->device()) {
  options.storage = storage;
  require_option(o.batch_size >= 1 && o.batch_size <= detail::kMaxBatch,
                 "option batch_size must be in [1, 2^24], got " + num(o.batch_size));
  require_option(o.static_capacity >= 0, "option static_capacity must be >= 0, got " + num(o.static_capacity));
  attention = kind_has_attention(k);
  if (attention) build_attention_parts(o);
  if (kind_is_linear(k)) build_linear_parts(o);
}

void Layer::Impl::require_option(bool ok, const std::string& what) const {
  if (!ok) throw InvalidArgument(where() + ": " + what);
}

void Layer::Impl::build_attention_parts(const LayerOptions& o) {
  require_option(o.num_kv_heads >= 1, "option num_kv_heads must be >= 1, got " + num(o.num_kv_heads));
  require_option(o.key_dim >= 1, "option key_dim must be >= 1, got " + num(o.key_dim));
  require_option(o.value_dim >= 0, "option value_dim must be >= 0 (0: same as key_dim), got " + num(o.value_dim));
  RetentionRule rule;
  if (kind == LayerKind::SlidingAttention || kind == LayerKind::HybridSliding) {
    require_option(o.sliding_window >= 1, "option sliding_window must be >= 1, got " + num(o.sliding_window));
    rule = {RetentionRule::Kind::Sliding, std::min(o.sliding_window, detail::kMaxWindow)};
    require_option(o.static_capacity == 0 || o.static_capacity >= o.sliding_window,
                   "static_capacity " + num(o.static_capacity) +
                       " cannot hold the window: it must be >= sliding_window (" + num(o.sliding_window) + ")");
  } else if (kind == LayerKind::ChunkedAttention) {
    require_option(o.chunk_size >= 1, "option chunk_size must be >= 1, got " + num(o.chunk_size));
    rule = {RetentionRule::Kind::Chunked, std::min(o.chunk_size, detail::kMaxWindow)};
    require_option(o.static_capacity == 0 || o.static_capacity >= o.chunk_size,
                   "static_capacity " + num(o.static_capacity) + " cannot hold a chunk: it must be >= chunk_size (" +
                       num(o.chunk_size) + ")");
  }
  if (kind == LayerKind::SparseAttention) {
    require_option(!o.side_dims.empty(), "deepseek_sparse_attention needs at least one side tensor (option side_dims)");
  }
  const std::int64_t vdim = o.value_dim == 0 ? o.key_dim : o.value_dim;
  checked_bytes({o.batch_size, o.num_kv_heads, std::max(o.key_dim, vdim), std::max<std::int64_t>(o.static_capacity, 1)},
                dtype_size(o.dtype), where());
  TrackShape ks{TrackShape::Layout::Heads, o.batch_size, o.num_kv_heads, o.key_dim, o.dtype};
  TrackShape vs{TrackShape::Layout::Heads, o.batch_size, o.num_kv_heads, vdim, o.dtype};
  keys = TokenTrack(ks, rule, o.static_capacity, storage, budget);
  values = TokenTrack(vs, rule, o.static_capacity, storage, budget);
  for (std::size_t i = 0; i < o.side_dims.size(); ++i) {
    require_option(o.side_dims[i] >= 1,
                   "side_dims[" + num(static_cast<std::int64_t>(i)) + "] must be >= 1, got " + num(o.side_dims[i]));
    checked_bytes({o.batch_size, o.side_dims[i], std::max<std::int64_t>(o.static_capacity, 1)}, dtype_size(o.dtype),
                  where());
    TrackShape ss{TrackShape::Layout::Rows, o.batch_size, 1, o.side_dims[i], o.dtype};
    sides.emplace_back(ss, rule, o.static_capacity, storage, budget);
  }
}

void Layer::Impl::build_linear_parts(const LayerOptions& o) {
  const bool conv_only = kind == LayerKind::Conv;
  require_option(!o.conv_channels.empty() || (!conv_only && !o.recurrent_shapes.empty()),
                 conv_only ? "a conv layer needs at least one conv state (option conv_channels)"
                           : "a linear-attention layer needs at least one conv or recurrent state "
                             "(options conv_channels, recurrent_shapes)");
  if (!o.conv_channels.empty()) {
    require_option(o.conv_kernel_size >= 1, "option conv_kernel_size must be >= 1, got " + num(o.conv_kernel_size));
  }
  for (std::size_t i = 0; i < o.conv_channels.size(); ++i) {
    const std::string name = "conv_channels[" + num(static_cast<std::int64_t>(i)) + "]";
    require_option(o.conv_channels[i] >= 1, name + " must be >= 1, got " + num(o.conv_channels[i]));
    checked_bytes({o.batch_size, o.conv_channels[i], o.conv_kernel_size}, dtype_size(o.dtype), where());
    TrackShape cs{TrackShape::Layout::Channels, o.batch_size, 1, o.conv_channels[i], o.dtype};
    convs.emplace_back(cs, RetentionRule{RetentionRule::Kind::Conv, o.conv_kernel_size}, 0, storage, budget);
  }
  if (!conv_only) {
    for (std::size_t i = 0; i < o.recurrent_shapes.size(); ++i) {
      const auto& shape = o.recurrent_shapes[i];
      const std::string name = "recurrent_shapes[" + num(static_cast<std::int64_t>(i)) + "]";
      require_option(!shape.empty() && shape.size() <= 3,
                     name + " must have 1 to 3 dimensions, got " + num(static_cast<std::int64_t>(shape.size())));
      for (std::int64_t e : shape) {
        require_option(e >= 1, name + " has extent " + num(e) + "; extents must be >= 1");
      }
      std::size_t bytes = checked_bytes({o.batch_size, 2}, dtype_size(o.recurrent_dtype), where());
      for (std::int64_t e : shape) bytes = checked_bytes({e}, bytes, where());
      // R + 1 = 1 snapshot, plus the fresh slot an update writes into.
      recurrents.emplace_back(shape, o.recurrent_dtype, o.batch_size, 1, 2, storage, budget);
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

bool Layer::Impl::in_step() const {
  const std::int64_t L = length();
  bool ok = true;
  for_tracks([&](const TokenTrack& t) { ok = ok && t.length() == L; });
  for (const auto& r : recurrents) ok = ok && r.length == L;
  return ok;
}

void Layer::Impl::check_in_step(const char* operation) const {
  const std::int64_t L = length();
  auto mismatch = [&](const std::string& part, std::int64_t n) {
    throw StateError(where() + ": " + operation + " needs every part of the layer at the same length, but " +
                     (attention ? "keys hold " : "its first part holds ") + num(L) + " tokens and " + part + " holds " +
                     num(n) + " (an update of this layer is half done)");
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
bool is_sliding(const Layer::Impl& l) { return l.attention && l.keys.rule.kind == RetentionRule::Kind::Sliding; }
}  // namespace

std::int64_t Layer::Impl::max_rollback(bool received_only) const {
  if (stateless()) return 0;
  const std::int64_t L = length();
  if (!recording && linear()) return 0;
  std::int64_t depth = L;
  if (attention) {
    depth = std::min(depth, keys.rule.max_rollback(keys.buffer.first(), keys.buffer.end(), recording));
    for (const auto& s : sides)
      depth = std::min(depth, s.rule.max_rollback(s.buffer.first(), s.buffer.end(), recording));
  }
  for (const auto& c : convs) depth = std::min(depth, c.rule.max_rollback(c.buffer));
  for (const auto& r : recurrents) depth = std::min(depth, received_only ? r.max_rollback() : r.held_rollback());
  return depth;
}

void Layer::Impl::check_crop(std::int64_t n) const {
  if (stateless()) return;
  if (forward) refuse_during_forward("crop(" + num(n) + ")");
  check_in_step("crop");
  const std::int64_t L = length();
  auto context = [&]() {
    std::string c = " [" + where() + ": L=" + num(L);
    if (is_sliding(*this)) c += ", W=" + num(keys.rule.size);
    if (!convs.empty()) c += ", K=" + num(convs.front().rule.size);
    return c + ", crop(" + num(n) + ")]";
  };
  if (n > 0 && linear()) throw RollbackError(kLinearPositive + context());
  if (n <= 0 && linear() && !recording) throw RollbackError(kNotTracking + context());
  if (attention)
    check_attention_crop(
        keys.rule, keys.buffer.first(), L, recording, n, [this] { return where(); }, context);
  if (n >= 0) return;
  if (n == std::numeric_limits<std::int64_t>::min() || -n >= L) return;  // full rollback
  const std::int64_t depth = max_rollback();
  if (-n <= depth) return;
  // Deeper than max_rollback: exact only when it lands below every
  // placeholder a final-state-only update left, on states still held.
  const std::int64_t target = L + n;
  for (std::size_t i = 0; i < recurrents.size(); ++i) {
    const auto& r = recurrents[i];
    if (!r.is_unknown(target)) continue;
    throw RollbackError(where() + ": crop(" + num(n) + ") would restore recurrent state " +
                        num(static_cast<std::int64_t>(i)) + " after " + num(target) +
                        " tokens, which the layer never received: update_recurrent_state_final gave only the "
                        "final state of a multi-token update, so the states after " +
                        num(r.unknown_first) + ".." + num(r.unknown_end - 1) +
                        " tokens are unknown; the largest exact rollback is " + num(depth) + " (or to a length below " +
                        num(r.unknown_first) +
                        " still held); give every state (begin_recurrent_update) to make such rollbacks exact");
  }
  if (-n <= max_rollback(false)) return;
  throw_crop_too_deep(where(), n, L, depth);
}

void throw_crop_too_deep(const std::string& where, std::int64_t n, std::int64_t L, std::int64_t depth) {
  throw RollbackError(where + ": crop(" + num(n) + ") asks to remove " + num(-n) + " of " + num(L) +
                      " tokens, but at most " + num(depth) +
                      " can be removed exactly now (max_rollback); record more history with "
                      "activate_past_recording(R) before the tokens are appended, or remove all " +
                      num(L) + " tokens");
}

void Layer::Impl::apply_crop(std::int64_t n) noexcept {
  if (stateless()) return;
  const std::int64_t L = length();
  std::int64_t remove = 0;
  if (n > 0) {
    remove = std::max<std::int64_t>(0, L - n);
  } else if (n == 0) {
    for_tracks([this](TokenTrack& t) {
      t.buffer.evict_before(t.rule.keep_first(t.length(), 0));
      t.buffer.shrink_if_oversized(t.rule.refill_rows(history));
    });
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
  for_tracks([](const TokenTrack& t) { t.protect(); });
  for (const auto& r : recurrents) r.protect();
  ++generation;
}

// ---- recording -------------------------------------------------------------

Layer::Impl::RecordingPlan Layer::Impl::prepare_recording(bool on, std::int64_t R) const {
  RecordingPlan plan;
  const char* operation = on ? "activate_past_recording" : "deactivate_past_recording";
  if (on && (R < 0 || R > detail::kMaxTokens)) {
    throw InvalidArgument(where() + ": activate_past_recording(" + num(R) +
                          ") needs a number of tokens to keep in [0, 2^40]");
  }
  if (stateless()) return plan;
  if (forward) refuse_during_forward(operation);
  check_in_step(operation);
  const std::int64_t history_tokens = on ? R : 0;
  if (attention && keys.buffer.is_static() && keys.rule.kind != RetentionRule::Kind::Full) {
    const std::int64_t needed = keys.rule.size + history_tokens;  // retained (W-1+R or C-1+R) plus one update
    if (needed > keys.buffer.slots()) {
      throw CapacityError(where() + ": activate_past_recording(" + num(R) + ") needs " + num(needed) +
                          " token slots (window or chunk " + num(keys.rule.size) +
                          " - 1 + R + 1), but static_capacity is " + num(keys.buffer.slots()));
    }
  }
  const std::int64_t snapshots = history_tokens + 1;
  for (const auto& r : recurrents) {
    if (r.history == snapshots) continue;
    checked_bytes({snapshots + 1, static_cast<std::int64_t>(r.state_bytes())}, 1, where());
    plan.recurrents.push_back(budgeted(operation, [&] { return r.resized(snapshots); }));
  }
  return plan;
}

void Layer::Impl::commit_recording(bool on, std::int64_t R, RecordingPlan plan) noexcept {
  recording = on;
  history = on ? R : 0;
  if (stateless()) return;
  if (!plan.recurrents.empty()) recurrents = std::move(plan.recurrents);
  for_tracks([&](TokenTrack& t) {
    t.buffer.evict_before(t.rule.keep_first(t.length(), history));
    t.protect();
  });
  ++generation;
}

// ---- forward transactions --------------------------------------------------

Layer::Impl::ForwardPlan Layer::Impl::plan_forward(std::int64_t q, const char* operation) const {
  ForwardPlan plan;
  if (stateless()) return plan;
  check_in_step(operation);
  auto room = [&](const TokenTrack& t, const char* part) {
    if (!t.buffer.can_append(q)) {
      // begin_forward keeps the message users know; other callers say how many tokens.
      const std::string call = std::string_view(operation) == "begin_forward"
                                   ? "begin_forward(" + num(q) + ")"
                                   : operation + (" of " + num(q) + " tokens");
      throw CapacityError(where() + ": " + call + " needs " + num(t.buffer.rows_needed(q)) + " token slots for its " +
                          part + " (" + num(t.buffer.stored()) + " retained + " + num(q) +
                          " new), but static_capacity is " + num(t.buffer.slots()));
    }
  };
  for_tracks([&](const TokenTrack& t) {
    room(t, t.shape.layout == detail::TrackShape::Layout::Channels ? "conv inputs" : "keys");
  });
  bool allocates = false;
  for_tracks([&](const TokenTrack& t) { allocates = allocates || t.buffer.plan_allocates(q); });
  for (const auto& r : recurrents) allocates = allocates || !r.has_room(q);
  budgeted(operation, [&] {
    // The decode path (room left by earlier growth) allocates nothing here.
    if (allocates) {
      for_tracks([&](const TokenTrack& t) { plan.tracks.push_back(t.buffer.plan_append(q)); });
      for (const auto& r : recurrents) {
        if (r.has_room(q)) {
          plan.recurrents.emplace_back();
        } else {
          plan.recurrents.emplace_back(r.with_room(q));
        }
      }
    }
    // open_forward cannot fail: the record of what to restore gets its room now.
    std::size_t tracks = 0;
    for_tracks([&](const TokenTrack&) { ++tracks; });
    saved.tracks.reserve(tracks);
    saved.recurrents.resize(recurrents.size());
    for (std::size_t j = 0; j < recurrents.size(); ++j) {
      const std::size_t capacity = j < plan.recurrents.size() && plan.recurrents[j] ? plan.recurrents[j]->table.size()
                                                                                    : recurrents[j].table.size();
      saved.recurrents[j].table.reserve(capacity);
    }
  });
  return plan;
}

void Layer::Impl::open_forward(std::int64_t q, ForwardPlan plan) noexcept {
  if (stateless()) return;
  std::size_t i = 0;
  saved.tracks.clear();  // within the capacity plan_forward reserved: no allocation
  for_tracks([&](TokenTrack& t) {
    t.buffer.apply(plan.tracks.empty() ? detail::PositionBuffer::Plan{} : std::move(plan.tracks[i++]), q);
    saved.tracks.push_back({t.buffer.first(), t.buffer.end()});
    t.protect();
  });
  for (std::size_t j = 0; j < recurrents.size(); ++j) {
    if (!plan.recurrents.empty() && plan.recurrents[j]) recurrents[j] = std::move(*plan.recurrents[j]);
    const auto& r = recurrents[j];
    auto& record = saved.recurrents[j];
    record.length = r.length;
    record.held = r.held;
    record.unknown_first = r.unknown_first;
    record.unknown_end = r.unknown_end;
    record.table.assign(r.table.begin(), r.table.end());
  }
  forward = true;
  forward_start = length();
  forward_end = forward_start + q;
  ++generation;
}

void Layer::Impl::refuse_during_forward(const std::string& operation) const {
  throw StateError(where() + ": " + operation + " during an open forward; commit() or abandon() it first");
}

void Layer::Impl::check_forward_room(std::int64_t part_length, std::int64_t q, const std::string& part) const {
  if (!forward || q <= forward_end - part_length) return;
  throw StateError(where() + ": an update of " + num(q) + " tokens to " + part + " at length " + num(part_length) +
                   " passes the open forward, which ends at length " + num(forward_end) +
                   " (begin_forward reserved room for that many tokens per part)");
}

void Layer::Impl::check_forward_complete() const {
  if (!forward) return;
  bool complete = true;
  for_tracks([&](const TokenTrack& t) { complete = complete && t.length() == forward_end; });
  for (const auto& r : recurrents) complete = complete && r.length == forward_end;
  if (complete) return;  // the message below is built only for a refusal
  std::string missing;
  auto check = [&](std::int64_t n, const std::string& part) {
    if (n != forward_end) missing += (missing.empty() ? "" : ", ") + part + " at " + num(n);
  };
  if (attention) {
    check(keys.length(), "keys");
    check(values.length(), "values");
    for (std::size_t i = 0; i < sides.size(); ++i)
      check(sides[i].length(), "side tensor " + num(static_cast<std::int64_t>(i)));
  }
  for (std::size_t i = 0; i < convs.size(); ++i)
    check(convs[i].length(), "conv state " + num(static_cast<std::int64_t>(i)));
  for (std::size_t i = 0; i < recurrents.size(); ++i)
    check(recurrents[i].length, "recurrent state " + num(static_cast<std::int64_t>(i)));
  if (!missing.empty()) {
    throw StateError(where() + ": the forward must bring every part to length " + num(forward_end) + ", but " +
                     missing);
  }
}

void Layer::Impl::abandon_forward() noexcept {
  if (!forward) return;
  std::size_t i = 0;
  for_tracks([&](TokenTrack& t) {
    const PositionRange& range = saved.tracks[i++];
    const bool written = t.buffer.end() != range.end;
    t.buffer.restore(range.first, range.end);
    if (written) t.buffer.relocate();  // debug builds: the forward's views (conv windows too) become unreadable
    t.protect();
  });
  for (std::size_t j = 0; j < recurrents.size(); ++j) {
    auto& r = recurrents[j];
    const auto& record = saved.recurrents[j];
    r.length = record.length;
    r.held = record.held;
    r.unknown_first = record.unknown_first;
    r.unknown_end = record.unknown_end;
    r.table.assign(record.table.begin(), record.table.end());  // same size: no allocation
    ++r.version;
    r.protect();
  }
  close_forward();
  ++generation;
}

// ---- batch -----------------------------------------------------------------

void Layer::Impl::check_batch_rows(std::span<const std::int64_t> rows, const char* operation) const {
  if (rows.empty()) throw InvalidArgument(where() + ": " + operation + " needs at least one batch index");
  if (rows.size() > static_cast<std::size_t>(detail::kMaxBatch)) {
    throw CapacityError(where() + ": " + operation + " asks for " + std::to_string(rows.size()) +
                        " batch rows; at most 2^24 are allowed");
  }
  if (forward) refuse_during_forward(operation);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] < 0 || rows[i] >= batch) {
      throw IndexError(where() + ": " + operation + " index " + num(rows[i]) + " (entry " +
                       num(static_cast<std::int64_t>(i)) + ") is outside the batch [0, " + num(batch) + ")");
    }
  }
}

std::unique_ptr<Layer::Impl> Layer::Impl::gathered(std::span<const std::int64_t> rows, const char* operation) const {
  check_in_step(operation);
  return budgeted(operation, [&] {
    auto out = std::make_unique<Impl>();
    out->kind = kind;
    out->options = options;
    out->index = index;
    out->batch = static_cast<std::int64_t>(rows.size());
    out->recording = recording;
    out->history = history;
    out->generation = generation + 1;
    out->budget = budget;
    out->storage = storage;
    out->device = device;
    out->attention = attention;
    if (attention) {
      out->keys = keys.gathered(rows);
      out->values = values.gathered(rows);
      for (const auto& s : sides) out->sides.push_back(s.gathered(rows));
    }
    for (const auto& c : convs) out->convs.push_back(c.gathered(rows));
    for (const auto& r : recurrents) out->recurrents.push_back(r.gathered(rows));
    return out;
  });
}

std::unique_ptr<Layer::Impl> Layer::Impl::fresh() const {
  if (forward) refuse_during_forward("reset");
  return budgeted("reset", [&] {
    auto out = std::make_unique<Impl>(kind, options, index, budget);
    out->commit_recording(recording, history, out->prepare_recording(recording, history));
    out->generation = generation + 1;
    return out;
  });
}

void Layer::Impl::attach_budget(detail::MemoryBudget* b) noexcept {
  budget = b;
  for_tracks([&](TokenTrack& t) { t.buffer.attach(b); });
  for (auto& r : recurrents) r.ring.attach(b);
}

void Layer::Impl::shrink_to_fit() noexcept {
  if (forward) return;  // the open forward's room must stay
  for_tracks([](TokenTrack& t) {
    t.buffer.shrink_to_fit();
    t.protect();
  });
}

std::vector<std::int64_t> repeat_rows(std::int64_t batch, std::int64_t repeats) {
  const std::size_t n = checked_bytes({batch, repeats}, 1, "batch_repeat_interleave(" + num(repeats) + ")");
  if (n > static_cast<std::size_t>(detail::kMaxBatch)) {
    throw CapacityError("batch_repeat_interleave(" + num(repeats) + ") asks for " + std::to_string(n) +
                        " batch rows; at most 2^24 are allowed");
  }
  std::vector<std::int64_t> rows;
  try {
    rows.reserve(n);
  } catch (const std::bad_alloc&) {
    throw CapacityError("batch_repeat_interleave(" + num(repeats) + "): the system could not allocate the list of " +
                        std::to_string(n) + " batch rows; nothing was changed");
  }
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t r = 0; r < repeats; ++r) rows.push_back(b);
  return rows;
}

// ---- accessors with checks -------------------------------------------------

void Layer::Impl::check_attention(const char* operation) const {
  if (!attention) {
    throw StateError(where() + ": " + operation + " needs an attention layer; " + std::string(layer_kind_name(kind)) +
                     " layers hold no keys");
  }
}

const TokenTrack& Layer::Impl::conv(int state, const char* operation) const {
  if (convs.empty()) {
    throw StateError(std::string(kConvOnNonLinear) + " [" + where() + ": " + operation +
                     " on a layer without conv states]");
  }
  if (state < 0 || static_cast<std::size_t>(state) >= convs.size()) {
    throw IndexError(where() + ": " + operation + " conv state " + num(state) + " is outside [0, " +
                     num(static_cast<std::int64_t>(convs.size())) + ")");
  }
  return convs[static_cast<std::size_t>(state)];
}

TokenTrack& Layer::Impl::conv(int state, const char* operation) {
  return const_cast<TokenTrack&>(std::as_const(*this).conv(state, operation));
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

detail::RecurrentState& Layer::Impl::recurrent(int state, const char* operation) {
  return const_cast<detail::RecurrentState&>(std::as_const(*this).recurrent(state, operation));
}

const TokenTrack& Layer::Impl::side(int s, const char* operation) const {
  check_attention(operation);
  if (s < 0 || static_cast<std::size_t>(s) >= sides.size()) {
    throw IndexError(where() + ": " + operation + " side tensor " + num(s) + " is outside [0, " +
                     num(static_cast<std::int64_t>(sides.size())) + ")");
  }
  return sides[static_cast<std::size_t>(s)];
}

TokenTrack& Layer::Impl::side(int s, const char* operation) {
  return const_cast<TokenTrack&>(std::as_const(*this).side(s, operation));
}

namespace {

// Checks `input` against a track's expected shape; returns q.
std::int64_t check_tokens(const Layer::Impl& l, const TokenTrack& track, const TensorView& input, const char* what) {
  const TrackShape& s = track.shape;
  auto fail = [&](const std::string& why) {
    throw InvalidArgument(l.where() + ": " + what + " " + input.describe() + " " + why + "; expected " +
                          s.expected("q") + " " + std::string(dtype_name(s.dtype)));
  };
  l.check_device(input, what);
  if (input.rank != s.rank()) fail("has rank " + num(input.rank));
  if (input.dtype != s.dtype) fail("has the wrong dtype");
  if (input.size(0) != s.batch) fail("has batch size " + num(input.size(0)));
  const std::int64_t q = input.size(s.token_dim());
  if (q < 1) fail("has no tokens");
  if (detail::passes_token_limit(track.length(), q)) {
    throw CapacityError(l.where() + ": " + what + " " + input.describe() + ": an append of " + num(q) +
                        " tokens at length " + num(track.length()) + " passes the limit of 2^40 tokens per sequence");
  }
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
  throw CapacityError(l.where() + ": " + what + " of " + num(q) + " tokens needs " + num(track.buffer.rows_needed(q)) +
                      " token slots (" + num(track.buffer.stored()) + " retained + " + num(q) +
                      " new), but static_capacity is " + num(track.buffer.slots()));
}

// An input that aliases a buffer this call writes or moves (a view the
// layer returned, passed back in) is copied first: growth may free, and
// compaction or the append itself may overwrite, the memory it points to.
// Other parts of the layer are not touched by the call, so a view of them
// needs no copy.
struct StagedInput {
  Tensor copy;
  TensorView view;
};
StagedInput stage(const Layer::Impl& l, const TensorView& input, const char* operation,
                  std::initializer_list<const detail::PositionBuffer*> written) {
  const detail::ByteSpan span = detail::byte_span(input);
  bool aliases = false;
  for (const detail::PositionBuffer* b : written) aliases = aliases || b->allocation().overlaps(span.lo, span.hi);
  if (!aliases) return {Tensor(), input};
  StagedInput staged;
  l.budgeted(operation, [&] { staged.copy = detail::copy_of(input); });
  staged.view = staged.copy.view();
  return staged;
}

}  // namespace

// ---- Layer -----------------------------------------------------------------

Layer::Layer(LayerKind kind, const LayerOptions& options, int index)
    : impl_(std::make_unique<Impl>(kind, options, index)) {}
Layer::Layer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
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
  if (q < 1 || q > detail::kMaxTokens) {
    throw InvalidArgument(impl_->where() + ": get_mask_sizes(" + num(q) + ") needs a query length in [1, 2^40]");
  }
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
  l.check_forward_room(l.keys.length(), q, "keys");
  check_room(l, l.keys, q, "update");
  // Plan both before moving either, so a refusal changes nothing. Inside an
  // open forward the room is already there and nothing may move (abandon
  // needs every row where begin_forward left it).
  auto plans = l.budgeted("update", [&] {
    using Plan = detail::PositionBuffer::Plan;
    return l.forward ? std::make_pair(Plan{}, Plan{})
                     : std::make_pair(l.keys.buffer.plan_append(q), l.values.buffer.plan_append(q));
  });
  const StagedInput k = stage(l, keys, "update", {&l.keys.buffer, &l.values.buffer});
  const StagedInput v = stage(l, values, "update", {&l.keys.buffer, &l.values.buffer});
  l.keys.buffer.apply(std::move(plans.first), q);
  l.values.buffer.apply(std::move(plans.second), q);
  return {l.keys.append(k.view, q, l.history), l.values.append(v.view, q, l.history)};
}

namespace {

TensorView append_one(Layer::Impl& l, TokenTrack& track, const TensorView& input, const char* operation,
                      const char* what, const std::string& part) {
  const std::int64_t q = check_tokens(l, track, input, what);
  l.check_forward_room(track.length(), q, part);
  check_room(l, track, q, operation);
  auto plan = l.budgeted(operation, [&] {
    return l.forward ? detail::PositionBuffer::Plan{} : track.buffer.plan_append(q);  // see Layer::update
  });
  const StagedInput staged = stage(l, input, operation, {&track.buffer});
  track.buffer.apply(std::move(plan), q);
  return track.append(staged.view, q, l.history);
}

}  // namespace

TensorView Layer::update_side(const TensorView& rows, int side) {
  Impl& l = *impl_;
  return append_one(l, l.side(side, "update_side"), rows, "update_side", "side rows", "side tensor " + num(side));
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

TensorView Layer::update_conv_state(const TensorView& x, int state) {
  Impl& l = *impl_;
  return append_one(l, l.conv(state, "update_conv_state"), x, "update_conv_state", "conv input",
                    "conv state " + num(state));
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

RecurrentUpdate Layer::begin_recurrent_update(std::int64_t q, int state) {
  Impl& l = *impl_;
  auto& r = l.recurrent(state, "begin_recurrent_update");
  if (q < 1) {
    throw InvalidArgument(l.where() + ": begin_recurrent_update(" + num(q) + ") needs at least one token");
  }
  if (detail::passes_token_limit(r.length, q)) {
    throw CapacityError(l.where() + ": begin_recurrent_update(" + num(q) + ") at length " + num(r.length) +
                        " passes the limit of 2^40 tokens per sequence");
  }
  if (l.forward && (r.length != l.forward_start || q != l.forward_end - l.forward_start)) {
    throw StateError(l.where() + ": begin_recurrent_update(" + num(q) + ") of recurrent state " + num(state) +
                     " at length " + num(r.length) + " inside a forward from length " + num(l.forward_start) + " to " +
                     num(l.forward_end) + ": a recurrent state takes the forward's tokens in one update");
  }
  if (!r.has_room(q)) {
    detail::RecurrentState grown = l.budgeted("begin_recurrent_update", [&] { return r.with_room(q); });
    r = std::move(grown);
  }
  l.budgeted("begin_recurrent_update", [&] { r.choose_fresh(q); });
  for (std::int32_t s : r.fresh) detail::unpoison(r.physical(s), r.state_bytes());
  return RecurrentUpdate(this, state, q, l.generation, r.version);
}

namespace {

void check_state_input(const Layer::Impl& l, const detail::RecurrentState& r, const TensorView& input,
                       const char* operation) {
  l.check_device(input, operation);
  const TensorView expected = r.view(r.length);
  if (input.rank != expected.rank || input.shape != expected.shape || input.dtype != r.dtype || input.data == nullptr) {
    throw InvalidArgument(l.where() + ": " + operation + " got " + input.describe() + "; expected " +
                          expected.describe());
  }
}

}  // namespace

void Layer::update_recurrent_state(const TensorView& new_state, int state) {
  const auto& r = impl_->recurrent(state, "update_recurrent_state");
  check_state_input(*impl_, r, new_state, "update_recurrent_state");
  RecurrentUpdate u = begin_recurrent_update(1, state);
  // next(1) never aliases a held snapshot, and a one-token update never
  // grows the slots (there is always one free), so new_state may be a view
  // of this layer's own S(L) or snapshots: copying it reads what is there.
  detail::copy_view(new_state, u.next(1));
  u.commit();
}

void Layer::update_recurrent_state_final(const TensorView& final_state, std::int64_t q, int state) {
  auto& r = impl_->recurrent(state, "update_recurrent_state_final");
  check_state_input(*impl_, r, final_state, "update_recurrent_state_final");
  if (q == 1) {
    update_recurrent_state(final_state, state);
    return;
  }
  // begin_recurrent_update may grow the slots, which frees the old ones: an
  // input that is a view of this state's storage is copied out first.
  std::vector<std::byte> staged;
  TensorView input = final_state;
  const detail::ByteSpan span = detail::byte_span(final_state);
  if (r.ring.overlaps(span.lo, span.hi)) {
    impl_->budgeted("update_recurrent_state_final", [&] { staged.resize(r.state_bytes()); });
    input = r.view_of(staged.data());
    input.device = Device{};  // staged on the host
    copy_tensor(final_state, input);
  }
  const std::int64_t start = r.length;
  RecurrentUpdate u = begin_recurrent_update(q, state);  // checks q, the token limit and an open forward
  const TensorView last = u.next(q);
  detail::copy_view(input, last);
  // Every slot before the last gets the final state too, so that no slot is
  // ever read uninitialised; check_crop refuses to land on them.
  for (std::int64_t t = 1; t < q; ++t) {
    const TensorView slot = u.next(t);
    if (slot.data != last.data) detail::copy_view(last, slot);
  }
  u.commit();
  r.mark_unknown(start + 1, start + q);
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
std::int64_t Layer::max_rollback() const {
  impl_->check_in_step("max_rollback");
  return impl_->max_rollback();
}

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
  const auto rows = impl_->budgeted("batch_repeat_interleave", [&] { return repeat_rows(impl_->batch, repeats); });
  impl_->check_batch_rows(rows, "batch_repeat_interleave");
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

Layer Layer::clone() const {
  std::vector<std::int64_t> rows(static_cast<std::size_t>(impl_->batch));
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<std::int64_t>(i);
  std::unique_ptr<Impl> copy = impl_->gathered(rows, "clone");
  // gathered() counts the copy against the owner's budget; the copy lives
  // outside any cache.
  copy->attach_budget(nullptr);
  return Layer(std::move(copy));
}

void Layer::shrink_to_fit() { impl_->shrink_to_fit(); }

RetentionBytes Layer::retention_bytes(std::int64_t R) const {
  if (R < 0 || R > detail::kMaxTokens) {
    throw InvalidArgument(impl_->where() + ": retention_bytes(" + num(R) + ") needs R in [0, 2^40]");
  }
  RetentionBytes out;
  const std::string where = impl_->where() + ": retention_bytes";
  impl_->for_tracks([&](const TokenTrack& t) {
    const auto row = static_cast<std::int64_t>(t.buffer.row_bytes());
    switch (t.rule.kind) {
      case RetentionRule::Kind::Full: out.per_token += static_cast<std::size_t>(row); break;
      case RetentionRule::Kind::Sliding:
      case RetentionRule::Kind::Chunked: out.bounded += checked_bytes({t.rule.size - 1 + R, row}, 1, where); break;
      case RetentionRule::Kind::Conv: out.bounded += checked_bytes({t.rule.size + R, row}, 1, where); break;
    }
  });
  for (const auto& r : impl_->recurrents) {
    out.bounded += checked_bytes({R + 1, static_cast<std::int64_t>(r.state_bytes())}, 1, where);
  }
  return out;
}

LayerMemory Layer::memory() const {
  LayerMemory m;
  m.kind = std::string(layer_kind_name(impl_->kind));
  impl_->for_tracks([&](const TokenTrack& t) {
    m.bytes_reserved += t.buffer.bytes_reserved();
    m.bytes_used += t.buffer.bytes_used();
  });
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
detail::RecurrentState& live_state(Layer* layer, Layer::Impl* impl, int state, std::uint64_t generation,
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
    throw IndexError(layer_->impl_->where() + ": RecurrentUpdate::next(" + num(t) + ") is outside [1, " + num(q_) +
                     "]");
  }
  const auto Q = static_cast<std::int64_t>(r.fresh.size());
  return r.view_of(r.physical(r.fresh[static_cast<std::size_t>((t - 1) % Q)]));
}

void RecurrentUpdate::commit() {
  auto& r = live_state(layer_, layer_ ? layer_->impl_.get() : nullptr, state_, generation_, version_, "commit");
  r.advance(q_, r.fresh);
  layer_ = nullptr;
}

}  // namespace rwd

namespace rwd::detail {

ByteSpan byte_span(const TensorView& v) {
  std::int64_t lo = 0, hi = 0;
  bool overflow = false;
  for (int d = 0; d < v.rank; ++d) {
    const std::int64_t extent = v.size(d);
    if (extent <= 1) continue;
    std::int64_t reach = 0;
    overflow = overflow || __builtin_mul_overflow(v.stride(d), extent - 1, &reach);
    overflow = overflow ||
               (reach >= 0 ? __builtin_add_overflow(hi, reach, &hi) : __builtin_add_overflow(lo, reach, &lo));
  }
  const auto es = static_cast<std::int64_t>(dtype_size(v.dtype));
  overflow = overflow || __builtin_add_overflow(hi, 1, &hi) || __builtin_mul_overflow(lo, es, &lo) ||
             __builtin_mul_overflow(hi, es, &hi);
  const auto base = reinterpret_cast<std::uintptr_t>(v.data);
  if (overflow || (lo < 0 && static_cast<std::uint64_t>(-lo) > base) ||
      (hi > 0 && static_cast<std::uint64_t>(hi) > UINTPTR_MAX - base)) {
    return {0, UINTPTR_MAX};
  }
  return {base - static_cast<std::uintptr_t>(-lo), base + static_cast<std::uintptr_t>(hi)};
}

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

}  // namespace rwd::detail
