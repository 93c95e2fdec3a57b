// rewind verify: check that speculative decoding equals greedy decoding,
// token by token (exit 1 at the first divergence).
#include <algorithm>
#include <cstdio>

#include "common.h"
#include "rewind/error.h"
#include "runtime/decode_bench.h"

namespace rwd::cli {
namespace {

struct VerifyFlags {
  std::string model_dir;
  PromptChoice prompt;
  std::int64_t max_new = 128;
  DraftChoice choice;
  int repeats = 1;
  std::optional<std::int64_t> ctx_size;
};

// verify --prompts: every prompt decoded speculatively in one batch, each
// checked against greedy decoding of that prompt alone.
int run_verify_batch(const CLI::App& cmd, const std::string& model_dir, const PromptChoice& prompt_choice,
                     std::int64_t max_new, const DraftChoice& choice, const std::optional<std::int64_t>& ctx_size) {
  const Model model = load_model(model_dir);
  const Tokenizer tokenizer = load_tokenizer(model_dir, model);
  const std::optional<Model> draft = load_draft(choice, model, tokenizer);
  const std::vector<std::vector<std::int32_t>> prompts = encode_prompts(prompt_choice, tokenizer);
  const std::int64_t ctx = resolve_ctx_size(ctx_size, model);
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    check_context(static_cast<std::int64_t>(prompts[i].size()), max_new, ctx, ctx_size.has_value(),
                  "--prompts line " + std::to_string(i + 1));
  }
  GenerationOptions options;
  options.max_new_tokens = max_new;
  options.max_batch = resolve_max_batch(cmd, prompt_choice, model, draft ? &*draft : nullptr, max_new,
                                        choice.num_draft);
  options.max_prefill_rows = prompt_choice.max_prefill_rows;
  std::vector<std::vector<std::int32_t>> greedy;
  double greedy_seconds = 0.0;
  {
    Progress progress("greedy, one prompt at a time", "prompts");
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      GenerationStats s;
      greedy.push_back(generate(model, prompts[i], options, &s));
      greedy_seconds += s.seconds;
      progress.update(static_cast<std::int64_t>(i + 1), static_cast<std::int64_t>(prompts.size()));
    }
  }
  GenerationStats stats;
  const auto sources = make_sources(prompts.size(), choice, draft, options.sampling, options.max_prefill_rows);
  const auto spec = speculative_generate_batch(model, *sources, prompts, choice.applied_to(options), &stats);
  std::int64_t tokens = 0;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const std::size_t common = std::min(greedy[i].size(), spec[i].size());
    for (std::size_t j = 0; j < common; ++j) {
      if (greedy[i][j] != spec[i][j]) {
        std::printf("DIVERGED: prompt %zu at new token %zu: greedy %d, speculative %d\n", i, j, greedy[i][j],
                    spec[i][j]);
        return 1;
      }
    }
    if (greedy[i].size() != spec[i].size()) {
      std::printf("DIVERGED: prompt %zu: greedy produced %zu tokens, speculative %zu\n", i, greedy[i].size(),
                  spec[i].size());
      return 1;
    }
    tokens += static_cast<std::int64_t>(greedy[i].size());
  }
  std::printf(
      "IDENTICAL: %zu prompts, %lld new tokens; greedy one at a time %.1f tok/s, speculative batch "
      "%.1f tok/s, acceptance %.3f (%lld/%lld)%s\n",
      prompts.size(), static_cast<long long>(tokens),
      greedy_seconds > 0 ? static_cast<double>(tokens) / greedy_seconds : 0.0, stats.tokens_per_second(),
      stats.acceptance_rate(), static_cast<long long>(stats.accepted), static_cast<long long>(stats.drafted),
      acceptance_by_position(stats).c_str());
  return 0;
}

// Decodes greedily and speculatively `repeats` times each, alternating (so
// that a burst of load on a shared machine hits both), checks every
// speculative run against the greedy output token by token and reports the
// median tokens/s of each.
int run_verify(const CLI::App& cmd, const std::string& model_dir, const PromptChoice& prompt_choice,
               std::int64_t max_new, const DraftChoice& choice, int repeats,
               const std::optional<std::int64_t>& ctx_size) {
  if (!choice.any()) throw InvalidArgument("verify needs a draft source: --draft DIR or --lookup N");
  choice.check(cmd);
  prompt_choice.check_batch(cmd);
  if (prompt_choice.many(cmd)) {
    if (choice.tree())
      throw InvalidArgument(
          "verify --tree checks one prompt (--prompt / --prompt-file); batched tree speculation is not built yet");
    if (cmd.count("--repeats") > 0) throw InvalidArgument("verify --prompts runs once; --repeats applies to --prompt");
    return run_verify_batch(cmd, model_dir, prompt_choice, max_new, choice, ctx_size);
  }
  const OnePrompt one(cmd, model_dir, prompt_choice, choice, max_new, ctx_size);
  const auto& [prompt, model, tokenizer, draft, tokens] = one;
  GenerationOptions options;
  options.max_new_tokens = max_new;
  options.max_prefill_rows = prompt_choice.max_prefill_rows;
  GenerationStats greedy_stats, spec_stats;
  std::vector<std::int32_t> greedy;
  std::vector<double> greedy_rates, spec_rates;
  for (int run = 1; run <= repeats; ++run) {
    const std::string suffix = repeats > 1 ? " " + std::to_string(run) + "/" + std::to_string(repeats) : "";
    {
      Progress progress("greedy" + suffix, "tokens");
      std::int64_t n = 0;
      options.on_token = [&](std::int32_t) { progress.update(++n, max_new); };
      std::vector<std::int32_t> out = generate(model, tokens, options, &greedy_stats);
      // Greedy decoding is deterministic; a difference between its runs
      // would be a bug of its own.
      if (run == 1)
        greedy = std::move(out);
      else if (out != greedy)
        throw StateError("verify: greedy decoding gave different tokens in run " + std::to_string(run));
    }
    greedy_rates.push_back(greedy_stats.tokens_per_second());
    std::vector<std::int32_t> spec;
    {
      Progress progress("speculative" + suffix, "tokens");
      std::int64_t n = 0;
      options.on_token = [&](std::int32_t) { progress.update(++n, max_new); };
      if (choice.tree()) {
        auto source = make_tree_source(choice, draft, options.max_prefill_rows);
        spec = tree_speculative_generate(model, *source, tokens, choice.applied_to(options), &spec_stats);
      } else {
        auto source = make_source(choice, draft, options.sampling, options.max_prefill_rows);
        spec = speculative_generate(model, *source, tokens, choice.applied_to(options), &spec_stats);
      }
    }
    spec_rates.push_back(spec_stats.tokens_per_second());
    const std::size_t common = std::min(greedy.size(), spec.size());
    for (std::size_t i = 0; i < common; ++i) {
      if (greedy[i] != spec[i]) {
        std::printf("DIVERGED at new token %zu: greedy %d, speculative %d\n", i, greedy[i], spec[i]);
        return 1;
      }
    }
    if (greedy.size() != spec.size()) {
      std::printf("DIVERGED: greedy produced %zu tokens, speculative %zu\n", greedy.size(), spec.size());
      return 1;
    }
  }
  const double g = median(greedy_rates), sp = median(spec_rates);
  std::printf(
      "IDENTICAL: %zu new tokens; greedy %.1f tok/s, speculative %.1f tok/s (%.2fx), acceptance %.3f "
      "(%lld/%lld), %lld rounds, %lld rollbacks%s%s\n",
      greedy.size(), g, sp, g > 0 ? sp / g : 0.0, spec_stats.acceptance_rate(),
      static_cast<long long>(spec_stats.accepted), static_cast<long long>(spec_stats.drafted),
      static_cast<long long>(spec_stats.rounds), static_cast<long long>(spec_stats.rollbacks),
      repeats > 1 ? ("; tok/s are medians of " + std::to_string(repeats) + " runs each").c_str() : "",
      acceptance_by_position(spec_stats).c_str());
  return 0;
}

}  // namespace

Command add_verify_command(CLI::App& app, SharedFlags& shared) {
  auto flags = std::make_shared<VerifyFlags>();
  VerifyFlags& f = *flags;
  auto* ver = app.add_subcommand("verify", "check that speculative decoding equals greedy decoding");
  add_model_option(ver, f.model_dir);
  add_prompt_options(ver, f.prompt);
  add_prompts_option(ver, f.prompt,
                     "decode every line of FILE ('-' = standard input) speculatively, in batches of at most "
                     "--max-batch sequences, and check "
                     "each against greedy decoding of that prompt alone; exit 1 names the first divergence "
                     "(prompt and position)");
  add_max_new_option(ver, f.max_new);
  add_draft_options(ver, f.choice);
  ver->add_option("--repeats", f.repeats,
                  "decode greedily and speculatively this many times each, alternating; every run is "
                  "checked and tok/s (end to end, prefill included) are medians")
      ->check(integer_in(1, 100));
  add_weights_option(ver, shared);
  add_threads_option(ver, shared.threads);
  add_ctx_option(ver, f.ctx_size);
  return {ver, [ver, flags] {
            const VerifyFlags& o = *flags;
            return run_verify(*ver, o.model_dir, o.prompt, o.max_new, o.choice, o.repeats, o.ctx_size);
          }};
}

}  // namespace rwd::cli
