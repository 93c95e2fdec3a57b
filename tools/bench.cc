// rewind bench: tokens/s of greedy and speculative decoding over a fixed
// prompt set (exit 1 when a speculative row's tokens differ from greedy's).
#include <cstdio>
#include <fstream>

#include "common.h"
#include "rewind/error.h"
#include "runtime/decode_bench.h"

namespace rwd::cli {
namespace {

struct BenchFlags {
  std::string model_dir, json;
  DraftChoice choice;
  std::int64_t max_new = 128;
  int repeats = 3;
  std::vector<std::int64_t> ks, batches;
};

int run_bench(const CLI::App& cmd, const std::string& model_dir, const DraftChoice& tree_choice, std::int64_t max_new,
              int repeats, const std::vector<std::int64_t>& ks, const std::vector<std::int64_t>& batch_sizes,
              const std::string& json_path) {
  if (cmd.count("--tree-nodes") > 0 && !tree_choice.tree()) {
    throw InvalidArgument("--tree-nodes sizes tree speculation: it needs --tree W (W >= 2)");
  }
  const Model model = load_model(model_dir);
  DraftChoice choice;
  choice.draft_dir = tree_choice.draft_dir;
  const Tokenizer tokenizer = load_tokenizer(model_dir, model);
  const std::optional<Model> draft = load_draft(choice, model, tokenizer);
  DecodeBenchOptions options;
  options.encode = [&tokenizer](const std::string& text) {
    return encode_for_generation(tokenizer, text, "bench prompt '" + text + "'");
  };
  std::size_t prompt_tokens = 0;
  for (const std::string& p : default_bench_prompts()) prompt_tokens += options.encode(p).size();
  std::fprintf(stderr, "bench: %zu prompts, %zu prompt tokens (%s tokenizer)\n", default_bench_prompts().size(),
               prompt_tokens, tokenizer.kind_name().c_str());
  options.max_new_tokens = max_new;
  options.repeats = repeats;
  if (!ks.empty()) options.ks = ks;
  options.batch_sizes = batch_sizes;
  options.tree_width = tree_choice.tree_width;
  options.tree_nodes = tree_choice.tree_nodes;
  const auto rows = run_decode_bench(model, draft ? &*draft : nullptr, options, [](const std::string& line) {
    std::fprintf(stderr, "bench: %s\n", line.c_str());
  });
  std::printf("%-12s %5s %3s %12s %9s %12s %9s %11s %12s %10s\n", "method", "batch", "K", "tokens/s", "speedup",
              "decode tok/s", "speedup", "acceptance", "cache share", "identical");
  bool all_identical = true;
  for (const auto& r : rows) {
    char share[32];
    if (r.cache_share < 0) {
      std::snprintf(share, sizeof share, "n/a");
    } else {
      std::snprintf(share, sizeof share, "%.3f%%", 100.0 * r.cache_share);
    }
    std::printf("%-12s %5lld %3lld %12.1f %8.2fx %12.1f %8.2fx %11.3f %12s %10s\n", r.method.c_str(),
                static_cast<long long>(r.batch), static_cast<long long>(r.k), r.tokens_per_second, r.speedup,
                r.decode_tokens_per_second, r.decode_speedup, r.acceptance_rate, share, r.identical ? "yes" : "NO");
    all_identical = all_identical && r.identical;
  }
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << decode_bench_json(rows) << "\n";
    if (!out) throw Error("cannot write " + json_path);
  }
  return all_identical ? 0 : 1;
}

}  // namespace

Command add_bench_command(CLI::App& app, SharedFlags& shared) {
  auto flags = std::make_shared<BenchFlags>();
  BenchFlags& f = *flags;
  auto* ben = app.add_subcommand("bench", "tokens/s of greedy and speculative decoding over a fixed prompt set");
  ben->add_option("-m,--model", f.model_dir, "target model directory")->required()->check(CLI::ExistingDirectory);
  ben->add_option("--draft", f.choice.draft_dir, "draft model directory (none: no draft-model rows)")
      ->check(CLI::ExistingDirectory)
      ->default_str("none");
  ben->add_option("-n,--max-new-tokens", f.max_new, "tokens per prompt")->check(integer_in(1, std::int64_t{1} << 20));
  ben->add_option("--repeats", f.repeats, "runs per configuration (median reported)")->check(integer_in(1, 100));
  ben->add_option("--batch", f.batches,
                  "batch sizes to add, comma-separated: B prompts decoded together (greedy, and with --draft "
                  "speculatively at the first K), aggregate tokens/s")
      ->delimiter(',')
      ->check(integer_in(1, 4096))
      ->default_str("none");
  ben->add_option("--tree", f.choice.tree_width,
                  "also rows draft_tree / lookup_tree: tree speculation with W children per node, depth each K")
      ->check(integer_in(2, 64))
      ->default_str("off");
  ben->add_option("--tree-nodes", f.choice.tree_nodes, "with --tree: at most N nodes per round")
      ->check(integer_in(2, 1024));
  ben->add_option("--k", f.ks, "draft lengths to try, comma-separated")
      ->delimiter(',')
      ->check(integer_in(1, 64))
      ->default_str("2,3,4,5,6,7,8");
  ben->add_option("--json", f.json, "also write the rows as JSON to this file")->default_str("none");
  add_weights_option(ben, shared);
  add_threads_option(ben, shared.threads);
  return {ben, [ben, flags] {
            const BenchFlags& o = *flags;
            return run_bench(*ben, o.model_dir, o.choice, o.max_new, o.repeats, o.ks, o.batches, o.json);
          }};
}

}  // namespace rwd::cli
