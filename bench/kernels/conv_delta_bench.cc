// The Gated DeltaNet recurrence in isolation (BM_GatedDeltaRule* of
// rewind_kernel_bench): kernels::gated_delta_rule over `tokens` tokens of
// every value head, the state updated in place (one slot, as a prompt's
// forward without recording gets it). Arguments: tokens (1: a decoding
// step, 64: a piece of a prompt). Shapes: Qwen3.5-0.8B's linear-attention
// layer (16 value heads over 16 key heads, k_dim = v_dim = 128: a 64 KiB
// state per head) and one whose value dim leaves a tail (4 heads, 48 x 40).
// Counter: flops_per_second (7 per state element and token: the decay, the
// two multiply-adds of kv and o, the update's multiply-add).
// BM_CausalConv: kernels::causal_conv1d over `rows` rows, the
// linear-attention mixer's shape (6,144 channels, kernel 4, SiLU fused),
// the cache's window layout (channel stride 1); BM_CausalConvTaps: the same
// with the weights tap-major (causal_conv1d_taps, what the model runs).
// Arguments: rows (1 to 3: a decoding step's rows, 512: a prompt's).
// Counter: bytes_per_second (window, weights and outputs once each).
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "runtime/kernels.h"

namespace {

namespace k = rwd::runtime::kernels;

struct DeltaShape {
  std::int64_t v_heads, k_heads, k_dim, v_dim;
};

void gated_delta(benchmark::State& state, DeltaShape s) {
  const std::int64_t tokens = state.range(0);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  const auto fill = [&](std::vector<float>& v, std::int64_t n) {
    v.resize(static_cast<std::size_t>(n));
    for (float& x : v) x = uniform(rng);
  };
  std::vector<float> q, key, v, g, beta, slot, out;
  fill(q, tokens * s.k_heads * s.k_dim);
  fill(key, tokens * s.k_heads * s.k_dim);
  fill(v, tokens * s.v_heads * s.v_dim);
  fill(g, tokens * s.v_heads);
  fill(beta, tokens * s.v_heads);
  fill(slot, s.v_heads * s.k_dim * s.v_dim);
  out.resize(static_cast<std::size_t>(tokens * s.v_heads * s.v_dim));
  // Unit keys and queries, decays below 1 and betas in (0, 1): the state
  // stays bounded however many iterations run.
  k::l2_normalize(q.data(), tokens * s.k_heads, s.k_dim, 1e-6f);
  k::l2_normalize(key.data(), tokens * s.k_heads, s.k_dim, 1e-6f);
  for (float& x : g) x = -0.1f - 0.5f * std::abs(x);
  for (float& x : beta) x = 0.5f + 0.4f * x;
  const std::vector<float*> states(static_cast<std::size_t>(tokens), slot.data());
  for (auto _ : state) {
    k::gated_delta_rule(q.data(), key.data(), v.data(), g.data(), beta.data(), tokens, s.v_heads, s.k_heads, s.k_dim,
                        s.v_dim, slot.data(), states.data(), out.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::DoNotOptimize(slot.data());
  }
  state.counters["flops_per_second"] = benchmark::Counter(
      7.0 * static_cast<double>(tokens * s.v_heads * s.k_dim * s.v_dim), benchmark::Counter::kIsIterationInvariantRate,
      benchmark::Counter::kIs1000);
}

void BM_GatedDeltaRuleQwen35(benchmark::State& state) { gated_delta(state, {16, 16, 128, 128}); }
void BM_GatedDeltaRuleTail(benchmark::State& state) { gated_delta(state, {4, 4, 48, 40}); }

BENCHMARK(BM_GatedDeltaRuleQwen35)->ArgNames({"tokens"})->Arg(1)->Arg(64)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_GatedDeltaRuleTail)->ArgNames({"tokens"})->Arg(64)->Unit(benchmark::kMicrosecond);

void causal_conv(benchmark::State& state, bool tap_major) {
  const std::int64_t q = state.range(0), channels = 6144, kernel = 4;
  std::mt19937 rng(12);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> window(static_cast<std::size_t>((kernel - 1 + q) * channels)),
      w(static_cast<std::size_t>(channels * kernel));
  for (float& x : window) x = uniform(rng);
  for (float& x : w) x = uniform(rng);
  std::vector<float> out(static_cast<std::size_t>(q * channels));
  for (auto _ : state) {
    if (tap_major) {
      k::causal_conv1d_taps(window.data(), channels, kernel, q, 1, channels, w.data(), nullptr, true, out.data());
    } else {
      k::causal_conv1d(window.data(), channels, kernel, q, 1, channels, w.data(), nullptr, true, out.data());
    }
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["bytes_per_second"] = benchmark::Counter(
      4.0 * static_cast<double>((kernel - 1 + 2 * q) * channels + channels * kernel),
      benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1024);
}

void BM_CausalConv(benchmark::State& state) { causal_conv(state, false); }
void BM_CausalConvTaps(benchmark::State& state) { causal_conv(state, true); }

BENCHMARK(BM_CausalConv)->ArgNames({"rows"})->Arg(1)->Arg(2)->Arg(3)->Arg(512)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_CausalConvTaps)->ArgNames({"rows"})->Arg(1)->Arg(2)->Arg(3)->Arg(512)->Unit(benchmark::kMicrosecond);

}  // namespace
