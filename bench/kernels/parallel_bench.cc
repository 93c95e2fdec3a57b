// The kernels' thread pool in isolation (BM_ParallelFor of
// rewind_kernel_bench): what splitting a kernel costs. Arguments: threads,
// pieces, and the floats each piece sums (0: an empty body, the pool's own
// cost: waking or finding its threads, handing out pieces, waiting for the
// last). A forward runs dozens of kernels, so this is paid dozens of times a
// token; compare it with the kernel's time on one thread.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "kernels/parallel.h"

namespace {

using rwd::runtime::kernels::detail::run_parallel;

struct Job {
  const float* x;
  std::int64_t floats;
  float* out;
};

void piece(void* ctx, std::int64_t i) {
  const Job& job = *static_cast<const Job*>(ctx);
  const float* x = job.x + i * job.floats;
  float s = 0.0f;
  for (std::int64_t j = 0; j < job.floats; ++j) s += x[j];
  job.out[i] = s;
}

void BM_ParallelFor(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const std::int64_t pieces = state.range(1), floats = state.range(2);
  const std::vector<float> x(static_cast<std::size_t>(pieces * floats), 1.0f);
  std::vector<float> out(static_cast<std::size_t>(pieces));
  Job job{x.data(), floats, out.data()};
  for (auto _ : state) {
    run_parallel(pieces, threads, piece, &job);
    benchmark::DoNotOptimize(out.data());
  }
}
BENCHMARK(BM_ParallelFor)
    ->ArgNames({"threads", "pieces", "floats"})
    ->Args({1, 8, 0})
    ->Args({2, 8, 0})
    ->Args({1, 8, 4096})
    ->Args({2, 8, 4096})
    ->Args({1, 8, 65536})
    ->Args({2, 8, 65536});

}  // namespace
