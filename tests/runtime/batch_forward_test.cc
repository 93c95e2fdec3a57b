// Model::forward_batch over a SequenceCache: every sequence's logits and
// state are bit-identical to running that sequence alone through
// Model::forward with a single-sequence Cache, whatever else is in the
// batch (ragged counts, 0 included), across forks and crops.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "generation_options.h"
#include "rewind/error.h"
#include "runtime/decode_bench.h"
#include "runtime/generate.h"
#include "runtime/model.h"
#include "test_configs.h"

namespace rwd::runtime {
namespace {

using Tokens = std::vector<std::int32_t>;

Tokens random_tokens(std::mt19937_64& rng, std::size_t n) {
  std::uniform_int_distribution<std::int32_t> pick(0, 257);
  Tokens t(n);
  for (auto& v : t) v = pick(rng);
  return t;
}

// One prompt per length in `lengths`: BOS, then random tokens.
std::vector<Tokens> bos_prompts(const Model& model, std::mt19937_64& rng, std::initializer_list<std::size_t> lengths) {
  std::vector<Tokens> prompts;
  for (std::size_t n : lengths) {
    Tokens p = random_tokens(rng, n);
    p.insert(p.begin(), static_cast<std::int32_t>(model.config().bos_token_id));
    prompts.push_back(p);
  }
  return prompts;
}

// One sequence of the batched cache and its solo twin.
struct Twin {
  SeqId id;
  Cache solo;
};

// Feeds `chunks[i]` to twin i: all of them in one forward_batch (twin i
// asking for the rows of logits `wanted[i]`, every row when not given), each
// alone through forward() with every row; the rows asked for must be equal
// bit for bit, and no other row may be written.
void step(const Model& model, SequenceCache& batched, std::vector<Twin>& twins, const std::vector<Tokens>& chunks,
          const std::string& what, const std::vector<LogitRows>& wanted = {}) {
  std::vector<SequenceTokens> batch;
  for (std::size_t i = 0; i < twins.size(); ++i) {
    batch.push_back({twins[i].id, chunks[i], wanted.empty() ? LogitRows::kAll : wanted[i]});
  }
  std::vector<float> logits;
  model.forward_batch(batch, batched, logits);
  const auto V = static_cast<std::size_t>(model.vocab_size());
  std::size_t row = 0;
  for (std::size_t i = 0; i < twins.size(); ++i) {
    if (chunks[i].empty()) continue;
    std::vector<float> solo;
    model.forward(chunks[i], twins[i].solo, solo, /*all_logits=*/true);
    ASSERT_EQ(solo.size(), chunks[i].size() * V);
    const LogitRows rows = batch[i].logits;
    const std::size_t first = rows == LogitRows::kAll ? 0 : chunks[i].size() - 1;
    const std::size_t count = rows == LogitRows::kAll ? chunks[i].size() : rows == LogitRows::kLast ? 1 : 0;
    ASSERT_LE((row + count) * V, logits.size()) << what;
    if (count > 0) {  // (no rows: logits may be empty, its data() null)
      EXPECT_EQ(std::memcmp(solo.data() + first * V, logits.data() + row * V, count * V * sizeof(float)), 0)
          << what << ": sequence " << i << " differs from its solo forward";
    }
    EXPECT_EQ(batched.seq_length(twins[i].id), twins[i].solo.get_seq_length()) << what;
    row += count;
  }
  EXPECT_EQ(row * V, logits.size()) << what;
}

TEST(ForwardBatch, EverySequenceMatchesItsSoloForwardBitForBit) {
  for (std::uint64_t seed : {1u, 2u, 3u}) {
    std::mt19937_64 rng(seed);
    ModelConfig config = testing_configs::hybrid();
    std::shuffle(config.layer_types.begin(), config.layer_types.end(), rng);
    const Model model(ModelWeights::random(config, seed));
    SequenceCache batched = model.make_sequence_cache({/*block_size=*/4});
    std::vector<Twin> twins;
    for (int i = 0; i < 3; ++i) twins.push_back({batched.add_sequence(), model.make_cache()});
    // Prompts of different lengths in one batch, then ragged decode rounds
    // (a sequence with no token in a round is left alone).
    step(model, batched, twins, {random_tokens(rng, 7), random_tokens(rng, 2), random_tokens(rng, 12)}, "prefill");
    std::uniform_int_distribution<int> q(0, 4);
    for (int round = 0; round < 12; ++round) {
      std::vector<Tokens> chunks;
      for (std::size_t i = 0; i < twins.size(); ++i)
        chunks.push_back(random_tokens(rng, static_cast<std::size_t>(q(rng))));
      if (chunks[0].empty() && chunks[1].empty() && chunks[2].empty()) chunks[1] = random_tokens(rng, 1);
      step(model, batched, twins, chunks, "round " + std::to_string(round));
    }
  }
}

// Entries asking for every row, the last row or none, mixed in one batch:
// the rows asked for come out in entry order with the bits of a full
// forward, and the state is the same whatever is asked.
TEST(ForwardBatch, EachEntryGetsTheLogitRowsItAsksFor) {
  std::mt19937_64 rng(11);
  const Model model(ModelWeights::random(testing_configs::hybrid(), 11));
  SequenceCache batched = model.make_sequence_cache({/*block_size=*/4});
  std::vector<Twin> twins;
  for (int i = 0; i < 4; ++i) twins.push_back({batched.add_sequence(), model.make_cache()});
  step(model, batched, twins,
       {random_tokens(rng, 9), random_tokens(rng, 1), random_tokens(rng, 5), random_tokens(rng, 3)}, "prompts",
       {LogitRows::kLast, LogitRows::kNone, LogitRows::kAll, LogitRows::kLast});
  std::uniform_int_distribution<int> q(0, 4), kind(0, 2);
  const LogitRows kinds[] = {LogitRows::kAll, LogitRows::kLast, LogitRows::kNone};
  for (int round = 0; round < 10; ++round) {
    std::vector<Tokens> chunks;
    std::vector<LogitRows> wanted;
    for (std::size_t i = 0; i < twins.size(); ++i) {
      chunks.push_back(random_tokens(rng, static_cast<std::size_t>(q(rng))));
      wanted.push_back(kinds[kind(rng)]);
    }
    chunks[round % 4] = random_tokens(rng, 2);
    step(model, batched, twins, chunks, "round " + std::to_string(round), wanted);
  }
  // Nothing asked at all: no logits, the tokens still appended.
  step(model, batched, twins, {random_tokens(rng, 2), random_tokens(rng, 1), {}, random_tokens(rng, 3)}, "no rows",
       {LogitRows::kNone, LogitRows::kNone, LogitRows::kNone, LogitRows::kNone});
}

TEST(ForwardBatch, ForksAndPerSequenceRollbackStayExact) {
  std::mt19937_64 rng(7);
  const Model model(ModelWeights::random(testing_configs::hybrid(), 7));
  SequenceCache batched = model.make_sequence_cache({/*block_size=*/3});
  std::vector<Twin> twins;
  twins.push_back({batched.add_sequence(), model.make_cache()});
  batched.activate_past_recording(twins[0].id, 4);
  twins[0].solo.activate_past_recording(4);
  const Tokens prompt = random_tokens(rng, 10);
  step(model, batched, twins, {prompt}, "prompt");
  // A fork continues differently; its twin replays the parent's tokens.
  twins.push_back({batched.fork(twins[0].id), model.make_cache()});
  twins[1].solo.activate_past_recording(4);
  std::vector<float> ignored;
  model.forward(prompt, twins[1].solo, ignored);
  for (int round = 0; round < 6; ++round) {
    step(model, batched, twins, {random_tokens(rng, 3), random_tokens(rng, 4)}, "draft round " + std::to_string(round));
    // Each rejects a different number of its drafts.
    const std::int64_t reject0 = round % 3, reject1 = (round + 1) % 4;
    batched.crop(twins[0].id, -reject0);
    twins[0].solo.crop(-reject0);
    batched.crop(twins[1].id, -reject1);
    twins[1].solo.crop(-reject1);
  }
  step(model, batched, twins, {random_tokens(rng, 1), random_tokens(rng, 1)}, "after the crops");
}

// A batched forward that cannot get its memory changes no sequence: under a
// budget that holds the cache as it is, a forward of more tokens than fit
// throws CapacityError from begin_batch, and every sequence keeps its
// length, blocks and logits (the next forward gives what it would have).
TEST(ForwardBatch, RefusedForLackOfMemoryChangesNoSequence) {
  std::mt19937_64 rng(5);
  const Model model(ModelWeights::random(testing_configs::hybrid(), 5));
  SequenceCache batched = model.make_sequence_cache({/*block_size=*/2});
  std::vector<Twin> twins;
  for (int i = 0; i < 2; ++i) twins.push_back({batched.add_sequence(), model.make_cache()});
  step(model, batched, twins, {random_tokens(rng, 5), random_tokens(rng, 3)}, "prefill");
  const SequenceMemory before = batched.memory();
  batched.set_memory_budget(before.bytes_reserved);
  const Tokens many = random_tokens(rng, 40);
  std::vector<SequenceTokens> big{{twins[0].id, many}, {twins[1].id, many}};
  std::vector<float> logits;
  EXPECT_THROW(model.forward_batch(big, batched, logits), CapacityError);
  EXPECT_EQ(batched.memory().blocks_in_use, before.blocks_in_use);
  EXPECT_EQ(batched.seq_length(twins[0].id), 5);
  EXPECT_EQ(batched.seq_length(twins[1].id), 3);
  batched.set_memory_budget(0);
  step(model, batched, twins, {random_tokens(rng, 2), random_tokens(rng, 1)}, "after the refusal");
}

TEST(ForwardBatch, RefusesBadInputAndChangesNothing) {
  const Model model(ModelWeights::random(testing_configs::hybrid(), 3));
  SequenceCache batched = model.make_sequence_cache();
  const SeqId a = batched.add_sequence();
  const Tokens good{1, 2, 3}, bad{1, 300};
  std::vector<float> logits;
  EXPECT_THROW(model.forward_batch({}, batched, logits), InvalidArgument);
  const std::vector<SequenceTokens> out_of_vocab{{a, bad}};
  EXPECT_THROW(model.forward_batch(out_of_vocab, batched, logits), InvalidArgument);
  const std::vector<SequenceTokens> twice{{a, good}, {a, good}};
  EXPECT_THROW(model.forward_batch(twice, batched, logits), InvalidArgument);
  const std::vector<SequenceTokens> nothing{{a, {}}};
  EXPECT_THROW(model.forward_batch(nothing, batched, logits), InvalidArgument);
  const std::vector<SequenceTokens> no_such_rows{{a, good, static_cast<LogitRows>(3)}};
  EXPECT_THROW(model.forward_batch(no_such_rows, batched, logits), InvalidArgument);
  EXPECT_EQ(batched.seq_length(a), 0);
  EXPECT_EQ(batched.memory().blocks_in_use, 0);
}

// generate_batch: each prompt's tokens equal generate()'s for it alone, in
// greedy and sampled mode, while sequences of different lengths and budgets
// join in one prefill and leave at different rounds.
TEST(GenerateBatch, EverySequenceEqualsGenerateAlone) {
  const Model model(ModelWeights::random(testing_configs::hybrid(), 11));
  std::mt19937_64 rng(11);
  const std::vector<Tokens> prompts = bos_prompts(model, rng, {1u, 5u, 9u, 2u});
  for (const float temperature : {0.0f, 0.9f}) {
    for (const std::int64_t max_new : {0, 1, 17}) {
      GenerationOptions options;
      options.max_new_tokens = max_new;
      options.stop_at_eos = false;
      options.sampling.temperature = temperature;
      options.sampling.seed = 5;
      GenerationStats stats;
      const auto batched = generate_batch(model, prompts, options, &stats);
      ASSERT_EQ(batched.size(), prompts.size());
      std::int64_t total = 0;
      for (std::size_t i = 0; i < prompts.size(); ++i) {
        GenerationOptions alone = options;
        alone.sampling.seed += i;  // sequence i's own random stream
        EXPECT_EQ(batched[i], generate(model, prompts[i], alone))
            << "prompt " << i << ", temperature " << temperature << ", max_new_tokens " << max_new;
        EXPECT_EQ(static_cast<std::int64_t>(batched[i].size()), max_new);
        total += static_cast<std::int64_t>(batched[i].size());
      }
      EXPECT_EQ(stats.new_tokens, total);
      EXPECT_EQ(stats.forwards, max_new);  // one prefill, then one round per further token
    }
  }
  // Continuous batching: at most two sequences at once, the others join as
  // sequences finish; still each equals its solo decoding.
  for (const std::int64_t max_batch : {1, 2, 3}) {
    GenerationOptions options;
    options.max_new_tokens = 9;
    options.max_batch = max_batch;
    options.sampling.temperature = 0.7f;
    options.sampling.seed = 3;
    GenerationStats stats;
    const auto joined = generate_batch(model, prompts, options, &stats);
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      GenerationOptions alone = options;
      alone.sampling.seed += i;
      EXPECT_EQ(joined[i], generate(model, prompts[i], alone)) << "max_batch " << max_batch << ", prompt " << i;
    }
    // ceil(4 / max_batch) waves of 9 forwards each.
    EXPECT_EQ(stats.forwards, 9 * ((4 + max_batch - 1) / max_batch)) << max_batch;
  }
  // The same with stop_at_eos on (the default).
  GenerationOptions options;
  options.max_new_tokens = 12;
  const auto all = generate_batch(model, prompts, options);
  for (std::size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(all[i], generate(model, prompts[i], options)) << i;
  EXPECT_THROW(generate_batch(model, std::vector<Tokens>{}, options), InvalidArgument);
  EXPECT_THROW(generate_batch(model, std::vector<Tokens>{Tokens{1}, Tokens{}}, options), InvalidArgument);
}

// speculative_generate_batch with prompt lookup, then with the model as its
// own draft, one draft source per sequence: each output is alone[i].
void expect_speculative_batch_gives(const Model& model, const std::vector<Tokens>& prompts,
                                    const GenerationOptions& options, const std::vector<Tokens>& alone) {
  for (int source = 0; source < 2; ++source) {
    std::vector<std::unique_ptr<DraftSource>> each;
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      if (source == 0)
        each.push_back(std::make_unique<LookupDraft>(3));
      else
        each.push_back(std::make_unique<ModelDraft>(model, options.sampling, 3));
    }
    PerSequenceDrafts drafts(std::move(each));
    const auto spec = speculative_generate_batch(model, drafts, prompts, with_chain(options, {3, false}));
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      EXPECT_EQ(spec[i], alone[i]) << "speculative, source " << source << ", max_prefill_rows "
                                   << options.max_prefill_rows << ", prompt " << i;
    }
  }
}

// max_prefill_rows: prompts go in forwards of at most that many prompt
// tokens (all joining prompts together), decoding rows whole; every output
// stays the one of a single prefill (generate alone with the default), the
// forwards are counted, and a value below 1 is refused before anything runs.
TEST(GenerateBatch, PromptsGoInPiecesOfAtMostMaxPrefillRows) {
  const Model model(ModelWeights::random(testing_configs::hybrid(), 12));
  std::mt19937_64 rng(12);
  std::vector<Tokens> prompts;
  for (std::size_t n : {0u, 1u, 6u, 22u, 39u}) {
    Tokens p = random_tokens(rng, n);
    p.insert(p.end(), p.begin(), p.end());  // repeats for prompt lookup
    p.insert(p.begin(), static_cast<std::int32_t>(model.config().bos_token_id));
    prompts.push_back(p);
  }
  GenerationOptions plain;
  plain.max_new_tokens = 9;
  plain.stop_at_eos = false;
  std::vector<Tokens> alone;
  for (const Tokens& p : prompts) alone.push_back(generate(model, p, plain));
  for (const std::int64_t rows : {1, 3, 16, 100}) {
    GenerationOptions options = plain;
    options.max_prefill_rows = rows;
    GenerationStats one;
    EXPECT_EQ(generate(model, prompts[4], options, &one), alone[4]) << rows;
    const auto P = static_cast<std::int64_t>(prompts[4].size());
    EXPECT_EQ(one.forwards, (P + rows - 1) / rows + plain.max_new_tokens - 1) << rows;

    GenerationStats stats;
    const auto batched = generate_batch(model, prompts, options, &stats);
    std::int64_t prompt_tokens = 0;
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      EXPECT_EQ(batched[i], alone[i]) << "max_prefill_rows " << rows << ", prompt " << i;
      prompt_tokens += static_cast<std::int64_t>(prompts[i].size());
    }
    // Every forward but the ones after the last prompt is in takes `rows`
    // prompt tokens (the prompts of one token, BOS alone, count as decoding
    // rows and go at once).
    const std::int64_t multi = prompt_tokens - 1;  // the BOS-only prompt aside
    const std::int64_t prefill_forwards = (multi + rows - 1) / rows;
    EXPECT_GE(stats.forwards, std::max<std::int64_t>(prefill_forwards, plain.max_new_tokens)) << rows;
    EXPECT_LE(stats.forwards, prefill_forwards + plain.max_new_tokens) << rows;

    expect_speculative_batch_gives(model, prompts, options, alone);
  }
  // on_prefill: after each piece, the tokens in so far and the total.
  {
    GenerationOptions options = plain;
    options.max_prefill_rows = 16;
    std::vector<std::pair<std::int64_t, std::int64_t>> calls;
    options.on_prefill = [&calls](std::int64_t done, std::int64_t total) { calls.emplace_back(done, total); };
    EXPECT_EQ(generate(model, prompts[4], options), alone[4]);
    const auto P = static_cast<std::int64_t>(prompts[4].size());
    std::vector<std::pair<std::int64_t, std::int64_t>> expected;
    for (std::int64_t done = 16; done < P + 16; done += 16) expected.emplace_back(std::min(done, P), P);
    EXPECT_EQ(calls, expected);
    calls.clear();
    LookupDraft lookup(3);
    EXPECT_EQ(speculative_generate(model, lookup, prompts[4], with_chain(options, {3, false})), alone[4]);
    ASSERT_FALSE(calls.empty());
    EXPECT_EQ(calls.back(), std::make_pair(P - 1, P - 1));  // all but the pending last token
  }
  GenerationOptions bad = plain;
  bad.max_prefill_rows = 0;
  EXPECT_THROW(generate(model, prompts[2], bad), InvalidArgument);
  EXPECT_THROW(generate_batch(model, prompts, bad), InvalidArgument);
  LookupDraft lookup(3);
  EXPECT_THROW(speculative_generate(model, lookup, prompts[2], with_chain(bad, {3, false})), InvalidArgument);
  // Refused also where no prefill would run (BOS alone, nothing to generate).
  EXPECT_THROW(speculative_generate(model, lookup, prompts[0], with_chain(bad, {3, false})), InvalidArgument);
  bad.max_new_tokens = 0;
  EXPECT_THROW(generate(model, prompts[2], bad), InvalidArgument);
  Cache cache = model.make_cache();
  std::vector<float> logits;
  GenerationStats stats;
  EXPECT_THROW(prefill(model, prompts[2], cache, logits, nullptr, stats, -1), InvalidArgument);
  EXPECT_THROW(prefill(model, Tokens{}, cache, logits, nullptr, stats), InvalidArgument);
  EXPECT_EQ(cache.get_seq_length(), 0);
  EXPECT_EQ(stats.forwards, 0);
}

// prefill() in pieces is all or nothing, as its one forward was: a piece
// that fails (an exception from on_piece, a budget refusing growth) comes out
// with the caller's cache empty (recording kept) and its logits untouched,
// and the same cache then prefills to the logits of one forward of the
// prompt in a fresh cache. A cache that already holds tokens is refused.
TEST(Prefill, AFailingPieceLeavesTheCacheEmptyAndTheLogitsUnchanged) {
  const Model model(ModelWeights::random(testing_configs::hybrid(), 41));
  std::mt19937_64 rng(41);
  const Tokens prompt = random_tokens(rng, 50);
  const Tokens next = random_tokens(rng, 1);
  std::vector<float> expected, expected_next;
  {
    Cache fresh = model.make_cache();
    model.forward(prompt, fresh, expected, false);
    model.forward(next, fresh, expected_next, false);
  }
  const std::vector<float> sentinel{1.0f, 2.0f, 3.0f};
  struct Stop {};
  auto check_empty_then_reusable = [&](Cache& cache, const char* what) {
    for (int i = 0; i < cache.num_layers(); ++i) EXPECT_EQ(cache.get_seq_length(i), 0) << what << ", layer " << i;
    EXPECT_TRUE(cache.is_recording()) << what;
    cache.set_memory_budget(0);
    std::vector<float> logits;
    GenerationStats stats;
    prefill(model, prompt, cache, logits, nullptr, stats, 16);
    EXPECT_EQ(logits, expected) << what;
    model.forward(next, cache, logits, false);
    EXPECT_EQ(logits, expected_next) << what;
  };
  {
    Cache cache = model.make_cache();
    cache.activate_past_recording(2);
    std::vector<float> logits = sentinel;
    GenerationStats stats;
    int pieces = 0;
    const auto stop_after_two = [&pieces](std::int64_t, std::int64_t) {
      if (++pieces == 2) throw Stop{};
    };
    EXPECT_THROW(prefill(model, prompt, cache, logits, nullptr, stats, 16, stop_after_two), Stop);
    EXPECT_EQ(pieces, 2);
    EXPECT_EQ(logits, sentinel);
    check_empty_then_reusable(cache, "on_piece threw");
  }
  {
    // A budget that holds the first pieces but not the whole prompt.
    Cache probe = model.make_cache();
    probe.activate_past_recording(2);
    std::vector<float> logits = sentinel;
    model.forward(Tokens(prompt.begin(), prompt.begin() + 8), probe, logits, false);
    const std::size_t budget = probe.memory().bytes_reserved;
    Cache cache = model.make_cache();
    cache.activate_past_recording(2);
    cache.set_memory_budget(budget);
    logits = sentinel;
    GenerationStats stats;
    std::int64_t in_cache = 0;
    EXPECT_THROW(prefill(model, prompt, cache, logits, nullptr, stats, 8,
                         [&in_cache](std::int64_t done, std::int64_t) { in_cache = done; }),
                 CapacityError);
    EXPECT_GE(in_cache, 8);  // a piece went in before the budget refused one
    EXPECT_LT(in_cache, 50);
    EXPECT_EQ(logits, sentinel);
    check_empty_then_reusable(cache, "budget");
  }
  {
    Cache cache = model.make_cache();
    cache.activate_past_recording(2);
    std::vector<float> logits;
    GenerationStats stats;
    model.forward(next, cache, logits, false);
    logits = sentinel;
    EXPECT_THROW(prefill(model, prompt, cache, logits, nullptr, stats), InvalidArgument);
    EXPECT_EQ(cache.get_seq_length(), 1);
    EXPECT_EQ(logits, sentinel);
    EXPECT_EQ(stats.forwards, 0);
  }
}

// The draft models take what their caches have not seen (whole prompts at
// the first propose) in forwards of at most max_prefill_rows tokens, as the
// target's prefill does: every output equals the one with the default (one
// forward for these prompts), for ModelDraft, BatchedModelDraft (pieces of
// several prompts sharing a forward) and ModelTreeDraft; 0 is refused.
TEST(Drafts, ModelDraftsTakeLongPromptsInPiecesWithTheSameOutput) {
  constexpr std::int64_t kHugeRows = std::numeric_limits<std::int64_t>::max();
  const Model target(ModelWeights::random(testing_configs::hybrid(), 51));
  const Model draft(ModelWeights::random(testing_configs::hybrid({"conv", "sliding_attention"}, 16, 3), 52));
  std::mt19937_64 rng(51);
  std::vector<Tokens> prompts;
  for (std::size_t n : {1u, 2u, 40u, 57u}) prompts.push_back(random_tokens(rng, n));
  GenerationOptions options;
  options.max_new_tokens = 10;
  options.stop_at_eos = false;
  std::vector<Tokens> greedy, first_drafts;
  for (const Tokens& p : prompts) {
    greedy.push_back(generate(target, p, options));
    ModelDraft d(draft, {}, 3);
    first_drafts.push_back(d.propose(p, 3, nullptr));
  }
  // INT64_MAX: no piece arithmetic may overflow; one forward as the default.
  for (const std::int64_t rows : {std::int64_t{1}, std::int64_t{3}, std::int64_t{16}, kHugeRows}) {
    for (std::size_t i = 0; i < prompts.size(); ++i) {
      ModelDraft d(draft, {}, 3, rows);
      EXPECT_EQ(d.propose(prompts[i], 3, nullptr), first_drafts[i]) << rows << ", prompt " << i;
      ModelDraft spec(draft, {}, 3, rows);
      EXPECT_EQ(speculative_generate(target, spec, prompts[i], with_chain(options, {3, false})), greedy[i])
          << rows << ", " << i;
      ModelTreeDraft tree(draft, rows);
      EXPECT_EQ(tree_speculative_generate(target, tree, prompts[i], with_tree(options, {2, 8, 3})), greedy[i])
          << rows << ", " << i;
    }
    BatchedModelDraft batched(draft, options.sampling, 3, rows);
    const auto out = speculative_generate_batch(target, batched, prompts, with_chain(options, {3, false}));
    for (std::size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(out[i], greedy[i]) << "batched, " << rows << ", " << i;
  }
  {
    std::vector<float> one, huge;
    Cache c1 = target.make_cache(), c2 = target.make_cache();
    target.forward(prompts[3], c1, one, false);
    GenerationStats stats;
    prefill(target, prompts[3], c2, huge, nullptr, stats, kHugeRows);
    EXPECT_EQ(huge, one);
    EXPECT_EQ(stats.forwards, 1);
  }
  EXPECT_THROW(ModelDraft(draft, {}, 3, 0), InvalidArgument);
  EXPECT_THROW(BatchedModelDraft(draft, {}, 3, 0), InvalidArgument);
  EXPECT_THROW(ModelTreeDraft(draft, -1), InvalidArgument);
}

// A server reuses the index of a sequence that left (finish) for a new one:
// the new sequence drafts what a fresh ModelDraft drafts for it alone,
// whatever the index held before.
TEST(Drafts, BatchedModelDraftIndexIsReusableAfterFinish) {
  const Model draft(ModelWeights::random(testing_configs::hybrid({"conv", "sliding_attention"}, 16, 3), 53));
  std::mt19937_64 rng(53);
  const Tokens a = random_tokens(rng, 30), b = random_tokens(rng, 12);
  BatchedModelDraft batched(draft, {}, 4);
  batched.begin(std::vector<Tokens>(1));
  Tokens out;
  const BatchDraftSource::Request first{0, a, 4, &out, nullptr};
  batched.propose(std::span(&first, 1));
  batched.accept(0, 4, 2);
  batched.finish(0);
  const BatchDraftSource::Request second{0, b, 4, &out, nullptr};
  batched.propose(std::span(&second, 1));
  ModelDraft fresh(draft, {}, 4);
  EXPECT_EQ(out, fresh.propose(b, 4, nullptr));
}

// Batched speculative decoding: for random hybrids with every runtime kind
// and a window far below the generated length, batches of 1 / 3 / 8 prompts
// of different lengths, every draft source (draft model, prompt lookup,
// adversarial random draft, perfect draft = the target itself) and K in
// {1, 3, 6}: every sequence's tokens equal generate() for its prompt alone
// (greedy), and equal speculative_generate() alone in sampling mode.
TEST(SpeculativeBatch, EverySequenceEqualsItsSoloDecoding) {
  for (std::uint64_t seed : {21u, 22u, 23u}) {
    std::mt19937_64 rng(seed);
    ModelConfig config = testing_configs::hybrid();
    std::shuffle(config.layer_types.begin(), config.layer_types.end(), rng);
    const Model target(ModelWeights::random(config, seed));
    ModelConfig small = testing_configs::hybrid({"conv", "sliding_attention"}, 16, 3);
    const Model draft_model(ModelWeights::random(small, seed + 100));
    for (std::size_t batch_size : {1u, 3u, 8u}) {
      std::vector<Tokens> prompts;
      for (std::size_t i = 0; i < batch_size; ++i) {
        Tokens p = random_tokens(rng, 1 + (i * 5) % 11);
        // Repeats give prompt lookup something to find.
        p.insert(p.end(), p.begin(), p.end());
        p.insert(p.begin(), static_cast<std::int32_t>(config.bos_token_id));
        prompts.push_back(p);
      }
      for (int source = 0; source < 6; ++source) {
        for (std::int64_t K : {1, 3, 6}) {
          GenerationOptions options;
          options.max_new_tokens = 10 + static_cast<std::int64_t>(seed % 3) * 7;
          options.stop_at_eos = false;
          auto make = [&]() -> std::unique_ptr<DraftSource> {
            switch (source) {
              case 0: return std::make_unique<ModelDraft>(draft_model, options.sampling, K);
              case 1: return std::make_unique<LookupDraft>(3);
              case 2: return std::make_unique<RandomDraft>(target.vocab_size(), seed);
              default: return std::make_unique<ModelDraft>(target, options.sampling, K);
            }
          };
          // Sources 4 and 5: the draft model and the perfect draft run
          // batched (BatchedModelDraft) instead of one sequence at a time.
          std::unique_ptr<BatchDraftSource> drafts;
          if (source == 4) {
            drafts = std::make_unique<BatchedModelDraft>(draft_model, options.sampling, K);
          } else if (source == 5) {
            drafts = std::make_unique<BatchedModelDraft>(target, options.sampling, K);
          } else {
            std::vector<std::unique_ptr<DraftSource>> each;
            for (std::size_t i = 0; i < batch_size; ++i) each.push_back(make());
            drafts = std::make_unique<PerSequenceDrafts>(std::move(each));
          }
          GenerationStats stats;
          const auto batched = speculative_generate_batch(target, *drafts, prompts, with_chain(options, {K, false}),
                                                          &stats);
          const std::string what = "seed " + std::to_string(seed) + ", batch " + std::to_string(batch_size) +
                                   ", source " + std::to_string(source) + ", K " + std::to_string(K);
          ASSERT_EQ(batched.size(), batch_size) << what;
          std::int64_t drafted = 0;
          for (std::size_t i = 0; i < batch_size; ++i) {
            EXPECT_EQ(batched[i], generate(target, prompts[i], options)) << what << ", sequence " << i;
            drafted += stats.per_sequence[i].drafted;
          }
          if (source != 1) {  // lookup may find nothing
            EXPECT_GT(drafted, 0) << what;
          }
          if (source == 3 || source == 5) {  // a perfect draft is always accepted
            for (const auto& s : stats.per_sequence) EXPECT_EQ(s.accepted, s.drafted) << what;
          }
        }
      }
    }
  }
}

TEST(SpeculativeBatch, SamplingEqualsSoloSpeculativeSampling) {
  const Model target(ModelWeights::random(testing_configs::hybrid(), 31));
  const Model draft_model(ModelWeights::random(testing_configs::hybrid({"conv", "full_attention"}, 16), 32));
  std::mt19937_64 rng(31);
  std::vector<Tokens> prompts{random_tokens(rng, 4), random_tokens(rng, 9), random_tokens(rng, 1)};
  GenerationOptions options;
  options.max_new_tokens = 24;
  options.stop_at_eos = false;
  options.sampling.temperature = 0.8f;
  options.sampling.top_k = 40;
  options.sampling.seed = 77;
  for (const bool adaptive : {false, true}) {
    for (const bool batched_draft : {false, true}) {
      std::unique_ptr<BatchDraftSource> drafts;
      if (batched_draft) {
        drafts = std::make_unique<BatchedModelDraft>(draft_model, options.sampling, 4);
      } else {
        std::vector<std::unique_ptr<DraftSource>> each;
        for (std::size_t i = 0; i < prompts.size(); ++i) {
          SamplingParams own = options.sampling;
          own.seed += i;
          each.push_back(std::make_unique<ModelDraft>(draft_model, own, 4));
        }
        drafts = std::make_unique<PerSequenceDrafts>(std::move(each));
      }
      const auto batched = speculative_generate_batch(target, *drafts, prompts, with_chain(options, {4, adaptive}));
      for (std::size_t i = 0; i < prompts.size(); ++i) {
        GenerationOptions alone = options;
        alone.sampling.seed += i;
        ModelDraft alone_draft(draft_model, alone.sampling, 4);
        EXPECT_EQ(batched[i], speculative_generate(target, alone_draft, prompts[i], with_chain(alone, {4, adaptive})))
            << "sequence " << i << (adaptive ? ", adaptive K" : "") << (batched_draft ? ", batched draft" : "");
      }
    }
  }
  // Continuous batching: two sequences at once; they finish at different
  // rounds (different acceptance), and the next prompt joins mid-run.
  {
    GenerationOptions joined = options;
    joined.max_batch = 2;
    std::vector<Tokens> five = prompts;
    five.push_back(random_tokens(rng, 6));
    five.push_back(random_tokens(rng, 2));
    BatchedModelDraft drafts(draft_model, joined.sampling, 3);
    const auto out = speculative_generate_batch(target, drafts, five, with_chain(joined, {3, true}));
    for (std::size_t i = 0; i < five.size(); ++i) {
      GenerationOptions alone = joined;
      alone.sampling.seed += i;
      alone.max_batch = 0;
      ModelDraft alone_draft(draft_model, alone.sampling, 3);
      EXPECT_EQ(out[i], speculative_generate(target, alone_draft, five[i], with_chain(alone, {3, true})))
          << "joined sequence " << i;
    }
    joined.max_batch = -1;
    EXPECT_THROW(speculative_generate_batch(target, drafts, five, with_chain(joined, {3, true})), InvalidArgument);
  }
  std::vector<std::unique_ptr<DraftSource>> one;
  one.push_back(std::make_unique<LookupDraft>(2));
  PerSequenceDrafts too_few(std::move(one));
  EXPECT_THROW(speculative_generate_batch(target, too_few, prompts, with_chain(options, {4, false})), InvalidArgument);
}

// The rounds of B sequences are timed at the context asked, B = 1 first,
// each size once; bad arguments are refused before anything runs.
TEST(BatchRoundCosts, RowsPerBatchSizeAndRefusals) {
  const Model model(ModelWeights::random(testing_configs::hybrid(), 43));
  const auto rows = measure_batch_round_costs(model, {4, 2, 4}, 1, 2);  // context 1: no prefill at all
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].batch, 1);
  EXPECT_EQ(rows[1].batch, 4);
  EXPECT_EQ(rows[2].batch, 2);
  EXPECT_EQ(rows[0].gain, 1.0);
  for (const auto& r : rows) {
    EXPECT_GT(r.microseconds, 0.0);
    EXPECT_DOUBLE_EQ(r.per_token, r.microseconds / static_cast<double>(r.batch));
    EXPECT_DOUBLE_EQ(r.gain, static_cast<double>(r.batch) * rows[0].microseconds / r.microseconds);
  }
  EXPECT_EQ(measure_batch_round_costs(model, {}, 5, 1).size(), 1u);
  EXPECT_THROW(measure_batch_round_costs(model, {0}, 5, 1), InvalidArgument);
  EXPECT_THROW(measure_batch_round_costs(model, {4097}, 5, 1), InvalidArgument);
  EXPECT_THROW(measure_batch_round_costs(model, {2}, 0, 1), InvalidArgument);
  EXPECT_THROW(measure_batch_round_costs(model, {2}, 5, 0), InvalidArgument);
}

// rewind bench --batch: batch rows decode B prompts together (the prompt
// set repeated), each checked against greedy decoding of its prompt alone.
TEST(DecodeBenchBatch, BatchRowsAreMeasuredAndCheckedAgainstGreedy) {
  const Model target(ModelWeights::random(testing_configs::hybrid(), 41));
  const Model draft(ModelWeights::random(testing_configs::hybrid({"conv", "full_attention"}, 16), 42));
  DecodeBenchOptions options;
  options.prompts = {"in the beginning", "and God said"};
  options.ks = {2};
  options.max_new_tokens = 12;
  options.repeats = 1;
  options.batch_sizes = {1, 3};
  const auto rows = run_decode_bench(target, &draft, options);
  std::vector<std::string> methods;
  for (const auto& r : rows) {
    methods.push_back(r.method + "/" + std::to_string(r.batch));
    EXPECT_TRUE(r.identical) << r.method << " batch " << r.batch;
    EXPECT_GT(r.tokens_per_second, 0.0) << r.method;
    EXPECT_GT(r.decode_tokens_per_second, 0.0) << r.method << ": 12 tokens each, 11 after the first";
    if (r.batch > 1 || r.method.find("_batch") != std::string::npos) {
      EXPECT_LT(r.cache_share, 0.0) << "batch rows do not time cache calls";
    }
  }
  EXPECT_EQ(methods, (std::vector<std::string>{"greedy/1", "draft/1", "lookup/1", "greedy_batch/1", "draft_batch/1",
                                               "lookup_batch/1", "greedy_batch/3", "draft_batch/3", "lookup_batch/3"}));
  // Tree rows come with tree_width >= 2, each checked against greedy.
  options.batch_sizes = {};
  options.tree_width = 2;
  options.tree_nodes = 6;
  methods.clear();
  for (const auto& r : run_decode_bench(target, &draft, options)) {
    methods.push_back(r.method);
    EXPECT_TRUE(r.identical) << r.method;
  }
  EXPECT_EQ(methods, (std::vector<std::string>{"greedy", "draft", "lookup", "draft_tree", "lookup_tree"}));
  options.tree_width = 0;
  EXPECT_EQ(rows.front().decode_speedup, 1.0);  // greedy against itself
  EXPECT_NE(decode_bench_json(rows).find("\"batch\": 3"), std::string::npos);
  EXPECT_NE(decode_bench_json(rows).find("\"decode_tokens_per_second\""), std::string::npos);
  options.batch_sizes = {0};
  EXPECT_THROW(run_decode_bench(target, &draft, options), InvalidArgument);
}

// GenerationStats::max_batch is the bound admission applied (the
// prompts' number for 0 or a larger max_batch) and peak_batch the most
// sequences one forward held, for plain and speculative batches alike; both
// are in to_json. decode_seconds, when set, replaces the time after the last
// first token in decode_tokens_per_second.
TEST(GenerateBatch, StatsReportTheBatchBoundAndTheLargestBatch) {
  const Model model(ModelWeights::random(testing_configs::hybrid(), 12));
  std::mt19937_64 rng(12);
  const std::vector<Tokens> prompts = bos_prompts(model, rng, {3u, 1u, 4u, 2u, 6u});
  struct Case {
    std::int64_t max_batch, bound, peak;
  };
  for (const Case c : {Case{0, 5, 5}, Case{2, 2, 2}, Case{9, 5, 5}, Case{1, 1, 1}}) {
    GenerationOptions options;
    options.max_new_tokens = 4;
    options.stop_at_eos = false;
    options.max_batch = c.max_batch;
    GenerationStats plain, spec;
    generate_batch(model, prompts, options, &plain);
    std::vector<std::unique_ptr<DraftSource>> each;
    for (std::size_t i = 0; i < prompts.size(); ++i) each.push_back(std::make_unique<LookupDraft>(2));
    PerSequenceDrafts drafts(std::move(each));
    speculative_generate_batch(model, drafts, prompts, with_chain(options, {3, false}), &spec);
    for (const GenerationStats* s : {&plain, &spec}) {
      EXPECT_EQ(s->max_batch, c.bound) << "max_batch " << c.max_batch;
      EXPECT_EQ(s->peak_batch, c.peak) << "max_batch " << c.max_batch;
      const std::string json = s->to_json();
      EXPECT_NE(json.find("\"max_batch\":" + std::to_string(c.bound) + ","), std::string::npos) << json;
      EXPECT_NE(json.find("\"peak_batch\":" + std::to_string(c.peak) + ","), std::string::npos) << json;
    }
  }
  GenerationOptions none;
  none.max_new_tokens = 0;  // nothing decodes: no forward held a sequence
  GenerationStats idle;
  generate_batch(model, prompts, none, &idle);
  EXPECT_EQ(idle.peak_batch, 0);

  GenerationStats joined;
  joined.seconds = 10.0;
  GenerationStats a, b;
  a.new_tokens = 5;
  a.time_to_first_token = 1.0;
  b.new_tokens = 3;
  b.time_to_first_token = 6.0;
  joined.per_sequence = {a, b};
  EXPECT_DOUBLE_EQ(joined.decode_tokens_per_second(), 6.0 / 4.0);  // (4 + 2) tokens after 6 s
  joined.decode_seconds = 3.0;
  EXPECT_DOUBLE_EQ(joined.decode_tokens_per_second(), 6.0 / 3.0);
  // sum_per_sequence: the counts summed, the draft's cache time included,
  // the last first token's time, forwards and seconds left as set.
  a.prompt_tokens = 2;
  a.cache_seconds = 0.25;
  a.drafted_at = {3, 1};
  a.accepted_at = {2, 0};
  b.prompt_tokens = 7;
  b.cache_seconds = 0.5;
  b.drafted_at = {4};
  b.accepted_at = {4};
  b.peak_cache_bytes = 100;
  joined.per_sequence = {a, b};
  joined.forwards = 9;
  joined.draft_cache_seconds = 1.0;
  joined.sum_per_sequence();
  EXPECT_EQ(joined.new_tokens, 8);
  EXPECT_EQ(joined.prompt_tokens, 9);
  EXPECT_DOUBLE_EQ(joined.cache_seconds, 1.75);
  EXPECT_DOUBLE_EQ(joined.time_to_first_token, 6.0);
  EXPECT_EQ(joined.drafted_at, (std::vector<std::int64_t>{7, 1}));
  EXPECT_EQ(joined.accepted_at, (std::vector<std::int64_t>{6, 0}));
  EXPECT_EQ(joined.peak_cache_bytes, 100u);
  EXPECT_EQ(joined.forwards, 9);
  EXPECT_DOUBLE_EQ(joined.seconds, 10.0);
}

}  // namespace
}  // namespace rwd::runtime
