// SequenceCache's snapshots: snapshot and restore (shared blocks), export
// and import (the Snapshot value of rewind/snapshot.h).
#include "cache/sequence_cache_impl.h"

namespace rwd {

// ---- snapshots ---------------------------------------------------------------------

detail::SnapshotHold::~SnapshotHold() {
  if (cache) cache->drop(*this);
}

bool SequenceSnapshot::valid() const { return hold_ && hold_->cache; }
std::int64_t SequenceSnapshot::length() const { return valid() ? hold_->length : 0; }

detail::SnapshotHold& SequenceCache::hold_of(const SequenceSnapshot& snapshot, const Impl& cache,
                                             const char* operation) {
  if (!snapshot.hold_) throw InvalidArgument(std::string(operation) + ": the snapshot is empty (default-constructed)");
  if (snapshot.hold_->cache != &cache) {
    throw InvalidArgument(std::string(operation) +
                          ": the snapshot belongs to another SequenceCache (or to one that was destroyed)");
  }
  return *snapshot.hold_;
}

SequenceSnapshot SequenceCache::snapshot(SeqId id) {
  Impl& c = state();
  auto name = [&] { return "snapshot(" + to_string(id) + ")"; };
  c.refuse_in_batch(name);
  const Sequence& parent = c.lookup(id);
  return budgeted(name, [&] {
    SequenceSnapshot out;
    out.hold_ = std::make_shared<detail::SnapshotHold>();
    c.holds.reserve(c.holds.size() + 1);
    c.deferred.reserve(c.holds.size() + 1);
    std::unique_ptr<Sequence> s = c.copy_of(parent);
    c.or_release(*s, [&](Sequence& seq) { c.set_recording(seq, false, 0); });  // no history: the state at L
    out.hold_->length = s->length;
    out.hold_->seq = std::move(s);
    out.hold_->cache = &c;
    c.holds.push_back(out.hold_.get());  // capacity reserved
    return out;
  });
}

SeqId SequenceCache::restore(const SequenceSnapshot& snapshot) {
  Impl& c = state();
  c.refuse_in_batch("restore");
  const detail::SnapshotHold& h = hold_of(snapshot, c, "restore");
  return budgeted("restore", [&] {
    c.reserve_slot();
    return c.place(c.copy_of(*h.seq));
  });
}

void SequenceCache::restore(SeqId id, const SequenceSnapshot& snapshot) {
  Impl& c = state();
  auto name = [&] { return "restore(" + to_string(id) + ")"; };
  c.refuse_in_batch(name);
  Sequence& old = c.lookup(id);
  const detail::SnapshotHold& h = hold_of(snapshot, c, "restore");
  budgeted(name, [&] {
    std::unique_ptr<Sequence> s = c.copy_of(*h.seq);
    if (old.recording) c.or_release(*s, [&](Sequence& seq) { c.set_recording(seq, true, old.history); });
    c.replace(old, std::move(s));
  });
}

Snapshot SequenceCache::export_snapshot(SeqId id, std::int64_t from_position) const {
  const Impl& c = state();
  auto name = [&] { return "export_snapshot(" + to_string(id) + ", " + num(from_position) + ")"; };
  c.refuse_in_batch(name);
  const Sequence& s = c.lookup(id);
  if (from_position < 0 || from_position > s.length) {
    throw InvalidArgument(name() + ": the first position must be in [0, L = " + num(s.length) + "]");
  }
  return budgeted(name, [&] { return c.export_of(s, from_position); });
}

Snapshot SequenceCache::export_snapshot(const SequenceSnapshot& snapshot) const {
  const Impl& c = state();
  c.refuse_in_batch("export_snapshot");
  const detail::SnapshotHold& h = hold_of(snapshot, c, "export_snapshot");
  return budgeted("export_snapshot", [&] { return c.export_of(*h.seq); });
}

SeqId SequenceCache::import_snapshot(const Snapshot& s) {
  Impl& c = state();
  c.refuse_in_batch("import_snapshot");
  c.check_snapshot(s, "import_snapshot");
  c.mark_pools();
  try {
    SeqId id = budgeted("import_snapshot", [&] {
      c.reserve_slot();
      return c.place(c.import(s));
    });
    c.unmark_pools();
    return id;
  } catch (...) {
    c.restore_pools();
    throw;
  }
}

std::int64_t SequenceCache::num_snapshots() const { return static_cast<std::int64_t>(state().holds.size()); }

}  // namespace rwd
