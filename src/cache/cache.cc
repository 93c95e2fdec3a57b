#include "rewind/cache.h"
#include "rewind/encoder_decoder_cache.h"

#include <functional>
#include <string>
#include <utility>

#include "aligned_memory.h"
#include "cache/cache_impl.h"
#include "cache/layer_impl.h"
#include "cache/warnings.h"

namespace rwd {

namespace {

LayerOptions options_for(LayerKind kind, const LayerOptions& options) {
  LayerOptions o = options;
  if (kind != LayerKind::SparseAttention) o.side_dims.clear();
  return o;
}

Cache::Impl::RowsFor select_rows(std::span<const std::int64_t> indices) {
  std::vector<std::int64_t> rows(indices.begin(), indices.end());
  return [rows](const Layer::Impl&) { return rows; };
}

Cache::Impl::RowsFor repeat_rows_for(std::int64_t repeats) {
  if (repeats < 1) {
    throw InvalidArgument("batch_repeat_interleave(" + std::to_string(repeats) + ") needs repeats >= 1");
  }
  return [repeats](const Layer::Impl& l) { return repeat_rows(l.batch, repeats); };
}

Cache::Impl::RowsFor reorder_rows(std::span<const std::int64_t> beam_idx) {
  std::vector<std::int64_t> rows(beam_idx.begin(), beam_idx.end());
  return [rows](const Layer::Impl& l) {
    if (static_cast<std::int64_t>(rows.size()) != l.batch) {
      throw InvalidArgument(l.where() + ": reorder_cache got " + std::to_string(rows.size()) +
                            " indices for a batch of " + std::to_string(l.batch));
    }
    return rows;
  };
}

}  // namespace

// ---- Cache -------------------------------------------------------------------

Cache::Cache(const std::vector<std::string>& layer_types, const LayerOptions& options)
    : impl_(std::make_unique<Impl>()) {
  if (layer_types.empty()) {
    throw InvalidArgument("Cache(layer_types): the list is empty; a cache needs one entry per model layer");
  }
  state().layers.reserve(layer_types.size());
  for (std::size_t i = 0; i < layer_types.size(); ++i) {
    LayerKind kind;
    try {
      kind = parse_layer_kind(layer_types[i]);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument("layer_types[" + std::to_string(i) + "]: " + e.what());
    }
    state().layers.emplace_back(kind, options_for(kind, options), static_cast<int>(i));
  }
}

Cache::Cache(std::vector<Layer> layers) : impl_(std::make_unique<Impl>()) {
  if (layers.empty()) {
    throw InvalidArgument("Cache(layers): the list is empty; a cache needs one layer per model layer");
  }
  for (std::size_t i = 0; i < layers.size(); ++i) {
    const Layer::Impl& l = *layers[i].impl_;
    if (l.length() != 0) {
      throw StateError("Cache(layers): layer " + std::to_string(i) + " (" + std::string(layer_kind_name(l.kind)) +
                       ") already holds " + std::to_string(l.length()) + " tokens; a cache starts empty");
    }
  }
  state().layers = std::move(layers);
  for (std::size_t i = 0; i < state().layers.size(); ++i) state().layers[i].set_index(static_cast<int>(i));
}

Cache Cache::adopt(std::vector<Layer> layers) {
  if (layers.empty()) {
    throw InvalidArgument("Cache::adopt(layers): the list is empty; a cache needs one layer per model layer");
  }
  Cache c;
  c.impl_ = std::make_unique<Impl>();
  c.state().layers = std::move(layers);
  return c;
}

std::vector<Layer> Cache::release_layers() {
  Impl& c = state();
  if (c.busy()) c.check_whole("release_layers");
  std::vector<Layer> out = std::move(c.layers);
  impl_.reset();
  return out;
}

Cache::~Cache() = default;
Cache::Cache(Cache&&) noexcept = default;
Cache& Cache::operator=(Cache&& other) noexcept = default;

int Cache::num_layers() const { return static_cast<int>(state().layers.size()); }

Cache::Impl& Cache::state() const {
  if (!impl_) throw StateError("this Cache was moved from; it holds no layers");
  return *impl_;
}

void Cache::set_memory_budget(std::size_t bytes) {
  if (state().busy()) state().check_whole("set_memory_budget");
  const std::size_t reserved = state().budget ? state().budget->reserved : memory().bytes_reserved;
  if (bytes != 0 && reserved > bytes) {
    throw CapacityError("set_memory_budget(" + std::to_string(bytes) + "): the cache already reserves " +
                        std::to_string(reserved) +
                        " bytes; free some first (crop(0), shrink_to_fit, reset) or "
                        "set a larger budget");
  }
  if (!state().budget) {
    state().budget = std::make_unique<detail::MemoryBudget>();
    for (auto& l : state().layers) l.impl_->attach_budget(state().budget.get());
  }
  state().budget->limit = bytes;
}

std::size_t Cache::memory_budget() const { return state().budget ? state().budget->limit : 0; }

const Layer& Cache::layer(int layer_idx) const {
  state().check_index(layer_idx);
  return state().layers[static_cast<std::size_t>(layer_idx)];
}

std::int64_t Cache::get_seq_length() const {
  for (const auto& l : state().layers)
    if (!l.is_stateless()) return l.get_seq_length();
  return 0;
}

std::int64_t Cache::get_seq_length(int layer_idx) const { return layer(layer_idx).get_seq_length(); }

MaskSizes Cache::get_mask_sizes(std::int64_t query_length, int layer_idx) const {
  return layer(layer_idx).get_mask_sizes(query_length);
}

namespace {
Layer& mutable_layer(Cache::Impl& impl, int layer_idx) {
  impl.check_index(layer_idx);
  if (impl.tree) {
    throw StateError("layer " + std::to_string(layer_idx) +
                     ": a per-layer update while a tree is open (begin_tree); the tree's handle takes the updates "
                     "(TreeForward::update, update_side, update_conv, recurrent_slots) until it commits or abandons");
  }
  return impl.layers[static_cast<std::size_t>(layer_idx)];
}
}  // namespace

KeyValueView Cache::update(const TensorView& keys, const TensorView& values, int layer_idx) {
  return mutable_layer(Cache::state(), layer_idx).update(keys, values);
}

TensorView Cache::update_side(const TensorView& rows, int layer_idx, int side) {
  return mutable_layer(Cache::state(), layer_idx).update_side(rows, side);
}

TensorView Cache::update_conv_state(const TensorView& x, int layer_idx, int state) {
  return mutable_layer(Cache::state(), layer_idx).update_conv_state(x, state);
}

RecurrentUpdate Cache::begin_recurrent_update(std::int64_t q, int layer_idx, int state) {
  return mutable_layer(Cache::state(), layer_idx).begin_recurrent_update(q, state);
}

void Cache::update_recurrent_state(const TensorView& new_state, int layer_idx, int state) {
  mutable_layer(Cache::state(), layer_idx).update_recurrent_state(new_state, state);
}

void Cache::update_recurrent_state_final(const TensorView& final_state, std::int64_t q, int layer_idx, int state) {
  mutable_layer(Cache::state(), layer_idx).update_recurrent_state_final(final_state, q, state);
}

TensorView Cache::get_recurrent_state(int layer_idx, int state) const {
  return layer(layer_idx).get_recurrent_state(state);
}

TensorView Cache::get_conv_state(int layer_idx, int state) const { return layer(layer_idx).get_conv_state(state); }

bool Cache::has_previous_state() const {
  const auto& layers = state().layers;
  for (auto it = layers.rbegin(); it != layers.rend(); ++it)
    if (it->is_linear()) return it->has_previous_state();
  // No linear layer: the message of transformers.
  return layers.front().has_previous_state();  // throws with the layer named
}

bool Cache::has_previous_state(int layer_idx) const { return layer(layer_idx).has_previous_state(); }

// ---- forwards ------------------------------------------------------------------

Forward Cache::begin_forward(std::int64_t q) { return state().begin_forward(q); }

bool Cache::forward_open() const { return state().open != nullptr; }

Forward::Forward(Forward&& other) noexcept
    : cache_(std::exchange(other.cache_, nullptr)), q_(other.q_), start_(other.start_) {
  if (cache_) cache_->open = this;
}

Forward& Forward::operator=(Forward&& other) noexcept {
  if (this != &other) {
    abandon();
    cache_ = std::exchange(other.cache_, nullptr);
    q_ = other.q_;
    start_ = other.start_;
    if (cache_) cache_->open = this;
  }
  return *this;
}

Forward::~Forward() { abandon(); }

void Forward::commit() {
  if (!cache_) throw StateError("Forward::commit: the forward is not open (committed, abandoned or moved from)");
  for (std::size_t i = 0; i < cache_->layers.size(); ++i) cache_->layer_impl(i).check_forward_complete();
  for (std::size_t i = 0; i < cache_->layers.size(); ++i) cache_->layer_impl(i).close_forward();
  cache_->open = nullptr;
  cache_ = nullptr;
}

void Forward::abandon() noexcept {
  if (cache_) cache_->abandon_forward();
}

// ---- whole-cache operations -------------------------------------------------------

void Cache::check_crop(std::int64_t n) const {
  state().check_whole([n] { return "crop(" + std::to_string(n) + ")"; });
  for (const auto& l : state().layers) l.impl_->check_crop(n);
}

void Cache::crop(std::int64_t n) {
  check_crop(n);  // every layer first: an error leaves the whole cache untouched
  if (n > 0) detail::warn_positive_crop_once();
  for (auto& l : state().layers) l.impl_->apply_crop(n);
}

std::int64_t Cache::max_rollback() const {
  state().check_whole("max_rollback");
  bool any = false;
  std::int64_t depth = 0;
  for (const auto& l : state().layers) {
    if (l.is_stateless()) continue;
    const std::int64_t d = l.max_rollback();
    depth = any ? std::min(depth, d) : d;
    any = true;
  }
  return any ? depth : get_seq_length();
}

void Cache::activate_past_recording(std::int64_t max_tokens) { state().set_recording(true, max_tokens); }

void Cache::deactivate_past_recording() { state().set_recording(false, 0); }

bool Cache::is_recording() const {
  for (const auto& l : state().layers)
    if (!l.is_recording()) return false;
  return true;
}

void Cache::batch_select_indices(std::span<const std::int64_t> indices) {
  state().commit_layers(state().prepare_gather("batch_select_indices", select_rows(indices)));
}

void Cache::batch_repeat_interleave(std::int64_t repeats) {
  state().commit_layers(state().prepare_gather("batch_repeat_interleave", repeat_rows_for(repeats)));
}

void Cache::reorder_cache(std::span<const std::int64_t> beam_idx) {
  state().commit_layers(state().prepare_gather("reorder_cache", reorder_rows(beam_idx)));
}

void Cache::reset() { state().commit_layers(state().prepare_reset()); }

Snapshot Cache::snapshot(std::int64_t from_position) const {
  const Impl& c = state();
  c.check_whole("snapshot");
  Snapshot out;
  out.length = get_seq_length();
  if (from_position < 0 || from_position > out.length) {
    throw InvalidArgument("snapshot(" + std::to_string(from_position) +
                          "): the first position must be in [0, L = " + std::to_string(out.length) + "]");
  }
  out.layers.resize(c.layers.size());
  for (std::size_t i = 0; i < c.layers.size(); ++i) {
    const Layer::Impl& l = c.layer_impl(i);
    if (l.batch != 1) {
      throw InvalidArgument(l.where() + ": snapshot needs batch_size 1 (one sequence), this layer has " +
                            std::to_string(l.batch) + " rows");
    }
    out.layers[i].kind = l.kind;
    l.capture(out.layers[i], true, from_position);
  }
  return out;
}

void Cache::restore(const Snapshot& s) {
  Impl& c = state();
  if (c.busy()) c.check_whole("restore");
  detail::check_snapshot_frame(s, c.layers.size(), "restore");
  for (std::size_t i = 0; i < c.layers.size(); ++i) {
    const Layer::Impl& l = c.layer_impl(i);
    if (l.batch != 1) {
      throw InvalidArgument("restore: " + l.where() + " has batch_size " + std::to_string(l.batch) +
                            "; a snapshot holds one sequence (batch_size 1)");
    }
    detail::check_layer_snapshot(s.layers[i], s.length, l.kind, l.options, l.keys.rule, "restore: " + l.where());
  }
  std::vector<std::unique_ptr<Layer::Impl>> next;
  next.reserve(c.layers.size());
  for (std::size_t i = 0; i < c.layers.size(); ++i) next.push_back(c.layer_impl(i).restored(s.layers[i], s.length));
  c.commit_layers(std::move(next));
}

void Cache::shrink_to_fit() {
  if (state().busy()) state().check_whole("shrink_to_fit");
  for (auto& l : state().layers) l.impl_->shrink_to_fit();
}

MemoryReport Cache::memory() const {
  MemoryReport report;
  for (const auto& l : state().layers) {
    report.layers.push_back(l.memory());
    report.bytes_reserved += report.layers.back().bytes_reserved;
    report.bytes_used += report.layers.back().bytes_used;
  }
  return report;
}

// ---- EncoderDecoderCache -------------------------------------------------------

EncoderDecoderCache::EncoderDecoderCache(Cache self_attention, Cache cross_attention)
    : self_(std::move(self_attention)), cross_(std::move(cross_attention)) {}

KeyValueView EncoderDecoderCache::update_cross_attention(const TensorView& keys, const TensorView& values,
                                                         int layer_idx) {
  Layer& l = mutable_layer(cross_.state(), layer_idx);
  if (l.has_attention() && l.get_seq_length() > 0) return l.keys_values();
  return l.update(keys, values);
}

bool EncoderDecoderCache::is_cross_attention_updated(int layer_idx) const {
  const Layer& l = cross_.layer(layer_idx);
  return l.has_attention() && l.get_seq_length() > 0;
}

namespace {
// The cross-attention part may be half written (its layers are written one
// by one during the first forward): only the self-attention part must be in step.
void gather_both(Cache::Impl& self, Cache::Impl& cross, const char* operation, const Cache::Impl::RowsFor& rows_for) {
  auto next_self = self.prepare_gather(operation, rows_for);
  auto next_cross = cross.prepare_gather(operation, rows_for, false);
  self.commit_layers(std::move(next_self));
  cross.commit_layers(std::move(next_cross));
}
}  // namespace

void EncoderDecoderCache::batch_select_indices(std::span<const std::int64_t> indices) {
  gather_both(self_.state(), cross_.state(), "batch_select_indices", select_rows(indices));
}

void EncoderDecoderCache::batch_repeat_interleave(std::int64_t repeats) {
  gather_both(self_.state(), cross_.state(), "batch_repeat_interleave", repeat_rows_for(repeats));
}

void EncoderDecoderCache::reorder_cache(std::span<const std::int64_t> beam_idx) {
  gather_both(self_.state(), cross_.state(), "reorder_cache", reorder_rows(beam_idx));
}

void EncoderDecoderCache::reset() {
  auto next_self = self_.state().prepare_reset();
  auto next_cross = cross_.state().prepare_reset();
  self_.state().commit_layers(std::move(next_self));
  cross_.state().commit_layers(std::move(next_cross));
}

}  // namespace rwd
