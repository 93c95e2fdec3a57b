// The runtime's decode attention in isolation (BM_DecodeAttention* of
// rewind_kernel_bench): kernels::attention_paged for S sequences of one decoding row each, every
// sequence's keys and values in 16-row blocks at scattered addresses, as a
// batched decoding round over a SequenceCache reads them. Arguments:
// sequences, context (keys per sequence), and whether the caches are
// flushed (a 64 MiB buffer written) before each round: 0 keeps the keys and
// values wherever the previous round left them (L2 / L3 when they fit), 1
// makes every round read them from DRAM, as when a round's weights have
// evicted them. Shapes: the shipped target's (4 query heads over 2 KV heads
// of 48) and a Qwen3-size one (32 over 8 of 128).
// Counters: kv_bytes_per_second (keys and values read), per_key_head (the
// time per key and KV head, all query heads of a group together).
// BM_PrefillAttention*: kernels::attention for a prompt of `rows` rows
// attending causally to themselves (one strided buffer), the shipped
// target's shape and a Qwen3.5-0.8B full-attention one (8 query heads over 2
// KV heads of 256). Counter: flops_per_second (2 per multiply-add of the
// scores and of the weighted values).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "runtime/kernels.h"

namespace {

namespace k = rwd::runtime::kernels;

constexpr std::int64_t kBlockRows = 16;

struct Shape {
  std::int64_t heads, kv_heads, head_dim;
};

// S sequences' blocks, shuffled across one pool of separately allocated
// blocks so that consecutive blocks of a sequence are not adjacent.
struct Batch {
  Shape shape;
  std::int64_t sequences, context, blocks_per_sequence;
  std::vector<std::vector<float>> keys, values;  // [block][row][kv head][head_dim]
  std::vector<std::int64_t> block_of;            // sequence * blocks_per_sequence + b -> pool index
  std::vector<float> q, out;                     // [sequence][heads][head_dim]

  Batch(Shape s, std::int64_t seqs, std::int64_t ctx)
      : shape(s), sequences(seqs), context(ctx), blocks_per_sequence((ctx + kBlockRows - 1) / kBlockRows) {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal;
    const std::int64_t pool = sequences * blocks_per_sequence;
    const auto block_floats = static_cast<std::size_t>(kBlockRows * s.kv_heads * s.head_dim);
    keys.assign(static_cast<std::size_t>(pool), std::vector<float>(block_floats));
    values.assign(static_cast<std::size_t>(pool), std::vector<float>(block_floats));
    for (auto* side : {&keys, &values}) {
      for (auto& block : *side) {
        for (float& x : block) x = normal(rng);
      }
    }
    block_of.resize(static_cast<std::size_t>(pool));
    std::iota(block_of.begin(), block_of.end(), 0);
    std::shuffle(block_of.begin(), block_of.end(), rng);
    q.resize(static_cast<std::size_t>(sequences * s.heads * s.head_dim));
    for (float& x : q) x = normal(rng);
    out.resize(q.size());
  }

  void round() {
    const k::StridedKV strides{nullptr, shape.head_dim, shape.kv_heads * shape.head_dim};
    std::vector<k::KVRun> runs;
    for (std::int64_t s = 0; s < sequences; ++s) {
      runs.clear();
      for (std::int64_t b = 0; b < blocks_per_sequence; ++b) {
        const auto i = static_cast<std::size_t>(block_of[static_cast<std::size_t>(s * blocks_per_sequence + b)]);
        runs.push_back({keys[i].data(), values[i].data(), std::min(kBlockRows, context - b * kBlockRows)});
      }
      const std::int64_t offset = s * shape.heads * shape.head_dim;
      k::attention_paged(q.data() + offset, 1, context - 1, shape.heads, shape.kv_heads, shape.head_dim, runs, strides,
                         strides, 0, context, {}, out.data() + offset);
    }
  }
};

void flush_caches() {
  static std::vector<char> buffer(64 << 20);
  for (std::size_t i = 0; i < buffer.size(); i += 64) buffer[i] = static_cast<char>(buffer[i] + 1);
  benchmark::DoNotOptimize(buffer.data());
}

void decode_attention(benchmark::State& state, Shape shape) {
  const std::int64_t sequences = state.range(0), context = state.range(1);
  const bool flush = state.range(2) != 0;
  Batch batch(shape, sequences, context);
  batch.round();  // first touch
  for (auto _ : state) {
    if (flush) {
      state.PauseTiming();
      flush_caches();
      state.ResumeTiming();
    }
    batch.round();
    benchmark::DoNotOptimize(batch.out.data());
  }
  const double kv_bytes = 2.0 * static_cast<double>(sequences * context * shape.kv_heads * shape.head_dim) * 4.0;
  state.counters["kv_bytes_per_second"] = benchmark::Counter(kv_bytes, benchmark::Counter::kIsIterationInvariantRate,
                                                             benchmark::Counter::kIs1024);
  state.counters["per_key_head"] = benchmark::Counter(
      static_cast<double>(sequences * context * shape.kv_heads),
      benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
}

void BM_DecodeAttentionShipped(benchmark::State& state) { decode_attention(state, {4, 2, 48}); }
void BM_DecodeAttentionQwen3(benchmark::State& state) { decode_attention(state, {32, 8, 128}); }

void prefill_attention(benchmark::State& state, Shape shape) {
  const std::int64_t rows = state.range(0);
  std::mt19937 rng(9);
  std::normal_distribution<float> normal;
  const auto kv_floats = static_cast<std::size_t>(rows * shape.kv_heads * shape.head_dim);
  std::vector<float> q(static_cast<std::size_t>(rows * shape.heads * shape.head_dim)), keys(kv_floats),
      values(kv_floats), out(q.size());
  for (auto* v : {&q, &keys, &values}) {
    for (float& x : *v) x = normal(rng);
  }
  const k::StridedKV ks{keys.data(), shape.head_dim, shape.kv_heads * shape.head_dim};
  const k::StridedKV vs{values.data(), shape.head_dim, shape.kv_heads * shape.head_dim};
  for (auto _ : state) {
    k::attention(q.data(), rows, 0, shape.heads, shape.kv_heads, shape.head_dim, ks, vs, 0, rows, {}, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  // Row r attends to r + 1 keys: rows (rows + 1) / 2 score-and-value pairs
  // per query head, each 2 * head_dim multiply-adds.
  const double pairs = static_cast<double>(rows) * static_cast<double>(rows + 1) / 2.0;
  state.counters["flops_per_second"] = benchmark::Counter(
      4.0 * pairs * static_cast<double>(shape.heads * shape.head_dim), benchmark::Counter::kIsIterationInvariantRate,
      benchmark::Counter::kIs1000);
}

void BM_PrefillAttentionShipped(benchmark::State& state) { prefill_attention(state, {4, 2, 48}); }
void BM_PrefillAttentionQwen35(benchmark::State& state) { prefill_attention(state, {8, 2, 256}); }

BENCHMARK(BM_PrefillAttentionShipped)->ArgNames({"rows"})->Arg(172)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_PrefillAttentionQwen35)->ArgNames({"rows"})->Arg(256)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DecodeAttentionShipped)
    ->ArgNames({"seqs", "ctx", "flush"})
    ->ArgsProduct({{1, 16}, {64, 172, 1024}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DecodeAttentionQwen3)
    ->ArgNames({"seqs", "ctx", "flush"})
    ->ArgsProduct({{1, 16}, {1024}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
