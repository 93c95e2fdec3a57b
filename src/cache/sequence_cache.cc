// SequenceCache: construction, sequences, rollback, reads and memory. The
// batched forwards are in sequence_batch.cc, the snapshots in
// sequence_snapshot.cc; the state all three share in sequence_cache_impl.h.
#include "cache/sequence_cache_impl.h"

namespace rwd {

std::string to_string(SeqId id) {
  return "sequence " + std::to_string(id.slot) + " (generation " + std::to_string(id.generation) + ")";
}

// ---- BlockLayout ---------------------------------------------------------------

std::int64_t BlockLayout::row_elements(int part) const {
  if (part == 0) return num_kv_heads * key_dim;
  if (part == 1) return num_kv_heads * value_dim;
  return side_dims[static_cast<std::size_t>(part - 2)];
}

TensorView BlockLayout::rows(const std::byte* block, int part, std::int64_t row, std::int64_t n) const {
  const std::int64_t width = row_elements(part);
  std::byte* base = const_cast<std::byte*>(block) + part_offsets[static_cast<std::size_t>(part)] +
                    static_cast<std::size_t>(row * width) * dtype_size(dtype);
  if (part < 2) {
    const std::int64_t d = part == 0 ? key_dim : value_dim;
    TensorView v = TensorView::strided(base, dtype, {1, num_kv_heads, n, d}, {width, d, width, 1});
    v.device = device;
    return v;
  }
  TensorView v = TensorView::strided(base, dtype, {1, n, width}, {width, width, 1});
  v.device = device;
  return v;
}

void BlockLayout::gather(std::span<const BlockSpan> spans, int part, std::int64_t first, const TensorView& dst) const {
  if (part < 0 || part >= num_parts()) {
    throw InvalidArgument("BlockLayout::gather: part " + num(part) + " is outside [0, " + num(num_parts()) + ")");
  }
  const bool heads = part < 2;
  const int token_dim = heads ? 2 : 1;
  const std::int64_t width = heads ? (part == 0 ? key_dim : value_dim) : row_elements(part);
  const bool shape_ok = dst.dtype == dtype && dst.rank == (heads ? 4 : 3) && dst.size(0) == 1 &&
                        (heads ? dst.size(1) == num_kv_heads && dst.size(3) == width : dst.size(2) == width);
  if (!shape_ok) {
    throw InvalidArgument(
        "BlockLayout::gather: destination " + dst.describe() + " does not match part " + num(part) +
        (heads ? " [1, H=" + num(num_kv_heads) + ", n, D=" + num(width) + "]" : " [1, n, D=" + num(width) + "]") + " " +
        std::string(dtype_name(dtype)));
  }
  const std::int64_t n = dst.size(token_dim);
  const std::int64_t p = for_each_block_rows(
      spans, first, n, [&](const std::byte* block, std::int64_t row, std::int64_t count, std::int64_t at) {
        copy_tensor(rows(block, part, row, count), dst.slice(token_dim, at, count));
      });
  if (p < first + n) {
    throw InvalidArgument("BlockLayout::gather: the spans do not cover position " + num(p) + " of [" + num(first) +
                          ", " + num(first + n) + ")");
  }
}

Layer::Impl& SequenceCache::layer_impl(const Layer& layer) { return *layer.impl_; }
std::unique_ptr<Layer> SequenceCache::make_layer(std::unique_ptr<Layer::Impl> impl) {
  return std::unique_ptr<Layer>(new Layer(std::move(impl)));
}

// ---- construction ------------------------------------------------------------------

namespace {

void check_sequence_options(const LayerOptions& options, const std::string& where) {
  if (options.batch_size != 1) {
    throw InvalidArgument("SequenceCache: " + where + "options.batch_size is " + num(options.batch_size) +
                          ", but each sequence is one batch row: it must be 1");
  }
  if (options.static_capacity != 0) {
    throw InvalidArgument("SequenceCache: " + where + "options.static_capacity is " + num(options.static_capacity) +
                          ", but paged storage grows by blocks: it must be 0 (cap memory with set_memory_budget)");
  }
}

void check_block_size(std::int64_t block_size) {
  if (block_size < 1 || block_size > kMaxBlockSize) {
    throw InvalidArgument("SequenceCache: block_size " + num(block_size) + " is outside [1, 65536]");
  }
}

}  // namespace

// Builds the per-layer state from a Cache of the same layers (which has
// validated their kinds and options).
void SequenceCache::init(const Cache& probe, std::int64_t block_size) {
  Impl& c = *impl_;
  c.block_size = block_size;
  c.layers.resize(static_cast<std::size_t>(probe.num_layers()));
  for (int i = 0; i < probe.num_layers(); ++i) {
    const Layer::Impl& model = layer_impl(probe.layer(i));
    const LayerOptions& options = model.options;
    LayerState& l = c.layers[static_cast<std::size_t>(i)];
    l.kind = model.kind;
    l.options = options;
    if (model.attention) {
      BlockLayout layout;
      layout.block_size = block_size;
      layout.dtype = options.dtype;
      layout.num_kv_heads = options.num_kv_heads;
      layout.key_dim = options.key_dim;
      layout.value_dim = options.value_dim == 0 ? options.key_dim : options.value_dim;
      for (const auto& s : model.sides) layout.side_dims.push_back(s.shape.width);
      std::size_t offset = 0;
      for (int k = 0; k < layout.num_parts(); ++k) {
        layout.part_offsets.push_back(offset);
        const std::size_t bytes = detail::checked_mul(
            detail::checked_mul(layout.block_size, layout.row_elements(k), "a block"), dtype_size(layout.dtype),
            "a block");
        offset = round64(offset + bytes);
      }
      layout.block_bytes = offset;
      l.paged = std::make_unique<PagedLayer>(model.keys.rule, std::move(layout), model.storage, &c.budget);
      l.sides_done.assign(model.sides.size(), false);
    }
    if (!model.stateless()) c.keeps_tokens = true;
    if (model.linear()) {
      l.linear = true;
      l.linear_kind = model.kind == LayerKind::Conv ? LayerKind::Conv : LayerKind::LinearAttention;
      for (const auto& conv : model.convs) l.conv_channels.push_back(conv.shape.width);
      l.num_recurrent = model.recurrents.size();
    }
  }
}

SequenceCache::SequenceCache(const std::vector<std::string>& layer_types, const LayerOptions& options,
                             SequenceCacheOptions cache_options)
    : impl_(std::make_unique<Impl>()) {
  check_sequence_options(options, "");
  check_block_size(cache_options.block_size);
  // The single-sequence cache validates the types and options (same messages).
  init(Cache(layer_types, options), cache_options.block_size);
}

SequenceCache::SequenceCache(std::vector<SequenceLayer> layers, SequenceCacheOptions cache_options)
    : impl_(std::make_unique<Impl>()) {
  check_block_size(cache_options.block_size);
  if (layers.empty()) throw InvalidArgument("SequenceCache needs at least one layer");
  std::vector<Layer> built;
  built.reserve(layers.size());
  for (std::size_t i = 0; i < layers.size(); ++i) {
    check_sequence_options(layers[i].options, "layer " + std::to_string(i) + ": ");
    built.emplace_back(layers[i].kind, layers[i].options, static_cast<int>(i));
  }
  init(Cache(std::move(built)), cache_options.block_size);
}

SequenceCache::~SequenceCache() = default;
SequenceCache::SequenceCache(SequenceCache&&) noexcept = default;
SequenceCache& SequenceCache::operator=(SequenceCache&&) noexcept = default;

SequenceCache::Impl& SequenceCache::state() const {
  if (!impl_) throw StateError("this SequenceCache was moved from");
  return *impl_;
}

int SequenceCache::num_layers() const { return static_cast<int>(state().layers.size()); }
LayerKind SequenceCache::layer_kind(int layer_idx) const {
  state().check_layer(layer_idx);
  return state().layers[static_cast<std::size_t>(layer_idx)].kind;
}
const LayerOptions& SequenceCache::layer_options(int layer_idx) const {
  state().check_layer(layer_idx);
  return state().layers[static_cast<std::size_t>(layer_idx)].options;
}
std::int64_t SequenceCache::block_size() const { return state().block_size; }
const BlockLayout& SequenceCache::block_layout(int layer_idx) const {
  return state().attention(layer_idx, "block_layout").layout();
}

// ---- sequences ---------------------------------------------------------------------

SeqId SequenceCache::add_sequence() {
  Impl& c = state();
  c.refuse_in_batch("add_sequence");
  return budgeted("add_sequence", [&] {
    auto s = c.make_sequence(nullptr);
    c.reserve_slot();
    return c.place(std::move(s));
  });
}

SeqId SequenceCache::fork(SeqId parent) {
  Impl& c = state();
  c.refuse_in_batch([&] { return "fork(" + to_string(parent) + ")"; });
  const Sequence& p = c.lookup(parent);
  return budgeted([&] { return "fork(" + to_string(parent) + ")"; },
                  [&] {
                    c.reserve_slot();
                    return c.place(c.copy_of(p));
                  });
}

bool SequenceCache::seq_rm(SeqId id) {
  Impl& c = state();
  c.refuse_in_batch([&] { return "seq_rm(" + to_string(id) + ")"; });
  Sequence* s = c.find(id);
  if (!s) return false;
  c.remove(*s);
  return true;
}

void SequenceCache::seq_keep(SeqId id) {
  Impl& c = state();
  c.refuse_in_batch([&] { return "seq_keep(" + to_string(id) + ")"; });
  c.lookup(id);
  for (auto& slot : c.slots)
    if (slot.seq && slot.generation != id.generation) c.remove(*slot.seq);
}

bool SequenceCache::contains(SeqId id) const { return state().find(id) != nullptr; }
std::int64_t SequenceCache::num_sequences() const { return state().live; }
std::vector<SeqId> SequenceCache::sequences() const {
  std::vector<SeqId> out;
  for (const auto& slot : state().slots)
    if (slot.seq) out.push_back(slot.seq->id());
  return out;
}

std::int64_t SequenceCache::seq_length(SeqId id) const { return state().lookup(id).length; }
std::int64_t SequenceCache::seq_pos_max(SeqId id) const { return state().lookup(id).length - 1; }
std::int64_t SequenceCache::seq_pos_min(SeqId id) const {
  const Impl& c = state();
  const Sequence& s = c.lookup(id);
  if (s.length == 0) return -1;
  std::int64_t first = s.length - 1;
  for (std::size_t i = 0; i < c.layers.size(); ++i)
    if (c.layers[i].paged && s.parts[i].first < s.parts[i].end) first = std::min(first, s.parts[i].first);
  return first;
}

// ---- rollback ----------------------------------------------------------------------

void SequenceCache::crop(SeqId id, std::int64_t n) {
  Impl& c = state();
  c.refuse_in_batch([&] { return "crop(" + to_string(id) + ", " + num(n) + ")"; });
  Sequence& s = c.lookup(id);
  c.check_crop(s, n);
  if (n > 0) detail::warn_positive_crop_once();
  c.apply_crop(s, n);
}

void SequenceCache::check_crop(SeqId id, std::int64_t n) const {
  const Impl& c = state();
  c.refuse_in_batch([&] { return "check_crop(" + to_string(id) + ", " + num(n) + ")"; });
  c.check_crop(c.lookup(id), n);
}

std::int64_t SequenceCache::max_rollback(SeqId id) const {
  const Impl& c = state();
  c.refuse_in_batch([&] { return "max_rollback(" + to_string(id) + ")"; });
  return c.max_rollback(c.lookup(id));
}

void SequenceCache::activate_past_recording(SeqId id, std::int64_t max_tokens) {
  Impl& c = state();
  if (max_tokens < 0 || max_tokens > detail::kMaxTokens) {
    throw InvalidArgument("activate_past_recording(" + to_string(id) + ", " + num(max_tokens) +
                          ") needs a number of tokens to keep in [0, 2^40]");
  }
  c.set_recording(c.lookup(id), true, max_tokens);
}

void SequenceCache::deactivate_past_recording(SeqId id) {
  Impl& c = state();
  c.set_recording(c.lookup(id), false, 0);
}

bool SequenceCache::is_recording(SeqId id) const { return state().lookup(id).recording; }
std::int64_t SequenceCache::recording_capacity(SeqId id) const { return state().lookup(id).retained_history(); }

// ---- reads -------------------------------------------------------------------------

namespace {
Tensor gather_part(const SequenceCache::Impl& c, const Sequence& s, std::size_t i, int part_index) {
  const PagedLayer& p = *c.layers[i].paged;
  const PagedPart& part = s.parts[i];
  const BlockLayout& layout = p.layout();
  const std::int64_t n = part.end - part.first;
  Tensor out = budgeted("reading " + c.where(static_cast<int>(i)), [&] {
    if (part_index < 2) {
      return Tensor(layout.dtype, {1, layout.num_kv_heads, n, part_index == 0 ? layout.key_dim : layout.value_dim});
    }
    return Tensor(layout.dtype, {1, n, layout.row_elements(part_index)});
  });
  std::vector<BlockSpan> spans;
  p.spans(part, part.first, spans);
  layout.gather(spans, part_index, part.first, out.view());
  return out;
}
}  // namespace

Tensor SequenceCache::keys(SeqId id, int layer_idx) const {
  const Impl& c = state();
  const Sequence& s = c.lookup(id);
  c.attention(layer_idx, "keys");
  return gather_part(c, s, static_cast<std::size_t>(layer_idx), 0);
}

Tensor SequenceCache::values(SeqId id, int layer_idx) const {
  const Impl& c = state();
  const Sequence& s = c.lookup(id);
  c.attention(layer_idx, "values");
  return gather_part(c, s, static_cast<std::size_t>(layer_idx), 1);
}

Tensor SequenceCache::side(SeqId id, int layer_idx, int side_idx) const {
  const Impl& c = state();
  const Sequence& s = c.lookup(id);
  const PagedLayer& p = c.attention(layer_idx, "side");
  if (side_idx < 0 || side_idx >= static_cast<int>(p.layout().side_dims.size())) {
    throw IndexError(c.where(layer_idx) + ": side tensor " + num(side_idx) + " is outside [0, " +
                     num(static_cast<std::int64_t>(p.layout().side_dims.size())) + ")");
  }
  return gather_part(c, s, static_cast<std::size_t>(layer_idx), 2 + side_idx);
}

PositionRange SequenceCache::stored_range(SeqId id, int layer_idx) const {
  const Impl& c = state();
  const Sequence& s = c.lookup(id);
  c.attention(layer_idx, "stored_range");
  const PagedPart& part = s.parts[static_cast<std::size_t>(layer_idx)];
  return {part.first, part.end};
}

std::vector<BlockSpan> SequenceCache::block_spans(SeqId id, int layer_idx) const {
  const Impl& c = state();
  const Sequence& s = c.lookup(id);
  const PagedLayer& p = c.attention(layer_idx, "block_spans");
  std::vector<BlockSpan> out;
  const PagedPart& part = s.parts[static_cast<std::size_t>(layer_idx)];
  budgeted("block_spans", [&] { p.spans(part, part.first, out); });
  return out;
}

TensorView SequenceCache::get_conv_state(SeqId id, int layer_idx, int state_idx) const {
  const Impl& c = state();
  return c.linear(c.lookup(id), layer_idx, "get_conv_state").get_conv_state(state_idx);
}
TensorView SequenceCache::conv_inputs(SeqId id, int layer_idx, int state_idx) const {
  const Impl& c = state();
  return c.linear(c.lookup(id), layer_idx, "conv_inputs").conv_inputs(state_idx);
}
PositionRange SequenceCache::conv_range(SeqId id, int layer_idx, int state_idx) const {
  const Impl& c = state();
  return c.linear(c.lookup(id), layer_idx, "conv_range").conv_range(state_idx);
}
TensorView SequenceCache::get_recurrent_state(SeqId id, int layer_idx, int state_idx) const {
  const Impl& c = state();
  return c.linear(c.lookup(id), layer_idx, "get_recurrent_state").get_recurrent_state(state_idx);
}
TensorView SequenceCache::recurrent_snapshot(SeqId id, int layer_idx, int state_idx, std::int64_t pos) const {
  const Impl& c = state();
  return c.linear(c.lookup(id), layer_idx, "recurrent_snapshot").recurrent_snapshot(state_idx, pos);
}

// ---- memory ------------------------------------------------------------------------

SequenceMemory SequenceCache::memory() const {
  const Impl& c = state();
  SequenceMemory m;
  m.bytes_reserved = c.budget.reserved;
  for (const auto& l : c.layers) {
    if (!l.paged) continue;
    m.blocks_in_use += l.paged->pool().in_use();
    m.blocks_free += l.paged->pool().free_count();
    m.bytes_used += static_cast<std::size_t>(l.paged->pool().in_use()) * l.paged->pool().block_bytes();
  }
  auto count_linear = [&](const Sequence& s) {
    for (const auto& layer : s.linear)
      if (layer) m.bytes_used += layer->memory().bytes_used;
  };
  for (const auto& slot : c.slots)
    if (slot.seq) count_linear(*slot.seq);
  for (const detail::SnapshotHold* h : c.holds) count_linear(*h->seq);
  for (const auto& s : c.deferred) count_linear(*s);
  return m;
}

void SequenceCache::set_memory_budget(std::size_t bytes) {
  Impl& c = state();
  c.refuse_in_batch("set_memory_budget");
  if (bytes != 0 && c.budget.reserved > bytes) {
    throw CapacityError("set_memory_budget(" + std::to_string(bytes) + "): " + std::to_string(c.budget.reserved) +
                        " bytes are already reserved; the budget stays " + std::to_string(c.budget.limit));
  }
  c.budget.limit = bytes;
}

std::size_t SequenceCache::memory_budget() const { return state().budget.limit; }

void SequenceCache::shrink_to_fit() {
  Impl& c = state();
  c.refuse_in_batch("shrink_to_fit");
  for (auto& l : c.layers)
    if (l.paged) l.paged->pool().trim();
  for (auto& slot : c.slots) {
    if (!slot.seq) continue;
    for (auto& layer : slot.seq->linear)
      if (layer) layer_impl(*layer).shrink_to_fit();
  }
}

}  // namespace rwd
