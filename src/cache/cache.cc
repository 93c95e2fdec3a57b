#include "rewind/cache.h"

#include <array>
#include <utility>

#include "cache/layer_impl.h"
#include "cache/warnings.h"

namespace rwd {
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

LayerOptions options_for(LayerKind kind, const LayerOptions& options) {
  LayerOptions o = options;
  if (kind != LayerKind::SparseAttention) o.side_dims.clear();
  return o;
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

// ---- Cache -------------------------------------------------------------------

Cache::Cache(const std::vector<std::string>& layer_types, const LayerOptions& options) {
  layers_.reserve(layer_types.size());
  for (std::size_t i = 0; i < layer_types.size(); ++i) {
    LayerKind kind;
    try {
      kind = parse_layer_kind(layer_types[i]);
    } catch (const InvalidArgument& e) {
      throw InvalidArgument("layer_types[" + std::to_string(i) + "]: " + e.what());
    }
    layers_.emplace_back(kind, options_for(kind, options), static_cast<int>(i));
  }
}

Cache::Cache(std::vector<Layer> layers) : layers_(std::move(layers)) {
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const Layer::Impl& l = *layers_[i].impl_;
    if (l.length() != 0) {
      throw StateError("Cache(layers): layer " + std::to_string(i) + " (" + std::string(layer_kind_name(l.kind)) +
                       ") already holds " + std::to_string(l.length()) + " tokens; a cache starts empty");
    }
  }
  for (std::size_t i = 0; i < layers_.size(); ++i) layers_[i].set_index(static_cast<int>(i));
}

Cache::~Cache() = default;
Cache::Cache(Cache&&) noexcept = default;
Cache& Cache::operator=(Cache&& other) noexcept {
  // Swap, so that the old layers die (in `gone`) before their budget does.
  Cache gone(std::move(other));
  std::swap(budget_, gone.budget_);
  std::swap(layers_, gone.layers_);
  return *this;
}

void Cache::set_memory_budget(std::size_t bytes) {
  const std::size_t reserved = budget_ ? budget_->reserved : memory().bytes_reserved;
  if (bytes != 0 && reserved > bytes) {
    throw CapacityError("set_memory_budget(" + std::to_string(bytes) + "): the cache already reserves " +
                        std::to_string(reserved) + " bytes; free some first (crop(0), reset) or set a larger budget");
  }
  if (!budget_) {
    budget_ = std::make_unique<detail::MemoryBudget>();
    for (auto& l : layers_) l.impl_->attach_budget(budget_.get());
  }
  budget_->limit = bytes;
}

std::size_t Cache::memory_budget() const { return budget_ ? budget_->limit : 0; }

void Cache::check_index(int layer_idx) const {
  if (layer_idx < 0 || layer_idx >= num_layers()) {
    throw IndexError("layer index " + std::to_string(layer_idx) + " is outside [0, " + std::to_string(num_layers()) +
                     ")");
  }
}

Layer& Cache::layer(int layer_idx) {
  check_index(layer_idx);
  return layers_[static_cast<std::size_t>(layer_idx)];
}

const Layer& Cache::layer(int layer_idx) const {
  check_index(layer_idx);
  return layers_[static_cast<std::size_t>(layer_idx)];
}

std::int64_t Cache::get_seq_length() const {
  for (const auto& l : layers_)
    if (!l.is_stateless()) return l.get_seq_length();
  return 0;
}

std::int64_t Cache::get_seq_length(int layer_idx) const { return layer(layer_idx).get_seq_length(); }

MaskSizes Cache::get_mask_sizes(std::int64_t query_length, int layer_idx) const {
  return layer(layer_idx).get_mask_sizes(query_length);
}

KeyValueView Cache::update(const TensorView& keys, const TensorView& values, int layer_idx) {
  return layer(layer_idx).update(keys, values);
}

TensorView Cache::update_side(const TensorView& rows, int layer_idx, int side) {
  return layer(layer_idx).update_side(side, rows);
}

TensorView Cache::update_conv_state(const TensorView& x, int layer_idx, int state) {
  return layer(layer_idx).update_conv_state(state, x);
}

RecurrentUpdate Cache::begin_recurrent_update(int layer_idx, std::int64_t q, int state) {
  return layer(layer_idx).begin_recurrent_update(state, q);
}

void Cache::update_recurrent_state(const TensorView& new_state, int layer_idx, int state) {
  layer(layer_idx).update_recurrent_state(state, new_state);
}

TensorView Cache::get_recurrent_state(int layer_idx, int state) const {
  return layer(layer_idx).get_recurrent_state(state);
}

TensorView Cache::get_conv_state(int layer_idx, int state) const { return layer(layer_idx).get_conv_state(state); }

bool Cache::has_previous_state() const {
  for (auto it = layers_.rbegin(); it != layers_.rend(); ++it)
    if (it->is_linear()) return it->has_previous_state();
  // No linear layer: the message of transformers.
  if (layers_.empty()) throw StateError(std::string(kHasPreviousOnAttention) + " [empty cache]");
  return layers_.front().has_previous_state();  // throws with the layer named
}

bool Cache::has_previous_state(int layer_idx) const { return layer(layer_idx).has_previous_state(); }

void Cache::check_crop(std::int64_t n) const {
  for (const auto& l : layers_) l.impl_->check_crop(n);
}

void Cache::crop(std::int64_t n) {
  check_crop(n);  // every layer first: an error leaves the whole cache untouched
  if (n > 0) detail::warn_positive_crop_once();
  for (auto& l : layers_) l.impl_->apply_crop(n);
}

std::int64_t Cache::max_rollback() const {
  bool any = false;
  std::int64_t depth = 0;
  for (const auto& l : layers_) {
    if (l.is_stateless()) continue;
    const std::int64_t d = l.max_rollback();
    depth = any ? std::min(depth, d) : d;
    any = true;
  }
  return any ? depth : get_seq_length();
}

void Cache::set_recording(bool on, std::int64_t max_tokens) {
  std::vector<Layer::Impl::RecordingPlan> plans;
  plans.reserve(layers_.size());
  for (const auto& l : layers_) plans.push_back(l.impl_->prepare_recording(on, max_tokens));
  for (std::size_t i = 0; i < layers_.size(); ++i)
    layers_[i].impl_->commit_recording(on, max_tokens, std::move(plans[i]));
}

void Cache::activate_past_recording(std::int64_t max_tokens) { set_recording(true, max_tokens); }

void Cache::deactivate_past_recording() { set_recording(false, 0); }

bool Cache::is_recording() const {
  for (const auto& l : layers_)
    if (!l.is_recording()) return false;
  return !layers_.empty();
}

std::vector<std::unique_ptr<Layer::Impl>> Cache::prepare_gather(const char* operation, const RowsFor& rows_for) const {
  std::vector<std::unique_ptr<Layer::Impl>> next;
  next.reserve(layers_.size());
  for (const auto& l : layers_) {
    const std::vector<std::int64_t> rows = rows_for(*l.impl_);
    l.impl_->check_batch_rows(rows, operation);
    next.push_back(l.impl_->gathered(rows));
  }
  return next;
}

void Cache::commit_layers(std::vector<std::unique_ptr<Layer::Impl>> next) noexcept {
  for (std::size_t i = 0; i < layers_.size(); ++i) layers_[i].impl_ = std::move(next[i]);
}

Cache::RowsFor Cache::select_rows(std::span<const std::int64_t> indices) {
  std::vector<std::int64_t> rows(indices.begin(), indices.end());
  return [rows](const Layer::Impl&) { return rows; };
}

Cache::RowsFor Cache::repeat_rows_for(std::int64_t repeats) {
  if (repeats < 1) {
    throw InvalidArgument("batch_repeat_interleave(" + std::to_string(repeats) + ") needs repeats >= 1");
  }
  return [repeats](const Layer::Impl& l) { return repeat_rows(l.batch, repeats); };
}

Cache::RowsFor Cache::reorder_rows(std::span<const std::int64_t> beam_idx) {
  std::vector<std::int64_t> rows(beam_idx.begin(), beam_idx.end());
  return [rows](const Layer::Impl& l) {
    if (static_cast<std::int64_t>(rows.size()) != l.batch) {
      throw InvalidArgument(l.where() + ": reorder_cache got " + std::to_string(rows.size()) +
                            " indices for a batch of " + std::to_string(l.batch));
    }
    return rows;
  };
}

void Cache::batch_select_indices(std::span<const std::int64_t> indices) {
  commit_layers(prepare_gather("batch_select_indices", select_rows(indices)));
}

void Cache::batch_repeat_interleave(std::int64_t repeats) {
  commit_layers(prepare_gather("batch_repeat_interleave", repeat_rows_for(repeats)));
}

void Cache::reorder_cache(std::span<const std::int64_t> beam_idx) {
  commit_layers(prepare_gather("reorder_cache", reorder_rows(beam_idx)));
}

std::vector<std::unique_ptr<Layer::Impl>> Cache::prepare_reset() const {
  std::vector<std::unique_ptr<Layer::Impl>> next;
  next.reserve(layers_.size());
  for (const auto& l : layers_) next.push_back(l.impl_->fresh());
  return next;
}

void Cache::reset() { commit_layers(prepare_reset()); }

MemoryReport Cache::memory() const {
  MemoryReport report;
  for (const auto& l : layers_) {
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
  Layer& l = cross_.layer(layer_idx);
  if (l.has_attention() && l.get_seq_length() > 0) return l.keys_values();
  return l.update(keys, values);
}

bool EncoderDecoderCache::is_cross_attention_updated(int layer_idx) const {
  const Layer& l = cross_.layer(layer_idx);
  return l.has_attention() && l.get_seq_length() > 0;
}

void EncoderDecoderCache::gather_both(const char* operation, const Cache::RowsFor& rows_for) {
  auto next_self = self_.prepare_gather(operation, rows_for);
  auto next_cross = cross_.prepare_gather(operation, rows_for);
  self_.commit_layers(std::move(next_self));
  cross_.commit_layers(std::move(next_cross));
}

void EncoderDecoderCache::batch_select_indices(std::span<const std::int64_t> indices) {
  gather_both("batch_select_indices", Cache::select_rows(indices));
}

void EncoderDecoderCache::batch_repeat_interleave(std::int64_t repeats) {
  gather_both("batch_repeat_interleave", Cache::repeat_rows_for(repeats));
}

void EncoderDecoderCache::reorder_cache(std::span<const std::int64_t> beam_idx) {
  gather_both("reorder_cache", Cache::reorder_rows(beam_idx));
}

void EncoderDecoderCache::reset() {
  auto next_self = self_.prepare_reset();
  auto next_cross = cross_.prepare_reset();
  self_.commit_layers(std::move(next_self));
  cross_.commit_layers(std::move(next_cross));
}

}  // namespace rwd
