// matmul in isolation (BM_Matmul* of rewind_kernel_bench): y = x w^T for
// `rows` rows of x against one packed matrix, by element type. Arguments:
// rows (1: a decoding step; K + 1: a verification forward) and the element
// type (0 f32, 1 f16, 2 bf16, 3 Q8 quantized from the f32 values). Shapes: one of the shipped target's
// projections (192 inputs, 512 outputs: resident in L2 / L3) and a Qwen3-size
// one (1024 x 4096: 4-16 MB, past L2; from L3 or memory, by CPU). Counter: flops_per_second (2 per
// multiply-add). Which instruction-set copy runs follows the CPU and the
// REWIND_MATMUL_* environment overrides (docs/building.md).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include "rewind/dtype.h"
#include "runtime/kernels.h"

namespace {

namespace k = rwd::runtime::kernels;

k::PackedMatrix packed(const std::vector<float>& w, std::int64_t out, std::int64_t in, std::int64_t element) {
  if (element == 0) return k::PackedMatrix(w.data(), out, in);
  if (element == 3) return k::PackedMatrix::from_q8(w.data(), k::PackedMatrix::Element::F32, out, in);
  std::vector<std::uint16_t> h(w.size());
  for (std::size_t i = 0; i < w.size(); ++i) {
    h[i] = element == 1 ? rwd::f32_to_f16(w[i]) : rwd::f32_to_bf16(w[i]);
  }
  return element == 1 ? k::PackedMatrix::from_f16(h.data(), out, in) : k::PackedMatrix::from_bf16(h.data(), out, in);
}

void matmul(benchmark::State& state, std::int64_t in, std::int64_t out) {
  const std::int64_t rows = state.range(0), element = state.range(1);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  std::vector<float> w(static_cast<std::size_t>(out * in)), x(static_cast<std::size_t>(rows * in));
  for (float& v : w) v = normal(rng);
  for (float& v : x) v = normal(rng);
  const k::PackedMatrix m = packed(w, out, in, element);
  std::vector<float> y(static_cast<std::size_t>(rows * out));
  for (auto _ : state) {
    k::matmul(x.data(), rows, m, y.data());
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["flops_per_second"] = benchmark::Counter(2.0 * static_cast<double>(rows * in * out),
                                                          benchmark::Counter::kIsIterationInvariantRate);
}

void BM_MatmulShipped(benchmark::State& state) { matmul(state, 192, 512); }
void BM_MatmulQwen3(benchmark::State& state) { matmul(state, 1024, 4096); }

BENCHMARK(BM_MatmulShipped)
    ->ArgNames({"rows", "element"})
    ->ArgsProduct({{1, 2, 5, 8, 16}, {0, 1, 2, 3}})
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_MatmulQwen3)
    ->ArgNames({"rows", "element"})
    ->ArgsProduct({{1, 5}, {0, 1, 2, 3}})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
