// SequenceCache's batched forwards: begin_batch and the updates of an open
// batch, SequenceBatch and BatchRecurrentUpdate.
#include "cache/sequence_cache_impl.h"

namespace rwd {

// ---- batches -----------------------------------------------------------------------

MaskSizes SequenceCache::get_mask_sizes(SeqId id, std::int64_t q, int layer_idx) const {
  const Impl& c = state();
  const Sequence& s = c.lookup(id);
  const PagedLayer& p = c.attention(layer_idx, "get_mask_sizes");
  if (q < 1 || q > detail::kMaxTokens) {
    throw InvalidArgument(c.where(layer_idx) + ": get_mask_sizes(" + num(q) + ") needs a query length in [1, 2^40]");
  }
  const std::int64_t first = p.rule().visible_first(s.length);
  return {s.length + q - first, first};
}

std::vector<Sequence*> SequenceCache::Impl::batch_sequences(std::span<const BatchEntry> entries, std::int64_t& total) {
  if (entries.empty()) throw InvalidArgument("begin_batch needs at least one entry");
  if (entries.size() > static_cast<std::size_t>(detail::kMaxBatch)) {
    throw CapacityError("begin_batch got " + std::to_string(entries.size()) + " entries; at most 2^24 are allowed");
  }
  std::vector<Sequence*> seqs;
  total = 0;
  budgeted("begin_batch", [&] { seqs.reserve(entries.size()); });
  for (std::size_t e = 0; e < entries.size(); ++e) {
    Sequence& s = lookup(entries[e].seq);
    const std::int64_t q = entries[e].num_tokens;
    const std::string entry = "begin_batch: entry " + std::to_string(e) + " (" + to_string(s.id()) + ")";
    if (q < 0) throw InvalidArgument(entry + " asks for " + num(q) + " tokens; a count must be >= 0");
    if (detail::passes_token_limit(s.length, q)) {
      throw CapacityError(entry + ": " + num(q) + " tokens at length " + num(s.length) +
                          " pass the limit of 2^40 tokens per sequence; nothing was changed");
    }
    if (detail::passes_token_limit(total, q)) {
      throw CapacityError("begin_batch: the batch passes 2^40 tokens in all; nothing was changed");
    }
    total += q;
    seqs.push_back(&s);
  }
  for (std::size_t e = 0; e < seqs.size(); ++e) {
    if (seqs[e]->in_batch) {
      for (std::size_t k = 0; k < e; ++k) seqs[k]->in_batch = false;
      throw InvalidArgument("begin_batch lists " + to_string(seqs[e]->id()) + " twice (entry " + std::to_string(e) +
                            "); each sequence may appear once");
    }
    seqs[e]->in_batch = true;
  }
  if (total == 0) {
    for (Sequence* s : seqs) s->in_batch = false;
    throw InvalidArgument("begin_batch: every entry has 0 tokens; a batch needs at least one token");
  }
  return seqs;
}

void SequenceCache::Impl::reserve_batch(std::span<const BatchEntry> entries, const std::vector<Sequence*>& seqs) {
  const std::size_t L = layers.size();
  // Progress: entries before `at_entry` hold every layer's reservation,
  // entry `at_entry` those of the layers before `at_layer`.
  std::size_t at_entry = 0, at_layer = 0;
  mark_pools();
  try {
    budgeted("begin_batch", [&] {
      active.reserve(entries.size());
      plans.resize(std::max(plans.size(), entries.size()));
      for (std::size_t i = 0; i < L; ++i) {
        LayerState& l = layers[i];
        l.views.reserve(entries.size());
        l.windows.reserve(entries.size());
        if (!l.paged) continue;
        std::size_t spans = 0;
        for (Sequence* s : seqs) spans += s->parts[i].runs.size() + 1;
        l.spans.reserve(spans);
      }
      for (at_entry = 0; at_entry < seqs.size(); ++at_entry) {
        const std::int64_t q = entries[at_entry].num_tokens;
        if (q == 0) continue;
        Sequence& s = *seqs[at_entry];
        plans[at_entry].resize(L);
        for (at_layer = 0; at_layer < L; ++at_layer) {
          if (s.linear[at_layer]) {
            plans[at_entry][at_layer] = layer_impl(*s.linear[at_layer]).plan_forward(q, "begin_batch");
          }
          if (layers[at_layer].paged) layers[at_layer].paged->reserve(s.parts[at_layer], q);
        }
        at_layer = 0;
      }
    });
  } catch (...) {
    for (std::size_t e = 0; e <= at_entry && e < seqs.size(); ++e) {
      if (entries[e].num_tokens == 0) continue;
      const std::size_t held = e < at_entry ? L : at_layer;
      for (std::size_t i = 0; i < held; ++i)
        if (layers[i].paged) layers[i].paged->unreserve(seqs[e]->parts[i]);
    }
    restore_pools();
    for (auto& p : plans) p.clear();
    for (Sequence* s : seqs) s->in_batch = false;
    throw;
  }
  unmark_pools();
}

void SequenceCache::Impl::open_batch(std::span<const BatchEntry> entries, const std::vector<Sequence*>& seqs,
                                     SequenceBatch& batch) {
  const std::size_t L = layers.size();
  batch.cache_ = this;
  batch.entries_.assign(entries.begin(), entries.end());
  batch.offsets_.reserve(entries.size());
  std::int64_t offset = 0;
  for (std::size_t e = 0; e < seqs.size(); ++e) {
    const std::int64_t q = entries[e].num_tokens;
    batch.offsets_.push_back(offset);
    active.push_back({seqs[e], q, offset});
    offset += q;
    if (q == 0) continue;
    for (std::size_t i = 0; i < L; ++i) {
      if (seqs[e]->linear[i]) layer_impl(*seqs[e]->linear[i]).open_forward(q, std::move(plans[e][i]));
      if (layers[i].paged) layers[i].paged->open(seqs[e]->parts[i]);
    }
    plans[e].clear();
  }
  for (auto& l : layers) {
    l.views_built = false;
    l.kv_done = false;
    std::fill(l.sides_done.begin(), l.sides_done.end(), false);
  }
}

SequenceBatch SequenceCache::begin_batch(std::span<const BatchEntry> entries) {
  Impl& c = state();
  c.refuse_in_batch("begin_batch");
  std::int64_t total = 0;
  const std::vector<Sequence*> seqs = c.batch_sequences(entries, total);
  c.reserve_batch(entries, seqs);
  SequenceBatch batch;
  c.open_batch(entries, seqs, batch);
  batch.total_ = total;
  c.open = &batch;
  return batch;
}

bool SequenceCache::batch_open() const { return state().open != nullptr; }

std::span<const PagedKeyValues> SequenceCache::update(const TensorView& keys, const TensorView& values, int layer_idx) {
  Impl& c = state();
  c.check_batch("update");
  c.attention(layer_idx, "update");
  const auto i = static_cast<std::size_t>(layer_idx);
  LayerState& l = c.layers[i];
  if (l.kv_done) throw StateError(c.where(layer_idx) + ": update was already called in this batch");
  const BlockLayout& layout = l.paged->layout();
  c.check_input(keys, layer_idx, "keys", {1, layout.num_kv_heads, 0, layout.key_dim}, 2);
  c.check_input(values, layer_idx, "values", {1, layout.num_kv_heads, 0, layout.value_dim}, 2);
  // Stage both before writing either: writing keys may overwrite what a
  // values view reads.
  Tensor keys_copy, values_copy;
  const TensorView k = c.staged(keys, c.aliases_written_blocks(i, keys), keys_copy, layer_idx, "update");
  const TensorView v = c.staged(values, c.aliases_written_blocks(i, values), values_copy, layer_idx, "update");
  c.write_part(i, 0, k, 2);
  c.write_part(i, 1, v, 2);
  l.kv_done = true;
  return c.views(i);
}

std::span<const PagedKeyValues> SequenceCache::update_side(const TensorView& rows, int layer_idx, int side) {
  Impl& c = state();
  c.check_batch("update_side");
  c.attention(layer_idx, "update_side");
  const auto i = static_cast<std::size_t>(layer_idx);
  LayerState& l = c.layers[i];
  if (side < 0 || side >= static_cast<int>(l.sides_done.size())) {
    throw IndexError(c.where(layer_idx) + ": side tensor " + num(side) + " is outside [0, " +
                     num(static_cast<std::int64_t>(l.sides_done.size())) + ")");
  }
  if (l.sides_done[static_cast<std::size_t>(side)]) {
    throw StateError(c.where(layer_idx) + ": update_side(" + num(side) + ") was already called in this batch");
  }
  c.check_input(rows, layer_idx, "side rows", {1, 0, l.paged->layout().side_dims[static_cast<std::size_t>(side)]}, 1);
  Tensor copy;
  c.write_part(i, 2 + side, c.staged(rows, c.aliases_written_blocks(i, rows), copy, layer_idx, "update_side"), 1);
  l.sides_done[static_cast<std::size_t>(side)] = true;
  return c.views(i);
}

std::span<const TensorView> SequenceCache::update_conv_state(const TensorView& x, int layer_idx, int state_idx) {
  Impl& c = state();
  c.check_batch("update_conv_state");
  c.check_layer(layer_idx);
  const auto i = static_cast<std::size_t>(layer_idx);
  LayerState& l = c.layers[i];
  if (!l.linear || l.conv_channels.empty()) {
    throw StateError(c.where(layer_idx) + ": update_conv_state needs a layer with conv states");
  }
  if (state_idx < 0 || state_idx >= static_cast<int>(l.conv_channels.size())) {
    throw IndexError(c.where(layer_idx) + ": conv state " + num(state_idx) + " is outside [0, " +
                     num(static_cast<std::int64_t>(l.conv_channels.size())) + ")");
  }
  const std::int64_t channels = l.conv_channels[static_cast<std::size_t>(state_idx)];
  c.check_input(x, layer_idx, "conv input", {1, channels, 0}, 2);
  // Each sequence stages what aliases its own storage; an input that
  // aliases another sequence of the batch is copied here, once.
  const detail::ByteSpan span = detail::byte_span(x);
  bool aliases = false;
  for (const auto& a : c.active) {
    if (a.q == 0) continue;
    const auto& track = layer_impl(*a.seq->linear[i]).convs[static_cast<std::size_t>(state_idx)];
    aliases = aliases || track.buffer.allocation().overlaps(span.lo, span.hi);
  }
  Tensor copy;
  const TensorView source = c.staged(x, aliases, copy, layer_idx, "update_conv_state");
  l.windows.clear();
  for (const auto& a : c.active) {
    if (a.q == 0) {
      l.windows.push_back(TensorView::strided(nullptr, x.dtype, {1, channels, 0}, {0, 0, 0}));
      continue;
    }
    l.windows.push_back(a.seq->linear[i]->update_conv_state(source.slice(2, a.offset, a.q), state_idx));
  }
  return l.windows;
}

BatchRecurrentUpdate SequenceCache::begin_recurrent_update(int layer_idx, int state_idx) {
  Impl& c = state();
  c.check_batch("begin_recurrent_update");
  c.check_layer(layer_idx);
  const auto i = static_cast<std::size_t>(layer_idx);
  const LayerState& l = c.layers[i];
  if (!l.linear || l.num_recurrent == 0) {
    throw StateError(c.where(layer_idx) + ": begin_recurrent_update needs a layer with recurrent states");
  }
  if (state_idx < 0 || state_idx >= static_cast<int>(l.num_recurrent)) {
    throw IndexError(c.where(layer_idx) + ": recurrent state " + num(state_idx) + " is outside [0, " +
                     num(static_cast<std::int64_t>(l.num_recurrent)) + ")");
  }
  BatchRecurrentUpdate out;
  out.cache_ = &c;
  out.batch_ = c.batch_serial;
  out.layer_ = layer_idx;
  budgeted([&] { return c.where(layer_idx) + ": begin_recurrent_update"; },
           [&] {
             out.updates_.reserve(c.active.size());
             out.index_.reserve(c.active.size());
             out.previous_.reserve(c.active.size());
           });
  for (const auto& a : c.active) {
    Layer& layer = *a.seq->linear[i];
    if (a.q > 0) {
      out.index_.push_back(static_cast<std::int32_t>(out.updates_.size()));
      out.updates_.push_back(layer.begin_recurrent_update(a.q, state_idx));
      out.previous_.push_back(out.updates_.back().previous());
    } else {
      out.index_.push_back(-1);
      out.previous_.push_back(layer.get_recurrent_state(state_idx));
    }
  }
  return out;
}

// ---- SequenceBatch -----------------------------------------------------------------

SequenceBatch::SequenceBatch(SequenceBatch&& other) noexcept
    : cache_(std::exchange(other.cache_, nullptr)), entries_(std::move(other.entries_)),
      offsets_(std::move(other.offsets_)), total_(other.total_) {
  if (cache_) cache_->open = this;
}

SequenceBatch& SequenceBatch::operator=(SequenceBatch&& other) noexcept {
  if (this != &other) {
    abandon();
    cache_ = std::exchange(other.cache_, nullptr);
    entries_ = std::move(other.entries_);
    offsets_ = std::move(other.offsets_);
    total_ = other.total_;
    if (cache_) cache_->open = this;
  }
  return *this;
}

SequenceBatch::~SequenceBatch() { abandon(); }

void SequenceBatch::commit() {
  if (!cache_) throw StateError("SequenceBatch::commit: the batch is not open (committed, abandoned or moved from)");
  SequenceCache::Impl& c = *cache_;
  // The first layer (in model order) that misses a part is named.
  for (std::size_t i = 0; i < c.layers.size(); ++i) {
    const LayerState& l = c.layers[i];
    if (l.paged && !l.kv_done) {
      throw StateError("SequenceBatch::commit: " + c.where(static_cast<int>(i)) +
                       " did not receive its keys and values (update); the batch stays open");
    }
    for (std::size_t s = 0; s < l.sides_done.size(); ++s) {
      if (!l.sides_done[s]) {
        throw StateError("SequenceBatch::commit: " + c.where(static_cast<int>(i)) + " did not receive side tensor " +
                         std::to_string(s) + " (update_side); the batch stays open");
      }
    }
    if (!l.linear) continue;
    for (const auto& a : c.active) {
      if (a.q == 0) continue;
      try {
        SequenceCache::layer_impl(*a.seq->linear[i]).check_forward_complete();
      } catch (const StateError& e) {
        throw StateError("SequenceBatch::commit: " + to_string(a.seq->id()) + ": " + e.what() +
                         "; the batch stays open");
      }
    }
  }
  for (const auto& a : c.active) {
    if (a.q == 0) continue;
    for (std::size_t i = 0; i < c.layers.size(); ++i) {
      if (c.layers[i].paged) c.layers[i].paged->commit(a.seq->parts[i], a.seq->retained_history());
      if (a.seq->linear[i]) SequenceCache::layer_impl(*a.seq->linear[i]).close_forward();
    }
    if (c.keeps_tokens) a.seq->length += a.q;  // Cache::get_seq_length: 0 when no layer keeps tokens
  }
  c.close_batch();
}

void SequenceBatch::abandon() noexcept {
  if (cache_) cache_->abandon_batch();
}

// ---- BatchRecurrentUpdate ----------------------------------------------------------

BatchRecurrentUpdate::BatchRecurrentUpdate(BatchRecurrentUpdate&&) noexcept = default;
BatchRecurrentUpdate& BatchRecurrentUpdate::operator=(BatchRecurrentUpdate&&) noexcept = default;
BatchRecurrentUpdate::~BatchRecurrentUpdate() = default;

void BatchRecurrentUpdate::check_open(const char* operation) const {
  // Compared before anything is dereferenced: after the batch ended, a
  // sequence (and its layers) may be gone.
  if (cache_ == nullptr || cache_->open == nullptr || cache_->batch_serial != batch_) {
    throw StateError(std::string("BatchRecurrentUpdate::") + operation + ": the handle of layer " +
                     std::to_string(layer_) +
                     " belongs to a batch that was committed or abandoned; take a new one "
                     "with begin_recurrent_update in the open batch");
  }
}

std::int64_t BatchRecurrentUpdate::num_tokens(std::size_t entry) const {
  if (entry >= index_.size()) {
    throw IndexError("BatchRecurrentUpdate: entry " + std::to_string(entry) + " is outside [0, " +
                     std::to_string(index_.size()) + ")");
  }
  return index_[entry] < 0 ? 0 : updates_[static_cast<std::size_t>(index_[entry])].num_tokens();
}

TensorView BatchRecurrentUpdate::previous(std::size_t entry) const {
  check_open("previous");
  num_tokens(entry);  // checks the entry
  return previous_[entry];
}

TensorView BatchRecurrentUpdate::next(std::size_t entry, std::int64_t t) const {
  check_open("next");
  const std::int64_t q = num_tokens(entry);
  if (q == 0) {
    throw IndexError("BatchRecurrentUpdate::next(" + std::to_string(entry) + ", " + std::to_string(t) +
                     "): the entry has 0 tokens, so no slot to write");
  }
  return updates_[static_cast<std::size_t>(index_[entry])].next(t);
}

void BatchRecurrentUpdate::commit() {
  check_open("commit");
  for (auto& u : updates_) u.commit();
}

}  // namespace rwd
