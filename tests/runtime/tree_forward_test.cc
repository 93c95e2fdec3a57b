// Model::forward_tree: every node's logits equal its path's logits fed as a
// chain, bit for bit, on random hybrids with every layer kind the runtime
// supports and windows far below the lengths; committing a path leaves the
// cache as the chain would (the next forward and a crop agree bitwise).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "generation_options.h"
#include "rewind/error.h"
#include "runtime/generate.h"
#include "runtime/model.h"
#include "runtime/weights_io.h"
#include "test_configs.h"

namespace rwd::runtime {
namespace {

using testing_configs::hybrid;
using testing_configs::kEveryKind;

bool same_bits(const float* a, const float* b, std::size_t n) { return std::memcmp(a, b, n * sizeof(float)) == 0; }

TEST(TreeForward, EveryNodeEqualsItsPathAsAChainAndCommitEqualsTheChain) {
  for (int variant = 0; variant < 3; ++variant) {
    const std::vector<std::string> kinds = variant == 0 ? kEveryKind
                                           : variant == 1
                                               ? std::vector<std::string>{"sliding_attention", "linear_attention",
                                                                          "sliding_attention"}
                                               : std::vector<std::string>{"conv", "full_attention", "linear_attention",
                                                                          "conv"};
    const Model model(ModelWeights::random(hybrid(kinds, 32, 3 + variant), 70 + static_cast<std::uint64_t>(variant)));
    const std::int64_t V = model.vocab_size();
    std::mt19937_64 rng(9 + static_cast<std::uint64_t>(variant));
    std::vector<std::int32_t> prompt{256};
    for (int i = 0; i < 11; ++i) prompt.push_back(static_cast<std::int32_t>(rng() % 256));
    for (int round = 0; round < 4; ++round) {
      const std::int64_t n = 1 + static_cast<std::int64_t>(rng() % 10);
      std::vector<std::int64_t> parents{-1};
      std::vector<std::int32_t> tokens{static_cast<std::int32_t>(rng() % 256)};
      for (std::int64_t i = 1; i < n; ++i) {
        parents.push_back(static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(i)));
        tokens.push_back(static_cast<std::int32_t>(rng() % 256));
      }
      Cache cache = model.make_cache();
      cache.activate_past_recording(12);
      std::vector<float> logits;
      model.forward(prompt, cache, logits);
      TreeForward tree = cache.begin_tree(parents);
      std::vector<float> tree_logits;
      model.forward_tree(tokens, tree, cache, tree_logits);
      ASSERT_EQ(tree_logits.size(), static_cast<std::size_t>(n * V));
      for (std::int64_t node = 0; node < n; ++node) {
        Cache chain = model.make_cache();
        std::vector<std::int32_t> seq = prompt;
        for (std::int64_t p : tree.path(node)) seq.push_back(tokens[static_cast<std::size_t>(p)]);
        std::vector<float> chain_logits;
        model.forward(seq, chain, chain_logits, /*all_logits=*/false);
        EXPECT_TRUE(same_bits(tree_logits.data() + node * V, chain_logits.data(), static_cast<std::size_t>(V)))
            << "variant " << variant << ", round " << round << ", node " << node << " of " << n;
      }
      const std::int64_t leaf = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(n));
      const std::vector<std::int64_t> path = tree.path(leaf);
      tree.commit(leaf);
      // The chain that fed the same tokens in one piece: the next forward
      // and a crop back into the path agree bit for bit.
      Cache chain = model.make_cache();
      chain.activate_past_recording(12);
      std::vector<std::int32_t> seq = prompt;
      for (std::int64_t p : path) seq.push_back(tokens[static_cast<std::size_t>(p)]);
      std::vector<float> ignored;
      model.forward(prompt, chain, ignored);
      std::vector<std::int32_t> rest(seq.begin() + static_cast<std::ptrdiff_t>(prompt.size()), seq.end());
      model.forward(rest, chain, ignored);
      const std::int64_t back = static_cast<std::int64_t>(path.size()) / 2;
      cache.crop(-back);
      chain.crop(-back);
      const std::int32_t next = static_cast<std::int32_t>(rng() % 256);
      std::vector<float> a, b;
      model.forward(std::span<const std::int32_t>(&next, 1), cache, a);
      model.forward(std::span<const std::int32_t>(&next, 1), chain, b);
      EXPECT_TRUE(same_bits(a.data(), b.data(), static_cast<std::size_t>(V)))
          << "variant " << variant << ", round " << round;
      prompt = seq;
      prompt.resize(prompt.size() - static_cast<std::size_t>(back));
      prompt.push_back(next);
    }
  }
}

// The same on the transformers families' random checkpoints (q/k norms, the
// output gate, partial RoPE, (1 + w) norms, fused projections).
TEST(TreeForward, FamiliesNodeLogitsEqualTheirPathsAsChains) {
  for (const char* family : {"lfm2", "qwen3_5", "qwen3_next"}) {
    const Model model = Model::load(std::string(REWIND_SOURCE_DIR) + "/tests/fixtures/families/" + family);
    const std::int64_t V = model.vocab_size();
    std::mt19937_64 rng(17);
    std::vector<std::int32_t> prompt;
    for (int i = 0; i < 9; ++i) prompt.push_back(static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(V)));
    const std::vector<std::int64_t> parents{-1, 0, 0, 1, 1, 3, 2};
    std::vector<std::int32_t> tokens;
    for (std::size_t i = 0; i < parents.size(); ++i)
      tokens.push_back(static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(V)));
    Cache cache = model.make_cache();
    std::vector<float> logits;
    model.forward(prompt, cache, logits, false);
    TreeForward tree = cache.begin_tree(parents);
    std::vector<float> tree_logits;
    model.forward_tree(tokens, tree, cache, tree_logits);
    for (std::int64_t node = 0; node < tree.num_nodes(); ++node) {
      Cache chain = model.make_cache();
      std::vector<std::int32_t> seq = prompt;
      for (std::int64_t p : tree.path(node)) seq.push_back(tokens[static_cast<std::size_t>(p)]);
      std::vector<float> chain_logits;
      model.forward(seq, chain, chain_logits, false);
      EXPECT_TRUE(same_bits(tree_logits.data() + node * V, chain_logits.data(), static_cast<std::size_t>(V)))
          << family << ", node " << node;
    }
  }
}

TEST(TreeForward, Refusals) {
  const Model model(ModelWeights::random(hybrid(kEveryKind), 71));
  Cache cache = model.make_cache();
  std::vector<float> logits;
  const std::vector<std::int32_t> prompt{256, 1, 2};
  model.forward(prompt, cache, logits);
  const std::vector<std::int64_t> parents{-1, 0};
  TreeForward tree = cache.begin_tree(parents);
  const std::vector<std::int32_t> one{3}, bad{3, 9999};
  EXPECT_THROW(model.forward_tree(one, tree, cache, logits), rwd::InvalidArgument);
  EXPECT_THROW(model.forward_tree(bad, tree, cache, logits), rwd::InvalidArgument);
  tree.abandon();
  const std::vector<std::int32_t> two{3, 4};
  EXPECT_THROW(model.forward_tree(two, tree, cache, logits), rwd::StateError);
  EXPECT_EQ(cache.get_seq_length(), 3);
}

}  // namespace
}  // namespace rwd::runtime

namespace rwd::runtime {
namespace {

// Greedy tree speculation equals greedy decoding, for every tree shape and
// draft source; a perfect draft (the target itself) is accepted all along.
TEST(TreeSpeculation, IdenticalToGreedyForEveryShapeAndSource) {
  for (int variant = 0; variant < 2; ++variant) {
    const std::vector<std::string> kinds = variant == 0 ? kEveryKind
                                                        : std::vector<std::string>{"conv", "sliding_attention",
                                                                                   "linear_attention"};
    const Model target(ModelWeights::random(hybrid(kinds, 32, 4), 80 + static_cast<std::uint64_t>(variant)));
    const Model other(ModelWeights::random(hybrid({"conv", "sliding_attention"}, 16, 4), 90));
    GenerationOptions o;
    o.max_new_tokens = 40;
    o.stop_at_eos = false;
    // A repetitive prompt, so that prompt lookup finds several matches.
    std::vector<std::int32_t> prompt{256};
    for (int i = 0; i < 30; ++i) prompt.push_back(static_cast<std::int32_t>("abcabd"[i % 6]));
    const std::vector<std::int32_t> want = generate(target, prompt, o);
    for (const TreeOptions t :
         {TreeOptions{2, 4, 1}, TreeOptions{2, 16, 3}, TreeOptions{3, 16, 6}, TreeOptions{4, 64, 4}}) {
      LookupTreeDraft lookup(3);
      ModelTreeDraft model_draft(other), perfect(target);
      GenerationStats sl, sm, sp;
      EXPECT_EQ(tree_speculative_generate(target, lookup, prompt, with_tree(o, t), &sl), want)
          << "lookup, W " << t.width;
      EXPECT_EQ(tree_speculative_generate(target, model_draft, prompt, with_tree(o, t), &sm), want)
          << "draft, W " << t.width;
      EXPECT_EQ(tree_speculative_generate(target, perfect, prompt, with_tree(o, t), &sp), want)
          << "perfect, W " << t.width;
      // The perfect draft ranks the target's greedy token first at the root,
      // so every round keeps at least one draft (the beam may drop the
      // greedy chain deeper down, when other paths are likelier).
      EXPECT_LE(sp.rounds, (o.max_new_tokens + 1) / 2) << "W " << t.width << ", depth " << t.depth;
      EXPECT_GE(sp.accepted, sp.rounds - 1);
      EXPECT_GT(sl.drafted, 0);
      EXPECT_EQ(sl.rollbacks + sm.rollbacks + sp.rollbacks, 0);  // a tree never crops the target
    }
  }
}

TEST(TreeSpeculation, Refusals) {
  const Model target(ModelWeights::random(hybrid(kEveryKind), 81));
  LookupTreeDraft lookup(2);
  GenerationOptions o;
  const std::vector<std::int32_t> prompt{256, 1};
  EXPECT_THROW(tree_speculative_generate(target, lookup, prompt, with_tree(o, {1, 16, 4})), rwd::InvalidArgument);
  EXPECT_THROW(tree_speculative_generate(target, lookup, prompt, with_tree(o, {2, 1, 4})), rwd::InvalidArgument);
  EXPECT_THROW(tree_speculative_generate(target, lookup, prompt, with_tree(o, {2, 16, 0})), rwd::InvalidArgument);
  o.sampling.temperature = -0.5f;
  EXPECT_THROW(tree_speculative_generate(target, lookup, prompt, with_tree(o, {2, 16, 4})), rwd::InvalidArgument);
  EXPECT_THROW(tree_speculative_generate(target, lookup, {}, with_tree(GenerationOptions{}, {2, 16, 4})),
               rwd::InvalidArgument);
}

}  // namespace
}  // namespace rwd::runtime

#ifdef REWIND_CLI_PATH
#include <nlohmann/json.hpp>

#include "cli_test_util.h"

namespace rwd::runtime {
namespace {

using namespace cli_test;

TEST(TreeCli, VerifyGenerateAndBenchWithTrees) {
  const std::string dir = (scratch_dir() / "tree_models").string();
  fs::remove_all(dir);
  write_random_model(hybrid(kEveryKind), dir + "/target", 15, DType::F32);
  write_random_model(hybrid({"conv", "sliding_attention"}, 16, 4), dir + "/draft", 16, DType::F32);
  const std::string model = " --model " + quote(dir + "/target");
  const std::string prompt = " --prompt " + quote("abcabdabcabd abc");
  for (const std::string& source : {" --draft " + quote(dir + "/draft"), std::string(" --lookup 3")}) {
    for (const std::string& shape :
         {std::string(" --tree 2 --num-draft 3"), std::string(" --tree 4 --tree-nodes 32 --num-draft 5")}) {
      const CliResult v = run_cli("verify" + model + prompt + source + shape + " --max-new-tokens 60");
      EXPECT_EQ(v.status, 0) << v.all();
      EXPECT_EQ(v.out.rfind("IDENTICAL", 0), 0u) << v.out;
    }
  }
  const CliResult plain = run_cli("generate" + model + prompt + " --max-new-tokens 40");
  const CliResult tree = run_cli("generate" + model + prompt + " --lookup 2 --tree 3 --max-new-tokens 40 --stats");
  ASSERT_EQ(tree.status, 0) << tree.all();
  EXPECT_EQ(tree.out.substr(0, plain.out.size()), plain.out);
  // Sampling with a tree: a valid run (its distribution is the chi-square test's).
  EXPECT_EQ(run_cli("generate" + model + prompt + " --lookup 2 --tree 2 --temperature 0.8 --seed 3").status, 0);
  // Usage errors.
  EXPECT_EQ(run_cli("generate" + model + prompt + " --tree 2").status, 2);                   // no draft source
  EXPECT_EQ(run_cli("generate" + model + prompt + " --lookup 2 --tree 1").status, 2);        // W < 2
  EXPECT_EQ(run_cli("generate" + model + prompt + " --lookup 2 --tree-nodes 8").status, 2);  // nodes without a tree
  EXPECT_EQ(run_cli("generate" + model + prompt + " --lookup 2 --tree 2 --adaptive").status, 2);
  const CliResult bench = run_cli("bench" + model + " --draft " + quote(dir + "/draft") +
                                  " --tree 2 --k 2 --max-new-tokens 16 --repeats 1");
  EXPECT_EQ(bench.status, 0) << bench.all();
  EXPECT_NE(bench.out.find("draft_tree"), std::string::npos) << bench.out;
  EXPECT_NE(bench.out.find("lookup_tree"), std::string::npos) << bench.out;
  fs::remove_all(dir);
}

}  // namespace
}  // namespace rwd::runtime
#endif
