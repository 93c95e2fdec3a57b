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
// A store that fails (StoreError: Redis stopped, a directory gone) turns
// into misses and skipped writes with one warning per PrefixCache, through
// rwd::set_warning_handler. Thread safety: none inside; one owner.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
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
};

struct PrefixCacheStats {
  std::int64_t lookups = 0;
  std::int64_t hit_tokens = 0;        // summed over lookups
  std::int64_t entries_read = 0;      // entries fetched and accepted
  std::int64_t entries_rejected = 0;  // corrupted, truncated, foreign or inconsistent entries
  std::int64_t entries_written = 0;
  std::int64_t writes_refused = 0;    // the store refused for room (put returned false)
  std::int64_t store_errors = 0;      // StoreError from the store (reads and writes)
  std::size_t bytes_read = 0;
  std::size_t bytes_written = 0;
};

struct PrefixHit {
  std::int64_t length = 0;  // tokens the state covers; 0: a miss
  Snapshot state;           // restorable (Cache::restore, SequenceCache::import_snapshot) when length > 0
};

class PrefixCache {
 public:
  // Throws InvalidArgument for a null store, an interval outside [1, 2^40]
  // or an empty fingerprint.
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
  bool store_available() const;

  std::shared_ptr<BlobStore> store_;
  PrefixCacheOptions options_;
  std::uint64_t fingerprint_hash_ = 0;
  PrefixCacheStats stats_;
  bool warned_ = false;
  std::chrono::steady_clock::time_point backoff_until_{};
};

}  // namespace rwd
