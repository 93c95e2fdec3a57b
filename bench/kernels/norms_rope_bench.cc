// The normalisations and RoPE in isolation (BM_RmsNorm, BM_GatedRmsNorm,
// BM_L2Normalize, BM_Rope of rewind_kernel_bench), at the shapes a
// Qwen3.5-0.8B-like forward gives them. Argument: rows (1: a decoding
// step, 512: a prompt's piece).
//  - BM_RmsNorm: a residual row of 1,024;
//  - BM_GatedRmsNorm: the Gated DeltaNet output, 16 value heads of 128 per row;
//  - BM_L2Normalize: the delta rule's queries, 16 key heads of 128 per row;
//  - BM_Rope: 8 query heads of 256, partial rotary of 64 (RopeTable built
//    outside the loop).
// Counter: bytes_per_second (floats read and written once each).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "runtime/kernels.h"

namespace {

namespace k = rwd::runtime::kernels;

std::vector<float> random_floats(std::int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = uniform(rng);
  return v;
}

void set_bytes(benchmark::State& state, std::int64_t floats) {
  state.counters["bytes_per_second"] = benchmark::Counter(
      4.0 * static_cast<double>(floats), benchmark::Counter::kIsIterationInvariantRate, benchmark::Counter::kIs1024);
}

void BM_RmsNorm(benchmark::State& state) {
  const std::int64_t rows = state.range(0), dim = 1024;
  const std::vector<float> x = random_floats(rows * dim, 1), w = random_floats(dim, 2);
  std::vector<float> y(x.size());
  for (auto _ : state) {
    k::rms_norm(x.data(), w.data(), rows, dim, 1e-6, y.data());
    benchmark::DoNotOptimize(y.data());
  }
  set_bytes(state, 2 * rows * dim);
}

void BM_GatedRmsNorm(benchmark::State& state) {
  const std::int64_t rows = state.range(0) * 16, dim = 128;
  const std::vector<float> x = random_floats(rows * dim, 3), z = random_floats(rows * dim, 4),
                           w = random_floats(dim, 5);
  std::vector<float> y(x.size());
  for (auto _ : state) {
    k::gated_rms_norm(x.data(), z.data(), w.data(), rows, dim, 1e-6, y.data());
    benchmark::DoNotOptimize(y.data());
  }
  set_bytes(state, 3 * rows * dim);
}

void BM_L2Normalize(benchmark::State& state) {
  const std::int64_t rows = state.range(0) * 16, dim = 128;
  std::vector<float> x = random_floats(rows * dim, 6);
  for (auto _ : state) {
    k::l2_normalize(x.data(), rows, dim, 1e-6f);  // unit rows stay unit rows
    benchmark::DoNotOptimize(x.data());
  }
  set_bytes(state, 2 * rows * dim);
}

void BM_Rope(benchmark::State& state) {
  const std::int64_t rows = state.range(0), heads = 8, head_dim = 256, rotary = 64;
  std::vector<std::int64_t> positions(static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r) positions[static_cast<std::size_t>(r)] = 1000 + r;
  const k::RopeTable table(positions.data(), rows, 1e7, rotary);
  std::vector<float> x = random_floats(rows * heads * head_dim, 7);
  for (auto _ : state) {
    k::rope_inplace(x.data(), rows, heads, head_dim, table);  // rotations keep norms bounded
    benchmark::DoNotOptimize(x.data());
  }
  set_bytes(state, 2 * rows * heads * rotary);
}

BENCHMARK(BM_RmsNorm)->ArgNames({"rows"})->Arg(1)->Arg(512)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_GatedRmsNorm)->ArgNames({"rows"})->Arg(1)->Arg(512)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_L2Normalize)->ArgNames({"rows"})->Arg(1)->Arg(512)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Rope)->ArgNames({"rows"})->Arg(1)->Arg(512)->Unit(benchmark::kMicrosecond);

}  // namespace
