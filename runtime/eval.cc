#include "runtime/eval.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "rewind/error.h"

namespace rwd::runtime {

double negative_log2_prob(const float* logits, std::int64_t n, std::int64_t target) {
  float max_value = logits[0];
  for (std::int64_t i = 1; i < n; ++i) max_value = std::max(max_value, logits[i]);
  double sum = 0.0;
  for (std::int64_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(logits[i]) - max_value);
  const double log_prob = static_cast<double>(logits[target]) - max_value - std::log(sum);
  return -log_prob / std::log(2.0);
}

namespace {

// One window of the text's tokens: fed [feed, end), targets [target, end).
struct Window {
  std::int64_t feed = 0, target = 0, end = 0;
};

std::string count(std::int64_t n, const char* unit) { return std::to_string(n) + " " + unit + (n == 1 ? "" : "s"); }

void check_options(const std::string& where, std::string_view text, const EvalOptions& options) {
  if (text.empty()) throw InvalidArgument(where + ": the text is empty");
  if (options.chunk < 1) throw InvalidArgument(where + ": chunk must be >= 1, got " + std::to_string(options.chunk));
  if (options.context < 0) {
    throw InvalidArgument(where + ": context must be >= 0 (0 = the whole text), got " +
                          std::to_string(options.context));
  }
  if (options.context == 0 && options.stride != 0) {
    throw InvalidArgument(where + ": stride " + std::to_string(options.stride) +
                          " needs a context (context 0 scores the whole text as one window)");
  }
  if (options.stride < 0 || options.stride > options.context) {
    throw InvalidArgument(where + ": stride " + std::to_string(options.stride) + " must be in [1, context " +
                          std::to_string(options.context) + "], or 0 for disjoint windows");
  }
}

void check_vocabulary(const std::string& where, const std::vector<std::int32_t>& ids, std::int64_t V) {
  for (const std::int32_t id : ids) {
    if (id < 0 || id >= V) {
      throw InvalidArgument(where + ": the tokenizer gives token " + std::to_string(id) +
                            ", outside the model's vocabulary [0, " + std::to_string(V) + ")");
    }
  }
}

// Windows of W tokens every S tokens, each scoring only the tokens no earlier
// window scored; the scored tokens are appended to scored_ids in text order.
std::vector<Window> plan_windows(const std::vector<std::int32_t>& tokens, std::int64_t P, std::int64_t W,
                                 std::int64_t S, std::vector<std::int32_t>& scored_ids) {
  const auto N = static_cast<std::int64_t>(tokens.size());
  std::vector<Window> windows;
  for (std::int64_t end = 0, k = 0; end < N; ++k) {
    Window w;
    w.feed = k * S;
    w.target = end;
    w.end = std::min(w.feed + W, N);
    // With no prefix, the window's first token has nothing before it.
    const std::int64_t first_scored = (P == 0 && w.target == w.feed) ? w.target + 1 : w.target;
    if (first_scored < w.end) {
      scored_ids.insert(scored_ids.end(), tokens.begin() + first_scored, tokens.begin() + w.end);
      w.target = first_scored;
      windows.push_back(w);
    }
    end = w.end;
  }
  return windows;
}

// Feeds one window from a reset cache, chunk tokens per forward, and adds
// its scored tokens' bits to result.
void score_window(const Model& model, const Window& w, const std::vector<std::int32_t>& prefix,
                  const std::vector<std::int32_t>& tokens, const EvalOptions& options, std::int64_t total, Cache& cache,
                  std::vector<float>& logits, std::vector<std::int32_t>& sequence, EvalResult& result) {
  const std::int64_t V = model.vocab_size();
  const auto P = static_cast<std::int64_t>(prefix.size());
  sequence.assign(prefix.begin(), prefix.end());
  sequence.insert(sequence.end(), tokens.begin() + w.feed, tokens.begin() + w.end);
  // Row i of the logits predicts sequence[i + 1]: the last token is only a
  // target, never fed; rows before the first target's are context only.
  const std::int64_t fed = static_cast<std::int64_t>(sequence.size()) - 1;
  const std::int64_t first_row = P + (w.target - w.feed) - 1;
  cache.reset();
  for (std::int64_t s = 0; s < fed; s += options.chunk) {
    const std::int64_t e = std::min(fed, s + options.chunk);
    const bool scores = e > first_row;
    model.forward(std::span<const std::int32_t>(sequence.data() + s, static_cast<std::size_t>(e - s)), cache, logits,
                  scores);
    ++result.forwards;
    if (scores) {
      for (std::int64_t row = std::max(s, first_row); row < e; ++row) {
        result.bits += negative_log2_prob(logits.data() + (row - s) * V, V,
                                          sequence[static_cast<std::size_t>(row + 1)]);
      }
      result.tokens += e - std::max(s, first_row);
    }
    if (options.on_progress) options.on_progress(result.tokens, total);
  }
  ++result.segments;
}

}  // namespace

EvalResult evaluate_text(const Model& model, const Tokenizer& tokenizer, std::string_view text,
                         const EvalOptions& options) {
  const std::string where = "evaluate_text";
  check_options(where, text, options);
  const auto t0 = std::chrono::steady_clock::now();
  const bool byte_level = tokenizer.kind() == TokenizerKind::ByteLevel;
  const char* unit = byte_level ? "byte" : "token";
  const std::vector<std::int32_t> tokens = tokenizer.encode(text, false);
  const std::vector<std::int32_t> prefix = tokenizer.prefix_ids();
  const std::int64_t V = model.vocab_size();
  check_vocabulary(where, prefix, V);
  check_vocabulary(where, tokens, V);
  const auto N = static_cast<std::int64_t>(tokens.size());
  const auto P = static_cast<std::int64_t>(prefix.size());
  if (N == 0) throw InvalidArgument(where + ": the text encodes to no tokens");
  const std::int64_t W = options.context > 0 ? std::min(options.context, N) : N;
  const std::int64_t S = options.stride > 0 ? std::min(options.stride, W) : W;
  if (const std::int64_t limit = model.config().max_position_embeddings; limit > 0 && P + W > limit) {
    throw InvalidArgument(where + ": context " + std::to_string(options.context) + " makes windows of " +
                          std::to_string(P + W) + " positions (" + std::to_string(P) + " before the text + " +
                          count(W, unit) + "), past the model's max_position_embeddings (" + std::to_string(limit) +
                          "); give a context of at most " + std::to_string(limit - P));
  }

  // Plan every window and what it scores before the first forward, so that
  // a text with nothing to score is refused without work.
  std::vector<std::int32_t> scored_ids;
  const std::vector<Window> windows = plan_windows(tokens, P, W, S, scored_ids);
  if (scored_ids.empty()) {
    throw InvalidArgument(where + ": nothing to score: the text is " + count(N, unit) +
                          (W < N ? ", windows of " + count(W, unit) : std::string()) +
                          ", and the tokenizer puts no token (BOS) before a text, so a window's first token "
                          "is not predicted; give a text" +
                          (W < N ? " and a context" : std::string()) + " of at least 2 tokens");
  }
  EvalResult result;
  result.text_tokens = N;
  result.bytes = static_cast<std::int64_t>(tokenizer.decode(scored_ids, false).size());
  if (result.bytes == 0) {
    throw InvalidArgument(where + ": the " + count(static_cast<std::int64_t>(scored_ids.size()), "scored token") +
                          (scored_ids.size() == 1 ? " decodes" : " decode") +
                          " to no bytes; bits per byte is undefined");
  }
  const auto total = static_cast<std::int64_t>(scored_ids.size());

  Cache cache = model.make_cache();
  std::vector<float> logits;
  std::vector<std::int32_t> sequence;
  for (const Window& w : windows)
    score_window(model, w, prefix, tokens, options, total, cache, logits, sequence, result);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

EvalResult evaluate_text(const Model& model, std::string_view text, const EvalOptions& options) {
  const ModelConfig& c = model.config();
  const std::int64_t bos = c.add_bos ? c.bos_token_id : -1;
  const std::int64_t eos = c.eos_token_ids.empty() ? -1 : c.eos_token_ids.front();
  const Tokenizer tokenizer = Tokenizer::byte_level(c.vocab_size, static_cast<std::int32_t>(bos),
                                                    static_cast<std::int32_t>(eos));
  return evaluate_text(model, tokenizer, text, options);
}

}  // namespace rwd::runtime
