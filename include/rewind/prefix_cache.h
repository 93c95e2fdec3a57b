// rewind/prefix_cache.h: prefix reuse for hybrid models, in any BlobStore.
//
// A PrefixCache stores, for a token prefix ending at a boundary b, one entry:
// the attention rows of the range since the previous boundary a (those the
// layers retain), the conv inputs and recurrent states at b, the tokens
// [a, b), the logits after position b - 1 when given, and the key of the
// entry for [0, a). Boundaries are every `interval` tokens and the end of
// every prefill, so a repeated prompt hits exactly where it ended. Keys are
// content addresses: a hash of the model fingerprint and the tokens [0, b).
//
// lookup() returns the longest stored prefix for which every layer's part
// is present: it joins the chain of entries back to position 0 and checks
// each one (checksums, fingerprint, its tokens against the prompt, its
// parent link) before using anything, so a model with recurrent or conv
// layers never gets attention rows without the states at the same position,
// and a corrupted, truncated or foreign entry is a miss, never wrong output.
//
// Only what a caller stores goes in: a runtime stores entries while it
// prefills a prompt, before any speculative token exists, so rolled-back
// tokens are never stored.
//
// Nothing a store holds or fails to deliver stops a caller: an entry the
// store refuses to hand out (StoreValueError: a FIFO, a device or a huge file
// named like a key, a Redis key of another type), one over max_entry_bytes,
// one that cannot be allocated or does not parse is a rejected entry (a
// miss, counted by reason); a store that fails (StoreError: Redis stopped, a
// directory gone) or is slow (a call over slow_call_s) is left alone for a
// back-off of 2 s, doubling to 64 s while it stays so, its lookups and
// writes skipped (misses, recomputation), with one warning per PrefixCache
// and cause through rwd::set_warning_handler ("rewind: warning: prefix
// cache ..."). A lookup stops asking the store once its calls took
// lookup_budget_s. Thread safety: none inside; one owner.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "rewind/snapshot.h"
#include "rewind/store.h"

namespace rwd {

// A fast non-cryptographic 64-bit hash of `bytes` (content addressing and
// model fingerprints; entries are verified by content, so a collision can
// only cost a miss).
std::uint64_t content_hash(std::span<const std::byte> bytes, std::uint64_t seed = 0);

struct PrefixCacheOptions {
  std::int64_t interval = 256;    // S: an entry every S tokens, 1..2^40
  std::string model_fingerprint;  // identifies the model (and its weights); required
  // The largest entry a lookup accepts (BlobStore::get_bounded: a directory
  // store refuses a larger file before reading it); 0: 2^32 bytes, any value.
  std::size_t max_entry_bytes = 0;
  // With entry_bytes_per_token > 0, the entry ending at b is also refused
  // unread past entry_fixed_bytes + b * entry_bytes_per_token: its rows
  // cover at most b tokens, so a caller that knows its model's sizes bounds
  // what a junk file under a short prompt's key can make it read.
  std::size_t entry_fixed_bytes = 0;
  std::size_t entry_bytes_per_token = 0;
  // A store call is slow when it takes longer than slow_call_s plus its
  // bytes at slow_bytes_per_s (a big entry may take its time); a slow call
  // starts a back-off as a failure does. slow_call_s 0: never slow; >= 0.
  double slow_call_s = 0.25;
  double slow_bytes_per_s = 256.0 * 1024 * 1024;  // > 0
  // Store time one lookup may spend; past it the lookup asks no more and
  // returns what it has joined by then (a shorter hit or a miss). 0: none.
  double lookup_budget_s = 5.0;
  // The clock store calls are timed by (tests inject one to make a store
  // "slow" without waiting); empty: std::chrono::steady_clock::now.
  std::function<std::chrono::steady_clock::time_point()> clock;
};

struct PrefixCacheStats {
  std::int64_t lookups = 0;
  std::int64_t hits = 0;              // lookups that restored at least one token (misses: lookups - hits)
  std::int64_t hit_tokens = 0;        // summed over lookups
  std::int64_t entries_read = 0;      // entries fetched and accepted
  std::int64_t entries_rejected = 0;  // entries_unusable + entries_corrupt + entries_foreign
  std::int64_t entries_unusable = 0;  // the store holds no usable value under the key: not a regular file, over
                                      // max_entry_bytes, another Redis type, cannot be allocated
  std::int64_t entries_corrupt = 0;   // values that do not parse: checksums, truncation, garbage
  std::int64_t entries_foreign = 0;   // another model's, other tokens, a wrong parent link, or not joining a chain
  std::int64_t entries_written = 0;
  std::int64_t writes_refused = 0;       // the store refused for room or as read-only (put returned false)
  std::int64_t store_errors = 0;         // StoreError from the store (reads and writes), each starting a back-off
  std::int64_t slow_calls = 0;           // store calls over the slow_call_s bound, each starting a back-off
  std::int64_t calls_skipped = 0;        // reads and writes not tried during a back-off
  std::int64_t lookups_over_budget = 0;  // lookups cut short by lookup_budget_s
  double store_seconds = 0;              // time spent in store calls (by options.clock)
  std::size_t bytes_read = 0;
  std::size_t bytes_written = 0;
};

struct PrefixHit {
  std::int64_t length = 0;  // tokens the state covers; 0: a miss
  Snapshot state;           // restorable (Cache::restore, SequenceCache::import_snapshot) when length > 0
};

class PrefixCache {
 public:
  // Throws InvalidArgument for a null store, an interval outside [1, 2^40],
  // an empty fingerprint, a negative or non-finite slow_call_s or
  // lookup_budget_s, or a slow_bytes_per_s that is not positive.
  PrefixCache(std::shared_ptr<BlobStore> store, PrefixCacheOptions options);

  const PrefixCacheOptions& options() const { return options_; }
  BlobStore& store() const { return *store_; }
  const PrefixCacheStats& stats() const { return stats_; }

  // The key of the entry ending at tokens.size() ("p1-" + 16 hex digits of
  // the fingerprint + "-" + the length + "-" + 32 hex digits of the tokens).
  std::string key(std::span<const std::int32_t> tokens) const;
  // Where a prefill of positions [from, to) writes entries: every multiple
  // of S in (from, to), then `to` (when to > from).
  std::vector<std::int64_t> boundaries(std::int64_t from, std::int64_t to) const;

  // The longest prefix of `tokens` whose entries are all present and valid,
  // tried at P = tokens.size(), P - 1, then down the multiples of S; with
  // `need_logits`, only entries that carry the logits of their last position
  // count (what a caller needs to emit the next token without a forward).
  // Never throws for what a store holds or fails to deliver (misses, counted
  // in stats); throws CapacityError when memory for the result runs out.
  PrefixHit lookup(std::span<const std::int32_t> tokens, bool need_logits = true);

  // Stores the entry for the prefix tokens[0, b) (b = tokens.size()) that
  // continues the entry ending at `a`: `segment` is the state at b with
  // attention rows from a (Cache::snapshot(a) or
  // SequenceCache::export_snapshot(id, a)), `logits` the model's output after
  // position b - 1 ([vocab] f32, or empty). Returns true when the store took
  // it. Store failures are counted and warned about (once), not thrown.
  // Throws InvalidArgument when 0 <= a < b does not hold or the segment's
  // length is not b.
  bool store(std::span<const std::int32_t> tokens, std::int64_t a, Snapshot segment,
             std::span<const float> logits = {});

 private:
  // Fetches, parses and checks the entry for tokens[0, b): null when absent
  // or rejected.
  std::unique_ptr<Snapshot> fetch(std::span<const std::int32_t> tokens, std::int64_t b);
  // Joins a chain of entries (oldest first, the first starting at 0) into
  // one restorable state; false when they do not fit together.
  bool join(const std::vector<std::shared_ptr<Snapshot>>& chain, Snapshot& out) const;
  void store_failed(const std::string& what);
  // Accounts a store call that began at `start` and moved `bytes`: its time,
  // and a back-off when it was slow; `ok` (it did not fail) and fast ends a
  // run of back-offs.
  void call_done(std::chrono::steady_clock::time_point start, std::size_t bytes, bool ok);
  void back_off();
  // False (counted in calls_skipped) during a back-off.
  bool store_available();
  std::chrono::steady_clock::time_point now() const;
  // The largest entry ending at b that fetch reads (max_entry_bytes, or the
  // per-token bound when it is smaller).
  std::size_t entry_bound(std::int64_t b) const;
  std::string named(const std::string& what) const;

  std::shared_ptr<BlobStore> store_;
  PrefixCacheOptions options_;
  std::uint64_t fingerprint_hash_ = 0;
  PrefixCacheStats stats_;
  bool warned_failure_ = false;
  bool warned_slow_ = false;
  std::chrono::steady_clock::time_point backoff_until_{};
  std::chrono::steady_clock::duration backoff_{};  // the next back-off's length
  double lookup_spent_s_ = 0;                      // store time of the lookup in progress
  bool over_budget_ = false;                       // the lookup in progress ran out of lookup_budget_s
};

}  // namespace rwd
