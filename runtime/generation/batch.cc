// runtime/generation/batch.cc: plain decoding of many prompts in one SequenceCache.
#include "runtime/generate.h"

#include <algorithm>

#include "internal.h"
#include "rewind/error.h"

namespace rwd::runtime {

using namespace generation;

namespace generation {

// prefill() for a new, empty sequence of a SequenceCache (batched decoding):
// `tokens` (a prompt but its pending last token) restored from the prefix
// cache as far as stored, the rest fed in forwards of this sequence alone
// that end at the cache's boundaries, an entry stored at each. Returns the
// sequence's id (a restored one replaces `id`, recording R again when R >= 0).
SeqId prefill_sequence(const Model& model, SequenceCache& cache, SeqId id, std::span<const std::int32_t> tokens,
                       PrefixCache& prefix_cache, std::int64_t R, std::int64_t max_rows, GenerationStats& stats) {
  const auto P = static_cast<std::int64_t>(tokens.size());
  if (P == 0) return id;
  std::int64_t a = 0;
  const PrefixHit hit = prefix_cache.lookup(tokens, false);
  if (hit.length > 0) {
    try {
      const SeqId restored = cache.import_snapshot(hit.state);
      cache.seq_rm(id);
      id = restored;
      if (R >= 0) cache.activate_past_recording(id, R);
      a = hit.length;
      stats.prefix_hit_tokens = a;
    } catch (const InvalidArgument&) {
      // an entry of another shape under this fingerprint: recompute
    }
  }
  const auto V = static_cast<std::size_t>(model.vocab_size());
  std::vector<float> logits;
  for (const std::int64_t b : prefix_cache.boundaries(a, P)) {
    for (std::int64_t c = a; c < b;) {
      const std::int64_t n = std::min(max_rows, b - c);
      const SequenceTokens one{id, tokens.subspan(static_cast<std::size_t>(c), static_cast<std::size_t>(n)),
                               c + n == b ? LogitRows::kLast : LogitRows::kNone};
      model.forward_batch(std::span<const SequenceTokens>(&one, 1), cache, logits);
      ++stats.forwards;
      c += n;
    }
    prefix_cache.store(tokens.first(static_cast<std::size_t>(b)), a, cache.export_snapshot(id, a),
                       std::span<const float>(logits.data(), V));
    a = b;
  }
  return id;
}

}  // namespace generation

std::vector<std::vector<std::int32_t>> generate_batch(const Model& model,
                                                      std::span<const std::vector<std::int32_t>> prompts,
                                                      const GenerationOptions& options, GenerationStats* stats) {
  validate(options);
  if (prompts.empty()) throw InvalidArgument("generate_batch needs at least one prompt");
  for (const auto& prompt : prompts) check_prompt(prompt);
  const auto t0 = Clock::now();
  GenerationOptions quiet = options;
  quiet.on_token = nullptr;
  const std::size_t n = prompts.size();
  GenerationStats local;
  // Sequence i samples as generate() with seed + i would (parallel samples of
  // one prompt differ).
  std::vector<std::mt19937_64> rngs;
  for (std::size_t i = 0; i < n; ++i) rngs.emplace_back(options.sampling.seed + i);
  std::vector<std::vector<std::int32_t>> out(n);
  for (const auto& prompt : prompts) local.per_sequence.push_back(start_stats(prompt, options.sampling));
  SequenceCache cache = model.make_sequence_cache();
  std::vector<SeqId> ids;
  std::vector<std::vector<std::int32_t>> pending(prompts.begin(), prompts.end());
  Admission admission(n, options);
  local.max_batch = static_cast<std::int64_t>(admission.limit());
  std::vector<std::size_t> active;  // sequences decoding now; a joining one feeds its prompt first
  ids.resize(n);
  std::vector<SequenceTokens> batch;
  std::vector<std::int64_t> fed;  // tokens batch[k] feeds
  std::vector<float> logits;
  const auto V = static_cast<std::size_t>(model.vocab_size());
  while (true) {
    for (std::size_t i : admission.admit(active.size())) {
      ids[i] = cache.add_sequence();
      if (options.prefix_cache && pending[i].size() > 1) {
        // All but the last prompt token through the prefix cache; the last
        // one joins the batch.
        ids[i] = prefill_sequence(model, cache, ids[i], std::span(pending[i]).first(pending[i].size() - 1),
                                  *options.prefix_cache, -1, options.max_prefill_rows, local.per_sequence[i]);
        pending[i].erase(pending[i].begin(), pending[i].end() - 1);
      }
      active.push_back(i);
    }
    if (active.empty()) break;
    local.peak_batch = std::max(local.peak_batch, static_cast<std::int64_t>(active.size()));
    // A decoding row goes whole; joining prompts share max_prefill_rows, a
    // prompt that does not fit going on in the next forwards (no logits
    // until its last token is in).
    batch.clear();
    fed.clear();
    std::int64_t prompt_rows = options.max_prefill_rows;
    for (std::size_t i : active) {
      const auto want = static_cast<std::int64_t>(pending[i].size());
      const std::int64_t take = want == 1 ? 1 : std::min(want, prompt_rows);
      if (want > 1) prompt_rows -= take;
      fed.push_back(take);
      batch.push_back({ids[i], std::span<const std::int32_t>(pending[i]).first(static_cast<std::size_t>(take)),
                       take == want ? LogitRows::kLast : LogitRows::kNone});
    }
    model.forward_batch(batch, cache, logits);
    ++local.forwards;
    std::size_t row = 0;  // one row of logits per sequence whose prompt is in
    std::vector<std::size_t> still;
    for (std::size_t k = 0; k < active.size(); ++k) {
      const std::size_t i = active[k];
      if (fed[k] < static_cast<std::int64_t>(pending[i].size())) {  // more of its prompt next time
        if (fed[k] > 0) ++local.per_sequence[i].forwards;
        pending[i].erase(pending[i].begin(), pending[i].begin() + fed[k]);
        still.push_back(i);
        continue;
      }
      const std::int32_t token = pick(std::span<const float>(logits.data() + row++ * V, V), options.sampling, rngs[i]);
      GenerationStats& s = local.per_sequence[i];
      ++s.forwards;
      if (emit(token, model, quiet, out[i], t0, s)) {
        pending[i].assign(1, token);
        still.push_back(i);
      } else {
        s.seconds = seconds_since(t0);
        cache.seq_rm(ids[i]);  // its blocks and states go back at once
      }
    }
    active = std::move(still);
  }
  for (std::size_t i = 0; i < n; ++i) local.per_sequence[i].new_tokens = static_cast<std::int64_t>(out[i].size());
  local.seconds = seconds_since(t0);
  local.sum_per_sequence();
  if (stats) *stats = std::move(local);
  return out;
}

}  // namespace rwd::runtime
