// runtime/generation/stats.cc: the statistics' JSON lines.
#include "runtime/generate.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "internal.h"

namespace rwd::runtime {

using namespace generation;

namespace {

// The one serializer of a GenerationStats' counts: a single call's --stats
// line, a batch's line and each entry of its per_sequence list have these
// keys.
nlohmann::json stats_object(const GenerationStats& s) {
  nlohmann::json j;
  j["new_tokens"] = s.new_tokens;
  j["prompt_tokens"] = s.prompt_tokens;
  j["seconds"] = s.seconds;
  j["time_to_first_token_s"] = s.time_to_first_token;
  j["tokens_per_second"] = s.tokens_per_second();
  j["decode_tokens_per_second"] = s.decode_tokens_per_second();
  j["drafted"] = s.drafted;
  j["accepted"] = s.accepted;
  j["acceptance_rate"] = s.acceptance_rate();
  j["drafted_at"] = s.drafted_at;
  j["accepted_at"] = s.accepted_at;
  nlohmann::json by_position = nlohmann::json::array();
  for (std::size_t i = 0; i < s.drafted_at.size(); ++i) by_position.push_back(s.acceptance_at(i));
  j["acceptance_at"] = by_position;
  j["rollbacks"] = s.rollbacks;
  j["rounds"] = s.rounds;
  j["forwards"] = s.forwards;
  j["cache_seconds"] = s.cache_seconds;
  j["peak_cache_bytes"] = s.peak_cache_bytes;
  j["prefix_hit_tokens"] = s.prefix_hit_tokens;
  j["seed"] = s.seed ? nlohmann::json(*s.seed) : nlohmann::json(nullptr);
  j["threads"] = s.threads;
  return j;
}

}  // namespace

void GenerationStats::sum_per_sequence() {
  new_tokens = prompt_tokens = rounds = drafted = accepted = rollbacks = prefix_hit_tokens = 0;
  drafted_at.clear();
  accepted_at.clear();
  time_to_first_token = 0.0;
  cache_seconds = draft_cache_seconds;
  peak_cache_bytes = 0;
  if (!per_sequence.empty()) {
    seed = per_sequence.front().seed;
    threads = per_sequence.front().threads;
  }
  for (const GenerationStats& s : per_sequence) {
    new_tokens += s.new_tokens;
    prompt_tokens += s.prompt_tokens;
    if (s.new_tokens > 0) time_to_first_token = std::max(time_to_first_token, s.time_to_first_token);
    rounds += s.rounds;
    drafted += s.drafted;
    accepted += s.accepted;
    drafted_at.resize(std::max(drafted_at.size(), s.drafted_at.size()), 0);
    accepted_at.resize(drafted_at.size(), 0);
    for (std::size_t i = 0; i < s.drafted_at.size(); ++i) {
      drafted_at[i] += s.drafted_at[i];
      accepted_at[i] += s.accepted_at[i];
    }
    rollbacks += s.rollbacks;
    cache_seconds += s.cache_seconds;
    peak_cache_bytes = std::max(peak_cache_bytes, s.peak_cache_bytes);
    prefix_hit_tokens += s.prefix_hit_tokens;
  }
}

double GenerationStats::decode_tokens_per_second() const {
  if (!batched()) {
    const double t = seconds - time_to_first_token;
    return new_tokens > 1 && t > 0 ? static_cast<double>(new_tokens - 1) / t : 0.0;
  }
  double last_first = 0.0;
  std::int64_t after_first = 0;
  for (const GenerationStats& s : per_sequence) {
    if (s.new_tokens < 1) continue;
    last_first = std::max(last_first, s.time_to_first_token);
    after_first += s.new_tokens - 1;
  }
  const double t = decode_seconds ? *decode_seconds : seconds - last_first;
  return after_first > 0 && t > 0 ? static_cast<double>(after_first) / t : 0.0;
}

std::string GenerationStats::to_json() const {
  nlohmann::json j = stats_object(*this);
  if (!batched()) return j.dump();
  nlohmann::json ttft = nlohmann::json::array(), each = nlohmann::json::array();
  for (const GenerationStats& s : per_sequence) {
    ttft.push_back(s.time_to_first_token);
    each.push_back(stats_object(s));
  }
  j["time_to_first_token_s"] = ttft;
  j["sequences"] = per_sequence.size();
  j["max_batch"] = max_batch;
  j["peak_batch"] = peak_batch;
  j["per_sequence"] = each;
  return j.dump();
}

std::string indexed_text_json(std::size_t index, const std::string& text) {
  const nlohmann::json line{{"index", index}, {"text", text}};
  return line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace rwd::runtime
