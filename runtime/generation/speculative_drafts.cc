// runtime/generation/speculative_drafts.cc: the chain draft sources, one sequence
// or a batch at a time.
#include "runtime/generate.h"

#include <algorithm>

#include "internal.h"
#include "rewind/error.h"
#include "runtime/kernels.h"

namespace rwd::runtime {

using namespace generation;

PerSequenceDrafts::PerSequenceDrafts(std::vector<std::unique_ptr<DraftSource>> sources) : sources_(std::move(sources)) {
  for (const auto& source : sources_)
    if (!source) throw InvalidArgument("PerSequenceDrafts: a draft source is null");
}

void PerSequenceDrafts::begin(std::span<const std::vector<std::int32_t>> prompts) {
  if (prompts.size() != sources_.size()) {
    throw InvalidArgument("PerSequenceDrafts holds " + std::to_string(sources_.size()) + " draft sources for " +
                          std::to_string(prompts.size()) + " prompts; it needs one per prompt");
  }
  for (std::size_t i = 0; i < prompts.size(); ++i) sources_[i]->begin(prompts[i]);
}

void PerSequenceDrafts::propose(std::span<const Request> requests) {
  for (const Request& r : requests) *r.drafts = sources_[r.index]->propose(r.sequence, r.k, r.probs);
}

void PerSequenceDrafts::accept(std::size_t index, std::int64_t proposed, std::int64_t accepted) {
  sources_[index]->accept(proposed, accepted);
}

double PerSequenceDrafts::cache_seconds() const {
  double total = 0.0;
  for (const auto& source : sources_) total += source->cache_seconds();
  return total;
}

BatchedModelDraft::BatchedModelDraft(const Model& draft, SamplingParams sampling, std::int64_t max_draft,
                                     std::int64_t max_prefill_rows)
    : model_(draft), sampling_(sampling), max_draft_(std::max<std::int64_t>(max_draft, 1)),
      max_prefill_rows_((check_prefill_rows(max_prefill_rows), max_prefill_rows)), cache_(draft.make_sequence_cache()) {
}

void BatchedModelDraft::begin(std::span<const std::vector<std::int32_t>> prompts) {
  for (const SeqId id : ids_)
    if (id.generation != 0) cache_.seq_rm(id);
  // A sequence's draft state is made at its first propose (it has joined
  // the batch) and released at finish: with max_batch, only the sequences
  // decoding hold one, however many prompts wait.
  ids_.assign(prompts.size(), SeqId{});
  seen_.assign(prompts.size(), 0);
  rngs_.clear();
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    rngs_.emplace_back((sampling_.seed + i) ^ 0x9e3779b97f4a7c15ull);  // as ModelDraft's with seed + i
  }
}

void BatchedModelDraft::propose(std::span<const Request> requests) {
  const auto V = static_cast<std::size_t>(model_.vocab_size());
  std::vector<float> logits;
  std::vector<SequenceTokens> batch;
  std::vector<std::int32_t> fed(requests.size());  // the draft each request feeds at the next step
  // Step 0 feeds what each sequence's draft cache has not seen, every later
  // step the draft token of the step before, for the requests still drafting
  // (ModelDraft's forwards, batched).
  std::vector<std::size_t> live;
  // All but the last unseen token of each sequence first, in forwards of at
  // most max_prefill_rows_ rows in all and without logits: a batch of whole
  // prompts would need working memory for all their tokens at once.
  std::vector<std::span<const std::int32_t>> early(requests.size()), last(requests.size());
  for (const Request& q : requests) {
    if (ids_[q.index].generation != 0) continue;
    ids_[q.index] = cache_.add_sequence();
    cache_.activate_past_recording(ids_[q.index], max_draft_);
  }
  for (std::size_t r = 0; r < requests.size(); ++r) {
    const Request& q = requests[r];
    last[r] = q.sequence.subspan(static_cast<std::size_t>(seen_[q.index]));
    if (last[r].size() > 1) {
      early[r] = last[r].first(last[r].size() - 1);
      last[r] = last[r].last(1);
    }
  }
  for (std::size_t r = 0; r < requests.size();) {
    std::int64_t room = max_prefill_rows_;
    for (; r < requests.size() && room > 0; ++r) {
      if (early[r].empty()) continue;
      const auto n = static_cast<std::size_t>(std::min<std::int64_t>(room, static_cast<std::int64_t>(early[r].size())));
      batch.push_back({ids_[requests[r].index], early[r].first(n), LogitRows::kNone});
      early[r] = early[r].subspan(n);
      room -= static_cast<std::int64_t>(n);
      if (!early[r].empty()) break;  // no room left: this sequence goes on in the next forward
    }
    if (!batch.empty()) model_.forward_batch(batch, cache_, logits);
    batch.clear();
  }
  for (std::size_t r = 0; r < requests.size(); ++r) {
    const Request& q = requests[r];
    batch.push_back({ids_[q.index], last[r], LogitRows::kLast});
    seen_[q.index] = static_cast<std::int64_t>(q.sequence.size());
    q.drafts->clear();
    live.push_back(r);
  }
  while (!live.empty()) {
    model_.forward_batch(batch, cache_, logits);
    std::vector<std::size_t> next;
    std::vector<SequenceTokens> next_batch;
    std::size_t offset = 0;  // one row of logits per request
    for (std::size_t r : live) {
      const Request& q = requests[r];
      const std::span<const float> row(logits.data() + offset++ * V, V);
      std::int32_t token;
      if (sampling_.greedy()) {
        token = static_cast<std::int32_t>(kernels::argmax(row.data(), static_cast<std::int64_t>(V)));
      } else {
        std::vector<float> p = sampling_distribution(row, sampling_);
        token = sample_from(p, rngs_[q.index]);
        if (q.probs) q.probs->push_back(std::move(p));
      }
      q.drafts->push_back(token);
      if (static_cast<std::int64_t>(q.drafts->size()) < q.k) {
        fed[r] = token;
        next_batch.push_back({ids_[q.index], std::span<const std::int32_t>(&fed[r], 1), LogitRows::kLast});
        ++seen_[q.index];
        next.push_back(r);
      }
    }
    live = std::move(next);
    batch = std::move(next_batch);
  }
}

void BatchedModelDraft::accept(std::size_t index, std::int64_t proposed, std::int64_t accepted) {
  if (proposed <= 0) return;
  // As ModelDraft::accept: the cache holds the sequence plus the first
  // proposed - 1 drafts; the accepted ones stay.
  const std::int64_t fed_drafts = proposed - 1;
  const std::int64_t remove = fed_drafts - std::min(accepted, fed_drafts);
  const auto t0 = Clock::now();
  cache_.crop(ids_[index], -remove);
  cache_seconds_ += seconds_since(t0);
  seen_[index] -= remove;
}

void BatchedModelDraft::finish(std::size_t index) {
  if (ids_[index].generation != 0) cache_.seq_rm(ids_[index]);
  ids_[index] = SeqId{};
  seen_[index] = 0;  // the index may be given to a new sequence
}

ModelDraft::ModelDraft(const Model& draft, SamplingParams sampling, std::int64_t max_draft,
                       std::int64_t max_prefill_rows)
    : model_(draft), sampling_(sampling), max_prefill_rows_((check_prefill_rows(max_prefill_rows), max_prefill_rows)),
      rng_(sampling.seed ^ 0x9e3779b97f4a7c15ull), cache_(draft.make_cache()) {
  cache_.activate_past_recording(std::max<std::int64_t>(max_draft, 1));
}

void ModelDraft::begin(std::span<const std::int32_t>) {
  cache_.reset();
  seen_ = 0;
}

std::vector<std::int32_t> ModelDraft::propose(std::span<const std::int32_t> sequence, std::int64_t k,
                                              std::vector<std::vector<float>>* probs) {
  std::vector<std::int32_t> out;
  if (k <= 0) return out;
  std::vector<float> logits;
  const auto size = static_cast<std::int64_t>(sequence.size());
  forward_in_pieces(model_, sequence.subspan(static_cast<std::size_t>(seen_)), max_prefill_rows_, cache_, logits,
                    &cache_seconds_, [](std::int64_t) {});
  seen_ = size;
  for (std::int64_t i = 0; i < k; ++i) {
    std::int32_t token;
    if (sampling_.greedy()) {
      token = static_cast<std::int32_t>(kernels::argmax(logits.data(), static_cast<std::int64_t>(logits.size())));
    } else {
      std::vector<float> q = sampling_distribution(logits, sampling_);
      token = sample_from(q, rng_);
      if (probs) probs->push_back(std::move(q));
    }
    out.push_back(token);
    if (i + 1 < k) {
      model_.forward(std::span<const std::int32_t>(&token, 1), cache_, logits, false, &cache_seconds_);
      ++seen_;
    }
  }
  return out;
}

void ModelDraft::accept(std::int64_t proposed, std::int64_t accepted) {
  if (proposed <= 0) return;
  // The cache holds the sequence plus the first proposed - 1 drafts; the
  // accepted ones stay, the rest go (crop(0) when nothing is rejected).
  const std::int64_t fed_drafts = proposed - 1;
  const std::int64_t remove = fed_drafts - std::min(accepted, fed_drafts);
  const auto t0 = Clock::now();
  cache_.crop(-remove);
  cache_seconds_ += seconds_since(t0);
  seen_ -= remove;
}

std::size_t ModelDraft::cache_bytes() const { return cache_.memory().bytes_reserved; }

LookupDraft::LookupDraft(std::int64_t max_ngram) : max_ngram_(max_ngram) {
  if (max_ngram < 1) throw InvalidArgument("prompt lookup needs an n-gram size >= 1, got " + std::to_string(max_ngram));
}

std::vector<std::int32_t> LookupDraft::propose(std::span<const std::int32_t> s, std::int64_t k,
                                               std::vector<std::vector<float>>*) {
  const auto n = static_cast<std::int64_t>(s.size());
  for (std::int64_t ng = std::min(max_ngram_, n - 1); ng >= 1; --ng) {
    const std::int32_t* pattern = s.data() + (n - ng);
    for (std::int64_t i = n - ng - 1; i >= 0; --i) {
      if (!std::equal(pattern, pattern + ng, s.data() + i)) continue;
      const std::int64_t from = i + ng, to = std::min(from + k, n);
      return std::vector<std::int32_t>(s.data() + from, s.data() + to);
    }
  }
  return {};
}

RandomDraft::RandomDraft(std::int64_t vocab, std::uint64_t seed) : vocab_(vocab), rng_(seed) {}

std::vector<std::int32_t> RandomDraft::propose(std::span<const std::int32_t>, std::int64_t k,
                                               std::vector<std::vector<float>>*) {
  std::vector<std::int32_t> out;
  for (std::int64_t i = 0; i < k; ++i)
    out.push_back(static_cast<std::int32_t>(rng_() % static_cast<std::uint64_t>(vocab_)));
  return out;
}

// ---- the speculative loop --------------------------------------------------------

}  // namespace rwd::runtime
