// runtime/generation/speculative.cc: chain speculative decoding, one sequence or a
// batch.
#include "runtime/generate.h"

#include <algorithm>

#include "internal.h"
#include "rewind/error.h"
#include "runtime/kernels.h"

namespace rwd::runtime {

using namespace generation;

void check_num_draft(std::int64_t k, const char* what) {
  if (k < 1 || k > kMaxDraft) {
    throw InvalidArgument(std::string(what) + " must be in [1, " + std::to_string(kMaxDraft) + "], got " +
                          std::to_string(k));
  }
}

std::vector<std::int32_t> accept_drafts(std::span<const float> logits, std::int64_t V,
                                        std::span<const std::int32_t> drafts,
                                        std::span<const std::vector<float>> draft_probs, const SamplingParams& sampling,
                                        std::mt19937_64& rng, std::int64_t& accepted) {
  const auto kd = static_cast<std::int64_t>(drafts.size());
  if (V < 1 || static_cast<std::int64_t>(logits.size()) < (kd + 1) * V) {
    throw InvalidArgument("accept_drafts: " + std::to_string(kd) + " drafts need " + std::to_string(kd + 1) +
                          " rows of " + std::to_string(V) + " logits, got " + std::to_string(logits.size()) +
                          " floats");
  }
  auto row = [&](std::int64_t j) {
    return logits.subspan(static_cast<std::size_t>(j * V), static_cast<std::size_t>(V));
  };
  std::vector<std::int32_t> emitted;
  accepted = 0;
  if (sampling.greedy()) {
    while (accepted < kd && kernels::argmax(row(accepted).data(), V) == drafts[static_cast<std::size_t>(accepted)]) {
      ++accepted;
    }
    emitted.assign(drafts.begin(), drafts.begin() + accepted);
    emitted.push_back(static_cast<std::int32_t>(kernels::argmax(row(accepted).data(), V)));
    return emitted;
  }
  for (std::int64_t j = 0; j < kd; ++j) {
    const std::vector<float> p = sampling_distribution(row(j), sampling);
    const auto d = static_cast<std::size_t>(drafts[static_cast<std::size_t>(j)]);
    const bool has_q = static_cast<std::size_t>(j) < draft_probs.size();
    const double qd = has_q ? draft_probs[static_cast<std::size_t>(j)][d] : 1.0;
    if (qd > 0.0 && uniform01(rng) < std::min(1.0, static_cast<double>(p[d]) / qd)) {
      emitted.push_back(static_cast<std::int32_t>(d));
      ++accepted;
      continue;
    }
    std::vector<float> residual(p.size());
    double total = 0.0;
    for (std::size_t t = 0; t < p.size(); ++t) {
      const double qt = has_q ? draft_probs[static_cast<std::size_t>(j)][t] : (t == d ? 1.0 : 0.0);
      residual[t] = static_cast<float>(std::max(0.0, static_cast<double>(p[t]) - qt));
      total += residual[t];
    }
    if (total > 0.0) {
      for (float& r : residual) r = static_cast<float>(r / total);
      emitted.push_back(sample_from(residual, rng));
    } else {
      emitted.push_back(sample_from(p, rng));
    }
    return emitted;
  }
  emitted.push_back(sample_from(sampling_distribution(row(kd), sampling), rng));
  return emitted;
}

namespace {

// One sequence under speculative decoding: what it has emitted, its own
// random stream and draft length, and its statistics. The pieces below each
// do one job of a round; speculative_generate and its batched form chain
// them around their forwards.
struct SpecSequence {
  std::vector<std::int32_t> sequence;  // prompt + emitted; the last token is pending
  std::vector<std::int32_t> out;
  std::mt19937_64 rng;
  std::int64_t k_now = 0;
  bool running = true;
  GenerationStats stats;
  // The round in flight.
  std::vector<std::int32_t> drafts;
  std::vector<std::vector<float>> q;  // draft distributions (sampling mode)
  std::int64_t k = 0;                 // draft length asked for this round
};

// `seed_offset`: sequence i of a batch draws from seed + i.
SpecSequence start_spec(std::span<const std::int32_t> prompt, const GenerationOptions& options,
                        const SpeculativeOptions& spec, std::uint64_t seed_offset = 0) {
  SpecSequence s;
  s.sequence.assign(prompt.begin(), prompt.end());
  s.rng.seed(options.sampling.seed + seed_offset);
  s.k_now = spec.num_draft;
  s.running = options.max_new_tokens > 0;
  s.stats = start_stats(prompt, options.sampling);
  return s;
}

// Sets this round's draft length (a round emits accepted + 1 tokens, so at
// most the budget - 1) and clears the last round's drafts.
void plan_round(SpecSequence& s, const GenerationOptions& options) {
  const std::int64_t budget = options.max_new_tokens - static_cast<std::int64_t>(s.out.size());
  s.k = std::min(s.k_now, budget - 1);
  s.q.clear();
  s.drafts.clear();
}

// The verify tokens once the drafts are in: the pending token, then the
// drafts (a source that proposed more than k is cut to k).
std::vector<std::int32_t> verify_tokens(SpecSequence& s) {
  if (static_cast<std::int64_t>(s.drafts.size()) > s.k)
    s.drafts.resize(static_cast<std::size_t>(std::max<std::int64_t>(s.k, 0)));
  std::vector<std::int32_t> verify;
  verify.reserve(s.drafts.size() + 1);
  verify.push_back(s.sequence.back());
  verify.insert(verify.end(), s.drafts.begin(), s.drafts.end());
  return verify;
}

// The tokens this round emits from the verify forward's logits ([kd + 1,
// V]): accept_drafts over this round's drafts.
std::vector<std::int32_t> accept_round(SpecSequence& s, std::span<const float> logits, std::int64_t V,
                                       const SamplingParams& sampling, std::int64_t& accepted) {
  return accept_drafts(logits, V, s.drafts, s.q, sampling, s.rng, accepted);
}

// After the target's crop and the draft's accept: counts the round, emits
// the tokens (stopping at EOS / the budget) and adapts K.
void finish_round(SpecSequence& s, const Model& target, const GenerationOptions& options,
                  const SpeculativeOptions& spec, std::int64_t accepted, const std::vector<std::int32_t>& emitted,
                  Clock::time_point t0) {
  const auto kd = static_cast<std::int64_t>(s.drafts.size());
  count_round(s.stats, kd, accepted, true);
  if (!emit_all(emitted, s.sequence, target, options, s.out, t0, s.stats)) s.running = false;
  if (spec.adaptive && kd > 0) {
    s.k_now = accepted == kd ? std::min(s.k_now + 2, spec.num_draft) : std::max<std::int64_t>(s.k_now - 1, 1);
  }
}

// A sequence joining the batch gets a cache sequence that records its past
// for rollbacks; with a prefix cache its prompt but the pending token is fed
// at once. Returns whether it is prefilled.
bool join_batch(const Model& target, SequenceCache& cache, SeqId& id, std::span<const std::int32_t> prompt,
                const GenerationOptions& options, SpecSequence& s) {
  const SpeculativeOptions& spec = options.speculation;
  id = cache.add_sequence();
  cache.activate_past_recording(id, spec.num_draft);  // a round rolls back at most K tokens
  if (prompt.size() < 2) return true;
  if (!options.prefix_cache) return false;
  id = prefill_sequence(target, cache, id, prompt.first(prompt.size() - 1), *options.prefix_cache, spec.num_draft,
                        options.max_prefill_rows, s.stats);
  return true;
}

// Every prefilled sequence plans its round; one propose call drafts for all
// of them (one request each).
void propose_round(BatchDraftSource& drafts, std::span<const std::size_t> active, const std::vector<bool>& prefilled,
                   std::vector<SpecSequence>& seqs, const GenerationOptions& options) {
  std::vector<BatchDraftSource::Request> requests;
  for (std::size_t i : active) {
    if (!prefilled[i]) continue;
    SpecSequence& s = seqs[i];
    plan_round(s, options);
    if (s.k > 0) requests.push_back({i, s.sequence, s.k, &s.drafts, options.sampling.greedy() ? nullptr : &s.q});
  }
  if (!requests.empty()) drafts.propose(requests);
}

// The next piece of a joining sequence's prompt (the pending last token
// excluded) after the `fed` tokens already in, at most `prompt_rows`, which
// it uses up.
void next_prompt_piece(std::span<const std::int32_t> prompt, std::size_t fed, std::int64_t& prompt_rows,
                       std::vector<std::int32_t>& piece) {
  const std::size_t rest = prompt.size() - 1 - fed;
  const auto take = static_cast<std::size_t>(std::min<std::int64_t>(static_cast<std::int64_t>(rest), prompt_rows));
  prompt_rows -= static_cast<std::int64_t>(take);
  const auto from = prompt.begin() + static_cast<std::ptrdiff_t>(fed);
  piece.assign(from, from + static_cast<std::ptrdiff_t>(take));
}

// After the verify forward, for sequence i of the batch: accepts from its
// rows of logits, crops the rejected drafts from its cache sequence only and
// emits. Returns whether it runs on; one that stops leaves the cache and the
// draft source.
bool settle_round(SpecSequence& s, std::size_t i, SeqId id, std::span<const float> rows, std::int64_t V,
                  const Model& target, SequenceCache& cache, BatchDraftSource& drafts, const GenerationOptions& options,
                  Clock::time_point t0) {
  std::int64_t accepted = 0;
  const std::vector<std::int32_t> emitted = accept_round(s, rows, V, options.sampling, accepted);
  const auto tc = Clock::now();
  cache.crop(id, -(static_cast<std::int64_t>(s.drafts.size()) - accepted));
  s.stats.cache_seconds += seconds_since(tc);
  if (s.k > 0) drafts.accept(i, static_cast<std::int64_t>(s.drafts.size()), accepted);
  finish_round(s, target, options, options.speculation, accepted, emitted, t0);
  if (s.running) return true;
  s.stats.seconds = seconds_since(t0);
  cache.seq_rm(id);
  drafts.finish(i);
  return false;
}

}  // namespace

std::vector<std::int32_t> speculative_generate(const Model& target, DraftSource& draft,
                                               std::span<const std::int32_t> prompt, const GenerationOptions& options,
                                               GenerationStats* stats) {
  validate(options);
  check_prompt(prompt);
  const SpeculativeOptions& spec = options.speculation;
  const auto t0 = Clock::now();
  const std::int64_t V = target.vocab_size();
  SpecSequence s = start_spec(prompt, options, spec);
  Cache cache = target.make_cache();
  cache.activate_past_recording(spec.num_draft);  // a round rolls back at most K tokens
  std::vector<float> logits;
  draft.begin(prompt);
  // The target sees every token but the last one; that "pending" token
  // leads each verify forward.
  if (prompt.size() > 1 && s.running) {
    s.stats.prefix_hit_tokens = prefill(target, prompt.first(prompt.size() - 1), cache, logits, options.prefix_cache,
                                        s.stats, options.max_prefill_rows, options.on_prefill);
  }
  while (s.running) {
    plan_round(s, options);
    if (s.k > 0) s.drafts = draft.propose(s.sequence, s.k, options.sampling.greedy() ? nullptr : &s.q);
    const std::vector<std::int32_t> verify = verify_tokens(s);
    target.forward(verify, cache, logits, true, &s.stats.cache_seconds);
    ++s.stats.forwards;
    std::int64_t accepted = 0;
    const std::vector<std::int32_t> emitted = accept_round(s, logits, V, options.sampling, accepted);
    // Remove the rejected drafts from every layer (crop(0) when none were).
    const auto tc = Clock::now();
    cache.crop(-(static_cast<std::int64_t>(s.drafts.size()) - accepted));
    s.stats.cache_seconds += seconds_since(tc);
    if (s.k > 0) draft.accept(static_cast<std::int64_t>(s.drafts.size()), accepted);
    finish_round(s, target, options, spec, accepted, emitted, t0);
    s.stats.peak_cache_bytes = std::max(s.stats.peak_cache_bytes, cache.memory().bytes_reserved + draft.cache_bytes());
  }
  s.stats.cache_seconds += draft.cache_seconds();
  s.stats.new_tokens = static_cast<std::int64_t>(s.out.size());
  s.stats.seconds = seconds_since(t0);
  if (stats) *stats = s.stats;
  return s.out;
}

std::vector<std::vector<std::int32_t>> speculative_generate_batch(const Model& target, BatchDraftSource& drafts,
                                                                  std::span<const std::vector<std::int32_t>> prompts,
                                                                  const GenerationOptions& options,
                                                                  GenerationStats* stats) {
  validate(options);
  if (prompts.empty()) throw InvalidArgument("speculative_generate_batch needs at least one prompt");
  for (const auto& prompt : prompts) check_prompt(prompt);
  const SpeculativeOptions& spec = options.speculation;
  const auto t0 = Clock::now();
  GenerationOptions quiet = options;
  quiet.on_token = nullptr;
  const std::int64_t V = target.vocab_size();
  const std::size_t n = prompts.size();
  std::vector<SpecSequence> seqs;
  for (std::size_t i = 0; i < n; ++i) seqs.push_back(start_spec(prompts[i], quiet, spec, i));
  SequenceCache cache = target.make_sequence_cache();
  std::vector<SeqId> ids(n);
  drafts.begin(prompts);
  GenerationStats local;
  std::vector<float> logits;
  std::vector<SequenceTokens> batch;
  std::vector<std::vector<std::int32_t>> verify(n);
  // A sequence that joins first feeds its prompt but the pending last token
  // (its "prefill"), in the same forwards as the others' verification, at
  // most max_prefill_rows prompt tokens of all joining sequences a forward.
  std::vector<bool> prefilled(n, false);
  std::vector<std::size_t> prompt_fed(n, 0);  // of a sequence not yet prefilled
  Admission admission(n, options);
  local.max_batch = static_cast<std::int64_t>(admission.limit());
  std::vector<std::size_t> active;
  while (true) {
    for (std::size_t i : admission.admit(active.size())) {
      prefilled[i] = join_batch(target, cache, ids[i], prompts[i], options, seqs[i]);
      active.push_back(i);
    }
    if (active.empty()) break;
    local.peak_batch = std::max(local.peak_batch, static_cast<std::int64_t>(active.size()));
    // Every prefilled sequence's drafts, then one forward verifies them all.
    propose_round(drafts, active, prefilled, seqs, quiet);
    batch.clear();
    std::int64_t prompt_rows = options.max_prefill_rows;
    for (std::size_t i : active) {
      if (prefilled[i]) {
        verify[i] = verify_tokens(seqs[i]);
      } else {
        next_prompt_piece(prompts[i], prompt_fed[i], prompt_rows, verify[i]);
      }
      // A prompt's logits are not read: its pending token verifies next round.
      batch.push_back({ids[i], verify[i], prefilled[i] ? LogitRows::kAll : LogitRows::kNone});
      if (!verify[i].empty()) ++seqs[i].stats.forwards;
    }
    target.forward_batch(batch, cache, logits);
    ++local.forwards;
    std::size_t row = 0;
    std::vector<std::size_t> still;
    for (std::size_t i : active) {
      if (!prefilled[i]) {  // no rows of logits
        prompt_fed[i] += verify[i].size();
        prefilled[i] = prompt_fed[i] == prompts[i].size() - 1;
        still.push_back(i);
        continue;
      }
      const std::span<const float> rows(logits.data() + row * static_cast<std::size_t>(V),
                                        verify[i].size() * static_cast<std::size_t>(V));
      row += verify[i].size();
      if (settle_round(seqs[i], i, ids[i], rows, V, target, cache, drafts, quiet, t0)) still.push_back(i);
    }
    active = std::move(still);
  }
  for (std::size_t i = 0; i < n; ++i) {
    SpecSequence& s = seqs[i];
    s.stats.new_tokens = static_cast<std::int64_t>(s.out.size());
    local.per_sequence.push_back(s.stats);
  }
  local.seconds = seconds_since(t0);
  local.draft_cache_seconds = drafts.cache_seconds();
  local.sum_per_sequence();
  std::vector<std::vector<std::int32_t>> out;
  for (auto& s : seqs) out.push_back(std::move(s.out));
  if (stats) *stats = std::move(local);
  return out;
}

}  // namespace rwd::runtime
