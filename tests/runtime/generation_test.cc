// The reference decoder and speculative decoding: batch invariance of the
// forward, losslessness of speculative decoding for every draft source, the
// distribution of speculative sampling (the CLI is tested in cli_test.cc).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "generation_options.h"
#include "rewind/error.h"
#include "runtime/generate.h"
#include "runtime/kernels.h"
#include "runtime/model.h"
#include "test_configs.h"

namespace rwd::runtime {
namespace {

using testing_configs::hybrid;
using testing_configs::kEveryKind;

Model random_model(const ModelConfig& c, std::uint64_t seed) { return Model(ModelWeights::random(c, seed)); }

std::vector<std::int32_t> prompt_tokens(const Model& m, const std::string& text) {
  return encode_prompt(text, m.config());
}

GenerationOptions greedy_options(std::int64_t n) {
  GenerationOptions o;
  o.max_new_tokens = n;
  o.stop_at_eos = false;
  return o;
}

// ---- batch invariance --------------------------------------------------------------

TEST(ModelForward, MultiTokenLogitsEqualSingleTokenLogitsBitwise) {
  for (std::uint64_t seed : {1u, 2u, 3u}) {
    const Model m = random_model(hybrid(kEveryKind), seed);
    const std::vector<std::int32_t> tokens = prompt_tokens(m, "And God said, Let there be light");
    const auto V = static_cast<std::size_t>(m.vocab_size());
    Cache all = m.make_cache();
    std::vector<float> batched;
    m.forward(tokens, all, batched, true);
    ASSERT_EQ(batched.size(), tokens.size() * V);
    Cache one = m.make_cache();
    std::vector<float> single;
    for (std::size_t t = 0; t < tokens.size(); ++t) {
      m.forward(std::span<const std::int32_t>(&tokens[t], 1), one, single, true);
      ASSERT_EQ(0, std::memcmp(single.data(), batched.data() + t * V, V * sizeof(float)))
          << "seed " << seed << ", token " << t << " (window 5: eviction happens from token 5 on)";
    }
    // Uneven chunks (3, 1, rest) give the same bits too.
    Cache chunks = m.make_cache();
    std::vector<float> part, joined;
    std::span<const std::int32_t> all_tokens(tokens);
    for (auto [from, count] : {std::pair<std::size_t, std::size_t>{0, 3}, {3, 1}, {4, tokens.size() - 4}}) {
      m.forward(all_tokens.subspan(from, count), chunks, part, true);
      joined.insert(joined.end(), part.begin(), part.end());
    }
    EXPECT_EQ(0, std::memcmp(joined.data(), batched.data(), batched.size() * sizeof(float)));
  }
}

TEST(ModelForward, RejectsBadTokensWithoutTouchingTheCache) {
  const Model m = random_model(hybrid(kEveryKind), 1);
  Cache cache = m.make_cache();
  std::vector<float> logits;
  const std::vector<std::int32_t> bad = {256, 12, 258};
  EXPECT_THROW(m.forward(bad, cache, logits), InvalidArgument);
  EXPECT_EQ(cache.get_seq_length(), 0);
  EXPECT_THROW(m.forward(std::span<const std::int32_t>(), cache, logits), InvalidArgument);
}

TEST(ModelForward, LastRowOnlyEqualsTheLastRowOfAllLogits) {
  const Model m = random_model(hybrid(kEveryKind), 4);
  const std::vector<std::int32_t> tokens = prompt_tokens(m, "abcdefgh");
  Cache a = m.make_cache(), b = m.make_cache();
  std::vector<float> all, last;
  m.forward(tokens, a, all, true);
  m.forward(tokens, b, last, false);
  const auto V = static_cast<std::size_t>(m.vocab_size());
  ASSERT_EQ(last.size(), V);
  EXPECT_EQ(0, std::memcmp(last.data(), all.data() + (tokens.size() - 1) * V, V * sizeof(float)));
}

// ---- lossless speculative decoding -------------------------------------------------------

struct Case {
  std::string name;
  std::vector<std::string> types;
  std::uint64_t seed;
};

class Lossless : public ::testing::TestWithParam<Case> {};

TEST_P(Lossless, EveryDraftSourceReproducesGreedyTokenForToken) {
  const Case& c = GetParam();
  const Model target = random_model(hybrid(c.types), c.seed);
  const Model small = random_model(hybrid({"conv", "sliding_attention"}, 16, 4), c.seed + 100);
  // A prompt with repeats so that prompt lookup finds matches.
  const std::vector<std::int32_t> prompt = prompt_tokens(target, "the lord is my shepherd; the lord is my");
  const GenerationOptions options = greedy_options(60);
  const std::vector<std::int32_t> greedy = generate(target, prompt, options);
  ASSERT_EQ(greedy.size(), 60u);

  for (std::int64_t K : {1, 3, 6}) {
    ModelDraft perfect(target, {}, K);
    RandomDraft adversarial(target.vocab_size(), c.seed * 31 + static_cast<std::uint64_t>(K));
    ModelDraft small_draft(small, {}, K);
    LookupDraft lookup(3);
    struct Source {
      const char* name;
      DraftSource* source;
    };
    for (Source s : {Source{"perfect", &perfect}, Source{"adversarial", &adversarial},
                     Source{"small model", &small_draft}, Source{"prompt lookup", &lookup}}) {
      for (bool adaptive : {false, true}) {
        GenerationStats stats;
        const std::vector<std::int32_t> spec = speculative_generate(target, *s.source, prompt,
                                                                    with_chain(options, {K, adaptive}), &stats);
        EXPECT_EQ(spec, greedy) << s.name << ", K=" << K << (adaptive ? ", adaptive" : "");
        EXPECT_EQ(stats.new_tokens, 60);
        if (std::string(s.name) == "perfect") {
          EXPECT_EQ(stats.accepted, stats.drafted) << "the target drafting for itself is always right";
          EXPECT_EQ(stats.rollbacks, 0) << "every round ends with crop(0)";
          EXPECT_GT(stats.drafted, 0);
        }
        if (std::string(s.name) == "adversarial") {
          EXPECT_GT(stats.rollbacks, stats.rounds / 2) << "random drafts are rejected most rounds";
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    RandomHybrids, Lossless,
    ::testing::Values(
        Case{"every_kind", kEveryKind, 1},
        Case{"attention_first", {"full_attention", "linear_attention", "sliding_attention", "conv"}, 2},
        Case{"two_linear", {"linear_attention", "conv", "linear_attention", "sliding_attention", "full_attention"}, 3}),
    [](const ::testing::TestParamInfo<Case>& param_info) { return param_info.param.name; });

TEST(Speculative, RejectsBadDraftLength) {
  const Model m = random_model(hybrid(kEveryKind), 1);
  LookupDraft lookup(2);
  const auto prompt = prompt_tokens(m, "x");
  EXPECT_THROW(speculative_generate(m, lookup, prompt, with_chain(greedy_options(4), {0, false})), InvalidArgument);
  EXPECT_THROW(speculative_generate(m, lookup, prompt, with_chain(greedy_options(4), {65, false})), InvalidArgument);
}

// GenerationOptions is the one options type: the draft length and the tree
// shape are its members, checked by validate() for every entry point (a
// plain generate() refuses a bad speculation.num_draft as well), and the
// forms taking them apart give the same tokens.
TEST(Speculative, OptionsCarryTheDraftLengthAndTreeShape) {
  const Model m = random_model(hybrid(kEveryKind), 1);
  const auto prompt = prompt_tokens(m, "abcabcab");
  GenerationOptions o = greedy_options(9);
  o.speculation = {3, true};
  o.tree = {2, 8, 3};
  EXPECT_NO_THROW(validate(o));
  LookupDraft a(2), b(2);
  GenerationStats sa, sb;
  EXPECT_EQ(speculative_generate(m, a, prompt, o, &sa),
            speculative_generate(m, b, prompt, with_chain(greedy_options(9), {3, true}), &sb));
  EXPECT_EQ(sa.drafted, sb.drafted);
  EXPECT_EQ(sa.accepted_at, sb.accepted_at);
  LookupTreeDraft ta(2), tb(2);
  EXPECT_EQ(tree_speculative_generate(m, ta, prompt, o),
            tree_speculative_generate(m, tb, prompt, with_tree(greedy_options(9), {2, 8, 3})));
  EXPECT_EQ(tree_speculative_generate(m, ta, prompt, o), generate(m, prompt, o));
  GenerationOptions bad = greedy_options(4);
  bad.speculation.num_draft = 0;
  EXPECT_THROW(validate(bad), InvalidArgument);
  EXPECT_THROW(generate(m, prompt, bad), InvalidArgument);
  bad = greedy_options(4);
  bad.tree.width = 1;
  EXPECT_THROW(generate(m, prompt, bad), InvalidArgument);
  bad = greedy_options(4);
  bad.max_batch = -1;
  EXPECT_THROW(generate(m, prompt, bad), InvalidArgument);
}

TEST(Speculative, StopsAtEosAndBudgetLikeGreedy) {
  const Model m = random_model(hybrid(kEveryKind), 9);
  const auto prompt = prompt_tokens(m, "abc");
  for (std::int64_t budget : {0, 1, 2, 7}) {
    GenerationOptions o = greedy_options(budget);
    o.stop_at_eos = true;
    ModelDraft perfect(m, {}, 4);
    EXPECT_EQ(speculative_generate(m, perfect, prompt, with_chain(o, {4, false})), generate(m, prompt, o)) << budget;
  }
}

TEST(PromptLookup, ProposesWhatFollowedTheLatestMatch) {
  LookupDraft lookup(2);
  const std::vector<std::int32_t> s = {1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3};
  // Last bigram (2, 3) occurred at 5..6 (followed by 5, 6) and 1..2.
  EXPECT_EQ(lookup.propose(s, 2, nullptr), (std::vector<std::int32_t>{5, 6}));
  EXPECT_EQ(lookup.propose(s, 5, nullptr), (std::vector<std::int32_t>{5, 6, 2, 3}));
  const std::vector<std::int32_t> none = {1, 2, 3};
  EXPECT_TRUE(lookup.propose(none, 3, nullptr).empty());
}

// ---- acceptance per draft position -------------------------------------------------

// Wraps a draft source and counts, from what it proposed and what accept()
// reports each round, how many tokens were drafted and accepted at each
// position of a round: a count independent of GenerationStats'.
class CountingDraft : public DraftSource {
 public:
  explicit CountingDraft(DraftSource& inner) : inner_(inner) {}
  void begin(std::span<const std::int32_t> prompt) override { inner_.begin(prompt); }
  std::vector<std::int32_t> propose(std::span<const std::int32_t> sequence, std::int64_t k,
                                    std::vector<std::vector<float>>* probs) override {
    return inner_.propose(sequence, k, probs);
  }
  void accept(std::int64_t proposed, std::int64_t accepted) override {
    for (std::int64_t i = 0; i < proposed; ++i) {
      if (static_cast<std::int64_t>(drafted_at.size()) <= i) {
        drafted_at.push_back(0);
        accepted_at.push_back(0);
      }
      ++drafted_at[static_cast<std::size_t>(i)];
      if (i < accepted) ++accepted_at[static_cast<std::size_t>(i)];
    }
    inner_.accept(proposed, accepted);
  }
  std::vector<std::int64_t> drafted_at, accepted_at;

 private:
  DraftSource& inner_;
};

// Drafts the known greedy continuation `script` (the tokens after the
// prompt), with the token at draft position `wrong_at` of every round
// replaced by another one: each round that drafts more than `wrong_at`
// tokens has exactly `wrong_at` accepted.
class ScriptedDraft : public DraftSource {
 public:
  ScriptedDraft(std::vector<std::int32_t> script, std::size_t prompt_size, std::int64_t wrong_at)
      : script_(std::move(script)), prompt_size_(prompt_size), wrong_at_(wrong_at) {}
  void begin(std::span<const std::int32_t>) override {}
  std::vector<std::int32_t> propose(std::span<const std::int32_t> sequence, std::int64_t k,
                                    std::vector<std::vector<float>>*) override {
    std::vector<std::int32_t> out;
    const std::size_t from = sequence.size() - prompt_size_;  // script tokens already emitted
    for (std::int64_t i = 0; i < k && from + static_cast<std::size_t>(i) < script_.size(); ++i) {
      const std::int32_t t = script_[from + static_cast<std::size_t>(i)];
      out.push_back(i == wrong_at_ ? (t + 1) % 256 : t);
    }
    return out;
  }
  void accept(std::int64_t, std::int64_t) override {}

 private:
  std::vector<std::int32_t> script_;
  std::size_t prompt_size_;
  std::int64_t wrong_at_;
};

std::int64_t sum(const std::vector<std::int64_t>& v) { return std::accumulate(v.begin(), v.end(), std::int64_t{0}); }

// The invariants of the per-position counts of one run.
void expect_consistent(const GenerationStats& stats, std::int64_t K, const std::string& what) {
  ASSERT_EQ(stats.drafted_at.size(), stats.accepted_at.size()) << what;
  EXPECT_LE(static_cast<std::int64_t>(stats.drafted_at.size()), K) << what;
  EXPECT_EQ(sum(stats.drafted_at), stats.drafted) << what;
  EXPECT_EQ(sum(stats.accepted_at), stats.accepted) << what;
  for (std::size_t i = 0; i < stats.drafted_at.size(); ++i) {
    EXPECT_LE(stats.accepted_at[i], stats.drafted_at[i]) << what << ", position " << i;
    EXPECT_LE(stats.drafted_at[i], stats.rounds) << what << ", position " << i;
    if (i > 0) {
      // A round accepts a prefix of its drafts and drafts a prefix of K.
      EXPECT_LE(stats.accepted_at[i], stats.accepted_at[i - 1]) << what << ", position " << i;
      EXPECT_LE(stats.drafted_at[i], stats.drafted_at[i - 1]) << what << ", position " << i;
    }
  }
}

// The statistics of greedy speculative decoding of `new_tokens` tokens at
// draft length K with the target as its own draft (every draft accepted).
GenerationStats perfect_draft_stats(const Model& m, const std::vector<std::int32_t>& prompt, std::int64_t K,
                                    std::int64_t new_tokens) {
  ModelDraft perfect(m, {}, K);
  GenerationStats stats;
  speculative_generate(m, perfect, prompt, with_chain(greedy_options(new_tokens), {K, false}), &stats);
  return stats;
}

TEST(AcceptanceByPosition, PerfectDraftAcceptsEveryPosition) {
  const Model m = random_model(hybrid(kEveryKind), 5);
  const auto prompt = prompt_tokens(m, "in the beginning");
  // K = 4, 62 tokens: 12 rounds emit 5 tokens each (60), then the budget
  // leaves room for one draft (a round emits its drafts + 1).
  const GenerationStats stats = perfect_draft_stats(m, prompt, 4, 62);
  EXPECT_EQ(stats.rounds, 13);
  EXPECT_EQ(stats.drafted_at, (std::vector<std::int64_t>{13, 12, 12, 12}));
  EXPECT_EQ(stats.accepted_at, stats.drafted_at);
  for (std::size_t i = 0; i < 4; ++i) EXPECT_EQ(stats.acceptance_at(i), 1.0) << i;
  EXPECT_EQ(stats.acceptance_at(4), 0.0) << "no position 4";
  expect_consistent(stats, 4, "perfect");
  // Plain decoding counts nothing per position.
  GenerationStats plain;
  generate(m, prompt, greedy_options(10), &plain);
  EXPECT_TRUE(plain.drafted_at.empty() && plain.accepted_at.empty());
}

TEST(AcceptanceByPosition, ScriptedMistakeStopsEveryRoundThere) {
  const Model m = random_model(hybrid(kEveryKind), 6);
  const auto prompt = prompt_tokens(m, "and god said");
  const GenerationOptions options = greedy_options(30);
  const std::vector<std::int32_t> greedy = generate(m, prompt, options);
  // Draft position 2 is always wrong: rounds of K = 4 accept 2 tokens and
  // emit 3. After 9 rounds (27 tokens) the budget of 3 leaves room for 2
  // drafts, both right: 10 rounds.
  ScriptedDraft scripted(greedy, prompt.size(), 2);
  CountingDraft counted(scripted);
  GenerationStats stats;
  EXPECT_EQ(speculative_generate(m, counted, prompt, with_chain(options, {4, false}), &stats), greedy);
  EXPECT_EQ(stats.rounds, 10);
  EXPECT_EQ(stats.drafted_at, (std::vector<std::int64_t>{10, 10, 9, 9}));
  EXPECT_EQ(stats.accepted_at, (std::vector<std::int64_t>{10, 10, 0, 0}));
  EXPECT_EQ(stats.drafted_at, counted.drafted_at);
  EXPECT_EQ(stats.accepted_at, counted.accepted_at);
  EXPECT_DOUBLE_EQ(stats.acceptance_at(1), 1.0);
  EXPECT_DOUBLE_EQ(stats.acceptance_at(2), 0.0);
  expect_consistent(stats, 4, "scripted");
  // The same counts per sequence when it decodes in a batch beside another
  // prompt.
  std::vector<std::unique_ptr<DraftSource>> sources;
  sources.push_back(std::make_unique<ScriptedDraft>(greedy, prompt.size(), 2));
  const auto other = prompt_tokens(m, "x");
  sources.push_back(std::make_unique<ScriptedDraft>(generate(m, other, options), other.size(), 1));
  PerSequenceDrafts drafts(std::move(sources));
  GenerationStats batch;
  const std::vector<std::vector<std::int32_t>> prompts = {prompt, other};
  speculative_generate_batch(m, drafts, prompts, with_chain(options, {4, false}), &batch);
  EXPECT_EQ(batch.per_sequence[0].drafted_at, stats.drafted_at);
  EXPECT_EQ(batch.per_sequence[0].accepted_at, stats.accepted_at);
  // Position 1 always wrong: rounds accept 1 token and emit 2. 13 rounds of
  // K = 4 (26 tokens), one of 3 drafts (the budget of 4 leaves room for 3),
  // then one of 1 draft, right: 15 rounds.
  EXPECT_EQ(batch.per_sequence[1].drafted_at, (std::vector<std::int64_t>{15, 14, 14, 13}));
  EXPECT_EQ(batch.per_sequence[1].accepted_at, (std::vector<std::int64_t>{15, 0, 0, 0}));
  // One serializer: each per_sequence entry is that sequence's own JSON line,
  // with the keys (and drafted_at) of a single call's.
  const nlohmann::json single = nlohmann::json::parse(stats.to_json());
  const nlohmann::json batched = nlohmann::json::parse(batch.to_json());
  ASSERT_EQ(batched.at("per_sequence").size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    const nlohmann::json& entry = batched.at("per_sequence")[i];
    EXPECT_EQ(entry, nlohmann::json::parse(batch.per_sequence[i].to_json())) << i;
    std::vector<std::string> keys, want;
    for (const auto& [key, value] : entry.items()) keys.push_back(key);
    for (const auto& [key, value] : single.items()) want.push_back(key);
    EXPECT_EQ(keys, want) << i;
  }
  EXPECT_EQ(batched.at("per_sequence")[0].at("drafted_at"), single.at("drafted_at"));
  // The batch's own line has every key of a single call's, over the batch:
  // sums of the two sequences' counts (computed here from the figures above).
  for (const auto& [key, value] : single.items()) EXPECT_TRUE(batched.contains(key)) << key;
  EXPECT_TRUE(batch.batched());
  EXPECT_FALSE(stats.batched());
  EXPECT_EQ(batch.drafted, batch.per_sequence[0].drafted + batch.per_sequence[1].drafted);
  EXPECT_EQ(batch.new_tokens, batch.per_sequence[0].new_tokens + batch.per_sequence[1].new_tokens);
  EXPECT_EQ(batch.accepted_at, (std::vector<std::int64_t>{10 + 15, 10 + 0, 0 + 0, 0 + 0}));
  EXPECT_EQ(batch.drafted_at, (std::vector<std::int64_t>{10 + 15, 10 + 14, 9 + 14, 9 + 13}));
  EXPECT_EQ(batched.at("drafted_at"), nlohmann::json(batch.drafted_at));
  EXPECT_EQ(batched.at("sequences"), 2);
}

TEST(AcceptanceByPosition, CountsMatchAnIndependentCountForEverySource) {
  const Model target = random_model(hybrid(kEveryKind), 7);
  const Model small = random_model(hybrid({"conv", "sliding_attention"}, 16, 4), 8);
  const auto prompt = prompt_tokens(target, "the lord is my shepherd; the lord is my");
  int partial = 0;  // runs whose acceptance by position is neither all nor nothing
  for (std::int64_t K : {1, 3, 5}) {
    for (bool adaptive : {false, true}) {
      for (bool sampled : {false, true}) {
        GenerationOptions options = greedy_options(50);
        if (sampled) {
          options.sampling.temperature = 0.9f;
          options.sampling.seed = 3;
        }
        // Another model (mostly rejected), the target itself (always
        // accepted when greedy, often when sampled), prompt lookup (partial,
        // sometimes fewer than K drafts), random tokens.
        ModelDraft model_draft(small, options.sampling, K);
        ModelDraft self_draft(target, options.sampling, K);
        LookupDraft lookup(2);
        RandomDraft random(target.vocab_size(), 11);
        for (DraftSource* source : {static_cast<DraftSource*>(&model_draft), static_cast<DraftSource*>(&self_draft),
                                    static_cast<DraftSource*>(&lookup), static_cast<DraftSource*>(&random)}) {
          CountingDraft counted(*source);
          GenerationStats stats;
          speculative_generate(target, counted, prompt, with_chain(options, {K, adaptive}), &stats);
          const std::string what = "K=" + std::to_string(K) + (adaptive ? " adaptive" : "") +
                                   (sampled ? " sampled" : " greedy");
          EXPECT_EQ(stats.drafted_at, counted.drafted_at) << what;
          EXPECT_EQ(stats.accepted_at, counted.accepted_at) << what;
          expect_consistent(stats, K, what);
          EXPECT_GT(stats.drafted, 0) << what;
          if (!stats.accepted_at.empty() && stats.accepted_at.front() > 0 &&
              stats.accepted_at.back() < stats.drafted_at.back())
            ++partial;
        }
      }
    }
  }
  EXPECT_GT(partial, 4) << "the sources must exercise partial acceptance";
}

TEST(AcceptanceByPosition, InTheStatsJsonAndEmptyForTrees) {
  const Model m = random_model(hybrid(kEveryKind), 9);
  const auto prompt = prompt_tokens(m, "abc abc ab");
  const GenerationStats stats = perfect_draft_stats(m, prompt, 2, 9);
  // 3 rounds of 2 drafts + 1 (9 tokens).
  const nlohmann::json j = nlohmann::json::parse(stats.to_json());
  EXPECT_EQ(j.at("drafted_at"), nlohmann::json::parse("[3, 3]"));
  EXPECT_EQ(j.at("accepted_at"), nlohmann::json::parse("[3, 3]"));
  EXPECT_EQ(j.at("acceptance_at"), nlohmann::json::parse("[1.0, 1.0]"));
  LookupTreeDraft tree(2);
  GenerationStats tree_stats;
  tree_speculative_generate(m, tree, prompt, with_tree(greedy_options(9), {2, 8, 2}), &tree_stats);
  EXPECT_TRUE(tree_stats.drafted_at.empty() && tree_stats.accepted_at.empty());
  EXPECT_EQ(nlohmann::json::parse(tree_stats.to_json()).at("acceptance_at"), nlohmann::json::array());
}

// ---- sampling ------------------------------------------------------------------------

TEST(Sampling, DistributionAppliesTemperatureTopKAndTopP) {
  const std::vector<float> logits = {1.0f, 3.0f, 2.0f, 0.0f};
  SamplingParams p;
  p.temperature = 1.0f;
  std::vector<float> d = sampling_distribution(logits, p);
  double z = std::exp(1.0) + std::exp(3.0) + std::exp(2.0) + 1.0;
  EXPECT_NEAR(d[1], std::exp(3.0) / z, 1e-6);
  p.top_k = 2;
  d = sampling_distribution(logits, p);
  EXPECT_EQ(d[0], 0.0f);
  EXPECT_EQ(d[3], 0.0f);
  EXPECT_NEAR(d[1], std::exp(3.0) / (std::exp(3.0) + std::exp(2.0)), 1e-6);
  p.top_k = 0;
  p.top_p = 0.5f;  // the top token alone has mass 0.66 >= 0.5
  d = sampling_distribution(logits, p);
  EXPECT_EQ(d[1], 1.0f);
  EXPECT_EQ(d[2], 0.0f);
  p.temperature = -1.0f;
  EXPECT_THROW(validate(p), InvalidArgument);
  // An infinite temperature would silently sample uniformly; NaN is no number.
  for (float t : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    p.temperature = t;
    EXPECT_THROW(validate(p), InvalidArgument) << t;
  }
}

// Chi-square goodness of fit of `counts` (n draws) against `probs`; bins
// with expected count < 5 are pooled.
double chi_square(const std::map<std::int32_t, int>& counts, const std::vector<double>& probs, int n, int* dof) {
  double stat = 0.0, pooled_expected = 0.0, pooled_observed = 0.0;
  int bins = 0;
  for (std::size_t t = 0; t < probs.size(); ++t) {
    const double expected = probs[t] * n;
    const auto it = counts.find(static_cast<std::int32_t>(t));
    const double observed = it == counts.end() ? 0.0 : it->second;
    if (expected < 5.0) {
      pooled_expected += expected;
      pooled_observed += observed;
      continue;
    }
    stat += (observed - expected) * (observed - expected) / expected;
    ++bins;
  }
  if (pooled_expected > 0.0) {
    stat += (pooled_observed - pooled_expected) * (pooled_observed - pooled_expected) / std::max(pooled_expected, 1e-9);
    ++bins;
  }
  *dof = bins - 1;
  return stat;
}

// Upper 0.1 % point of chi-square with `dof` degrees of freedom
// (Wilson-Hilferty approximation, accurate to a few percent for dof >= 3).
double chi_square_critical(int dof) {
  const double z = 3.090;  // standard normal 0.999 quantile
  const double k = dof;
  const double a = 2.0 / (9.0 * k);
  return k * std::pow(1.0 - a + z * std::sqrt(a), 3.0);
}

// accept_drafts, the rule speculative decoding and the server share: greedy
// keeps the drafts the argmax agrees with and adds the argmax after them;
// sampling with a draft the target gives all its mass keeps it; too few
// rows of logits are refused.
TEST(Sampling, AcceptDraftsKeepsTheAgreeingPrefix) {
  const std::vector<float> logits = {0, 5, 1,   // after the pending token: 1
                                     0, 1, 7,   // after draft 1: 2
                                     9, 1, 0,   // after draft 2: 0, not the draft 1
                                     0, 0, 3};  // not reached
  const std::vector<std::int32_t> drafts = {1, 2, 1};
  std::mt19937_64 rng(1);
  std::int64_t accepted = -1;
  EXPECT_EQ(accept_drafts(logits, 3, drafts, {}, SamplingParams{}, rng, accepted),
            (std::vector<std::int32_t>{1, 2, 0}));
  EXPECT_EQ(accepted, 2);
  SamplingParams sampled;
  sampled.temperature = 1.0f;
  sampled.top_k = 1;  // p is one-hot on the argmax: the same tokens, drawn
  EXPECT_EQ(accept_drafts(logits, 3, drafts, {}, sampled, rng, accepted), (std::vector<std::int32_t>{1, 2, 0}));
  EXPECT_EQ(accepted, 2);
  EXPECT_THROW(accept_drafts(std::span(logits).first(9), 3, drafts, {}, SamplingParams{}, rng, accepted),
               InvalidArgument);
}

GenerationOptions two_sampled_tokens(const SamplingParams& params, std::uint64_t seed) {
  GenerationOptions o;
  o.max_new_tokens = 2;
  o.stop_at_eos = false;
  o.sampling = params;
  o.sampling.seed = seed;
  return o;
}

// The exact marginals of the first and second token sampled after prompt,
// from the target's logits alone.
std::pair<std::vector<double>, std::vector<double>> two_token_marginals(const Model& target,
                                                                        const std::vector<std::int32_t>& prompt,
                                                                        const SamplingParams& params) {
  std::vector<float> logits;
  Cache cache = target.make_cache();
  target.forward(prompt, cache, logits, false);
  const std::vector<float> p1 = sampling_distribution(logits, params);
  const auto V = p1.size();
  std::vector<double> first(V), second(V, 0.0);
  for (std::size_t t = 0; t < V; ++t) {
    first[t] = p1[t];
    if (p1[t] == 0.0f) continue;
    std::vector<std::int32_t> extended = prompt;
    extended.push_back(static_cast<std::int32_t>(t));
    Cache c2 = target.make_cache();
    target.forward(extended, c2, logits, false);
    const std::vector<float> p2 = sampling_distribution(logits, params);
    for (std::size_t u = 0; u < V; ++u) second[u] += static_cast<double>(p1[t]) * p2[u];
  }
  return {first, second};
}

// One two-token generation by source 0..3 or 5..7 (numbered as in
// SpeculativeSamplingPreservesTheTargetDistribution).
std::vector<std::int32_t> draw_two_tokens(int source, const Model& target, const Model& draft,
                                          const std::vector<std::int32_t>& prompt, const GenerationOptions& o) {
  if (source == 5 || source == 6) {
    ModelTreeDraft d(source == 5 ? draft : target);
    return tree_speculative_generate(target, d, prompt, with_tree(o, {3, 8, 2}));
  }
  if (source == 7) {
    LookupTreeDraft d(2);
    return tree_speculative_generate(target, d, prompt, with_tree(o, {3, 8, 2}));
  }
  if (source == 0) return generate(target, prompt, o);
  if (source == 1) {
    ModelDraft d(draft, o.sampling, 2);
    return speculative_generate(target, d, prompt, with_chain(o, {2, false}));
  }
  if (source == 2) {
    SamplingParams flatter = o.sampling;
    flatter.temperature = 3.0f;
    ModelDraft d(target, flatter, 2);
    return speculative_generate(target, d, prompt, with_chain(o, {2, false}));
  }
  LookupDraft d(2);
  return speculative_generate(target, d, prompt, with_chain(o, {2, false}));
}

// Counts the first and second tokens of `trials` generations by source.
void count_two_token_draws(int source, int trials, const Model& target, const Model& draft,
                           const std::vector<std::int32_t>& prompt, const SamplingParams& params,
                           std::map<std::int32_t, int>& c1, std::map<std::int32_t, int>& c2) {
  if (source == 4) {
    for (int i = 0; i < trials / 3; ++i) {
      const GenerationOptions o = two_sampled_tokens(params, 5000 + 3 * static_cast<std::uint64_t>(i));
      BatchedModelDraft d(draft, o.sampling, 2);
      const std::vector<std::vector<std::int32_t>> three(3, prompt);
      for (const auto& out : speculative_generate_batch(target, d, three, with_chain(o, {2, false}))) {
        ASSERT_EQ(out.size(), 2u);
        ++c1[out[0]];
        ++c2[out[1]];
      }
    }
    return;
  }
  for (int i = 0; i < trials; ++i) {
    const std::uint64_t seed = (source >= 5 ? 9000 : 1000) + static_cast<std::uint64_t>(i);
    const std::vector<std::int32_t> out = draw_two_tokens(source, target, draft, prompt,
                                                          two_sampled_tokens(params, seed));
    ASSERT_EQ(out.size(), 2u);
    ++c1[out[0]];
    ++c2[out[1]];
  }
}

TEST(Sampling, SpeculativeSamplingPreservesTheTargetDistribution) {
  // Exact marginals of the first two sampled tokens are computed from the
  // target's logits; speculative sampling with a different model as draft
  // (so drafts are often rejected) and with prompt lookup must match them.
  const Model target = random_model(hybrid(kEveryKind, 16), 21);
  const Model draft = random_model(hybrid({"conv", "full_attention"}, 16), 22);
  SamplingParams params;
  params.temperature = 1.5f;
  params.top_k = 6;
  const std::vector<std::int32_t> prompt = prompt_tokens(target, "ab ab a");
  const auto [first, second] = two_token_marginals(target, prompt, params);

  // Sources: 0 plain sampling; 1 a different model as draft (disjoint top-k:
  // mostly rejections); 2 the target itself drafting at a flatter
  // temperature (same support, q != p: exercises the min(1, p/q) test);
  // 3 prompt lookup (a deterministic draft, q one-hot).
  // 4: batched speculative sampling (speculative_generate_batch with the
  // batched draft model), 3 copies of the prompt per batch: sequence j of a
  // batch draws with seed + j, so the copies are independent samples.
  // 5, 6, 7: tree speculation (tree_speculative_generate) with the other
  // model as draft, with the target itself as draft (its likeliest tokens as
  // siblings: the rejection of one sibling must renormalise before the next),
  // and with prompt lookup as branches.
  const int trials = 1500;
  for (int source = 0; source < 8; ++source) {
    std::map<std::int32_t, int> c1, c2;
    ASSERT_NO_FATAL_FAILURE(count_two_token_draws(source, trials, target, draft, prompt, params, c1, c2));
    int dof1 = 0, dof2 = 0;
    const double x1 = chi_square(c1, first, trials, &dof1);
    const double x2 = chi_square(c2, second, trials, &dof2);
    EXPECT_LT(x1, chi_square_critical(dof1)) << "source " << source << ", first token, dof " << dof1;
    EXPECT_LT(x2, chi_square_critical(dof2)) << "source " << source << ", second token, dof " << dof2;
  }
}

}  // namespace
}  // namespace rwd::runtime
