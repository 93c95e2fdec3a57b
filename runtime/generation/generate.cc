// runtime/generation/generate.cc: one sequence: prefill and plain decoding.
#include "runtime/generate.h"

#include <omp.h>

#include <algorithm>

#include "internal.h"
#include "rewind/error.h"

namespace rwd::runtime {

using namespace generation;

namespace generation {

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

bool emit_all(std::span<const std::int32_t> tokens, std::vector<std::int32_t>& sequence, const Model& model,
              const GenerationOptions& options, std::vector<std::int32_t>& out, Clock::time_point t0,
              GenerationStats& stats) {
  for (std::int32_t token : tokens) {
    sequence.push_back(token);
    if (!emit(token, model, options, out, t0, stats)) return false;
  }
  return true;
}

void count_round(GenerationStats& stats, std::int64_t drafted, std::int64_t accepted, bool chain) {
  ++stats.rounds;
  stats.drafted += drafted;
  stats.accepted += accepted;
  if (!chain) return;
  if (drafted > accepted) ++stats.rollbacks;
  if (static_cast<std::int64_t>(stats.drafted_at.size()) < drafted) {
    stats.drafted_at.resize(static_cast<std::size_t>(drafted), 0);
    stats.accepted_at.resize(static_cast<std::size_t>(drafted), 0);
  }
  for (std::int64_t i = 0; i < drafted; ++i) ++stats.drafted_at[static_cast<std::size_t>(i)];
  for (std::int64_t i = 0; i < accepted; ++i) ++stats.accepted_at[static_cast<std::size_t>(i)];
}

// The plain decoding loop from a cache that has seen the prompt and the

void check_prefill_rows(std::int64_t max_rows) {
  if (max_rows < 1) {
    throw InvalidArgument("max_prefill_rows must be >= 1 (prompt tokens per forward), got " + std::to_string(max_rows));
  }
}

}  // namespace generation

// The one place the options are checked, whatever paths a call takes.
void validate(const GenerationOptions& options) {
  validate(options.sampling);
  check_prefill_rows(options.max_prefill_rows);
  if (options.max_batch < 0) {
    throw InvalidArgument("max_batch must be >= 0 (0: every sequence at once), got " +
                          std::to_string(options.max_batch));
  }
  check_num_draft(options.speculation.num_draft, "num_draft (K)");
  check_tree_options(options.tree);
}

namespace {

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

PrefixCacheOptions prefix_cache_options(const Model& model, std::int64_t interval) {
  if (interval < 1 || interval > (std::int64_t{1} << 40)) {
    throw InvalidArgument("prefix_cache_options: interval must be in [1, 2^40], got " + std::to_string(interval));
  }
  PrefixCacheOptions options;
  options.interval = interval;
  options.model_fingerprint = model.fingerprint();
  // An entry ending at b holds at most b tokens' rows, the fixed states and
  // the logits; twice that (and 1 MiB of headers) bounds what a file under
  // a short prompt's key is read for.
  const std::size_t logits_bytes = static_cast<std::size_t>(model.vocab_size()) * sizeof(float);
  options.entry_bytes_per_token = 2 * (model.kv_bytes_per_token() + sizeof(std::int32_t));
  options.entry_fixed_bytes = 2 * (model.fixed_state_bytes() + logits_bytes) + (std::size_t{1} << 20);
  return options;
}

std::int64_t prefill(const Model& model, std::span<const std::int32_t> tokens, Cache& cache, std::vector<float>& logits,
                     PrefixCache* prefix_cache, GenerationStats& stats, std::int64_t max_rows,
                     const std::function<void(std::int64_t, std::int64_t)>& on_piece) {
  check_prefill_rows(max_rows);
  if (tokens.empty()) throw InvalidArgument("prefill needs at least one token, got none");
  for (int i = 0; i < cache.num_layers(); ++i) {  // every layer: one out of step would be reset below
    if (cache.get_seq_length(i) != 0) {
      throw InvalidArgument("prefill needs an empty cache, layer " + std::to_string(i) + " holds " +
                            std::to_string(cache.get_seq_length(i)) +
                            " tokens (reset() it, or use forward to extend it)");
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

std::vector<std::int32_t> generate(const Model& model, std::span<const std::int32_t> prompt,
                                   const GenerationOptions& options, GenerationStats* stats) {
  validate(options);
  check_prompt(prompt);
  const auto t0 = Clock::now();
  GenerationStats local = start_stats(prompt, options.sampling);
  Cache cache = model.make_cache();
  std::vector<float> logits;
  if (options.max_new_tokens > 0)
    local.prefix_hit_tokens = prefill(model, prompt, cache, logits, options.prefix_cache, local,
                                      options.max_prefill_rows, options.on_prefill);
  return decode(model, cache, logits, options, local, t0, stats);
}

std::vector<std::int32_t> continue_generation(const Model& model, Cache& cache, std::vector<float>& logits,
                                              const GenerationOptions& options, GenerationStats* stats) {
  validate(options);
  if (cache.get_seq_length() < 1) throw InvalidArgument("continue_generation needs a cache holding at least one token");
  if (static_cast<std::int64_t>(logits.size()) != model.vocab_size()) {
    throw InvalidArgument("continue_generation needs the logits of the last token: " +
                          std::to_string(model.vocab_size()) + " floats, got " + std::to_string(logits.size()));
  }
  GenerationStats local = start_stats({}, options.sampling);
  local.prompt_tokens = cache.get_seq_length();
  return decode(model, cache, logits, options, local, Clock::now(), stats);
}

}  // namespace rwd::runtime
