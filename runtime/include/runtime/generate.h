// runtime/generate.h: greedy / sampled generation and speculative decoding.
//
// generate() runs the plain loop: prefill the prompt, then one token per
// forward. speculative_generate() runs transformers' assisted-generation
// loop with rewind's crop semantics: it records past states, lets a
// DraftSource propose up to K tokens, verifies them in one forward of
// (pending token + drafts), keeps the longest accepted prefix (greedy) or
// applies speculative sampling (temperature > 0), then calls
// crop(-(drafted - accepted)) on the target cache (also when that is 0, so
// sliding and conv states shrink back) and the draft's own crop.
//
// Losslessness: with greedy decoding the emitted tokens equal generate()'s
// token for token, because the model's forward is batch invariant
// (runtime/model.h) and every crop restores the cache exactly. With
// sampling, the tokens follow the same distribution as generate()'s (the
// random streams differ).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "rewind/prefix_cache.h"
#include "runtime/model.h"

namespace rwd::runtime {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy (argmax)
  std::int64_t top_k = 0;    // 0: no top-k filter
  float top_p = 1.0f;        // 1: no nucleus filter
  std::uint64_t seed = 0;
  bool greedy() const { return temperature <= 0.0f; }
};

// Throws InvalidArgument for a temperature that is negative or not finite
// (NaN, infinity), top_k < 0, or top_p outside (0, 1].
void validate(const SamplingParams& params);

// The distribution sampling draws from: softmax(logits / T) restricted to
// the top_k most likely tokens and to the smallest set whose mass reaches
// top_p (ties broken by token id), renormalised. REQUIRES !params.greedy().
std::vector<float> sampling_distribution(std::span<const float> logits, const SamplingParams& params);

// Draws an index from `probs` (sums to ~1) with one uniform from `rng`.
std::int32_t sample_from(std::span<const float> probs, std::mt19937_64& rng);

// Draft lengths K the runtime accepts: [1, kMaxDraft].
inline constexpr std::int64_t kMaxDraft = 64;
// Throws InvalidArgument naming `what` unless 1 <= k <= kMaxDraft.
void check_num_draft(std::int64_t k, const char* what);

// The tokens one speculative round emits, from the target's logits of the
// verify forward, `logits` [drafts.size() + 1, V] (the pending token's row,
// then one per draft): the accepted drafts and one more token. Greedy: the
// longest prefix of `drafts` the target's argmax agrees with, then the
// argmax after it (the tokens generate() emits). Sampling (speculative
// sampling): draft j is kept with probability min(1, p(d) / q(d)), p the
// sampling_distribution of row j and q draft_probs[j], or one-hot on d
// where draft_probs has no entry j (a deterministic draft); on a rejection
// one token is drawn from max(0, p - q) renormalised and the round ends;
// when every draft is kept one more is drawn from the last row. The tokens
// follow the target's own distribution; every draw comes from `rng`, so the
// same drafts, logits and generator state give the same tokens. Sets
// `accepted` to the drafts kept. Throws InvalidArgument when `logits` holds
// fewer than drafts.size() + 1 rows of V >= 1 floats.
std::vector<std::int32_t> accept_drafts(std::span<const float> logits, std::int64_t V,
                                        std::span<const std::int32_t> drafts,
                                        std::span<const std::vector<float>> draft_probs, const SamplingParams& sampling,
                                        std::mt19937_64& rng, std::int64_t& accepted);

struct SpeculativeOptions {
  std::int64_t num_draft = 4;  // K (the maximum when adaptive)
  // Adapt K from the acceptance (transformers' heuristic): +2 after a round
  // that accepted everything, -1 otherwise, within [1, num_draft].
  bool adaptive = false;
};

// Shape of a draft tree: at most `width` children per node, `max_nodes`
// nodes (the root, the pending token, included) and `depth` drafted tokens
// on any path.
struct TreeOptions {
  std::int64_t width = 2;
  std::int64_t max_nodes = 16;
  std::int64_t depth = 4;
};
// Throws InvalidArgument naming the option unless 2 <= width <= 64,
// 2 <= max_nodes <= 1024 and 1 <= depth <= kMaxDraft.
void check_tree_options(const TreeOptions& options);

// GenerationOptions::max_prefill_rows by default.
inline constexpr std::int64_t kDefaultMaxPrefillRows = 2048;

struct GenerationOptions {
  std::int64_t max_new_tokens = 128;
  bool stop_at_eos = true;
  SamplingParams sampling;
  // Called for every emitted token, in order, as soon as it is final.
  std::function<void(std::int32_t)> on_token;
  // Batched decoding (generate_batch, speculative_generate_batch): at most
  // this many sequences decode at once (0: all of them); the others wait and
  // join, in prompt order, as sequences finish. Must be >= 0.
  std::int64_t max_batch = 0;
  // Prefix reuse (every generate / speculative_generate function): the
  // prompt's prefill restores the longest stored prefix and stores an entry
  // at every boundary of what it computes (rewind/prefix_cache.h); batched
  // decoding prefills each joining sequence's prompt, but its last token,
  // alone through it. Not owned; null: none. Its fingerprint must be the
  // target model's (Model::fingerprint).
  PrefixCache* prefix_cache = nullptr;
  // Prompt tokens one target forward feeds at most (>= 1): a longer prompt,
  // or prompts joining a batch together, go in several forwards (outputs
  // bit-identical: batch invariance), so that a forward's working rows
  // (about 24 KB a token for the shipped target; more for larger models)
  // stay bounded whatever the prompts' lengths. Decoding and verification
  // rows always go whole.
  std::int64_t max_prefill_rows = kDefaultMaxPrefillRows;
  // Called after each prefill forward of one prompt (generate,
  // speculative_generate, tree_speculative_generate) with the tokens the
  // prefill has in the cache (a restored prefix included) and the number it
  // feeds in all (the prompt; speculative: all but its last token):
  // progress for a long prompt. Not called by the batched functions.
  std::function<void(std::int64_t done, std::int64_t total)> on_prefill;
  // Chain speculative decoding (speculative_generate and its batched form):
  // the draft length K and its adaptation.
  SpeculativeOptions speculation;
  // Tree speculation (tree_speculative_generate): the draft tree's shape.
  TreeOptions tree;
};

// What every generation function checks first: throws InvalidArgument
// naming the option for what validate(sampling) refuses, max_prefill_rows
// < 1, max_batch < 0, speculation.num_draft outside [1, kMaxDraft] and
// what check_tree_options(tree) refuses.
void validate(const GenerationOptions& options);

struct GenerationStats {
  std::int64_t new_tokens = 0;
  std::int64_t prompt_tokens = 0;  // tokens of the prompt (BOS included)
  double seconds = 0.0;            // wall time of the whole call: prompt prefill + decoding
  // Wall time from the start of the call until the first new token was
  // final: the prompt's prefill plus the forward (or, speculative, the first
  // round) that produced it. 0 when no token was generated.
  double time_to_first_token = 0.0;
  std::int64_t forwards = 0;  // target forwards
  std::int64_t rounds = 0;    // speculative rounds
  std::int64_t drafted = 0;
  std::int64_t accepted = 0;
  // Chain speculative decoding (speculative_generate and its batched form),
  // per draft position i, 0-based within a round: drafted_at[i] rounds
  // drafted a token at position i, and accepted_at[i] of those tokens were
  // accepted. A round accepts a prefix of its drafts, so accepted_at[i] also
  // counts the rounds that accepted more than i tokens and never increases
  // with i; drafted_at sums to drafted and accepted_at to accepted. Both
  // have one entry per position up to the longest draft of any round (empty
  // when nothing was drafted; tree speculation leaves them empty).
  std::vector<std::int64_t> drafted_at;
  std::vector<std::int64_t> accepted_at;
  std::int64_t rollbacks = 0;          // crops that removed at least one token (target; a tree never crops: 0)
  double cache_seconds = 0.0;          // time inside cache calls: updates, slots, crops (target + draft)
  std::size_t peak_cache_bytes = 0;    // reserved by the target (+ draft) caches
  std::int64_t prefix_hit_tokens = 0;  // prompt tokens restored from the prefix cache
  std::optional<std::uint64_t> seed;   // the sampling seed; empty for greedy decoding
  int threads = 1;                     // threads the forwards could use (the setting)

  // ---- batched calls (generate_batch, speculative_generate_batch) --------
  // Each sequence's own statistics in prompt order, seconds counted from
  // the start of the call; empty for a call of one sequence. When it is not
  // empty (batched()), the fields above are the batch's: forwards are
  // batched forwards and seconds the call's wall time (set by the call);
  // the rest is what sum_per_sequence() gives.
  std::vector<GenerationStats> per_sequence;
  // The most sequences allowed to decode at once (options.max_batch capped
  // by the number of prompts; that number for 0), and the most one forward
  // held (prefilling ones included; 0 when nothing decoded).
  std::int64_t max_batch = 0;
  std::int64_t peak_batch = 0;
  // Time in the draft source's cache calls (speculative), counted in
  // cache_seconds by sum_per_sequence().
  double draft_cache_seconds = 0.0;
  // Set by a caller that joins several calls' statistics (the CLI's
  // --prompts groups): the sum of each call's time after its last first
  // token. Empty: seconds minus the last first token's time.
  std::optional<double> decode_seconds;

  bool batched() const { return !per_sequence.empty(); }
  // Sets the batch's counts from per_sequence: new and prompt tokens,
  // drafts and acceptances (per position too), rounds, rollbacks and prefix
  // hits summed; cache_seconds summed plus draft_cache_seconds;
  // time_to_first_token when the last sequence's first token came (0 when
  // none); peak_cache_bytes the largest sequence's; sequence 0's seed and
  // threads. forwards, seconds and the batch fields are left as they are.
  void sum_per_sequence();

  // End to end: new tokens / seconds, the prompt's prefill included (so a
  // long prompt lowers it however fast decoding is). For a batch, every
  // sequence's tokens over the call's time.
  double tokens_per_second() const { return seconds > 0 ? static_cast<double>(new_tokens) / seconds : 0.0; }
  // Decoding alone: the tokens after the first over the time after the
  // first, (new_tokens - 1) / (seconds - time_to_first_token), as inference
  // servers define the time per output token. Speculative decoding's first
  // round may emit several tokens at once; those after the first count
  // here. 0 with fewer than 2 new tokens. For a batch: every sequence's
  // tokens after its first, over the time after the last sequence's first
  // token (from then on every sequence decodes), or over decode_seconds
  // when set.
  double decode_tokens_per_second() const;
  double acceptance_rate() const {
    return drafted > 0 ? static_cast<double>(accepted) / static_cast<double>(drafted) : 0.0;
  }
  // accepted_at[i] / drafted_at[i]: the fraction of the tokens drafted at
  // position i that were accepted (0 when none was drafted there).
  double acceptance_at(std::size_t i) const {
    return i < drafted_at.size() && drafted_at[i] > 0
               ? static_cast<double>(accepted_at[i]) / static_cast<double>(drafted_at[i])
               : 0.0;
  }
  // One JSON object on one line: every field of a single call plus
  // tokens_per_second, decode_tokens_per_second, acceptance_rate and
  // acceptance_at (the list of acceptance_at(i)); "seed" is null for greedy
  // decoding; time_to_first_token is "time_to_first_token_s". A batch adds
  // sequences (their number), max_batch, peak_batch and per_sequence (each
  // sequence's object, same keys), and its time_to_first_token_s is the
  // list of every sequence's.
  std::string to_json() const;
};

// Options of a PrefixCache for `model` (GenerationOptions::prefix_cache):
// an entry every `interval` tokens, the model's fingerprint, and entry
// bounds from its sizes, so that junk under a short prompt's key is refused
// unread past about twice what a real entry of that length holds. Throws
// InvalidArgument for an interval outside [1, 2^40].
PrefixCacheOptions prefix_cache_options(const Model& model, std::int64_t interval = 256);

// Runs `tokens` (non-empty) into `cache` (empty) and leaves the logits after
// the last one in `logits` [vocab]. With a prefix cache: restores the
// longest stored prefix (an entry that does not fit this model's cache is a
// miss), feeds the rest in forwards that end at the cache's boundaries and
// stores an entry at each. Returns the tokens restored. Bit-identical to
// one forward of `tokens` (batch invariance); forwards feed at most
// `max_rows` tokens each. Adds to stats.forwards and stats.cache_seconds.
// Throws InvalidArgument for no token, max_rows < 1 or a cache that is not
// empty (nothing run). `on_piece`, when set, is called after each forward
// with the tokens in the cache so far and tokens.size(). All or nothing: when
// a forward (a budget's CapacityError) or on_piece throws, the exception
// comes out with `cache` reset to empty (recording setting kept) and
// `logits` unchanged; prefix-cache entries stored by earlier pieces stay (they
// are correct). Only if that reset is itself refused (by the system's
// memory: a budget that held the empty cache holds a new one) is the cache
// left holding the earlier pieces.
std::int64_t prefill(const Model& model, std::span<const std::int32_t> tokens, Cache& cache, std::vector<float>& logits,
                     PrefixCache* prefix_cache, GenerationStats& stats, std::int64_t max_rows = kDefaultMaxPrefillRows,
                     const std::function<void(std::int64_t, std::int64_t)>& on_piece = {});

// Plain decoding from a state: `cache` has seen a sequence (a restored
// snapshot, say) and `logits` [vocab] are the model's output after its last
// token. Decodes as generate() does after its prefill (same tokens for the
// same state). Throws InvalidArgument for an empty cache or logits of
// another size, and what validate() throws.
std::vector<std::int32_t> continue_generation(const Model& model, Cache& cache, std::vector<float>& logits,
                                              const GenerationOptions& options, GenerationStats* stats = nullptr);

// Plain decoding. REQUIRES: prompt non-empty. Returns the new tokens (an
// EOS that stopped generation is included).
std::vector<std::int32_t> generate(const Model& model, std::span<const std::int32_t> prompt,
                                   const GenerationOptions& options, GenerationStats* stats = nullptr);

// Plain decoding of many prompts in one SequenceCache: the prompts in one
// batched forward, then each round one forward of every unfinished
// sequence's pending token; a sequence leaves the batch when it stops (EOS,
// max_new_tokens) and its state is released. Sequence i's tokens equal
// generate()'s for its prompt alone with the same options, the sampling
// seed raised by i (the forward is batch invariant; each sequence draws from
// its own generator, so parallel samples of one prompt differ).
// options.on_token is not called. Throws InvalidArgument for an empty list or an empty prompt, and
// what validate() throws.
std::vector<std::vector<std::int32_t>> generate_batch(const Model& model,
                                                      std::span<const std::vector<std::int32_t>> prompts,
                                                      const GenerationOptions& options,
                                                      GenerationStats* stats = nullptr);

// {"index": i, "text": text} as one JSON line (no newline); bytes that are
// not UTF-8 become U+FFFD.
std::string indexed_text_json(std::size_t index, const std::string& text);

// Proposes draft tokens. begin() is called once with the prompt; propose()
// with the whole sequence so far (prompt + emitted, the last token not yet
// seen by the target) and at most `k` tokens; it may return fewer (0 means
// "no guess": the round verifies the pending token alone). In sampling mode
// it also fills `probs` with the draft distribution of each proposed token
// (vocab floats per token), or leaves it empty for a deterministic draft.
// After verification, accept() tells how many of the proposed tokens the
// target kept.
class DraftSource {
 public:
  virtual ~DraftSource() = default;
  virtual void begin(std::span<const std::int32_t> prompt) = 0;
  virtual std::vector<std::int32_t> propose(std::span<const std::int32_t> sequence, std::int64_t k,
                                            std::vector<std::vector<float>>* probs) = 0;
  virtual void accept(std::int64_t proposed, std::int64_t accepted) = 0;
  // Bytes of cache this source holds (0 for model-free sources).
  virtual std::size_t cache_bytes() const { return 0; }
  // Seconds spent in its cache calls (updates and crops).
  virtual double cache_seconds() const { return 0.0; }
};

// A draft model with its own cache (may be the target itself: a perfect
// draft). Feeds the tokens its cache has not seen, drafts greedily or by
// sampling with `sampling`, and crops its cache back to the accepted prefix.
// REQUIRES: the draft's vocabulary equals the target's (checked by
// speculative_generate).
class ModelDraft : public DraftSource {
 public:
  // The tokens it has not seen (a whole prompt at the first propose) go in
  // forwards of at most `max_prefill_rows` tokens (the same drafts as one
  // forward; bounded memory). Throws InvalidArgument for max_prefill_rows < 1.
  ModelDraft(const Model& draft, SamplingParams sampling, std::int64_t max_draft,
             std::int64_t max_prefill_rows = kDefaultMaxPrefillRows);
  void begin(std::span<const std::int32_t> prompt) override;
  std::vector<std::int32_t> propose(std::span<const std::int32_t> sequence, std::int64_t k,
                                    std::vector<std::vector<float>>* probs) override;
  void accept(std::int64_t proposed, std::int64_t accepted) override;
  std::size_t cache_bytes() const override;
  double cache_seconds() const override { return cache_seconds_; }
  const Model& model() const { return model_; }

 private:
  const Model& model_;
  SamplingParams sampling_;
  std::int64_t max_prefill_rows_;
  std::mt19937_64 rng_;
  Cache cache_;
  std::int64_t seen_ = 0;  // tokens of the sequence in cache_
  double cache_seconds_ = 0.0;
};

// Prompt lookup: finds the most recent earlier occurrence of the last n
// tokens (n = max_ngram down to 1) and proposes the tokens that followed it.
class LookupDraft : public DraftSource {
 public:
  explicit LookupDraft(std::int64_t max_ngram);
  void begin(std::span<const std::int32_t>) override {}
  std::vector<std::int32_t> propose(std::span<const std::int32_t> sequence, std::int64_t k,
                                    std::vector<std::vector<float>>* probs) override;
  void accept(std::int64_t, std::int64_t) override {}

 private:
  std::int64_t max_ngram_;
};

// Uniformly random tokens (an adversarial draft: rejections every round).
class RandomDraft : public DraftSource {
 public:
  RandomDraft(std::int64_t vocab, std::uint64_t seed);
  void begin(std::span<const std::int32_t>) override {}
  std::vector<std::int32_t> propose(std::span<const std::int32_t> sequence, std::int64_t k,
                                    std::vector<std::vector<float>>* probs) override;
  void accept(std::int64_t, std::int64_t) override {}

 private:
  std::int64_t vocab_;
  std::mt19937_64 rng_;
};

// Speculative decoding with options.speculation. Throws InvalidArgument for
// an empty prompt and what validate() throws. Same result contract as
// generate() (identical tokens in greedy mode).
std::vector<std::int32_t> speculative_generate(const Model& target, DraftSource& draft,
                                               std::span<const std::int32_t> prompt, const GenerationOptions& options,
                                               GenerationStats* stats = nullptr);

// ---- tree speculation (rewind/tree.h) ----

// Proposes a draft tree each round: parents[0] = -1 and tokens[0] =
// sequence.back() (the root, the pending token), then nodes whose parent
// comes before them, within `options` (fewer nodes, a shallower tree, or the
// root alone are fine). accept() tells how many drafted tokens the target
// kept on the path it chose.
class TreeDraftSource {
 public:
  virtual ~TreeDraftSource() = default;
  virtual void begin(std::span<const std::int32_t> prompt) = 0;
  virtual void propose(std::span<const std::int32_t> sequence, const TreeOptions& options,
                       std::vector<std::int64_t>& parents, std::vector<std::int32_t>& tokens) = 0;
  virtual void accept(std::int64_t accepted) = 0;
  virtual std::size_t cache_bytes() const { return 0; }
  virtual double cache_seconds() const { return 0.0; }
};

// Prompt lookup as a tree: the continuations after several earlier
// occurrences of the sequence's last n-gram (n = max_ngram down to 1, most
// recent first) become branches, merged where they share a prefix.
class LookupTreeDraft : public TreeDraftSource {
 public:
  explicit LookupTreeDraft(std::int64_t max_ngram);
  void begin(std::span<const std::int32_t>) override {}
  void propose(std::span<const std::int32_t> sequence, const TreeOptions& options, std::vector<std::int64_t>& parents,
               std::vector<std::int32_t>& tokens) override;
  void accept(std::int64_t) override {}

 private:
  std::int64_t max_ngram_;
};

// A draft model growing the tree level by level (a beam, ranked by
// cumulative draft probability as EAGLE-2 ranks its nodes): each level runs
// the draft over the tree so far (Model::forward_tree on its own cache, then
// abandoned) and adds, among the top `width` tokens of every frontier node,
// the `width` of highest cumulative draft probability, until the depth or
// the node budget is reached. The draft's cache only ever takes the accepted
// sequence, so it needs no rollback. Its children are chosen, not sampled,
// so tree sampling treats them as one-hot proposals (exact either way).
class ModelTreeDraft : public TreeDraftSource {
 public:
  // Tokens its cache has not seen go in forwards of at most
  // `max_prefill_rows`. Throws InvalidArgument for max_prefill_rows < 1.
  explicit ModelTreeDraft(const Model& draft, std::int64_t max_prefill_rows = kDefaultMaxPrefillRows);
  void begin(std::span<const std::int32_t> prompt) override;
  void propose(std::span<const std::int32_t> sequence, const TreeOptions& options, std::vector<std::int64_t>& parents,
               std::vector<std::int32_t>& tokens) override;
  void accept(std::int64_t) override {}
  std::size_t cache_bytes() const override;
  double cache_seconds() const override { return cache_seconds_; }

 private:
  const Model& model_;
  std::int64_t max_prefill_rows_;
  Cache cache_;
  std::int64_t seen_ = 0;
  double cache_seconds_ = 0.0;
};

// Tree speculative decoding: every round the draft proposes a tree under
// the pending token, one Model::forward_tree verifies every node, and the
// target walks down it: greedy, along its own argmax choices (the tokens
// equal generate()'s: each node's logits are its path's as a chain);
// sampling, trying a node's children in order as one-hot proposals (kept
// with the target's probability of their token, else that token's mass is
// removed and the rest renormalised) and ending the round with a draw from
// what is left, which is exactly a draw from the target's distribution (same
// distribution as generate(), other random streams). The path walked is
// kept (TreeForward::commit) and one more token emitted. The target cache
// needs no rollback (a tree adds only the kept path). The tree's shape is
// options.tree. Throws InvalidArgument for an empty prompt and what
// validate() throws.
std::vector<std::int32_t> tree_speculative_generate(const Model& target, TreeDraftSource& draft,
                                                    std::span<const std::int32_t> prompt,
                                                    const GenerationOptions& options, GenerationStats* stats = nullptr);

// Drafts for every sequence of a batch at once. begin() is called once with
// the prompts; each round propose() gets one request per sequence that
// drafts (its index, the whole sequence so far, the most tokens it may
// propose) and fills each request's drafts (and, sampling, the draft
// distributions as DraftSource::propose does); accept() tells how many of
// sequence `index`'s proposals the target kept; finish() that the sequence
// left the batch (a later propose with that index starts a new sequence:
// a server reuses the indices of the sequences that left).
class BatchDraftSource {
 public:
  struct Request {
    std::size_t index = 0;
    std::span<const std::int32_t> sequence;
    std::int64_t k = 0;
    std::vector<std::int32_t>* drafts = nullptr;
    std::vector<std::vector<float>>* probs = nullptr;  // null in greedy mode
  };
  virtual ~BatchDraftSource() = default;
  virtual void begin(std::span<const std::vector<std::int32_t>> prompts) = 0;
  virtual void propose(std::span<const Request> requests) = 0;
  virtual void accept(std::size_t index, std::int64_t proposed, std::int64_t accepted) = 0;
  virtual void finish(std::size_t) {}
  virtual double cache_seconds() const { return 0.0; }
};

// One DraftSource per sequence, each asked in turn (prompt lookup, random
// drafts, or draft models run one sequence at a time).
class PerSequenceDrafts : public BatchDraftSource {
 public:
  explicit PerSequenceDrafts(std::vector<std::unique_ptr<DraftSource>> sources);
  void begin(std::span<const std::vector<std::int32_t>> prompts) override;
  void propose(std::span<const Request> requests) override;
  void accept(std::size_t index, std::int64_t proposed, std::int64_t accepted) override;
  double cache_seconds() const override;

 private:
  std::vector<std::unique_ptr<DraftSource>> sources_;
};

// A draft model over its own SequenceCache: every draft step is one batched
// forward of every drafting sequence (the draft's weights read once per step
// for the batch). Sequence i drafts exactly what a ModelDraft of the same
// model and max_draft, with the sampling seed raised by i, would for it
// alone (batch invariance; one random stream per sequence). A sequence's
// draft state exists from its first propose until finish(), so waiting
// prompts (max_batch) hold none.
class BatchedModelDraft : public BatchDraftSource {
 public:
  // What the sequences' draft caches have not seen (whole prompts at the
  // first propose) goes in forwards of at most `max_prefill_rows` tokens in
  // all. Throws InvalidArgument for max_prefill_rows < 1.
  BatchedModelDraft(const Model& draft, SamplingParams sampling, std::int64_t max_draft,
                    std::int64_t max_prefill_rows = kDefaultMaxPrefillRows);
  void begin(std::span<const std::vector<std::int32_t>> prompts) override;
  void propose(std::span<const Request> requests) override;
  void accept(std::size_t index, std::int64_t proposed, std::int64_t accepted) override;
  void finish(std::size_t index) override;
  double cache_seconds() const override { return cache_seconds_; }

 private:
  const Model& model_;
  SamplingParams sampling_;
  std::int64_t max_draft_;
  std::int64_t max_prefill_rows_;
  SequenceCache cache_;
  std::vector<SeqId> ids_;
  std::vector<std::int64_t> seen_;  // tokens of each sequence in cache_
  std::vector<std::mt19937_64> rngs_;
  double cache_seconds_ = 0.0;
};

// speculative_generate for many prompts in one SequenceCache: every round
// each unfinished sequence drafts up to its own K (adaptive per sequence),
// one batched forward verifies every sequence's pending token and drafts,
// and each sequence crops its own rejected tokens. Sequences finish
// independently and leave the batch. Sequence i's tokens equal
// speculative_generate()'s for its prompt alone with the same options, the
// sampling seed raised by i, and an equivalent draft source (greedy: equal
// to generate()'s).
// options.on_token is not called; K is options.speculation. Throws
// InvalidArgument for an empty list or an empty prompt, and what
// speculative_generate throws.
std::vector<std::vector<std::int32_t>> speculative_generate_batch(const Model& target, BatchDraftSource& drafts,
                                                                  std::span<const std::vector<std::int32_t>> prompts,
                                                                  const GenerationOptions& options,
                                                                  GenerationStats* stats = nullptr);

}  // namespace rwd::runtime
