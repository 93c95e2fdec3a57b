// runtime/generation/tree.cc: tree speculation: its options, draft sources and loop.
#include "runtime/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "internal.h"
#include "rewind/error.h"
#include "runtime/kernels.h"

namespace rwd::runtime {

using namespace generation;

void check_tree_options(const TreeOptions& t) {
  if (t.width < 2 || t.width > 64) {
    throw InvalidArgument("tree width W (children per node) must be in [2, 64], got " + std::to_string(t.width) +
                          "; W = 1 is a chain: use speculative decoding without a tree");
  }
  if (t.max_nodes < 2 || t.max_nodes > 1024) {
    throw InvalidArgument("tree node budget must be in [2, 1024], got " + std::to_string(t.max_nodes));
  }
  check_num_draft(t.depth, "tree depth (num_draft)");
}

namespace {

// A draft tree under construction: parents, tokens, depths, children.
struct TreeBuilder {
  std::vector<std::int64_t>& parents;
  std::vector<std::int32_t>& tokens;
  std::vector<std::int64_t> depth{0};
  std::vector<std::vector<std::int64_t>> children{{}};

  TreeBuilder(std::vector<std::int64_t>& p, std::vector<std::int32_t>& t, std::int32_t root) : parents(p), tokens(t) {
    parents.assign(1, -1);
    tokens.assign(1, root);
  }
  std::int64_t size() const { return static_cast<std::int64_t>(parents.size()); }
  std::int64_t child(std::int64_t node, std::int32_t token) const {
    for (std::int64_t c : children[static_cast<std::size_t>(node)])
      if (tokens[static_cast<std::size_t>(c)] == token) return c;
    return -1;
  }
  std::int64_t add(std::int64_t parent, std::int32_t token) {
    parents.push_back(parent);
    tokens.push_back(token);
    depth.push_back(depth[static_cast<std::size_t>(parent)] + 1);
    children.emplace_back();
    children[static_cast<std::size_t>(parent)].push_back(size() - 1);
    return size() - 1;
  }
};

}  // namespace

LookupTreeDraft::LookupTreeDraft(std::int64_t max_ngram) : max_ngram_(max_ngram) {}

void LookupTreeDraft::propose(std::span<const std::int32_t> s, const TreeOptions& o, std::vector<std::int64_t>& parents,
                              std::vector<std::int32_t>& tokens) {
  TreeBuilder tree(parents, tokens, s.back());
  const auto n = static_cast<std::int64_t>(s.size());
  for (std::int64_t ng = std::min(max_ngram_, n - 1); ng >= 1 && tree.size() < o.max_nodes; --ng) {
    const std::int32_t* pattern = s.data() + (n - ng);
    for (std::int64_t i = n - ng - 1; i >= 0 && tree.size() < o.max_nodes; --i) {
      if (!std::equal(pattern, pattern + ng, s.data() + i)) continue;
      // The continuation after this occurrence, merged into the tree.
      std::int64_t node = 0;
      for (std::int64_t j = i + ng; j < std::min(i + ng + o.depth, n) && tree.size() <= o.max_nodes; ++j) {
        const std::int64_t next = tree.child(node, s[static_cast<std::size_t>(j)]);
        if (next >= 0) {
          node = next;
          continue;
        }
        if (tree.size() == o.max_nodes ||
            static_cast<std::int64_t>(tree.children[static_cast<std::size_t>(node)].size()) >= o.width)
          break;
        node = tree.add(node, s[static_cast<std::size_t>(j)]);
      }
    }
  }
}

ModelTreeDraft::ModelTreeDraft(const Model& draft, std::int64_t max_prefill_rows)
    : model_(draft), max_prefill_rows_((check_prefill_rows(max_prefill_rows), max_prefill_rows)),
      cache_(draft.make_cache()) {}

void ModelTreeDraft::begin(std::span<const std::int32_t>) {
  cache_.reset();
  seen_ = 0;
}

std::size_t ModelTreeDraft::cache_bytes() const { return cache_.memory().bytes_reserved; }

void ModelTreeDraft::propose(std::span<const std::int32_t> s, const TreeOptions& o, std::vector<std::int64_t>& parents,
                             std::vector<std::int32_t>& tokens) {
  const auto before_root = static_cast<std::int64_t>(s.size()) - 1;
  std::vector<float> logits;
  if (before_root > seen_) {  // the tokens the last rounds accepted
    forward_in_pieces(model_, s.subspan(static_cast<std::size_t>(seen_), static_cast<std::size_t>(before_root - seen_)),
                      max_prefill_rows_, cache_, logits, &cache_seconds_, [](std::int64_t) {});
    seen_ = before_root;
  }
  TreeBuilder tree(parents, tokens, s.back());
  const std::int64_t V = model_.vocab_size();
  std::vector<double> logp{0.0};  // cumulative log probability of each node
  std::vector<std::int64_t> frontier{0};
  std::vector<float> probs(static_cast<std::size_t>(V));
  for (std::int64_t level = 1; level <= o.depth && !frontier.empty() && tree.size() < o.max_nodes; ++level) {
    {
      TreeForward t = cache_.begin_tree(parents);
      model_.forward_tree(tokens, t, cache_, logits, &cache_seconds_);
    }  // abandoned: the draft's cache keeps only accepted tokens
    struct Candidate {
      double logp;
      std::int64_t parent;
      std::int32_t token;
    };
    std::vector<Candidate> candidates;
    for (std::int64_t f : frontier) {
      kernels::softmax(logits.data() + f * V, V, probs.data());
      std::vector<std::int32_t> order(static_cast<std::size_t>(V));
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + o.width, order.end(), [&](std::int32_t a, std::int32_t b) {
        return probs[static_cast<std::size_t>(a)] > probs[static_cast<std::size_t>(b)] ||
               (probs[static_cast<std::size_t>(a)] == probs[static_cast<std::size_t>(b)] && a < b);
      });
      for (std::int64_t w = 0; w < o.width; ++w) {
        const std::int32_t tok = order[static_cast<std::size_t>(w)];
        const double p = std::max(static_cast<double>(probs[static_cast<std::size_t>(tok)]), 1e-30);
        candidates.push_back({logp[static_cast<std::size_t>(f)] + std::log(p), f, tok});
      }
    }
    std::stable_sort(candidates.begin(), candidates.end(),
                     [](const Candidate& a, const Candidate& b) { return a.logp > b.logp; });
    // A beam of `width` nodes per level: the tree reaches the full depth
    // (where a chain's accepted tokens come from) and keeps the likeliest
    // alternatives beside its best path.
    frontier.clear();
    for (const Candidate& c : candidates) {
      if (tree.size() >= o.max_nodes || static_cast<std::int64_t>(frontier.size()) >= o.width) break;
      frontier.push_back(tree.add(c.parent, c.token));
      logp.push_back(c.logp);
    }
  }
}

namespace {

// Greedy: the target's argmax at `node`, and the child holding it (-1: none).
std::int64_t greedy_child(std::span<const float> row, std::int64_t V, std::int64_t node,
                          const std::vector<std::int64_t>& parents, const std::vector<std::int32_t>& tokens,
                          std::int32_t& t) {
  const auto n = static_cast<std::int64_t>(parents.size());
  std::int64_t next = -1;
  t = static_cast<std::int32_t>(kernels::argmax(row.data(), V));
  for (std::int64_t c = node + 1; c < n && next < 0; ++c)
    if (parents[static_cast<std::size_t>(c)] == node && tokens[static_cast<std::size_t>(c)] == t) next = c;
  return next;
}

// Sampling (see follow_target): the token in t, and the child kept (-1: none).
std::int64_t sampled_child(std::span<const float> row, std::int64_t node, const std::vector<std::int64_t>& parents,
                           const std::vector<std::int32_t>& tokens, const SamplingParams& sampling,
                           std::mt19937_64& rng, std::int32_t& t) {
  const auto n = static_cast<std::int64_t>(parents.size());
  std::int64_t next = -1;
  std::vector<float> p = sampling_distribution(row, sampling);
  double mass = 1.0;
  for (std::int64_t c = node + 1; c < n && next < 0; ++c) {
    if (parents[static_cast<std::size_t>(c)] != node) continue;
    const auto x = static_cast<std::size_t>(tokens[static_cast<std::size_t>(c)]);
    const double px = mass > 0.0 ? static_cast<double>(p[x]) / mass : 0.0;
    if (std::generate_canonical<double, 64>(rng) < px) {
      next = c;
      t = static_cast<std::int32_t>(x);
    } else {
      mass -= static_cast<double>(p[x]);
      p[x] = 0.0f;
    }
  }
  if (next < 0) {
    if (mass <= 0.0) {  // every token the target allows was a rejected child: cannot happen but by rounding
      p = sampling_distribution(row, sampling);
    }
    double total = 0.0;
    for (float v : p) total += v;
    for (float& v : p) v = static_cast<float>(v / total);
    t = sample_from(p, rng);
  }
  return next;
}

// Follow the target down the tree from the root, appending what it emits;
// returns the last node accepted. Greedy, its argmax; sampling, the children
// tried in order as one-hot proposals (each kept with the target's
// probability of its token, else that token's mass removed and the rest
// renormalised), the round ending with a draw from what is left: exactly a
// draw from the target's distribution at each step, whatever the tree (its
// tokens are distinct siblings).
std::int64_t follow_target(std::span<const float> logits, std::int64_t V, const std::vector<std::int64_t>& parents,
                           const std::vector<std::int32_t>& tokens, const SamplingParams& sampling,
                           std::mt19937_64& rng, std::vector<std::int32_t>& emitted) {
  std::int64_t node = 0;
  while (true) {
    const std::span<const float> row(logits.data() + node * V, static_cast<std::size_t>(V));
    std::int32_t t = 0;
    const std::int64_t next = sampling.greedy() ? greedy_child(row, V, node, parents, tokens, t)
                                                : sampled_child(row, node, parents, tokens, sampling, rng, t);
    emitted.push_back(t);
    if (next < 0) return node;
    node = next;
  }
}

}  // namespace

std::vector<std::int32_t> tree_speculative_generate(const Model& target, TreeDraftSource& draft,
                                                    std::span<const std::int32_t> prompt,
                                                    const GenerationOptions& options, GenerationStats* stats) {
  validate(options);
  check_prompt(prompt);
  const TreeOptions& tree_options = options.tree;
  const auto t0 = Clock::now();
  std::mt19937_64 rng(options.sampling.seed);
  const std::int64_t V = target.vocab_size();
  GenerationStats local = start_stats(prompt, options.sampling);
  std::vector<std::int32_t> sequence(prompt.begin(), prompt.end()), out, tokens;
  std::vector<std::int64_t> parents;
  Cache cache = target.make_cache();  // no recording: a tree commit adds only what was accepted
  std::vector<float> logits;
  draft.begin(prompt);
  bool running = options.max_new_tokens > 0;
  if (prompt.size() > 1 && running)
    local.prefix_hit_tokens = prefill(target, prompt.first(prompt.size() - 1), cache, logits, options.prefix_cache,
                                      local, options.max_prefill_rows, options.on_prefill);
  while (running) {
    const std::int64_t budget = options.max_new_tokens - static_cast<std::int64_t>(out.size());
    TreeOptions round = tree_options;
    round.depth = std::min(tree_options.depth, budget - 1);
    if (round.depth >= 1) {
      draft.propose(sequence, round, parents, tokens);
    } else {
      parents.assign(1, -1);
      tokens.assign(1, sequence.back());
    }
    const auto n = static_cast<std::int64_t>(parents.size());
    std::vector<std::int32_t> emitted;
    {
      const auto tc = Clock::now();
      TreeForward tree = cache.begin_tree(parents);
      local.cache_seconds += seconds_since(tc);
      target.forward_tree(tokens, tree, cache, logits, &local.cache_seconds);
      ++local.forwards;
      const std::int64_t node = follow_target(logits, V, parents, tokens, options.sampling, rng, emitted);
      const auto tc2 = Clock::now();
      tree.commit(node);
      local.cache_seconds += seconds_since(tc2);
    }
    const auto accepted = static_cast<std::int64_t>(emitted.size()) - 1;
    draft.accept(accepted);
    count_round(local, n - 1, accepted, false);
    running = emit_all(emitted, sequence, target, options, out, t0, local);
    local.peak_cache_bytes = std::max(local.peak_cache_bytes, cache.memory().bytes_reserved + draft.cache_bytes());
  }
  local.cache_seconds += draft.cache_seconds();
  local.new_tokens = static_cast<std::int64_t>(out.size());
  local.seconds = seconds_since(t0);
  if (stats) *stats = local;
  return out;
}

}  // namespace rwd::runtime
