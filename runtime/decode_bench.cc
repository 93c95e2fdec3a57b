#include "runtime/decode_bench.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>

#include <nlohmann/json.hpp>

#include "rewind/error.h"
#include "runtime/generate.h"

namespace rwd::runtime {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

const std::vector<std::string>& default_bench_prompts() {
  static const std::vector<std::string> prompts = {
      "In the beginning God created the heaven and the earth. And the earth was",
      "And it came to pass, when the king heard the words of the law, that",
      "The LORD is my shepherd; I shall not want. He maketh me to lie down",
      "Then said Jesus unto his disciples, Verily I say unto you, That",
  };
  return prompts;
}

namespace {

// What every configuration of run_decode_bench runs over: the prompts
// encoded, the options of a plain run and the greedy tokens of each prompt
// (the reference every row is compared with).
struct BenchRun {
  const Model& target;
  const Model* draft;
  const DecodeBenchOptions& options;
  const std::function<void(const std::string&)>& progress;
  std::vector<std::vector<std::int32_t>> encoded;
  GenerationOptions gen;
  std::vector<std::vector<std::int32_t>> reference;

  // `gen` drafting K tokens a round: a chain of K, or a tree of depth K.
  GenerationOptions chain(std::int64_t k) const {
    GenerationOptions o = gen;
    o.speculation = {k, false};
    return o;
  }
  GenerationOptions tree(std::int64_t k) const {
    GenerationOptions o = gen;
    o.tree = {options.tree_width, options.tree_nodes, k};
    return o;
  }
};

// Runs one configuration over every prompt, `repeats` times ("greedy" fills
// run.reference).
DecodeBenchRow measure(BenchRun& run, const std::string& method, std::int64_t k) {
  const Model& target = run.target;
  const Model* draft = run.draft;
  const DecodeBenchOptions& options = run.options;
  const std::vector<std::vector<std::int32_t>>& encoded = run.encoded;
  const GenerationOptions& gen = run.gen;
  std::vector<std::vector<std::int32_t>>& reference = run.reference;
  const auto& progress = run.progress;
  if (progress) progress(method + (k ? " K=" + std::to_string(k) : std::string()));
  DecodeBenchRow row;
  row.method = method;
  row.k = k;
  std::vector<double> rates, shares, decode_rates;
  std::int64_t drafted = 0, accepted = 0;
  for (int r = 0; r < options.repeats; ++r) {
    double seconds = 0.0, cache_seconds = 0.0, decode_seconds = 0.0;
    std::int64_t tokens = 0, decode_tokens = 0;
    for (std::size_t p = 0; p < encoded.size(); ++p) {
      GenerationStats stats;
      std::vector<std::int32_t> out;
      if (method == "greedy") {
        out = generate(target, encoded[p], gen, &stats);
        if (r == 0) reference[p] = out;
      } else if (method == "draft") {
        ModelDraft source(*draft, gen.sampling, k);
        out = speculative_generate(target, source, encoded[p], run.chain(k), &stats);
      } else if (method == "draft_tree") {
        ModelTreeDraft source(*draft);
        out = tree_speculative_generate(target, source, encoded[p], run.tree(k), &stats);
      } else if (method == "lookup_tree") {
        LookupTreeDraft source(options.lookup_ngram);
        out = tree_speculative_generate(target, source, encoded[p], run.tree(k), &stats);
      } else {
        LookupDraft source(options.lookup_ngram);
        out = speculative_generate(target, source, encoded[p], run.chain(k), &stats);
      }
      row.identical = row.identical && out == reference[p];
      seconds += stats.seconds;
      cache_seconds += stats.cache_seconds;
      tokens += stats.new_tokens;
      if (stats.new_tokens > 1) {
        decode_seconds += stats.seconds - stats.time_to_first_token;
        decode_tokens += stats.new_tokens - 1;
      }
      drafted += stats.drafted;
      accepted += stats.accepted;
    }
    rates.push_back(seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0);
    shares.push_back(seconds > 0 ? cache_seconds / seconds : 0.0);
    decode_rates.push_back(decode_seconds > 0 ? static_cast<double>(decode_tokens) / decode_seconds : 0.0);
  }
  row.tokens_per_second = median(rates);
  row.decode_tokens_per_second = median(decode_rates);
  row.cache_share = median(shares);
  row.acceptance_rate = drafted > 0 ? static_cast<double>(accepted) / static_cast<double>(drafted) : 0.0;
  return row;
}

// B prompts decoded together: aggregate tokens / wall time of the call.
DecodeBenchRow measure_batch(BenchRun& run, const std::string& method, std::int64_t k, std::int64_t B) {
  const Model& target = run.target;
  const Model* draft = run.draft;
  const DecodeBenchOptions& options = run.options;
  const std::vector<std::vector<std::int32_t>>& encoded = run.encoded;
  const GenerationOptions& gen = run.gen;
  const std::vector<std::vector<std::int32_t>>& reference = run.reference;
  const auto& progress = run.progress;
  if (progress) progress(method + " B=" + std::to_string(B) + (k ? " K=" + std::to_string(k) : std::string()));
  DecodeBenchRow row;
  row.method = method;
  row.k = k;
  row.batch = B;
  std::vector<std::vector<std::int32_t>> batch;
  for (std::int64_t i = 0; i < B; ++i) batch.push_back(encoded[static_cast<std::size_t>(i) % encoded.size()]);
  std::vector<double> rates, decode_rates;
  std::int64_t drafted = 0, accepted = 0;
  for (int r = 0; r < options.repeats; ++r) {
    GenerationStats stats;
    std::vector<std::vector<std::int32_t>> out;
    if (method == "greedy_batch") {
      out = generate_batch(target, batch, gen, &stats);
    } else if (method == "lookup_batch") {
      std::vector<std::unique_ptr<DraftSource>> sources;
      for (std::int64_t i = 0; i < B; ++i) sources.push_back(std::make_unique<LookupDraft>(options.lookup_ngram));
      PerSequenceDrafts source(std::move(sources));
      out = speculative_generate_batch(target, source, batch, run.chain(k), &stats);
    } else {
      BatchedModelDraft source(*draft, gen.sampling, k);
      out = speculative_generate_batch(target, source, batch, run.chain(k), &stats);
    }
    for (std::size_t i = 0; i < out.size(); ++i) {
      row.identical = row.identical && out[i] == reference[i % encoded.size()];
      drafted += stats.per_sequence[i].drafted;
      accepted += stats.per_sequence[i].accepted;
    }
    rates.push_back(stats.tokens_per_second());
    decode_rates.push_back(stats.decode_tokens_per_second());
  }
  row.tokens_per_second = median(rates);
  row.decode_tokens_per_second = median(decode_rates);
  row.cache_share = -1.0;  // the batched forward does not time its cache calls
  row.acceptance_rate = drafted > 0 ? static_cast<double>(accepted) / static_cast<double>(drafted) : 0.0;
  return row;
}

}  // namespace

std::vector<DecodeBenchRow> run_decode_bench(const Model& target, const Model* draft, const DecodeBenchOptions& options,
                                             const std::function<void(const std::string&)>& progress) {
  if (options.ks.empty()) throw InvalidArgument("bench needs at least one K");
  for (std::int64_t k : options.ks) check_num_draft(k, "bench: K");
  if (options.repeats < 1) throw InvalidArgument("bench: repeats must be >= 1");
  if (options.max_new_tokens < 1) throw InvalidArgument("bench: max_new_tokens must be >= 1");
  for (std::int64_t b : options.batch_sizes) {
    if (b < 1 || b > 4096) throw InvalidArgument("bench: a batch size must be in [1, 4096], got " + std::to_string(b));
  }
  const std::vector<std::string>& prompts = options.prompts.empty() ? default_bench_prompts() : options.prompts;
  BenchRun run{target, draft, options, progress, {}, {}, {}};
  for (const auto& p : prompts) {
    run.encoded.push_back(options.encode ? options.encode(p) : encode_prompt(p, target.config()));
  }
  run.reference.resize(run.encoded.size());
  run.gen.max_new_tokens = options.max_new_tokens;
  run.gen.stop_at_eos = false;  // every run produces the same number of tokens

  std::vector<DecodeBenchRow> rows;
  rows.push_back(measure(run, "greedy", 0));
  if (draft) {
    for (std::int64_t k : options.ks) rows.push_back(measure(run, "draft", k));
  }
  for (std::int64_t k : options.ks) rows.push_back(measure(run, "lookup", k));
  if (options.tree_width >= 2) {
    check_tree_options({options.tree_width, options.tree_nodes, options.ks.front()});
    if (draft) {
      for (std::int64_t k : options.ks) rows.push_back(measure(run, "draft_tree", k));
    }
    for (std::int64_t k : options.ks) rows.push_back(measure(run, "lookup_tree", k));
  }
  for (std::int64_t B : options.batch_sizes) {
    rows.push_back(measure_batch(run, "greedy_batch", 0, B));
    if (draft) rows.push_back(measure_batch(run, "draft_batch", options.ks.front(), B));
    rows.push_back(measure_batch(run, "lookup_batch", options.ks.front(), B));
  }
  const double greedy = rows.front().tokens_per_second, greedy_decode = rows.front().decode_tokens_per_second;
  for (auto& row : rows) {
    row.speedup = greedy > 0 ? row.tokens_per_second / greedy : 0.0;
    row.decode_speedup = greedy_decode > 0 ? row.decode_tokens_per_second / greedy_decode : 0.0;
  }
  return rows;
}

namespace {

// Refuses what the forward-cost measurements cannot take (`what` names the
// measurement in the message).
void check_context_and_samples(const char* what, std::int64_t context, int samples) {
  if (context < 1 || context > (std::int64_t{1} << 20)) {
    throw InvalidArgument(std::string(what) + ": the context must be in [1, 2^20] tokens, got " +
                          std::to_string(context));
  }
  if (samples < 1 || samples > (1 << 20)) {
    throw InvalidArgument(std::string(what) + ": samples must be in [1, 2^20], got " + std::to_string(samples));
  }
}

// Token i of the measurements' contexts: the first bench prompt's bytes,
// repeated (the cost of a forward does not depend on which tokens it
// holds, only on how many).
std::int32_t context_token(const Model& model, std::int64_t i) {
  const std::string& text = default_bench_prompts().front();
  const auto byte = static_cast<unsigned char>(text[static_cast<std::size_t>(i) % text.size()]);
  return static_cast<std::int32_t>(byte) % static_cast<std::int32_t>(model.vocab_size());
}

}  // namespace

std::vector<ForwardCostRow> measure_forward_costs(const Model& model, std::int64_t max_q, std::int64_t context,
                                                  int samples) {
  if (max_q < 1 || max_q > 64)
    throw InvalidArgument("forward costs: q must be in [1, 64], got " + std::to_string(max_q));
  check_context_and_samples("forward costs", context, samples);
  const auto token_at = [&](std::int64_t i) { return context_token(model, i); };
  std::vector<std::int32_t> prompt(static_cast<std::size_t>(context));
  for (std::int64_t i = 0; i < context; ++i) prompt[static_cast<std::size_t>(i)] = token_at(i);
  Cache cache = model.make_cache();
  cache.activate_past_recording(max_q);
  std::vector<float> logits;
  model.forward(prompt, cache, logits, false);
  std::vector<std::int32_t> next(static_cast<std::size_t>(max_q));
  for (std::int64_t i = 0; i < max_q; ++i) next[static_cast<std::size_t>(i)] = token_at(context + i);
  std::vector<std::vector<double>> times(static_cast<std::size_t>(max_q));
  for (int s = 0; s < samples; ++s) {
    for (std::int64_t q = 1; q <= max_q; ++q) {
      const auto start = std::chrono::steady_clock::now();
      model.forward(std::span<const std::int32_t>(next.data(), static_cast<std::size_t>(q)), cache, logits, true);
      const auto stop = std::chrono::steady_clock::now();
      cache.crop(-q);
      times[static_cast<std::size_t>(q - 1)].push_back(std::chrono::duration<double, std::micro>(stop - start).count());
    }
  }
  std::vector<ForwardCostRow> rows;
  for (std::int64_t q = 1; q <= max_q; ++q) {
    ForwardCostRow r;
    r.q = q;
    r.microseconds = median(times[static_cast<std::size_t>(q - 1)]);
    r.one_token_forwards = rows.empty() ? 1.0 : r.microseconds / rows.front().microseconds;
    rows.push_back(r);
  }
  return rows;
}

std::vector<BatchRoundCostRow> measure_batch_round_costs(const Model& model,
                                                         const std::vector<std::int64_t>& batch_sizes,
                                                         std::int64_t context, int samples) {
  for (std::int64_t b : batch_sizes) {
    if (b < 1 || b > 4096)
      throw InvalidArgument("batch round costs: a batch size must be in [1, 4096], got " + std::to_string(b));
  }
  check_context_and_samples("batch round costs", context, samples);
  std::vector<std::int64_t> sizes{1};
  for (std::int64_t b : batch_sizes)
    if (std::find(sizes.begin(), sizes.end(), b) == sizes.end()) sizes.push_back(b);
  const std::int64_t widest = *std::max_element(sizes.begin(), sizes.end());
  // Sequence s's context starts at token s, so that sequences differ.
  const auto token_at = [&](std::int64_t i) { return context_token(model, i); };
  SequenceCache cache = model.make_sequence_cache();
  std::vector<SeqId> ids;
  std::vector<std::vector<std::int32_t>> prompts(static_cast<std::size_t>(widest));
  std::vector<SequenceTokens> batch;
  // The parents hold context - 1 tokens; each fork takes the last one in
  // an untimed round (which also gives it a block of its own: the timed
  // round does not pay the copy of a shared, partly filled block).
  for (std::int64_t s = 0; s < widest; ++s) {
    ids.push_back(cache.add_sequence());
    for (std::int64_t i = 0; i + 1 < context; ++i) prompts[static_cast<std::size_t>(s)].push_back(token_at(s + i));
    batch.push_back({ids.back(), prompts[static_cast<std::size_t>(s)], LogitRows::kNone});
  }
  std::vector<float> logits;
  if (context > 1) model.forward_batch(batch, cache, logits);
  std::vector<std::int32_t> last(static_cast<std::size_t>(widest)), next(static_cast<std::size_t>(widest));
  for (std::int64_t s = 0; s < widest; ++s) {
    last[static_cast<std::size_t>(s)] = token_at(s + context - 1);
    next[static_cast<std::size_t>(s)] = token_at(s + context);
  }
  std::vector<std::vector<double>> times(sizes.size());
  std::vector<SeqId> forks;
  // One token for each of the first n forks, from `tokens`.
  const auto round = [&](std::int64_t n, const std::vector<std::int32_t>& tokens) {
    batch.clear();
    for (std::int64_t s = 0; s < n; ++s) {
      batch.push_back({forks[static_cast<std::size_t>(s)],
                       std::span<const std::int32_t>(&tokens[static_cast<std::size_t>(s)], 1), LogitRows::kLast});
    }
    model.forward_batch(batch, cache, logits);
  };
  for (int sample = 0; sample < samples; ++sample) {
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      forks.clear();
      for (std::int64_t s = 0; s < sizes[k]; ++s) forks.push_back(cache.fork(ids[static_cast<std::size_t>(s)]));
      round(sizes[k], last);
      const auto start = std::chrono::steady_clock::now();
      round(sizes[k], next);
      const auto stop = std::chrono::steady_clock::now();
      for (const SeqId f : forks) cache.seq_rm(f);
      times[k].push_back(std::chrono::duration<double, std::micro>(stop - start).count());
    }
  }
  std::vector<BatchRoundCostRow> rows;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    BatchRoundCostRow r;
    r.batch = sizes[k];
    r.microseconds = median(times[k]);
    r.per_token = r.microseconds / static_cast<double>(r.batch);
    r.gain = rows.empty() ? 1.0 : static_cast<double>(r.batch) * rows.front().microseconds / r.microseconds;
    rows.push_back(r);
  }
  return rows;
}

std::string decode_bench_json(const std::vector<DecodeBenchRow>& rows) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& r : rows) {
    out.push_back({{"method", r.method},
                   {"k", r.k},
                   {"batch", r.batch},
                   {"tokens_per_second", r.tokens_per_second},
                   {"acceptance_rate", r.acceptance_rate},
                   {"cache_share", r.cache_share < 0 ? nlohmann::json(nullptr) : nlohmann::json(r.cache_share)},
                   {"speedup", r.speedup},
                   {"decode_tokens_per_second", r.decode_tokens_per_second},
                   {"decode_speedup", r.decode_speedup},
                   {"identical", r.identical}});
  }
  return out.dump(1);
}

}  // namespace rwd::runtime
