// runtime/decode_bench.h: end-to-end decoding throughput (`rewind bench`).
//
// Runs greedy decoding, speculative decoding with a draft model and with
// prompt lookup for each K of a list, over a fixed prompt set, several times,
// and reports medians: tokens/s, acceptance rate, and the share of decode
// time spent inside cache calls (updates, recurrent slots, crops). Every
// speculative run is also checked token for token against greedy.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "runtime/generate.h"
#include "runtime/model.h"

namespace rwd::runtime {

// The median of v (the mean of the middle two for an even count); 0 when
// v is empty.
double median(std::vector<double> v);

struct DecodeBenchOptions {
  std::vector<std::string> prompts;  // empty: the built-in prompt set
  // Turns a prompt's text into tokens (the model's tokenizer); empty:
  // encode_prompt (byte-level: BOS + bytes).
  std::function<std::vector<std::int32_t>(const std::string&)> encode;
  std::vector<std::int64_t> ks = {2, 3, 4, 5, 6, 7, 8};
  std::int64_t max_new_tokens = 200;
  int repeats = 3;
  std::int64_t lookup_ngram = 3;
  // Batched decoding: for each size B, B prompts (the prompt set repeated
  // as needed) decoded together (generate_batch), and with a draft model
  // speculatively (speculative_generate_batch, first K of `ks`). Empty: none.
  std::vector<std::int64_t> batch_sizes;
  // Tree speculation (tree_speculative_generate): with tree_width >= 2, rows
  // "lookup_tree" (and "draft_tree" with a draft model) for each K of `ks`
  // as the depth, at most tree_nodes nodes per round.
  std::int64_t tree_width = 0;
  std::int64_t tree_nodes = 16;
};

struct DecodeBenchRow {
  std::string method;      // "greedy", "draft", "lookup", "greedy_batch", "draft_batch", "lookup_batch",
                           // "draft_tree", "lookup_tree"
  std::int64_t k = 0;      // 0 for greedy
  std::int64_t batch = 1;  // sequences decoded together (1: one prompt at a time)
  double tokens_per_second =
      0.0;                       // median over repeats of (all prompts' tokens / their seconds); batch rows: aggregate
  double acceptance_rate = 0.0;  // accepted / drafted over all runs
  double cache_share = 0.0;      // median of cache_seconds / seconds; -1 (JSON null) for batch rows: not measured
  double speedup = 0.0;          // tokens_per_second / greedy's
  // Decoding alone (GenerationStats::decode_tokens_per_second: the tokens
  // after each sequence's first over the time after it, so without the
  // prompts' prefill), median over repeats, and its ratio to greedy's.
  double decode_tokens_per_second = 0.0;
  double decode_speedup = 0.0;
  bool identical = true;  // tokens equal greedy's for every prompt
};

// The built-in prompts (KJV-style openings).
const std::vector<std::string>& default_bench_prompts();

// Runs the grid. `draft` may be null (then no "draft" rows). `progress` is
// called with a line before each configuration. Throws InvalidArgument for
// an empty K list, a K outside [1, 64], repeats < 1, max_new_tokens < 1 or
// a batch size outside [1, 4096]. Batch rows are checked against the
// greedy reference of their prompts too.
std::vector<DecodeBenchRow> run_decode_bench(const Model& target, const Model* draft, const DecodeBenchOptions& options,
                                             const std::function<void(const std::string&)>& progress = {});

// The rows as a JSON array (one object per row).
std::string decode_bench_json(const std::vector<DecodeBenchRow>& rows);

// What a forward of q tokens costs: the verification term of speculative
// decoding (a round of K drafts verifies K + 1 tokens in one forward).
struct ForwardCostRow {
  std::int64_t q = 0;               // tokens in the forward
  double microseconds = 0.0;        // median wall time of one forward of q tokens
  double one_token_forwards = 0.0;  // microseconds / the q = 1 median
};

// Times forwards of q tokens for q in [1, max_q] after a context of
// `context` tokens: each sample is one forward of q tokens followed by a
// crop that removes them (the crop is not timed), q values interleaved
// sample by sample so that a noisy moment hits them alike; the median of
// `samples` per q. Throws InvalidArgument unless 1 <= max_q <= 64,
// 1 <= context <= 1 << 20 and 1 <= samples <= 1 << 20.
std::vector<ForwardCostRow> measure_forward_costs(const Model& model, std::int64_t max_q, std::int64_t context,
                                                  int samples);

// What a decoding round of B sequences costs (the term batched decoding
// divides by B).
struct BatchRoundCostRow {
  std::int64_t batch = 0;     // sequences, one token each
  double microseconds = 0.0;  // median wall time of one Model::forward_batch round
  double per_token = 0.0;     // microseconds / batch
  double gain = 0.0;          // batch x the B = 1 round / this round: tokens per unit of time vs one sequence
};

// Times decoding rounds of B sequences (one token each, one forward_batch)
// for each B of `batch_sizes`, every sequence holding `context` tokens (the
// round adds the next one, as measure_forward_costs' forwards do): they are
// prefilled once, and each sample forks all B (shared blocks, copied
// states), feeds each fork its last context token in an untimed round,
// times the next round and drops the forks, so the context stays the same
// and the blocks come from the pool.
// Sizes are interleaved sample by sample (noise hits them alike); the
// first row is B = 1 whatever the list says, so `gain` has its base.
// Throws InvalidArgument unless every B is in [1, 4096], 1 <= context <=
// 1 << 20 and 1 <= samples <= 1 << 20.
std::vector<BatchRoundCostRow> measure_batch_round_costs(const Model& model,
                                                         const std::vector<std::int64_t>& batch_sizes,
                                                         std::int64_t context, int samples);

}  // namespace rwd::runtime
