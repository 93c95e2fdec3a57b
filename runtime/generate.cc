#include "runtime/generate.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include <nlohmann/json.hpp>

#include "rewind/error.h"
#include "runtime/kernels.h"

namespace rwd::runtime {

void check_num_draft(std::int64_t k, const char* what) {
  if (k < 1 || k > kMaxDraft) {
    throw InvalidArgument(std::string(what) + " must be in [1, " + std::to_string(kMaxDraft) + "], got " +
                          std::to_string(k));
  }
}
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double uniform01(std::mt19937_64& rng) { return static_cast<double>(rng() >> 11) * 0x1.0p-53; }

std::int32_t pick(std::span<const float> logits, const SamplingParams& params, std::mt19937_64& rng) {
  if (params.greedy()) {
    return static_cast<std::int32_t>(kernels::argmax(logits.data(), static_cast<std::int64_t>(logits.size())));
  }
  const std::vector<float> p = sampling_distribution(logits, params);
  return sample_from(p, rng);
}

void check_prompt(std::span<const std::int32_t> prompt) {
  if (prompt.empty()) throw InvalidArgument("generation needs a non-empty prompt (at least the BOS token)");
}

// What every call records before it starts: the prompt, the seed, the threads.
GenerationStats start_stats(std::span<const std::int32_t> prompt, const SamplingParams& sampling) {
  GenerationStats s;
  s.prompt_tokens = static_cast<std::int64_t>(prompt.size());
  if (!sampling.greedy()) s.seed = sampling.seed;
  s.threads = omp_get_max_threads();
  return s;
}

// Emits `token`; returns false when generation must stop after it. The first
// token stops the time-to-first-token clock (before on_token, which may be slow).
bool emit(std::int32_t token, const Model& model, const GenerationOptions& options, std::vector<std::int32_t>& out,
          Clock::time_point t0, GenerationStats& stats) {
  if (out.empty()) stats.time_to_first_token = seconds_since(t0);
  out.push_back(token);
  if (options.on_token) options.on_token(token);
  if (options.stop_at_eos && model.config().is_eos(token)) return false;
  return static_cast<std::int64_t>(out.size()) < options.max_new_tokens;
}

// The plain decoding loop from a cache that has seen the prompt and the
// logits after its last token.
std::vector<std::int32_t> decode(const Model& model, Cache& cache, std::vector<float>& logits,
                                 const GenerationOptions& options, GenerationStats& local, Clock::time_point t0,
                                 GenerationStats* stats) {
  std::mt19937_64 rng(options.sampling.seed);
  std::vector<std::int32_t> out;
  if (options.max_new_tokens > 0) {
    while (true) {
      const std::int32_t token = pick(logits, options.sampling, rng);
      if (!emit(token, model, options, out, t0, local)) break;
      model.forward(std::span<const std::int32_t>(&token, 1), cache, logits, false, &local.cache_seconds);
      ++local.forwards;
    }
  }
  local.peak_cache_bytes = cache.memory().bytes_reserved;
  local.new_tokens = static_cast<std::int64_t>(out.size());
  local.seconds = seconds_since(t0);
  if (stats) *stats = local;
  return out;
}

}  // namespace

void validate(const SamplingParams& p) {
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature)) {
    throw InvalidArgument("temperature must be a finite number >= 0 (0 = greedy), got " +
                          std::to_string(p.temperature));
  }
  if (p.top_k < 0) throw InvalidArgument("top_k must be >= 0 (0 = off), got " + std::to_string(p.top_k));
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    throw InvalidArgument("top_p must be in (0, 1], got " + std::to_string(p.top_p));
  }
}

namespace {

void check_prefill_rows(std::int64_t max_rows) {
  if (max_rows < 1) {
    throw InvalidArgument("max_prefill_rows must be >= 1 (prompt tokens per forward), got " +
                          std::to_string(max_rows));
  }
}

// What every generation function checks first, whatever paths the call takes.
void validate(const GenerationOptions& options) {
  validate(options.sampling);
  check_prefill_rows(options.max_prefill_rows);
}

}  // namespace

std::vector<float> sampling_distribution(std::span<const float> logits, const SamplingParams& params) {
  const auto n = static_cast<std::int64_t>(logits.size());
  std::vector<float> scaled(logits.begin(), logits.end());
  kernels::scale_inplace(scaled.data(), n, 1.0f / params.temperature);
  std::vector<float> p(scaled.size());
  kernels::softmax(scaled.data(), n, p.data());
  if (params.top_k == 0 && params.top_p >= 1.0f) return p;
  std::vector<std::int32_t> order(p.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
    return p[static_cast<std::size_t>(a)] > p[static_cast<std::size_t>(b)];
  });
  std::size_t keep = order.size();
  if (params.top_k > 0) keep = std::min(keep, static_cast<std::size_t>(params.top_k));
  if (params.top_p < 1.0f) {
    double mass = 0.0;
    for (std::size_t i = 0; i < keep; ++i) {
      mass += p[static_cast<std::size_t>(order[i])];
      if (mass >= params.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  std::vector<float> out(p.size(), 0.0f);
  double total = 0.0;
  for (std::size_t i = 0; i < keep; ++i) total += p[static_cast<std::size_t>(order[i])];
  for (std::size_t i = 0; i < keep; ++i) {
    const auto t = static_cast<std::size_t>(order[i]);
    out[t] = static_cast<float>(p[t] / total);
  }
  return out;
}

std::int32_t sample_from(std::span<const float> probs, std::mt19937_64& rng) {
  const double u = uniform01(rng);
  double cumulative = 0.0;
  std::int32_t last = 0;
  for (std::size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] <= 0.0f) continue;
    cumulative += probs[i];
    last = static_cast<std::int32_t>(i);
    if (u < cumulative) return last;
  }
  return last;  // rounding left u above the total: the last possible token
}

std::string GenerationStats::to_json() const {
  nlohmann::json j;
  j["new_tokens"] = new_tokens;
  j["prompt_tokens"] = prompt_tokens;
  j["seconds"] = seconds;
  j["time_to_first_token_s"] = time_to_first_token;
  j["tokens_per_second"] = tokens_per_second();
  j["decode_tokens_per_second"] = decode_tokens_per_second();
  j["drafted"] = drafted;
  j["accepted"] = accepted;
  j["acceptance_rate"] = acceptance_rate();
  j["drafted_at"] = drafted_at;
  j["accepted_at"] = accepted_at;
  nlohmann::json by_position = nlohmann::json::array();
  for (std::size_t i = 0; i < drafted_at.size(); ++i) by_position.push_back(acceptance_at(i));
  j["acceptance_at"] = by_position;
  j["rollbacks"] = rollbacks;
  j["rounds"] = rounds;
  j["forwards"] = forwards;
  j["cache_seconds"] = cache_seconds;
  j["peak_cache_bytes"] = peak_cache_bytes;
  j["prefix_hit_tokens"] = prefix_hit_tokens;
  j["seed"] = seed ? nlohmann::json(*seed) : nlohmann::json(nullptr);
  j["threads"] = threads;
  return j.dump();
}

namespace {

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

// prefill()'s tokens [a, b) (a < b): counted in stats, reported to on_piece.
void prefill_range(const Model& model, std::span<const std::int32_t> tokens, std::int64_t a, std::int64_t b,
                   std::int64_t max_rows, Cache& cache, std::vector<float>& logits, GenerationStats& stats,
                   const std::function<void(std::int64_t, std::int64_t)>& on_piece) {
  const auto P = static_cast<std::int64_t>(tokens.size());
  forward_in_pieces(model, tokens.subspan(static_cast<std::size_t>(a), static_cast<std::size_t>(b - a)), max_rows,
                    cache, logits, &stats.cache_seconds, [&](std::int64_t fed) {
                      ++stats.forwards;
                      if (on_piece) on_piece(a + fed, P);
                    });
}

// prefill() past its checks: fills `logits` and `cache`, which prefill()
// restores to empty when this throws.
std::int64_t prefill_pieces(const Model& model, std::span<const std::int32_t> tokens, Cache& cache,
                            std::vector<float>& logits, PrefixCache* prefix_cache, GenerationStats& stats,
                            std::int64_t max_rows, const std::function<void(std::int64_t, std::int64_t)>& on_piece) {
  const auto P = static_cast<std::int64_t>(tokens.size());
  if (!prefix_cache) {
    prefill_range(model, tokens, 0, P, max_rows, cache, logits, stats, on_piece);
    return 0;
  }
  std::int64_t restored = 0;
  PrefixHit hit = prefix_cache->lookup(tokens, true);
  if (hit.length > 0 && hit.state.logits.numel() == model.vocab_size()) {
    try {
      const auto tc = Clock::now();
      cache.restore(hit.state);  // transactional: a misfit leaves the cache empty
      stats.cache_seconds += seconds_since(tc);
      restored = hit.length;
    } catch (const InvalidArgument&) {
      // an entry of another shape under this fingerprint: recompute
    }
  }
  if (restored == P) {
    const float* l = hit.state.logits.data<float>();
    logits.assign(l, l + model.vocab_size());
    return restored;
  }
  std::int64_t a = restored;
  for (const std::int64_t b : prefix_cache->boundaries(restored, P)) {
    prefill_range(model, tokens, a, b, max_rows, cache, logits, stats, on_piece);
    prefix_cache->store(tokens.first(static_cast<std::size_t>(b)), a, cache.snapshot(a), logits);
    a = b;
  }
  return restored;
}

}  // namespace

std::int64_t prefill(const Model& model, std::span<const std::int32_t> tokens, Cache& cache, std::vector<float>& logits,
                     PrefixCache* prefix_cache, GenerationStats& stats, std::int64_t max_rows,
                     const std::function<void(std::int64_t, std::int64_t)>& on_piece) {
  check_prefill_rows(max_rows);
  if (tokens.empty()) throw InvalidArgument("prefill needs at least one token, got none");
  for (int i = 0; i < cache.num_layers(); ++i) {  // every layer: one out of step would be reset below
    if (cache.get_seq_length(i) != 0) {
      throw InvalidArgument("prefill needs an empty cache, layer " + std::to_string(i) + " holds " +
                            std::to_string(cache.get_seq_length(i)) + " tokens (reset() it, or use forward to extend it)");
    }
  }
  // All or nothing, as one forward was: a piece that fails (a budget, an
  // exception from on_piece) must not leave the earlier pieces in the
  // caller's cache, nor their logits in `logits`.
  std::vector<float> out;
  try {
    const std::int64_t restored = prefill_pieces(model, tokens, cache, out, prefix_cache, stats, max_rows, on_piece);
    logits.swap(out);
    return restored;
  } catch (...) {
    try {
      cache.reset();  // it was empty; reset keeps the recording setting
    } catch (const Error&) {
      // reset refused new buffers (a budget): the original failure says more
    }
    throw;
  }
}

namespace {

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

}  // namespace

std::vector<std::int32_t> generate(const Model& model, std::span<const std::int32_t> prompt,
                                   const GenerationOptions& options, GenerationStats* stats) {
  validate(options);
  check_prompt(prompt);
  const auto t0 = Clock::now();
  GenerationStats local = start_stats(prompt, options.sampling);
  Cache cache = model.make_cache();
  std::vector<float> logits;
  if (options.max_new_tokens > 0)
    local.prefix_hit_tokens =
        prefill(model, prompt, cache, logits, options.prefix_cache, local, options.max_prefill_rows, options.on_prefill);
  return decode(model, cache, logits, options, local, t0, stats);
}

std::vector<std::int32_t> continue_generation(const Model& model, Cache& cache, std::vector<float>& logits,
                                              const GenerationOptions& options, GenerationStats* stats) {
  validate(options);
  if (cache.get_seq_length() < 1) throw InvalidArgument("continue_generation needs a cache holding at least one token");
  if (static_cast<std::int64_t>(logits.size()) != model.vocab_size()) {
    throw InvalidArgument("continue_generation needs the logits of the last token: " + std::to_string(model.vocab_size()) +
                          " floats, got " + std::to_string(logits.size()));
  }
  GenerationStats local = start_stats({}, options.sampling);
  local.prompt_tokens = cache.get_seq_length();
  return decode(model, cache, logits, options, local, Clock::now(), stats);
}

double BatchGenerationStats::decode_tokens_per_second() const {
  double last_first = 0.0;
  std::int64_t after_first = 0;
  for (const GenerationStats& s : sequences) {
    if (s.new_tokens < 1) continue;
    last_first = std::max(last_first, s.time_to_first_token);
    after_first += s.new_tokens - 1;
  }
  const double t = decode_seconds ? *decode_seconds : seconds - last_first;
  return after_first > 0 && t > 0 ? static_cast<double>(after_first) / t : 0.0;
}

std::string BatchGenerationStats::to_json() const {
  nlohmann::json j;
  j["sequences"] = sequences.size();
  j["new_tokens"] = new_tokens;
  j["forwards"] = forwards;
  j["max_batch"] = max_batch;
  j["peak_batch"] = peak_batch;
  j["seconds"] = seconds;
  j["tokens_per_second"] = tokens_per_second();
  j["decode_tokens_per_second"] = decode_tokens_per_second();
  nlohmann::json ttft = nlohmann::json::array(), per_sequence = nlohmann::json::array();
  std::int64_t hit = 0;
  for (const GenerationStats& s : sequences) {
    ttft.push_back(s.time_to_first_token);
    per_sequence.push_back({{"new_tokens", s.new_tokens}, {"prompt_tokens", s.prompt_tokens},
                            {"time_to_first_token_s", s.time_to_first_token}, {"seconds", s.seconds},
                            {"drafted", s.drafted}, {"accepted", s.accepted}, {"acceptance_rate", s.acceptance_rate()},
                            {"drafted_at", s.drafted_at}, {"accepted_at", s.accepted_at},
                            {"rounds", s.rounds}, {"rollbacks", s.rollbacks},
                            {"prefix_hit_tokens", s.prefix_hit_tokens}});
    hit += s.prefix_hit_tokens;
  }
  j["prefix_hit_tokens"] = hit;
  j["time_to_first_token_s"] = ttft;
  j["per_sequence"] = per_sequence;
  return j.dump();
}

namespace {

// Continuous batching: admits waiting sequences (prompt order) while fewer
// than options.max_batch decode; returns the indices admitted.
class Admission {
 public:
  Admission(std::size_t n, const GenerationOptions& options) : n_(n) {
    if (options.max_batch < 0) {
      throw InvalidArgument("max_batch must be >= 0 (0: every sequence at once), got " +
                            std::to_string(options.max_batch));
    }
    limit_ = options.max_batch == 0 ? n : static_cast<std::size_t>(std::min<std::int64_t>(options.max_batch, static_cast<std::int64_t>(n)));
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

}  // namespace

std::string indexed_text_json(std::size_t index, const std::string& text) {
  const nlohmann::json line{{"index", index}, {"text", text}};
  return line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::vector<std::vector<std::int32_t>> generate_batch(const Model& model,
                                                      std::span<const std::vector<std::int32_t>> prompts,
                                                      const GenerationOptions& options, BatchGenerationStats* stats) {
  validate(options);
  if (prompts.empty()) throw InvalidArgument("generate_batch needs at least one prompt");
  for (const auto& prompt : prompts) check_prompt(prompt);
  const auto t0 = Clock::now();
  GenerationOptions quiet = options;
  quiet.on_token = nullptr;
  const std::size_t n = prompts.size();
  BatchGenerationStats local;
  // Sequence i samples as generate() with seed + i would (parallel samples of
  // one prompt differ).
  std::vector<std::mt19937_64> rngs;
  for (std::size_t i = 0; i < n; ++i) rngs.emplace_back(options.sampling.seed + i);
  std::vector<std::vector<std::int32_t>> out(n);
  for (const auto& prompt : prompts) local.sequences.push_back(start_stats(prompt, options.sampling));
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
                                  *options.prefix_cache, -1, options.max_prefill_rows, local.sequences[i]);
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
        if (fed[k] > 0) ++local.sequences[i].forwards;
        pending[i].erase(pending[i].begin(), pending[i].begin() + fed[k]);
        still.push_back(i);
        continue;
      }
      const std::int32_t token = pick(std::span<const float>(logits.data() + row++ * V, V), options.sampling, rngs[i]);
      GenerationStats& s = local.sequences[i];
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
  for (std::size_t i = 0; i < n; ++i) {
    local.sequences[i].new_tokens = static_cast<std::int64_t>(out[i].size());
    local.new_tokens += local.sequences[i].new_tokens;
  }
  local.seconds = seconds_since(t0);
  if (stats) *stats = std::move(local);
  return out;
}

// ---- draft sources -------------------------------------------------------------

// ---- batch draft sources ---------------------------------------------------------

PerSequenceDrafts::PerSequenceDrafts(std::vector<std::unique_ptr<DraftSource>> sources) : sources_(std::move(sources)) {
  for (const auto& source : sources_)
    if (!source) throw InvalidArgument("PerSequenceDrafts: a draft source is null");
}

void PerSequenceDrafts::begin(std::span<const std::vector<std::int32_t>> prompts) {
  if (prompts.size() != sources_.size()) {
    throw InvalidArgument("PerSequenceDrafts holds " + std::to_string(sources_.size()) + " draft sources for " +
                          std::to_string(prompts.size()) + " prompts; it needs one per prompt");
  }
  for (std::size_t i = 0; i < prompts.size(); ++i) sources_[i]->begin(prompts[i]);
}

void PerSequenceDrafts::propose(std::span<const Request> requests) {
  for (const Request& r : requests) *r.drafts = sources_[r.index]->propose(r.sequence, r.k, r.probs);
}

void PerSequenceDrafts::accept(std::size_t index, std::int64_t proposed, std::int64_t accepted) {
  sources_[index]->accept(proposed, accepted);
}

double PerSequenceDrafts::cache_seconds() const {
  double total = 0.0;
  for (const auto& source : sources_) total += source->cache_seconds();
  return total;
}

BatchedModelDraft::BatchedModelDraft(const Model& draft, SamplingParams sampling, std::int64_t max_draft,
                                     std::int64_t max_prefill_rows)
    : model_(draft), sampling_(sampling), max_draft_(std::max<std::int64_t>(max_draft, 1)),
      max_prefill_rows_((check_prefill_rows(max_prefill_rows), max_prefill_rows)),
      cache_(draft.make_sequence_cache()) {}

void BatchedModelDraft::begin(std::span<const std::vector<std::int32_t>> prompts) {
  for (const SeqId id : ids_)
    if (id.generation != 0) cache_.seq_rm(id);
  // A sequence's draft state is made at its first propose (it has joined
  // the batch) and released at finish: with max_batch, only the sequences
  // decoding hold one, however many prompts wait.
  ids_.assign(prompts.size(), SeqId{});
  seen_.assign(prompts.size(), 0);
  rngs_.clear();
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    rngs_.emplace_back((sampling_.seed + i) ^ 0x9e3779b97f4a7c15ull);  // as ModelDraft's with seed + i
  }
}

void BatchedModelDraft::propose(std::span<const Request> requests) {
  const auto V = static_cast<std::size_t>(model_.vocab_size());
  std::vector<float> logits;
  std::vector<SequenceTokens> batch;
  std::vector<std::int32_t> fed(requests.size());  // the draft each request feeds at the next step
  // Step 0 feeds what each sequence's draft cache has not seen, every later
  // step the draft token of the step before, for the requests still drafting
  // (ModelDraft's forwards, batched).
  std::vector<std::size_t> live;
  // All but the last unseen token of each sequence first, in forwards of at
  // most max_prefill_rows_ rows in all and without logits: a batch of whole
  // prompts would need working memory for all their tokens at once.
  std::vector<std::span<const std::int32_t>> early(requests.size()), last(requests.size());
  for (const Request& q : requests) {
    if (ids_[q.index].generation != 0) continue;
    ids_[q.index] = cache_.add_sequence();
    cache_.activate_past_recording(ids_[q.index], max_draft_);
  }
  for (std::size_t r = 0; r < requests.size(); ++r) {
    const Request& q = requests[r];
    last[r] = q.sequence.subspan(static_cast<std::size_t>(seen_[q.index]));
    if (last[r].size() > 1) {
      early[r] = last[r].first(last[r].size() - 1);
      last[r] = last[r].last(1);
    }
  }
  for (std::size_t r = 0; r < requests.size();) {
    std::int64_t room = max_prefill_rows_;
    for (; r < requests.size() && room > 0; ++r) {
      if (early[r].empty()) continue;
      const auto n = static_cast<std::size_t>(std::min<std::int64_t>(room, static_cast<std::int64_t>(early[r].size())));
      batch.push_back({ids_[requests[r].index], early[r].first(n), LogitRows::kNone});
      early[r] = early[r].subspan(n);
      room -= static_cast<std::int64_t>(n);
      if (!early[r].empty()) break;  // no room left: this sequence goes on in the next forward
    }
    if (!batch.empty()) model_.forward_batch(batch, cache_, logits);
    batch.clear();
  }
  for (std::size_t r = 0; r < requests.size(); ++r) {
    const Request& q = requests[r];
    batch.push_back({ids_[q.index], last[r], LogitRows::kLast});
    seen_[q.index] = static_cast<std::int64_t>(q.sequence.size());
    q.drafts->clear();
    live.push_back(r);
  }
  while (!live.empty()) {
    model_.forward_batch(batch, cache_, logits);
    std::vector<std::size_t> next;
    std::vector<SequenceTokens> next_batch;
    std::size_t offset = 0;  // one row of logits per request
    for (std::size_t r : live) {
      const Request& q = requests[r];
      const std::span<const float> row(logits.data() + offset++ * V, V);
      std::int32_t token;
      if (sampling_.greedy()) {
        token = static_cast<std::int32_t>(kernels::argmax(row.data(), static_cast<std::int64_t>(V)));
      } else {
        std::vector<float> p = sampling_distribution(row, sampling_);
        token = sample_from(p, rngs_[q.index]);
        if (q.probs) q.probs->push_back(std::move(p));
      }
      q.drafts->push_back(token);
      if (static_cast<std::int64_t>(q.drafts->size()) < q.k) {
        fed[r] = token;
        next_batch.push_back({ids_[q.index], std::span<const std::int32_t>(&fed[r], 1), LogitRows::kLast});
        ++seen_[q.index];
        next.push_back(r);
      }
    }
    live = std::move(next);
    batch = std::move(next_batch);
  }
}

void BatchedModelDraft::accept(std::size_t index, std::int64_t proposed, std::int64_t accepted) {
  if (proposed <= 0) return;
  // As ModelDraft::accept: the cache holds the sequence plus the first
  // proposed - 1 drafts; the accepted ones stay.
  const std::int64_t fed_drafts = proposed - 1;
  const std::int64_t remove = fed_drafts - std::min(accepted, fed_drafts);
  const auto t0 = Clock::now();
  cache_.crop(ids_[index], -remove);
  cache_seconds_ += seconds_since(t0);
  seen_[index] -= remove;
}

void BatchedModelDraft::finish(std::size_t index) {
  if (ids_[index].generation != 0) cache_.seq_rm(ids_[index]);
  ids_[index] = SeqId{};
}

ModelDraft::ModelDraft(const Model& draft, SamplingParams sampling, std::int64_t max_draft,
                       std::int64_t max_prefill_rows)
    : model_(draft), sampling_(sampling), max_prefill_rows_((check_prefill_rows(max_prefill_rows), max_prefill_rows)),
      rng_(sampling.seed ^ 0x9e3779b97f4a7c15ull), cache_(draft.make_cache()) {
  cache_.activate_past_recording(std::max<std::int64_t>(max_draft, 1));
}

void ModelDraft::begin(std::span<const std::int32_t>) {
  cache_.reset();
  seen_ = 0;
}

std::vector<std::int32_t> ModelDraft::propose(std::span<const std::int32_t> sequence, std::int64_t k,
                                              std::vector<std::vector<float>>* probs) {
  std::vector<std::int32_t> out;
  if (k <= 0) return out;
  std::vector<float> logits;
  const auto size = static_cast<std::int64_t>(sequence.size());
  forward_in_pieces(model_, sequence.subspan(static_cast<std::size_t>(seen_)), max_prefill_rows_, cache_, logits,
                    &cache_seconds_, [](std::int64_t) {});
  seen_ = size;
  for (std::int64_t i = 0; i < k; ++i) {
    std::int32_t token;
    if (sampling_.greedy()) {
      token = static_cast<std::int32_t>(kernels::argmax(logits.data(), static_cast<std::int64_t>(logits.size())));
    } else {
      std::vector<float> q = sampling_distribution(logits, sampling_);
      token = sample_from(q, rng_);
      if (probs) probs->push_back(std::move(q));
    }
    out.push_back(token);
    if (i + 1 < k) {
      model_.forward(std::span<const std::int32_t>(&token, 1), cache_, logits, false, &cache_seconds_);
      ++seen_;
    }
  }
  return out;
}

void ModelDraft::accept(std::int64_t proposed, std::int64_t accepted) {
  if (proposed <= 0) return;
  // The cache holds the sequence plus the first proposed - 1 drafts; the
  // accepted ones stay, the rest go (crop(0) when nothing is rejected).
  const std::int64_t fed_drafts = proposed - 1;
  const std::int64_t remove = fed_drafts - std::min(accepted, fed_drafts);
  const auto t0 = Clock::now();
  cache_.crop(-remove);
  cache_seconds_ += seconds_since(t0);
  seen_ -= remove;
}

std::size_t ModelDraft::cache_bytes() const { return cache_.memory().bytes_reserved; }

LookupDraft::LookupDraft(std::int64_t max_ngram) : max_ngram_(max_ngram) {
  if (max_ngram < 1) throw InvalidArgument("prompt lookup needs an n-gram size >= 1, got " + std::to_string(max_ngram));
}

std::vector<std::int32_t> LookupDraft::propose(std::span<const std::int32_t> s, std::int64_t k,
                                               std::vector<std::vector<float>>*) {
  const auto n = static_cast<std::int64_t>(s.size());
  for (std::int64_t ng = std::min(max_ngram_, n - 1); ng >= 1; --ng) {
    const std::int32_t* pattern = s.data() + (n - ng);
    for (std::int64_t i = n - ng - 1; i >= 0; --i) {
      if (!std::equal(pattern, pattern + ng, s.data() + i)) continue;
      const std::int64_t from = i + ng, to = std::min(from + k, n);
      return std::vector<std::int32_t>(s.data() + from, s.data() + to);
    }
  }
  return {};
}

RandomDraft::RandomDraft(std::int64_t vocab, std::uint64_t seed) : vocab_(vocab), rng_(seed) {}

std::vector<std::int32_t> RandomDraft::propose(std::span<const std::int32_t>, std::int64_t k,
                                               std::vector<std::vector<float>>*) {
  std::vector<std::int32_t> out;
  for (std::int64_t i = 0; i < k; ++i) out.push_back(static_cast<std::int32_t>(rng_() % static_cast<std::uint64_t>(vocab_)));
  return out;
}

// ---- the speculative loop --------------------------------------------------------

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
  if (static_cast<std::int64_t>(s.drafts.size()) > s.k) s.drafts.resize(static_cast<std::size_t>(std::max<std::int64_t>(s.k, 0)));
  std::vector<std::int32_t> verify;
  verify.reserve(s.drafts.size() + 1);
  verify.push_back(s.sequence.back());
  verify.insert(verify.end(), s.drafts.begin(), s.drafts.end());
  return verify;
}

// The tokens this round emits from the verify forward's logits ([kd + 1,
// V]): the accepted drafts and one more. Greedy: the longest prefix the
// target's argmax agrees with. Sampling: accept draft d with probability
// min(1, p(d) / q(d)); on rejection draw from the residual max(0, p - q),
// renormalised (a deterministic draft has q = one-hot).
std::vector<std::int32_t> accept_round(SpecSequence& s, std::span<const float> logits, std::int64_t V,
                                       const SamplingParams& sampling, std::int64_t& accepted) {
  auto row = [&](std::int64_t j) { return logits.subspan(static_cast<std::size_t>(j * V), static_cast<std::size_t>(V)); };
  const auto kd = static_cast<std::int64_t>(s.drafts.size());
  std::vector<std::int32_t> emitted;
  accepted = 0;
  if (sampling.greedy()) {
    while (accepted < kd && kernels::argmax(row(accepted).data(), V) == s.drafts[static_cast<std::size_t>(accepted)]) {
      ++accepted;
    }
    emitted.assign(s.drafts.begin(), s.drafts.begin() + accepted);
    emitted.push_back(static_cast<std::int32_t>(kernels::argmax(row(accepted).data(), V)));
    return emitted;
  }
  for (std::int64_t j = 0; j < kd; ++j) {
    const std::vector<float> p = sampling_distribution(row(j), sampling);
    const auto d = static_cast<std::size_t>(s.drafts[static_cast<std::size_t>(j)]);
    const bool has_q = static_cast<std::size_t>(j) < s.q.size();
    const double qd = has_q ? s.q[static_cast<std::size_t>(j)][d] : 1.0;
    if (qd > 0.0 && uniform01(s.rng) < std::min(1.0, static_cast<double>(p[d]) / qd)) {
      emitted.push_back(static_cast<std::int32_t>(d));
      ++accepted;
      continue;
    }
    std::vector<float> residual(p.size());
    double total = 0.0;
    for (std::size_t t = 0; t < p.size(); ++t) {
      const double qt = has_q ? s.q[static_cast<std::size_t>(j)][t] : (t == d ? 1.0 : 0.0);
      residual[t] = static_cast<float>(std::max(0.0, static_cast<double>(p[t]) - qt));
      total += residual[t];
    }
    if (total > 0.0) {
      for (float& r : residual) r = static_cast<float>(r / total);
      emitted.push_back(sample_from(residual, s.rng));
    } else {
      emitted.push_back(sample_from(p, s.rng));
    }
    return emitted;
  }
  emitted.push_back(sample_from(sampling_distribution(row(kd), sampling), s.rng));
  return emitted;
}

// After the target's crop and the draft's accept: counts the round, emits
// the tokens (stopping at EOS / the budget) and adapts K.
void finish_round(SpecSequence& s, const Model& target, const GenerationOptions& options,
                  const SpeculativeOptions& spec, std::int64_t accepted, const std::vector<std::int32_t>& emitted,
                  Clock::time_point t0) {
  const auto kd = static_cast<std::int64_t>(s.drafts.size());
  if (kd - accepted > 0) ++s.stats.rollbacks;
  ++s.stats.rounds;
  s.stats.drafted += kd;
  s.stats.accepted += accepted;
  if (static_cast<std::int64_t>(s.stats.drafted_at.size()) < kd) {
    s.stats.drafted_at.resize(static_cast<std::size_t>(kd), 0);
    s.stats.accepted_at.resize(static_cast<std::size_t>(kd), 0);
  }
  for (std::int64_t i = 0; i < kd; ++i) ++s.stats.drafted_at[static_cast<std::size_t>(i)];
  for (std::int64_t i = 0; i < accepted; ++i) ++s.stats.accepted_at[static_cast<std::size_t>(i)];
  for (std::int32_t token : emitted) {
    s.sequence.push_back(token);
    if (!emit(token, target, options, s.out, t0, s.stats)) {
      s.running = false;
      break;
    }
  }
  if (spec.adaptive && kd > 0) {
    s.k_now = accepted == kd ? std::min(s.k_now + 2, spec.num_draft) : std::max<std::int64_t>(s.k_now - 1, 1);
  }
}

}  // namespace

std::vector<std::int32_t> speculative_generate(const Model& target, DraftSource& draft,
                                               std::span<const std::int32_t> prompt,
                                               const GenerationOptions& options, const SpeculativeOptions& spec,
                                               GenerationStats* stats) {
  validate(options);
  check_prompt(prompt);
  check_num_draft(spec.num_draft, "num_draft (K)");
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

std::vector<std::vector<std::int32_t>> speculative_generate_batch(
    const Model& target, BatchDraftSource& drafts, std::span<const std::vector<std::int32_t>> prompts,
    const GenerationOptions& options, const SpeculativeOptions& spec, BatchGenerationStats* stats) {
  validate(options);
  if (prompts.empty()) throw InvalidArgument("speculative_generate_batch needs at least one prompt");
  for (const auto& prompt : prompts) check_prompt(prompt);
  check_num_draft(spec.num_draft, "num_draft (K)");
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
  BatchGenerationStats local;
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
      ids[i] = cache.add_sequence();
      cache.activate_past_recording(ids[i], spec.num_draft);  // a round rolls back at most K tokens
      prefilled[i] = prompts[i].size() < 2;
      if (options.prefix_cache && !prefilled[i]) {
        ids[i] = prefill_sequence(target, cache, ids[i], std::span(prompts[i]).first(prompts[i].size() - 1),
                                  *options.prefix_cache, spec.num_draft, options.max_prefill_rows, seqs[i].stats);
        prefilled[i] = true;
      }
      active.push_back(i);
    }
    if (active.empty()) break;
    local.peak_batch = std::max(local.peak_batch, static_cast<std::int64_t>(active.size()));
    // Every prefilled sequence's drafts (one request each), then one forward
    // verifies them all.
    std::vector<BatchDraftSource::Request> requests;
    for (std::size_t i : active) {
      if (!prefilled[i]) continue;
      SpecSequence& s = seqs[i];
      plan_round(s, quiet);
      if (s.k > 0) requests.push_back({i, s.sequence, s.k, &s.drafts, options.sampling.greedy() ? nullptr : &s.q});
    }
    if (!requests.empty()) drafts.propose(requests);
    batch.clear();
    std::int64_t prompt_rows = options.max_prefill_rows;
    for (std::size_t i : active) {
      if (prefilled[i]) {
        verify[i] = verify_tokens(seqs[i]);
      } else {
        const std::size_t rest = prompts[i].size() - 1 - prompt_fed[i];
        const auto take = static_cast<std::size_t>(std::min<std::int64_t>(static_cast<std::int64_t>(rest), prompt_rows));
        prompt_rows -= static_cast<std::int64_t>(take);
        const auto from = prompts[i].begin() + static_cast<std::ptrdiff_t>(prompt_fed[i]);
        verify[i].assign(from, from + static_cast<std::ptrdiff_t>(take));
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
      SpecSequence& s = seqs[i];
      if (!prefilled[i]) {  // no rows of logits
        prompt_fed[i] += verify[i].size();
        prefilled[i] = prompt_fed[i] == prompts[i].size() - 1;
        still.push_back(i);
        continue;
      }
      const std::span<const float> rows(logits.data() + row * static_cast<std::size_t>(V), verify[i].size() * static_cast<std::size_t>(V));
      row += verify[i].size();
      std::int64_t accepted = 0;
      const std::vector<std::int32_t> emitted = accept_round(s, rows, V, options.sampling, accepted);
      const auto tc = Clock::now();
      cache.crop(ids[i], -(static_cast<std::int64_t>(s.drafts.size()) - accepted));  // this sequence only
      s.stats.cache_seconds += seconds_since(tc);
      if (s.k > 0) drafts.accept(i, static_cast<std::int64_t>(s.drafts.size()), accepted);
      finish_round(s, target, quiet, spec, accepted, emitted, t0);
      if (s.running) {
        still.push_back(i);
      } else {
        s.stats.seconds = seconds_since(t0);
        cache.seq_rm(ids[i]);
        drafts.finish(i);
      }
    }
    active = std::move(still);
  }
  for (std::size_t i = 0; i < n; ++i) {
    SpecSequence& s = seqs[i];
    s.stats.new_tokens = static_cast<std::int64_t>(s.out.size());
    local.new_tokens += s.stats.new_tokens;
    local.sequences.push_back(s.stats);
  }
  local.seconds = seconds_since(t0);
  local.draft_cache_seconds = drafts.cache_seconds();
  std::vector<std::vector<std::int32_t>> out;
  for (auto& s : seqs) out.push_back(std::move(s.out));
  if (stats) *stats = std::move(local);
  return out;
}

// ---- tree speculation ------------------------------------------------------------

void check_tree_options(const TreeOptions& t) {
  if (t.width < 2 || t.width > 64) {
    throw InvalidArgument("tree width W (children per node) must be in [2, 64], got " + std::to_string(t.width) +
                          "; W = 1 is a chain: use speculative decoding without a tree");
  }
  if (t.max_nodes < 2 || t.max_nodes > 1024) {
    throw InvalidArgument("tree node budget must be in [2, 1024], got " + std::to_string(t.max_nodes));
  }
  check_num_draft(t.depth, "tree depth (num_draft)");
}

namespace {

// A draft tree under construction: parents, tokens, depths, children.
struct TreeBuilder {
  std::vector<std::int64_t>& parents;
  std::vector<std::int32_t>& tokens;
  std::vector<std::int64_t> depth{0};
  std::vector<std::vector<std::int64_t>> children{{}};

  TreeBuilder(std::vector<std::int64_t>& p, std::vector<std::int32_t>& t, std::int32_t root) : parents(p), tokens(t) {
    parents.assign(1, -1);
    tokens.assign(1, root);
  }
  std::int64_t size() const { return static_cast<std::int64_t>(parents.size()); }
  std::int64_t child(std::int64_t node, std::int32_t token) const {
    for (std::int64_t c : children[static_cast<std::size_t>(node)])
      if (tokens[static_cast<std::size_t>(c)] == token) return c;
    return -1;
  }
  std::int64_t add(std::int64_t parent, std::int32_t token) {
    parents.push_back(parent);
    tokens.push_back(token);
    depth.push_back(depth[static_cast<std::size_t>(parent)] + 1);
    children.emplace_back();
    children[static_cast<std::size_t>(parent)].push_back(size() - 1);
    return size() - 1;
  }
};

}  // namespace

LookupTreeDraft::LookupTreeDraft(std::int64_t max_ngram) : max_ngram_(max_ngram) {}

void LookupTreeDraft::propose(std::span<const std::int32_t> s, const TreeOptions& o, std::vector<std::int64_t>& parents,
                              std::vector<std::int32_t>& tokens) {
  TreeBuilder tree(parents, tokens, s.back());
  const auto n = static_cast<std::int64_t>(s.size());
  for (std::int64_t ng = std::min(max_ngram_, n - 1); ng >= 1 && tree.size() < o.max_nodes; --ng) {
    const std::int32_t* pattern = s.data() + (n - ng);
    for (std::int64_t i = n - ng - 1; i >= 0 && tree.size() < o.max_nodes; --i) {
      if (!std::equal(pattern, pattern + ng, s.data() + i)) continue;
      // The continuation after this occurrence, merged into the tree.
      std::int64_t node = 0;
      for (std::int64_t j = i + ng; j < std::min(i + ng + o.depth, n) && tree.size() <= o.max_nodes; ++j) {
        const std::int64_t next = tree.child(node, s[static_cast<std::size_t>(j)]);
        if (next >= 0) {
          node = next;
          continue;
        }
        if (tree.size() == o.max_nodes ||
            static_cast<std::int64_t>(tree.children[static_cast<std::size_t>(node)].size()) >= o.width)
          break;
        node = tree.add(node, s[static_cast<std::size_t>(j)]);
      }
    }
  }
}

ModelTreeDraft::ModelTreeDraft(const Model& draft, std::int64_t max_prefill_rows)
    : model_(draft), max_prefill_rows_((check_prefill_rows(max_prefill_rows), max_prefill_rows)),
      cache_(draft.make_cache()) {}

void ModelTreeDraft::begin(std::span<const std::int32_t>) {
  cache_.reset();
  seen_ = 0;
}

std::size_t ModelTreeDraft::cache_bytes() const { return cache_.memory().bytes_reserved; }

void ModelTreeDraft::propose(std::span<const std::int32_t> s, const TreeOptions& o, std::vector<std::int64_t>& parents,
                             std::vector<std::int32_t>& tokens) {
  const auto before_root = static_cast<std::int64_t>(s.size()) - 1;
  std::vector<float> logits;
  if (before_root > seen_) {  // the tokens the last rounds accepted
    forward_in_pieces(model_, s.subspan(static_cast<std::size_t>(seen_), static_cast<std::size_t>(before_root - seen_)),
                      max_prefill_rows_, cache_, logits, &cache_seconds_, [](std::int64_t) {});
    seen_ = before_root;
  }
  TreeBuilder tree(parents, tokens, s.back());
  const std::int64_t V = model_.vocab_size();
  std::vector<double> logp{0.0};  // cumulative log probability of each node
  std::vector<std::int64_t> frontier{0};
  std::vector<float> probs(static_cast<std::size_t>(V));
  for (std::int64_t level = 1; level <= o.depth && !frontier.empty() && tree.size() < o.max_nodes; ++level) {
    {
      TreeForward t = cache_.begin_tree(parents);
      model_.forward_tree(tokens, t, cache_, logits, &cache_seconds_);
    }  // abandoned: the draft's cache keeps only accepted tokens
    struct Candidate {
      double logp;
      std::int64_t parent;
      std::int32_t token;
    };
    std::vector<Candidate> candidates;
    for (std::int64_t f : frontier) {
      kernels::softmax(logits.data() + f * V, V, probs.data());
      std::vector<std::int32_t> order(static_cast<std::size_t>(V));
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + o.width, order.end(), [&](std::int32_t a, std::int32_t b) {
        return probs[static_cast<std::size_t>(a)] > probs[static_cast<std::size_t>(b)] ||
               (probs[static_cast<std::size_t>(a)] == probs[static_cast<std::size_t>(b)] && a < b);
      });
      for (std::int64_t w = 0; w < o.width; ++w) {
        const std::int32_t tok = order[static_cast<std::size_t>(w)];
        const double p = std::max(static_cast<double>(probs[static_cast<std::size_t>(tok)]), 1e-30);
        candidates.push_back({logp[static_cast<std::size_t>(f)] + std::log(p), f, tok});
      }
    }
    std::stable_sort(candidates.begin(), candidates.end(),
                     [](const Candidate& a, const Candidate& b) { return a.logp > b.logp; });
    // A beam of `width` nodes per level: the tree reaches the full depth
    // (where a chain's accepted tokens come from) and keeps the likeliest
    // alternatives beside its best path.
    frontier.clear();
    for (const Candidate& c : candidates) {
      if (tree.size() >= o.max_nodes || static_cast<std::int64_t>(frontier.size()) >= o.width) break;
      frontier.push_back(tree.add(c.parent, c.token));
      logp.push_back(c.logp);
    }
  }
}

std::vector<std::int32_t> tree_speculative_generate(const Model& target, TreeDraftSource& draft,
                                                    std::span<const std::int32_t> prompt,
                                                    const GenerationOptions& options, const TreeOptions& tree_options,
                                                    GenerationStats* stats) {
  validate(options);
  check_prompt(prompt);
  check_tree_options(tree_options);
  const auto t0 = Clock::now();
  std::mt19937_64 rng(options.sampling.seed);
  const std::int64_t V = target.vocab_size();
  GenerationStats local = start_stats(prompt, options.sampling);
  std::vector<std::int32_t> sequence(prompt.begin(), prompt.end()), out, tokens;
  std::vector<std::int64_t> parents;
  Cache cache = target.make_cache();  // no recording: a tree commit adds only what was accepted
  std::vector<float> logits;
  draft.begin(prompt);
  bool running = options.max_new_tokens > 0;
  if (prompt.size() > 1 && running)
    local.prefix_hit_tokens = prefill(target, prompt.first(prompt.size() - 1), cache, logits, options.prefix_cache,
                                      local, options.max_prefill_rows, options.on_prefill);
  while (running) {
    const std::int64_t budget = options.max_new_tokens - static_cast<std::int64_t>(out.size());
    TreeOptions round = tree_options;
    round.depth = std::min(tree_options.depth, budget - 1);
    if (round.depth >= 1) {
      draft.propose(sequence, round, parents, tokens);
    } else {
      parents.assign(1, -1);
      tokens.assign(1, sequence.back());
    }
    const auto n = static_cast<std::int64_t>(parents.size());
    std::vector<std::int32_t> emitted;
    std::int64_t node = 0;
    {
      const auto tc = Clock::now();
      TreeForward tree = cache.begin_tree(parents);
      local.cache_seconds += seconds_since(tc);
      target.forward_tree(tokens, tree, cache, logits, &local.cache_seconds);
      ++local.forwards;
      // Follow the target down the tree: greedy, its argmax; sampling, the
      // children tried in order as one-hot proposals (each kept with the
      // target's probability of its token, else that token's mass removed
      // and the rest renormalised), the round ending with a draw from what
      // is left: exactly a draw from the target's distribution at each step,
      // whatever the tree (its tokens are distinct siblings).
      while (true) {
        const std::span<const float> row(logits.data() + node * V, static_cast<std::size_t>(V));
        std::int64_t next = -1;
        std::int32_t t = 0;
        if (options.sampling.greedy()) {
          t = static_cast<std::int32_t>(kernels::argmax(row.data(), V));
          for (std::int64_t c = node + 1; c < n && next < 0; ++c)
            if (parents[static_cast<std::size_t>(c)] == node && tokens[static_cast<std::size_t>(c)] == t) next = c;
        } else {
          std::vector<float> p = sampling_distribution(row, options.sampling);
          double mass = 1.0;
          for (std::int64_t c = node + 1; c < n && next < 0; ++c) {
            if (parents[static_cast<std::size_t>(c)] != node) continue;
            const auto x = static_cast<std::size_t>(tokens[static_cast<std::size_t>(c)]);
            const double px = mass > 0.0 ? static_cast<double>(p[x]) / mass : 0.0;
            if (std::generate_canonical<double, 64>(rng) < px) {
              next = c;
              t = static_cast<std::int32_t>(x);
            } else {
              mass -= static_cast<double>(p[x]);
              p[x] = 0.0f;
            }
          }
          if (next < 0) {
            if (mass <= 0.0) {  // every token the target allows was a rejected child: cannot happen but by rounding
              p = sampling_distribution(row, options.sampling);
            }
            double total = 0.0;
            for (float v : p) total += v;
            for (float& v : p) v = static_cast<float>(v / total);
            t = sample_from(p, rng);
          }
        }
        emitted.push_back(t);
        if (next < 0) break;
        node = next;
      }
      const auto tc2 = Clock::now();
      tree.commit(node);
      local.cache_seconds += seconds_since(tc2);
    }
    const auto accepted = static_cast<std::int64_t>(emitted.size()) - 1;
    draft.accept(accepted);
    ++local.rounds;
    local.drafted += n - 1;
    local.accepted += accepted;
    for (std::int32_t token : emitted) {
      sequence.push_back(token);
      if (!emit(token, target, options, out, t0, local)) {
        running = false;
        break;
      }
    }
    local.peak_cache_bytes = std::max(local.peak_cache_bytes, cache.memory().bytes_reserved + draft.cache_bytes());
  }
  local.cache_seconds += draft.cache_seconds();
  local.new_tokens = static_cast<std::int64_t>(out.size());
  local.seconds = seconds_since(t0);
  if (stats) *stats = local;
  return out;
}

}  // namespace rwd::runtime
