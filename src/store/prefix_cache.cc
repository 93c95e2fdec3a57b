// Prefix reuse (rewind/prefix_cache.h): entries per boundary, chained back
// to position 0 by parent keys, each checked before it is used.
#include "rewind/prefix_cache.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <new>
#include <utility>

#include "cache/warnings.h"
#include "tensor_copy.h"

namespace rwd {
namespace {

static_assert(std::endian::native == std::endian::little,
              "prefix-cache keys hash tokens as little-endian bytes: a big-endian host needs a byte swap here");

using detail::copy_of;
using detail::present;

constexpr std::int64_t kMaxTokens = std::int64_t{1} << 40;
// After a store failure or a slow call the store is left alone for this
// long, so that a stopped server costs one failed call per interval, not one
// per entry; doubled while it keeps failing or being slow, up to kMaxBackoff,
// so that a store slower than recomputation costs little over a long run.
constexpr std::chrono::seconds kStoreBackoff{2};
constexpr std::chrono::seconds kMaxBackoff{64};
constexpr std::size_t kMaxEntryBytes = std::size_t{1} << 32;  // every store's cap (rewind/store.h)

double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

std::uint64_t mix(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

std::string hex16(std::uint64_t v) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, v >>= 4) out[static_cast<std::size_t>(i)] = digits[v & 15];
  return out;
}

std::span<const std::byte> bytes_of(std::span<const std::int32_t> tokens) { return std::as_bytes(tokens); }

// Joins the rows of one attention part over a chain of entries: the longest
// run of entries, ending with the last, whose ranges follow each other.
// Returns false when shapes disagree (an inconsistent chain).
bool join_rows(const std::vector<const Tensor*>& parts, const std::vector<std::int64_t>& firsts,
               const std::vector<std::int64_t>& ends, int token_dim, Tensor& out, std::int64_t& first) {
  const std::size_t n = parts.size();
  std::size_t start = n - 1;
  while (start > 0 && ends[start - 1] == firsts[start]) --start;
  first = firsts[start];
  const TensorView& last = parts.back()->view();
  std::int64_t total = 0;
  for (std::size_t i = start; i < n; ++i) {
    const TensorView& v = parts[i]->view();
    if (v.rank != last.rank || v.dtype != last.dtype) return false;
    for (int d = 0; d < v.rank; ++d)
      if (d != token_dim && v.size(d) != last.size(d)) return false;
    if (v.size(token_dim) != ends[i] - firsts[i]) return false;
    total += v.size(token_dim);
  }
  std::array<std::int64_t, kMaxRank> shape = last.shape;
  shape[static_cast<std::size_t>(token_dim)] = total;
  out = Tensor(last.dtype, shape.data(), last.rank);
  std::int64_t at = 0;
  for (std::size_t i = start; i < n; ++i) {
    const TensorView& v = parts[i]->view();
    copy_tensor(v, out.view().slice(token_dim, at, v.size(token_dim)));
    at += v.size(token_dim);
  }
  return true;
}

}  // namespace

std::uint64_t content_hash(std::span<const std::byte> bytes, std::uint64_t seed) {
  std::uint64_t h = mix(seed ^ (static_cast<std::uint64_t>(bytes.size()) * 0x9e3779b97f4a7c15ULL));
  std::size_t i = 0;
  for (; i + 8 <= bytes.size(); i += 8) {
    std::uint64_t w;
    std::memcpy(&w, bytes.data() + i, 8);
    h = std::rotl(h ^ mix(w + 0x9e3779b97f4a7c15ULL), 29) * 0xff51afd7ed558ccdULL;
  }
  std::uint64_t tail = 0;
  for (std::size_t k = 0; i < bytes.size(); ++i, ++k)
    tail |= static_cast<std::uint64_t>(std::to_integer<unsigned>(bytes[i])) << (8 * k);
  h = std::rotl(h ^ mix(tail ^ 0xc4ceb9fe1a85ec53ULL), 29) * 0xff51afd7ed558ccdULL;
  return mix(h);
}

PrefixCache::PrefixCache(std::shared_ptr<BlobStore> store, PrefixCacheOptions options)
    : store_(std::move(store)), options_(std::move(options)) {
  if (!store_) throw InvalidArgument("PrefixCache needs a store (got null)");
  if (options_.interval < 1 || options_.interval > kMaxTokens) {
    throw InvalidArgument("PrefixCache: interval " + std::to_string(options_.interval) + " is outside [1, 2^40]");
  }
  if (options_.model_fingerprint.empty()) {
    throw InvalidArgument("PrefixCache needs a model fingerprint (entries of other models must be told apart)");
  }
  const auto check_seconds = [](const char* name, double v) {
    if (!(v >= 0.0 && std::isfinite(v))) {
      throw InvalidArgument(std::string("PrefixCache: ") + name + " " + std::to_string(v) +
                            " must be a finite number of seconds >= 0 (0: off)");
    }
  };
  check_seconds("slow_call_s", options_.slow_call_s);
  check_seconds("lookup_budget_s", options_.lookup_budget_s);
  if (!(options_.slow_bytes_per_s > 0.0)) {
    throw InvalidArgument("PrefixCache: slow_bytes_per_s " + std::to_string(options_.slow_bytes_per_s) +
                          " must be > 0");
  }
  if (options_.max_entry_bytes == 0 || options_.max_entry_bytes > kMaxEntryBytes)
    options_.max_entry_bytes = kMaxEntryBytes;
  fingerprint_hash_ = content_hash(std::as_bytes(std::span(options_.model_fingerprint)));
  backoff_ = kStoreBackoff;
}

std::string PrefixCache::key(std::span<const std::int32_t> tokens) const {
  const std::uint64_t a = content_hash(bytes_of(tokens), fingerprint_hash_);
  const std::uint64_t b = content_hash(bytes_of(tokens), ~fingerprint_hash_ ^ 0x5bd1e9955bd1e995ULL);
  return "p1-" + hex16(fingerprint_hash_) + "-" + std::to_string(tokens.size()) + "-" + hex16(a) + hex16(b);
}

std::vector<std::int64_t> PrefixCache::boundaries(std::int64_t from, std::int64_t to) const {
  std::vector<std::int64_t> out;
  if (to <= from) return out;
  const std::int64_t S = options_.interval;
  for (std::int64_t b = (from / S + 1) * S; b < to; b += S) out.push_back(b);
  out.push_back(to);
  return out;
}

std::size_t PrefixCache::entry_bound(std::int64_t b) const {
  const std::size_t per_token = options_.entry_bytes_per_token;
  if (per_token == 0) return options_.max_entry_bytes;
  const auto tokens = static_cast<std::size_t>(b);
  const std::size_t room = options_.max_entry_bytes - std::min(options_.max_entry_bytes, options_.entry_fixed_bytes);
  if (tokens > room / per_token) return options_.max_entry_bytes;
  return options_.entry_fixed_bytes + tokens * per_token;
}

std::chrono::steady_clock::time_point PrefixCache::now() const {
  return options_.clock ? options_.clock() : std::chrono::steady_clock::now();
}

// Store errors name their store ("directory /x: get of key ..."); others
// (a caller's store) get its description in front.
std::string PrefixCache::named(const std::string& what) const {
  const std::string d = store_->describe();
  return what.compare(0, d.size(), d) == 0 ? what : d + ": " + what;
}

void PrefixCache::back_off() {
  backoff_until_ = now() + backoff_;
  backoff_ = std::min<std::chrono::steady_clock::duration>(backoff_ * 2, kMaxBackoff);
}

void PrefixCache::store_failed(const std::string& what) {
  ++stats_.store_errors;
  back_off();
  if (warned_failure_) return;
  warned_failure_ = true;
  detail::warn("rewind: warning: prefix cache: " + named(what) +
               "; skipping the store for a while, then trying again (prefixes are recomputed meanwhile; this "
               "warning is shown once)");
}

void PrefixCache::call_done(std::chrono::steady_clock::time_point start, std::size_t bytes, bool ok) {
  const double took = seconds_between(start, now());
  stats_.store_seconds += took;
  lookup_spent_s_ += took;
  const double allowed = options_.slow_call_s + static_cast<double>(bytes) / options_.slow_bytes_per_s;
  if (options_.slow_call_s <= 0.0 || took <= allowed) {
    if (ok) backoff_ = kStoreBackoff;  // healthy again: the next back-off starts short
    return;
  }
  ++stats_.slow_calls;
  back_off();
  if (warned_slow_) return;
  warned_slow_ = true;
  char buf[160];
  std::snprintf(buf, sizeof buf, "a call took %.3g s, over the %.3g s allowed", took, allowed);
  detail::warn("rewind: warning: prefix cache: " + named(buf) +
               "; skipping the store for a while, then trying again (prefixes are recomputed meanwhile; this "
               "warning is shown once)");
}

bool PrefixCache::store_available() {
  if (now() >= backoff_until_) return true;
  ++stats_.calls_skipped;
  return false;
}

std::unique_ptr<Snapshot> PrefixCache::fetch(std::span<const std::int32_t> tokens, std::int64_t b) {
  if (options_.lookup_budget_s > 0.0 && lookup_spent_s_ >= options_.lookup_budget_s) {
    if (!over_budget_) ++stats_.lookups_over_budget;
    over_budget_ = true;
    return nullptr;
  }
  if (!store_available()) return nullptr;
  const auto prefix = tokens.first(static_cast<std::size_t>(b));
  const auto unusable = [&] {
    ++stats_.entries_unusable;
    ++stats_.entries_rejected;
    return nullptr;
  };
  std::optional<std::vector<std::byte>> bytes;
  const auto start = now();
  try {
    bytes = store_->get_bounded(key(prefix), entry_bound(b));
  } catch (const StoreValueError&) {
    // One name holds junk (a FIFO, a huge file, another Redis type): the
    // store itself works, so no back-off.
    call_done(start, 0, true);
    return unusable();
  } catch (const StoreError& e) {
    call_done(start, 0, false);
    store_failed(e.what());
    return nullptr;
  } catch (const Error&) {
    // CapacityError (a value too big to copy), InvalidArgument from a
    // caller's store: about this entry, not a reason to fail the caller.
    call_done(start, 0, true);
    return unusable();
  } catch (const std::exception& e) {
    call_done(start, 0, false);
    store_failed(e.what());
    return nullptr;
  }
  call_done(start, bytes ? bytes->size() : 0, true);
  if (!bytes) return nullptr;
  stats_.bytes_read += bytes->size();
  if (bytes->size() > entry_bound(b)) return unusable();  // a caller's store that ignored the bound
  auto entry = std::make_unique<Snapshot>();
  std::string fingerprint;
  try {
    *entry = deserialize_snapshot(*bytes, &fingerprint);
  } catch (const FormatError&) {
    ++stats_.entries_corrupt;
    ++stats_.entries_rejected;
    return nullptr;
  } catch (const CapacityError&) {
    // Sizes the checksums vouch for that memory cannot hold now.
    return unusable();
  }
  const auto n = static_cast<std::int64_t>(entry->tokens.size());
  const std::int64_t a = b - n;
  const bool ok = fingerprint == options_.model_fingerprint && entry->length == b && n >= 1 && a >= 0 &&
                  std::equal(entry->tokens.begin(), entry->tokens.end(), prefix.begin() + a) &&
                  entry->parent == (a > 0 ? key(prefix.first(static_cast<std::size_t>(a))) : std::string());
  if (!ok) {
    ++stats_.entries_foreign;
    ++stats_.entries_rejected;
    return nullptr;
  }
  ++stats_.entries_read;
  return entry;
}

PrefixHit PrefixCache::lookup(std::span<const std::int32_t> tokens, bool need_logits) {
  ++stats_.lookups;
  lookup_spent_s_ = 0;
  over_budget_ = false;
  const auto P = static_cast<std::int64_t>(tokens.size());
  const std::int64_t S = options_.interval;
  std::vector<std::int64_t> candidates;
  if (P > 0) candidates.push_back(P);
  // P - 1: where a prefill that leaves the last token pending (speculative
  // decoding, batched decoding) stored its end.
  if (P > 1 && (P - 1) % S != 0) candidates.push_back(P - 1);
  for (std::int64_t b = (P - 1) / S * S; b >= S; b -= S) candidates.push_back(b);
  std::map<std::int64_t, std::shared_ptr<Snapshot>> seen;  // one fetch per boundary (null: a miss)
  auto get = [&](std::int64_t b) {
    auto it = seen.find(b);
    if (it == seen.end()) it = seen.emplace(b, std::shared_ptr<Snapshot>(fetch(tokens, b))).first;
    return it->second;
  };
  for (const std::int64_t b : candidates) {
    std::shared_ptr<Snapshot> last = get(b);
    if (!last || (need_logits && !present(last->logits))) continue;
    std::vector<std::shared_ptr<Snapshot>> chain{last};
    while (chain.back()->length - static_cast<std::int64_t>(chain.back()->tokens.size()) > 0) {
      std::shared_ptr<Snapshot> parent = get(chain.back()->length -
                                             static_cast<std::int64_t>(chain.back()->tokens.size()));
      if (!parent) break;
      chain.push_back(std::move(parent));
    }
    if (chain.back()->length != static_cast<std::int64_t>(chain.back()->tokens.size())) continue;  // broken chain
    std::reverse(chain.begin(), chain.end());
    PrefixHit hit;
    if (!join(chain, hit.state)) {
      ++stats_.entries_foreign;
      ++stats_.entries_rejected;
      continue;
    }
    hit.length = b;
    ++stats_.hits;
    stats_.hit_tokens += b;
    return hit;
  }
  return {};
}

bool PrefixCache::join(const std::vector<std::shared_ptr<Snapshot>>& chain, Snapshot& out) const {
  const Snapshot& last = *chain.back();
  for (const auto& e : chain)
    if (e->layers.size() != last.layers.size()) return false;
  out.length = last.length;
  out.layers.resize(last.layers.size());
  std::vector<std::int64_t> firsts(chain.size()), ends(chain.size());
  for (std::size_t i = 0; i < chain.size(); ++i) ends[i] = chain[i]->length;
  for (std::size_t l = 0; l < last.layers.size(); ++l) {
    LayerSnapshot& o = out.layers[l];
    const LayerSnapshot& src = last.layers[l];
    o.kind = src.kind;
    for (std::size_t i = 0; i < chain.size(); ++i) {
      const LayerSnapshot& e = chain[i]->layers[l];
      if (e.kind != src.kind || e.sides.size() != src.sides.size() || present(e.keys) != present(src.keys))
        return false;
      firsts[i] = e.first;
    }
    if (present(src.keys)) {
      auto part = [&](auto select, int token_dim, Tensor& dst) {
        std::vector<const Tensor*> parts;
        for (const auto& e : chain) parts.push_back(&select(e->layers[l]));
        std::int64_t first = 0;
        if (!join_rows(parts, firsts, ends, token_dim, dst, first)) return false;
        o.first = first;
        return true;
      };
      if (!part([](const LayerSnapshot& s) -> const Tensor& { return s.keys; }, 2, o.keys)) return false;
      if (!part([](const LayerSnapshot& s) -> const Tensor& { return s.values; }, 2, o.values)) return false;
      o.sides.resize(src.sides.size());
      for (std::size_t k = 0; k < src.sides.size(); ++k)
        if (!part([k](const LayerSnapshot& s) -> const Tensor& { return s.sides[k]; }, 1, o.sides[k])) return false;
    }
    for (const Tensor& t : src.conv_states) o.conv_states.push_back(copy_of(t.view()));
    for (const Tensor& t : src.recurrent_states) o.recurrent_states.push_back(copy_of(t.view()));
  }
  if (present(last.logits)) out.logits = copy_of(last.logits.view());
  return true;
}

bool PrefixCache::store(std::span<const std::int32_t> tokens, std::int64_t a, Snapshot segment,
                        std::span<const float> logits) {
  const auto b = static_cast<std::int64_t>(tokens.size());
  if (a < 0 || a >= b) {
    throw InvalidArgument("PrefixCache::store: the entry's range [" + std::to_string(a) + ", " + std::to_string(b) +
                          ") must hold at least one token and start at >= 0");
  }
  if (segment.length != b) {
    throw InvalidArgument("PrefixCache::store: the segment's length " + std::to_string(segment.length) +
                          " is not the prefix length " + std::to_string(b));
  }
  if (!store_available()) return false;
  segment.tokens.assign(tokens.begin() + a, tokens.end());
  segment.parent = a > 0 ? key(tokens.first(static_cast<std::size_t>(a))) : std::string();
  segment.logits = Tensor();
  if (!logits.empty()) {
    segment.logits = Tensor(DType::F32, {static_cast<std::int64_t>(logits.size())});
    std::memcpy(segment.logits.data<float>(), logits.data(), logits.size() * sizeof(float));
  }
  const std::vector<std::byte> bytes = serialize_snapshot(segment, options_.model_fingerprint);
  const auto start = now();
  bool stored = false;
  try {
    stored = store_->put(key(tokens), bytes);
  } catch (const StoreError& e) {
    call_done(start, 0, false);
    store_failed(e.what());
    return false;
  } catch (const InvalidArgument&) {
    // A value over a store's limit (a caller's store, Redis's
    // proto-max-bulk-len reported as such): refused, not fatal.
    call_done(start, 0, true);
    ++stats_.writes_refused;
    return false;
  }
  call_done(start, bytes.size(), true);
  if (!stored) {
    ++stats_.writes_refused;
    return false;
  }
  ++stats_.entries_written;
  stats_.bytes_written += bytes.size();
  return true;
}

}  // namespace rwd
