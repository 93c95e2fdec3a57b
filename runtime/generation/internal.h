// runtime/generation/internal.h: what the generation files share (not
// installed; the public API is runtime/generate.h).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "runtime/generate.h"

namespace rwd::runtime::generation {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// A uniform double in [0, 1) from 53 bits of `rng`.
inline double uniform01(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

// The next token from `logits`: the argmax when greedy, else a draw from
// sampling_distribution with `rng`.
std::int32_t pick(std::span<const float> logits, const SamplingParams& params, std::mt19937_64& rng);

// Throws InvalidArgument for an empty prompt.
void check_prompt(std::span<const std::int32_t> prompt);

// Throws InvalidArgument for max_prefill_rows < 1.
void check_prefill_rows(std::int64_t max_rows);

// What every call records before it starts: the prompt, the seed, the threads.
GenerationStats start_stats(std::span<const std::int32_t> prompt, const SamplingParams& sampling);

// Emits `token`; returns false when generation must stop after it. The first
// token stops the time-to-first-token clock (before on_token, which may be slow).
bool emit(std::int32_t token, const Model& model, const GenerationOptions& options, std::vector<std::int32_t>& out,
          Clock::time_point t0, GenerationStats& stats);

// Emits `tokens` in order, each also appended to `sequence`, until emit()
// says to stop; returns false then (the tokens after it are dropped).
bool emit_all(std::span<const std::int32_t> tokens, std::vector<std::int32_t>& sequence, const Model& model,
              const GenerationOptions& options, std::vector<std::int32_t>& out, Clock::time_point t0,
              GenerationStats& stats);

// Counts one speculative round of `drafted` proposals of which `accepted`
// were kept. A chain round also counts a rollback when it rejected any and
// the per-position counts (drafted_at / accepted_at); a tree round neither
// (it commits a path and never crops; its drafts have no chain positions).
void count_round(GenerationStats& stats, std::int64_t drafted, std::int64_t accepted, bool chain);

// Feeds `tokens` to `cache` in forwards of at most max_rows tokens (the
// logits after the last token in `logits`: batch invariance makes them those
// of one forward) and calls after_piece(tokens fed so far) after each. At
// least one forward: no token throws as Model::forward does.
template <class AfterPiece>
void forward_in_pieces(const Model& model, std::span<const std::int32_t> tokens, std::int64_t max_rows, Cache& cache,
                       std::vector<float>& logits, double* cache_seconds, AfterPiece&& after_piece) {
  std::span<const std::int32_t> rest = tokens;
  do {
    const std::size_t n = std::min(static_cast<std::size_t>(max_rows), rest.size());
    model.forward(rest.first(n), cache, logits, false, cache_seconds);
    rest = rest.subspan(n);
    after_piece(static_cast<std::int64_t>(tokens.size() - rest.size()));
  } while (!rest.empty());
}

// prefill() for a new, empty sequence of a SequenceCache (batched decoding):
// `tokens` (a prompt but its pending last token) restored from the prefix
// cache as far as stored, the rest fed in forwards of this sequence alone
// that end at the cache's boundaries, an entry stored at each. Returns the
// sequence's id (a restored one replaces `id`, recording R again when R >= 0).
SeqId prefill_sequence(const Model& model, SequenceCache& cache, SeqId id, std::span<const std::int32_t> tokens,
                       PrefixCache& prefix_cache, std::int64_t R, std::int64_t max_rows, GenerationStats& stats);

// Continuous batching: admits waiting sequences (prompt order) while fewer
// than options.max_batch decode; returns the indices admitted.
class Admission {
 public:
  // REQUIRES: options.max_batch >= 0 (validate()).
  Admission(std::size_t n, const GenerationOptions& options) : n_(n) {
    limit_ = options.max_batch == 0
                 ? n
                 : static_cast<std::size_t>(std::min<std::int64_t>(options.max_batch, static_cast<std::int64_t>(n)));
    if (options.max_new_tokens <= 0) next_ = n_;  // nothing to decode
  }
  // Sequences that may decode at once (max_batch, or all of them for 0).
  std::size_t limit() const { return limit_; }
  std::vector<std::size_t> admit(std::size_t active) {
    std::vector<std::size_t> joined;
    while (active + joined.size() < limit_ && next_ < n_) joined.push_back(next_++);
    return joined;
  }

 private:
  std::size_t n_;
  std::size_t limit_ = 0;
  std::size_t next_ = 0;
};

}  // namespace rwd::runtime::generation
