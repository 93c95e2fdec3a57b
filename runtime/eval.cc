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

EvalResult evaluate_text(const Model& model, std::string_view text, const EvalOptions& options) {
  if (text.empty()) throw InvalidArgument("evaluate_text: the text is empty");
  if (options.chunk < 1) throw InvalidArgument("evaluate_text: chunk must be >= 1, got " + std::to_string(options.chunk));
  if (options.context < 0) {
    throw InvalidArgument("evaluate_text: context must be >= 0 (0 = whole text), got " +
                          std::to_string(options.context));
  }
  const auto t0 = std::chrono::steady_clock::now();
  const auto total = static_cast<std::int64_t>(text.size());
  const std::int64_t segment = options.context > 0 ? options.context : total;
  const std::int64_t V = model.vocab_size();
  EvalResult result;
  Cache cache = model.make_cache();
  std::vector<float> logits;
  for (std::int64_t start = 0; start < total; start += segment) {
    const std::int64_t len = std::min(segment, total - start);
    // BOS + the segment's bytes; the last byte is only a target, never fed.
    const std::vector<std::int32_t> tokens =
        encode_prompt(std::string(text.substr(static_cast<std::size_t>(start), static_cast<std::size_t>(len))),
                      model.config());
    cache.reset();
    for (std::int64_t s = 0; s < len; s += options.chunk) {
      const std::int64_t e = std::min(len, s + options.chunk);
      model.forward(std::span<const std::int32_t>(tokens.data() + s, static_cast<std::size_t>(e - s)), cache, logits,
                    true);
      ++result.forwards;
      for (std::int64_t j = s; j < e; ++j) {
        result.bits += negative_log2_prob(logits.data() + (j - s) * V, V, tokens[static_cast<std::size_t>(j + 1)]);
      }
      result.bytes += e - s;
      if (options.on_progress) options.on_progress(result.bytes, total);
    }
    ++result.segments;
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return result;
}

}  // namespace rwd::runtime
