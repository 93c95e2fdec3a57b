// rewind forward-cost: the cost of a q-token forward in one-token forwards
// (the verification term of speculative decoding), and of batched rounds.
#include <cstdio>

#include "common.h"
#include "runtime/decode_bench.h"

namespace rwd::cli {
namespace {

struct ForwardCostFlags {
  std::string model_dir;
  std::int64_t max_q = 8, context = 128;
  int samples = 200;
  std::vector<std::int64_t> batches;
};

int run_forward_cost(const std::string& model_dir, std::int64_t max_q, std::int64_t context, int samples,
                     const std::vector<std::int64_t>& batch_sizes) {
  const Model model = Model::load(model_dir);
  std::fprintf(stderr, "forward-cost: %lld samples per q after %lld tokens of context\n",
               static_cast<long long>(samples), static_cast<long long>(context));
  const auto rows = measure_forward_costs(model, max_q, context, samples);
  std::printf("%3s %14s %20s\n", "q", "microseconds", "one-token forwards");
  for (const auto& r : rows) {
    std::printf("%3lld %14.1f %19.2fx\n", static_cast<long long>(r.q), r.microseconds, r.one_token_forwards);
  }
  if (!batch_sizes.empty()) {
    std::fprintf(stderr, "forward-cost: decoding rounds of B sequences, each holding %lld tokens\n",
                 static_cast<long long>(context));
    std::printf("\n%5s %14s %14s %12s\n", "B", "microseconds", "per token", "gain");
    for (const auto& r : measure_batch_round_costs(model, batch_sizes, context, samples)) {
      std::printf("%5lld %14.1f %14.1f %11.2fx\n", static_cast<long long>(r.batch), r.microseconds, r.per_token,
                  r.gain);
    }
  }
  return 0;
}

}  // namespace

Command add_forward_cost_command(CLI::App& app, SharedFlags& shared) {
  auto flags = std::make_shared<ForwardCostFlags>();
  ForwardCostFlags& f = *flags;
  auto* cst = app.add_subcommand("forward-cost",
                                 "what a forward of q tokens costs, in one-token forwards (the "
                                 "verification term of speculative decoding)");
  add_model_option(cst, f.model_dir);
  cst->add_option("--max-q", f.max_q, "q from 1 to this")->check(integer_in(1, 64));
  cst->add_option("--context", f.context, "tokens in the cache before each forward")
      ->check(integer_in(1, std::int64_t{1} << 20));
  cst->add_option("--samples", f.samples, "forwards timed per q (median reported)")->check(integer_in(1, 1 << 20));
  cst->add_option("--batch", f.batches,
                  "batch sizes, comma-separated: also time decoding rounds of B sequences (one token each, every "
                  "sequence holding --context tokens) and print each round, its cost per token and its gain "
                  "(B x the one-sequence round / this round)")
      ->delimiter(',')
      ->check(integer_in(1, 4096));
  add_threads_option(cst, shared.threads);
  return {cst, [flags] {
            const ForwardCostFlags& o = *flags;
            return run_forward_cost(o.model_dir, o.max_q, o.context, o.samples, o.batches);
          }};
}

}  // namespace rwd::cli
