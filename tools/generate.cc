// rewind generate: stream text, greedy / sampled / speculative, for one
// prompt or every line of --prompts.
#include <algorithm>
#include <cstdio>
#include <limits>

#include "common.h"
#include "rewind/error.h"

namespace rwd::cli {
namespace {

struct GenerateFlags {
  std::string model_dir;
  PromptChoice prompt;
  std::int64_t max_new = 128;
  DraftChoice choice;
  SamplingChoice sampling;
  PrefixChoice prefix;
  bool stats = false;
  std::optional<std::int64_t> ctx_size;
};

// generate --prompts reads, decodes and prints this many times --max-batch
// lines at a time: enough waiting prompts for finished sequences to be
// replaced, few enough that neither the prompts nor the outputs pile up.
constexpr std::int64_t kLinesPerBatch = 4;

// generate --prompts: the lines go kLinesPerBatch x max_batch at a time
// (all at once for --max-batch 0) through one batched call each, at most
// max_batch sequences decoding at once, and each group's JSON lines are
// printed (input order) before the next group is read: a file of any length
// holds only one group's prompts, states and outputs. Every sequence's
// tokens are what one call over the whole file would give: sequence i
// samples with seed + i (its index in the file), and the forward is batch
// invariant. The --stats line covers every group: seconds and per-sequence
// times count from the start of the first, decode_tokens_per_second
// divides by the sum of each group's decoding time (after its last first
// token), as one call's does for its own.
int run_generate_batch(const CLI::App& cmd, const std::string& model_dir, const PromptChoice& prompt_choice,
                       std::int64_t max_new, const DraftChoice& choice, const SamplingParams& sampling,
                       const PrefixChoice& prefix_choice, bool stats_wanted,
                       const std::optional<std::int64_t>& ctx_size) {
  const Model model = load_model(model_dir);
  const std::int64_t ctx = resolve_ctx_size(ctx_size, model);
  const Tokenizer tokenizer = load_tokenizer(model_dir, model);
  const std::optional<Model> draft = load_draft(choice, model, tokenizer);
  const std::int64_t max_batch = resolve_max_batch(cmd, prompt_choice, model, draft ? &*draft : nullptr, max_new,
                                                   choice.any() ? choice.num_draft : 0);
  PromptChoice::Lines lines(prompt_choice.prompts);
  const std::unique_ptr<PrefixCache> prefix = prefix_choice.open(cmd, model);
  GenerationOptions options;
  options.prefix_cache = prefix.get();
  options.max_new_tokens = max_new;
  options.max_batch = max_batch;
  options.max_prefill_rows = prompt_choice.max_prefill_rows;
  const std::size_t group = max_batch == 0 ? std::numeric_limits<std::size_t>::max()
                                           : static_cast<std::size_t>(max_batch * kLinesPerBatch);
  GenerationStats total;
  const auto t0 = Clock::now();
  while (true) {
    const std::size_t first = lines.read();
    const std::vector<std::string> text = lines.next(group);
    if (text.empty()) break;
    std::vector<std::vector<std::int32_t>> prompts;
    for (const std::string& line : text) {
      const std::string what = "--prompts line " + std::to_string(first + prompts.size() + 1);
      prompts.push_back(encode_for_generation(tokenizer, line, what));
      check_context(static_cast<std::int64_t>(prompts.back().size()), max_new, ctx, ctx_size.has_value(), what);
    }
    options.sampling = sampling;
    options.sampling.seed = sampling.seed + first;  // sequence i of the file samples with seed + i
    const double offset = std::chrono::duration<double>(Clock::now() - t0).count();
    GenerationStats stats;
    std::vector<std::vector<std::int32_t>> out;
    if (choice.any()) {
      const auto sources = make_sources(prompts.size(), choice, draft, options.sampling, options.max_prefill_rows);
      out = speculative_generate_batch(model, *sources, prompts, choice.applied_to(options), &stats);
    } else {
      out = generate_batch(model, prompts, options, &stats);
    }
    for (std::size_t i = 0; i < out.size(); ++i) {
      std::printf("%s\n", indexed_text_json(first + i, tokenizer.decode(out[i], true)).c_str());
    }
    std::fflush(stdout);
    total.forwards += stats.forwards;
    total.peak_batch = std::max(total.peak_batch, stats.peak_batch);
    total.draft_cache_seconds += stats.draft_cache_seconds;
    total.seconds = offset + stats.seconds;  // from the first group's start to the end of this one's decoding
    {
      // Decoding time of this group: after its last first token (as one call's).
      double last_first = 0.0;
      for (const GenerationStats& s : stats.per_sequence) {
        if (s.new_tokens > 0) last_first = std::max(last_first, s.time_to_first_token);
      }
      total.decode_seconds = total.decode_seconds.value_or(0.0) + std::max(0.0, stats.seconds - last_first);
    }
    if (stats_wanted) {  // every sequence's statistics are kept only to be printed
      for (GenerationStats& s : stats.per_sequence) {
        if (s.new_tokens > 0) s.time_to_first_token += offset;
        s.seconds += offset;
        total.per_sequence.push_back(std::move(s));
      }
    }
  }
  total.sum_per_sequence();
  total.max_batch = max_batch == 0 ? static_cast<std::int64_t>(lines.read()) : max_batch;
  if (stats_wanted) std::printf("%s\n", with_prefix_stats(total.to_json(), prefix.get()).c_str());
  return 0;
}

int run_generate(const CLI::App& cmd, const std::string& model_dir, const PromptChoice& prompt_choice,
                 std::int64_t max_new, const DraftChoice& choice, const SamplingChoice& sampling_choice,
                 const PrefixChoice& prefix_choice, bool stats_wanted, const std::optional<std::int64_t>& ctx_size) {
  choice.check(cmd);
  const SamplingParams sampling = sampling_choice.resolve(cmd);
  prompt_choice.check_batch(cmd);
  if (prompt_choice.many(cmd)) {
    if (choice.tree())
      throw InvalidArgument(
          "--tree decodes one prompt (--prompt / --prompt-file); batched tree speculation is not built yet");
    return run_generate_batch(cmd, model_dir, prompt_choice, max_new, choice, sampling, prefix_choice, stats_wanted,
                              ctx_size);
  }
  const OnePrompt one(cmd, model_dir, prompt_choice, choice, max_new, ctx_size);
  const auto& [prompt, model, tokenizer, draft, tokens] = one;
  const std::unique_ptr<PrefixCache> prefix = prefix_choice.open(cmd, model);
  GenerationOptions options;
  options.max_new_tokens = max_new;
  options.sampling = sampling;
  options.prefix_cache = prefix.get();
  options.max_prefill_rows = prompt_choice.max_prefill_rows;
  Progress prefill_progress("prefill", "tokens");  // on a terminal, for a prompt that takes over half a second
  options.on_prefill = [&prefill_progress](std::int64_t done, std::int64_t total) {
    prefill_progress.update(done, total);
    if (done == total) prefill_progress.finish();
  };
  StdoutStream stream(tokenizer);
  options.on_token = [&stream](std::int32_t t) { stream.push(t); };
  GenerationStats stats;
  if (choice.tree()) {
    auto source = make_tree_source(choice, draft, options.max_prefill_rows);
    tree_speculative_generate(model, *source, tokens, choice.applied_to(options), &stats);
  } else if (choice.any()) {
    auto source = make_source(choice, draft, sampling, options.max_prefill_rows);
    speculative_generate(model, *source, tokens, choice.applied_to(options), &stats);
  } else {
    generate(model, tokens, options, &stats);
  }
  stream.finish();
  std::fputc('\n', stdout);
  if (stats_wanted) std::printf("%s\n", with_prefix_stats(stats.to_json(), prefix.get()).c_str());
  return 0;
}

}  // namespace

Command add_generate_command(CLI::App& app, SharedFlags& shared) {
  auto flags = std::make_shared<GenerateFlags>();
  GenerateFlags& f = *flags;
  auto* gen = app.add_subcommand("generate", "generate text (greedy, sampled or speculative)");
  add_model_option(gen, f.model_dir);
  add_prompt_options(gen, f.prompt);
  add_prompts_option(gen, f.prompt,
                     "decode every line of FILE ('-' = standard input) as a prompt, in batches of at most "
                     "--max-batch sequences; prints one JSON line per prompt, {\"index\": i, \"text\": ...}, in "
                     "input order (bytes that are not UTF-8 become U+FFFD), 4 x --max-batch lines at a time, each "
                     "group read, decoded and printed before the next is read (a line that cannot be encoded "
                     "stops with exit 2 after the groups before it); speculative with --draft / --lookup (each "
                     "sequence its own drafts and rollbacks); with --stats a last line: sequences, new_tokens, "
                     "forwards, max_batch, peak_batch (the most sequences in one forward), seconds, "
                     "tokens_per_second (all sequences' tokens over the wall time), time_to_first_token_s and "
                     "per_sequence figures (acceptance included)");
  add_max_new_option(gen, f.max_new);
  gen->add_option("--prefix-cache", f.prefix.spec,
                  "reuse prompt prefixes across runs and processes: a directory, ro:DIR (a directory read but "
                  "never written, e.g. a pre-built cache), or redis://HOST:PORT[/PREFIX]; other URLs are refused. "
                  "The prefill restores the longest stored prefix (attention rows with the conv and recurrent "
                  "states at the same position) and stores an entry every --prefix-interval tokens and at the "
                  "prompt's end; output is identical with or without it. Junk under an entry's name is a miss; a "
                  "store that fails or is slow (a call over 0.25 s) is skipped for 2 s to 64 s with one warning, "
                  "then tried again; --stats adds the counters (prefix_cache)")
      ->type_name("DIR|ro:DIR|URL")
      ->default_str("none");
  gen->add_option("--prefix-interval", f.prefix.interval, "tokens between prefix-cache entries")
      ->check(integer_in(1, std::int64_t{1} << 40));
  gen->add_option("--prefix-cache-bytes", f.prefix.bytes,
                  "cap of a directory prefix cache in bytes; least recently used entries go first (0: no cap)")
      ->check(integer_in(0, std::int64_t{1} << 50));
  add_draft_options(gen, f.choice);
  add_sampling_options(gen, f.sampling);
  add_weights_option(gen, shared);
  add_threads_option(gen, shared.threads);
  add_ctx_option(gen, f.ctx_size);
  gen->add_flag("--stats", f.stats,
                "end with one JSON line: new_tokens, prompt_tokens, seconds (wall time of prefill + decoding), "
                "time_to_first_token_s (prefill + the forward of the first token), tokens_per_second "
                "(end to end: new_tokens / seconds, prefill included), decode_tokens_per_second "
                "(decoding alone: (new_tokens - 1) / (seconds - time_to_first_token_s)), drafted, accepted, "
                "acceptance_rate, drafted_at, accepted_at, acceptance_at (per draft position within a round; "
                "speculative decoding without --tree), rollbacks, rounds, forwards, cache_seconds, peak_cache_bytes, "
                "prefix_hit_tokens (prompt tokens restored from --prefix-cache), seed (null when greedy), threads");
  return {gen, [gen, flags] {
            const GenerateFlags& o = *flags;
            return run_generate(*gen, o.model_dir, o.prompt, o.max_new, o.choice, o.sampling, o.prefix, o.stats,
                                o.ctx_size);
          }};
}

}  // namespace rwd::cli
