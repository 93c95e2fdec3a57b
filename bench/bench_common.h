// What rewind_bench (cache_bench.cc) and rewind_sequence_bench
// (sequence_bench.cc) share: the shapes of current models, the calibrated
// clock of manual timing, and the one prepared state kept across Google
// Benchmark's calls.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace rwd::bench {

// 8 KV heads x 128 head dim; conv states of 8192 channels, K = 4;
// recurrent states [32, 128, 128] f32 (Qwen3.5-sized, 2 MiB).
inline constexpr std::int64_t kHeads = 8;
inline constexpr std::int64_t kHeadDim = 128;
inline constexpr std::int64_t kConvChannels = 8192;
inline constexpr std::int64_t kConvKernel = 4;
inline constexpr std::int64_t kStateHeads = 32;
inline constexpr std::int64_t kStateDim = 128;
inline constexpr std::int64_t kPrefillChunk = 2048;  // tokens per update while filling a state to L

using Clock = std::chrono::steady_clock;

inline double g_clock_overhead_s = 0;  // one back-to-back pair of Clock::now()

inline double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The median cost of two back-to-back clock reads, subtracted from every
// manually timed interval.
inline void calibrate_clock() {
  std::vector<double> pairs(20001);
  for (auto& p : pairs) {
    const auto t0 = Clock::now();
    const auto t1 = Clock::now();
    p = seconds(t1 - t0);
  }
  std::nth_element(pairs.begin(), pairs.begin() + 10000, pairs.end());
  g_clock_overhead_s = pairs[10000];
}

// The median of v (the mean of the middle two for an even count, as the
// runtime's decode benchmark reports); 0 when empty. Defined here so the
// cache benchmarks need nothing from the runtime.
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// "1k", "64k", "8199".
inline std::string tokens_label(std::int64_t n) {
  return n % 1024 == 0 ? std::to_string(n / 1024) + "k" : std::to_string(n);
}

// ---- one prepared state at a time ---------------------------------------------
// Google Benchmark calls a benchmark function several times (to estimate the
// iteration count, then once per repetition). Filling a state to 64k tokens
// takes longer than measuring it, so the last prepared state is kept, keyed by
// benchmark name, and dropped as soon as another one is asked for: at most one
// is alive. Every benchmark leaves its state as it found it (same L).
struct Slot {
  std::string key;
  std::shared_ptr<void> object;
};
inline Slot& slot() {
  static Slot s;
  return s;
}
template <typename T, typename... Args>
T& prepared(const std::string& key, Args&&... args) {
  Slot& s = slot();
  if (s.key != key || !s.object) {
    s.object.reset();  // free the previous state before building the next
    s.key.clear();
    s.object = std::make_shared<T>(std::forward<Args>(args)...);
    s.key = key;
  }
  return *static_cast<T*>(s.object.get());
}
inline void release_prepared() {
  slot().object.reset();
  slot().key.clear();
}

// The main() of a bench binary: Google Benchmark's flags, the clock
// calibrated, `register_all` registering the cases, the prepared state freed.
inline int run_benchmarks(int argc, char** argv, void (*register_all)()) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  calibrate_clock();
  register_all();
  benchmark::AddCustomContext("clock_pair_overhead_ns", std::to_string(g_clock_overhead_s * 1e9));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  release_prepared();
  return 0;
}

}  // namespace rwd::bench
