// runtime/generation/sampling.cc: sampling parameters, distributions and draws.
#include "runtime/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "internal.h"
#include "rewind/error.h"
#include "runtime/kernels.h"

namespace rwd::runtime {

using namespace generation;

void validate(const SamplingParams& p) {
  if (!(p.temperature >= 0.0f) || !std::isfinite(p.temperature)) {
    throw InvalidArgument("temperature must be a finite number >= 0 (0 = greedy), got " +
                          std::to_string(p.temperature));
  }
  if (p.top_k < 0) throw InvalidArgument("top_k must be >= 0 (0 = off), got " + std::to_string(p.top_k));
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    throw InvalidArgument("top_p must be in (0, 1], got " + std::to_string(p.top_p));
  }
}

std::vector<float> sampling_distribution(std::span<const float> logits, const SamplingParams& params) {
  const auto n = static_cast<std::int64_t>(logits.size());
  std::vector<float> scaled(logits.begin(), logits.end());
  kernels::scale_inplace(scaled.data(), n, 1.0f / params.temperature);
  std::vector<float> p(scaled.size());
  kernels::softmax(scaled.data(), n, p.data());
  if (params.top_k == 0 && params.top_p >= 1.0f) return p;
  std::vector<std::int32_t> order(p.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
    return p[static_cast<std::size_t>(a)] > p[static_cast<std::size_t>(b)];
  });
  std::size_t keep = order.size();
  if (params.top_k > 0) keep = std::min(keep, static_cast<std::size_t>(params.top_k));
  if (params.top_p < 1.0f) {
    double mass = 0.0;
    for (std::size_t i = 0; i < keep; ++i) {
      mass += p[static_cast<std::size_t>(order[i])];
      if (mass >= params.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  std::vector<float> out(p.size(), 0.0f);
  double total = 0.0;
  for (std::size_t i = 0; i < keep; ++i) total += p[static_cast<std::size_t>(order[i])];
  for (std::size_t i = 0; i < keep; ++i) {
    const auto t = static_cast<std::size_t>(order[i]);
    out[t] = static_cast<float>(p[t] / total);
  }
  return out;
}

std::int32_t sample_from(std::span<const float> probs, std::mt19937_64& rng) {
  const double u = uniform01(rng);
  double cumulative = 0.0;
  std::int32_t last = 0;
  for (std::size_t i = 0; i < probs.size(); ++i) {
    if (probs[i] <= 0.0f) continue;
    cumulative += probs[i];
    last = static_cast<std::int32_t>(i);
    if (u < cumulative) return last;
  }
  return last;  // rounding left u above the total: the last possible token
}

namespace generation {

std::int32_t pick(std::span<const float> logits, const SamplingParams& params, std::mt19937_64& rng) {
  if (params.greedy()) {
    return static_cast<std::int32_t>(kernels::argmax(logits.data(), static_cast<std::int64_t>(logits.size())));
  }
  const std::vector<float> p = sampling_distribution(logits, params);
  return sample_from(p, rng);
}

}  // namespace generation

}  // namespace rwd::runtime
