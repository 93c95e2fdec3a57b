// rewind_sequence_bench: what rwd::SequenceCache (rewind/sequences.h) costs
// per operation, next to what it replaces.
//
// Shapes are rewind_bench's (bench/cache_bench.cc): attention 8 KV heads x
// 128 head dim, f16 (4 KiB of keys + values per token and layer); conv
// states of 8192 channels, K = 4 (f16); recurrent states [32, 128, 128] f32
// (2 MiB). Block size 16 (the SequenceCache default). Two models:
//   full_attention_x2  {"full_attention", "full_attention"}: 8 KiB per token
//                      (the model of issue 11's deep-copy figure)
//   hybrid_R8          {"linear_attention", "full_attention"}: conv +
//                      recurrent + attention, every sequence recording R = 8
//
// Run (Release build; one benchmark process at a time):
//   cmake --build build -j2 --target rewind_sequence_bench
//   build/bench/rewind_sequence_bench                         # ~3 s (peak ~1 GiB)
//   build/bench/rewind_sequence_bench --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
//   build/bench/rewind_sequence_bench --benchmark_filter='^fork/'   # one family
//
// Every case uses manual timing (two clock reads around the measured calls,
// their calibrated cost subtracted) and reports medians over iterations as
// counters; untimed work restores the state after each iteration, so every
// iteration measures the same state. Families:
//
//   deep_copy/<model>/L:8k   the baseline: rwd::Cache at 8k tokens,
//        batch_select_indices({0, 0}) (today's way to fork a sequence: a
//        deep copy of every layer), then batch_select_indices({0}) untimed.
//        Counters: copy_ms (median), bytes_added (what the copy reserved).
//   fork/<model>   SequenceCache::fork of a sequence at L = 1k, 8k and 64k
//        (three caches, visited in a rotating order in every iteration), then
//        seq_rm of the fork. Counters per L: fork_us (fork alone), rm_us
//        (seq_rm alone), fork_rm_us (the pair); fork_64k_over_1k (target
//        <= 2), fork_rm_64k_over_1k; fork_bytes (what one fork reserves);
//        for full_attention_x2 also deep_copy_over_fork_8k and
//        deep_copy_over_fork_rm_8k (target >= 100), from the deep_copy case
//        of the same run. Time column: mean fork + seq_rm over the three L.
//   memory/16_forks/full_attention_x2/prefix:<P>   one sequence of P tokens,
//        16 forks of it, each given 100 tokens of its own by ragged batches
//        (entries of 1..7 tokens and 0); the parent stays alive. Counters:
//        bytes_reserved, bytes_used, blocks_in_use, blocks_free; ref_bytes =
//        bytes_used of a separate SequenceCache holding one P-token sequence,
//        plus 16 x 100 tokens x 8 KiB; ratio_used = bytes_used / ref_bytes
//        (target <= 1.2), ratio_reserved; deep_copy_bytes (16 independent
//        copies) and saving_x = deep_copy_bytes / bytes_used. P = 8k is
//        block-aligned; P = 8199 makes every fork copy its shared partial
//        last block (copy-on-write).
//   ragged_update/full_attention_x2/16x1/L:~1k   per token, in one
//        iteration: 16 forwards of one token through rwd::Cache at L = 1k
//        (begin_forward + update of both layers + commit), 16 ragged batches
//        of 16 sequences x 1 token (lengths 1024 + 17 i, begin_batch +
//        update of both layers + commit), and 16 one-entry batches of
//        SequenceCache (the batch's fixed cost); then crop back, untimed.
//        Counters: single_ns_per_token, ragged_ns_per_token,
//        ragged_over_single (target <= 2), seq1_ns_per_token. Time column:
//        ragged ns per token.
//   crop/full_attention_x2/seqs:<N>   per-sequence crop(-4) with N live
//        sequences (1: one sequence; 16, 256: a sequence and N - 1 forks of
//        it, each with 32 tokens of its own; the newest fork is cropped) at
//        L = 1k, 8k, 64k (three caches, rotating): append 64 tokens in one
//        batch untimed, then time 16 consecutive crop(-4) (back to L).
//        Counters: crop_ns_<L> (median), crop_64k_over_1k (target <= 2); for
//        N > 1, crop_ns_<L>_over_seqs1 against the seqs:1 case of the same
//        run (flat in N: <= 2).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.h"
#include "rewind/cache.h"
#include "rewind/sequences.h"

namespace {

using rwd::BatchEntry;
using rwd::DType;
using rwd::LayerKind;
using rwd::LayerOptions;
using rwd::SeqId;
using rwd::SequenceCache;
using rwd::Tensor;
using rwd::TensorView;
using namespace rwd::bench;

// rewind_bench's shapes.
constexpr std::int64_t kRecord = 8;       // R of the hybrid model
constexpr std::int64_t kDecodeSteps = 8;  // one-token forwards that end a prefill

// Bytes of keys + values of one token in one attention layer (f16).
constexpr std::int64_t kTokenLayerBytes = 2 * kHeads * kHeadDim * 2;

// memory: 16 forks x 100 own tokens.
constexpr std::int64_t kForks = 16;
constexpr std::int64_t kOwnTokens = 100;

// ragged_update: 16 sequences x 1 token, 16 forwards per timed group.
constexpr std::int64_t kRaggedSeqs = 16;
constexpr std::int64_t kSteps = 16;
constexpr std::int64_t kRaggedLength = 1024;

// crop: kCropBatch consecutive crop(-kCropK) per timed group.
constexpr std::int64_t kCropK = 4;
constexpr std::int64_t kCropBatch = 16;
constexpr std::int64_t kCropOwn = 32;  // tokens each sequence gets of its own before the runs

const std::vector<std::int64_t> kLengths{1024, 8192, 65536};

double elapsed(Clock::time_point t0, Clock::time_point t1) {
  return std::max(0.0, seconds(t1 - t0) - g_clock_overhead_s);
}

// ---- models and inputs -------------------------------------------------------------

struct Model {
  std::string name;
  std::vector<std::string> types;
  LayerOptions options;
  bool hybrid = false;
};

Model full_model() {
  Model m;
  m.name = "full_attention_x2";
  m.types = {"full_attention", "full_attention"};
  m.options.dtype = DType::F16;
  m.options.num_kv_heads = kHeads;
  m.options.key_dim = kHeadDim;
  return m;
}

Model hybrid_model() {
  Model m = full_model();
  m.name = "hybrid_R8";
  m.types = {"linear_attention", "full_attention"};
  m.options.conv_kernel_size = kConvKernel;
  m.options.conv_channels = {kConvChannels};
  m.options.recurrent_shapes = {{kStateHeads, kStateDim, kStateDim}};
  m.options.recurrent_dtype = DType::F32;
  m.hybrid = true;
  return m;
}

void fill(const Tensor& t, unsigned char byte) {
  if (t.bytes() > 0) std::memset(t.view().data, byte, t.bytes());
}

// Packed inputs for up to `cap` tokens, in a transformers model's layouts:
// keys / values [1, H, T, D] viewed on [1, T, H, D], conv inputs [1, C, T]
// viewed on [1, T, C].
struct Feed {
  std::int64_t cap = 0;
  Tensor k, v, x;

  Feed(std::int64_t capacity, bool conv) : cap(capacity) {
    k = Tensor(DType::F16, {1, cap, kHeads, kHeadDim});
    v = Tensor(DType::F16, {1, cap, kHeads, kHeadDim});
    fill(k, 0x31);
    fill(v, 0x32);
    if (conv) {
      x = Tensor(DType::F16, {1, cap, kConvChannels});
      fill(x, 0x33);
    }
  }
  TensorView keys(std::int64_t n) const { return heads_view(k, n); }
  TensorView values(std::int64_t n) const { return heads_view(v, n); }
  TensorView conv(std::int64_t n) const {
    return TensorView::strided(x.view().data, DType::F16, {1, kConvChannels, n},
                               {cap * kConvChannels, 1, kConvChannels});
  }

 private:
  TensorView heads_view(const Tensor& t, std::int64_t n) const {
    return TensorView::strided(t.view().data, DType::F16, {1, kHeads, n, kHeadDim},
                               {cap * kHeads * kHeadDim, kHeadDim, kHeads * kHeadDim, 1});
  }
};

// One batched forward of `entries` through every layer (recurrent slots are
// handed out and committed without being written: their contents do not
// matter here). REQUIRES the batch's tokens <= feed.cap.
void seq_forward(SequenceCache& cache, std::span<const BatchEntry> entries, const Feed& feed) {
  rwd::SequenceBatch batch = cache.begin_batch(entries);
  const std::int64_t T = batch.num_tokens();
  for (int i = 0; i < cache.num_layers(); ++i) {
    if (cache.layer_kind(i) == LayerKind::LinearAttention) {
      const std::span<const TensorView> windows = cache.update_conv_state(feed.conv(T), i);
      benchmark::DoNotOptimize(windows.data());
      rwd::BatchRecurrentUpdate u = cache.begin_recurrent_update(i);
      u.commit();
    } else {
      const std::span<const rwd::PagedKeyValues> kv = cache.update(feed.keys(T), feed.values(T), i);
      benchmark::DoNotOptimize(kv.data());
    }
  }
  batch.commit();
}

// Gives each of `ids` q more tokens, in batches of at most feed.cap tokens.
void seq_append_all(SequenceCache& cache, const std::vector<SeqId>& ids, std::int64_t q, const Feed& feed) {
  std::vector<BatchEntry> entries;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    entries.push_back({ids[i], q});
    if (static_cast<std::int64_t>(entries.size() + 1) * q > feed.cap || i + 1 == ids.size()) {
      seq_forward(cache, entries, feed);
      entries.clear();
    }
  }
}

// Fills sequence `id` to L tokens: prompt chunks, then kDecodeSteps
// one-token forwards (so a recording sequence holds its decode-time history).
void seq_prefill(SequenceCache& cache, SeqId id, std::int64_t L, bool conv) {
  const Feed chunk(std::min(kPrefillChunk, L), conv);
  const std::int64_t prompt = L - kDecodeSteps;
  while (cache.seq_length(id) < prompt) {
    const BatchEntry e{id, std::min(chunk.cap, prompt - cache.seq_length(id))};
    seq_forward(cache, std::span<const BatchEntry>(&e, 1), chunk);
  }
  const Feed one(1, conv);
  while (cache.seq_length(id) < L) {
    const BatchEntry e{id, 1};
    seq_forward(cache, std::span<const BatchEntry>(&e, 1), one);
  }
}

// The same for a single-sequence rwd::Cache (forwards through begin_forward).
void cache_forward(rwd::Cache& cache, std::int64_t q, const Feed& feed) {
  rwd::Forward f = cache.begin_forward(q);
  for (int i = 0; i < cache.num_layers(); ++i) {
    if (cache.layer(i).has_attention()) {
      const rwd::KeyValueView kv = cache.update(feed.keys(q), feed.values(q), i);
      benchmark::DoNotOptimize(kv.keys.data);
    } else {
      const TensorView window = cache.update_conv_state(feed.conv(q), i);
      benchmark::DoNotOptimize(window.data);
      rwd::RecurrentUpdate u = cache.begin_recurrent_update(q, i);
      u.commit();
    }
  }
  f.commit();
}

void cache_prefill(rwd::Cache& cache, std::int64_t L, bool conv) {
  const Feed chunk(std::min(kPrefillChunk, L), conv);
  const std::int64_t prompt = L - kDecodeSteps;
  while (cache.get_seq_length() < prompt)
    cache_forward(cache, std::min(chunk.cap, prompt - cache.get_seq_length()), chunk);
  const Feed one(1, conv);
  while (cache.get_seq_length() < L) cache_forward(cache, 1, one);
}

// ---- 1. fork: the deep-copy baseline ---------------------------------------------------

double g_deep_copy_full_8k_s = 0;  // median of deep_copy/full_attention_x2/L:8k, for fork's ratio

struct DeepCopyState {
  rwd::Cache cache;
  DeepCopyState(const Model& m, std::int64_t L) : cache(m.types, m.options) {
    if (m.hybrid) cache.activate_past_recording(kRecord);
    cache_prefill(cache, L, m.hybrid);
  }
};

void BM_DeepCopy(benchmark::State& st, const Model& m, std::int64_t L) {
  auto& s = prepared<DeepCopyState>("deep_copy/" + m.name + "/" + std::to_string(L), m, L);
  const std::array<std::int64_t, 2> both{0, 0};
  const std::array<std::int64_t, 1> one{0};
  std::vector<double> copy, restore;
  std::size_t added = 0;
  for (auto _ : st) {
    const std::size_t before = s.cache.memory().bytes_reserved;
    const auto t0 = Clock::now();
    s.cache.batch_select_indices(both);  // B = 2: row 1 is the fork
    const auto t1 = Clock::now();
    added = s.cache.memory().bytes_reserved - before;
    const auto t2 = Clock::now();
    s.cache.batch_select_indices(one);  // back to B = 1 (untimed)
    const auto t3 = Clock::now();
    copy.push_back(elapsed(t0, t1));
    restore.push_back(elapsed(t2, t3));
    st.SetIterationTime(copy.back());
  }
  st.counters["copy_ms"] = median(copy) * 1e3;
  st.counters["restore_ms"] = median(restore) * 1e3;
  st.counters["bytes_added"] = benchmark::Counter(static_cast<double>(added), benchmark::Counter::kDefaults,
                                                  benchmark::Counter::kIs1024);
  st.counters["L"] = static_cast<double>(s.cache.get_seq_length());
  if (!m.hybrid && L == 8192) g_deep_copy_full_8k_s = median(copy);
}

// ---- 1. fork + seq_rm at L = 1k, 8k, 64k ------------------------------------------------

struct SeqAtLength {
  std::unique_ptr<SequenceCache> cache;
  SeqId parent;
};

SeqAtLength make_sequence_at(const Model& m, std::int64_t L) {
  SeqAtLength s{std::make_unique<SequenceCache>(m.types, m.options), {}};
  s.parent = s.cache->add_sequence();
  if (m.hybrid) s.cache->activate_past_recording(s.parent, kRecord);
  seq_prefill(*s.cache, s.parent, L, m.hybrid);
  return s;
}

struct ForkSet {
  std::vector<SeqAtLength> at;
  explicit ForkSet(const Model& m) {
    for (std::int64_t L : kLengths) at.push_back(make_sequence_at(m, L));
  }
};

void BM_Fork(benchmark::State& st, const Model& m) {
  auto& set = prepared<ForkSet>("fork/" + m.name, m);
  const std::size_t n = set.at.size();
  std::vector<std::vector<double>> fork(n), rm(n), pair(n);
  std::vector<std::size_t> fork_bytes(n, 0);
  for (std::size_t i = 0; i < n; ++i) {  // what one fork reserves (untimed)
    SequenceCache& c = *set.at[i].cache;
    const std::size_t before = c.memory().bytes_reserved;
    const SeqId id = c.fork(set.at[i].parent);
    fork_bytes[i] = c.memory().bytes_reserved - before;
    c.seq_rm(id);
  }
  std::size_t rotation = 0;
  for (auto _ : st) {
    double total = 0;
    for (std::size_t v = 0; v < n; ++v) {
      const std::size_t i = (v + rotation) % n;
      SequenceCache& c = *set.at[i].cache;
      const auto t0 = Clock::now();
      const SeqId id = c.fork(set.at[i].parent);
      const auto t1 = Clock::now();
      const bool removed = c.seq_rm(id);
      const auto t2 = Clock::now();
      benchmark::DoNotOptimize(removed);
      fork[i].push_back(elapsed(t0, t1));
      rm[i].push_back(elapsed(t1, t2));
      pair[i].push_back(elapsed(t0, t2));
      total += pair[i].back();
    }
    ++rotation;
    st.SetIterationTime(total / static_cast<double>(n));
  }
  for (std::size_t i = 0; i < n; ++i) {
    const std::string L = tokens_label(set.at[i].cache->seq_length(set.at[i].parent));
    st.counters["fork_us_" + L] = median(fork[i]) * 1e6;
    st.counters["rm_us_" + L] = median(rm[i]) * 1e6;
    st.counters["fork_rm_us_" + L] = median(pair[i]) * 1e6;
  }
  st.counters["fork_64k_over_1k"] = median(fork[n - 1]) / median(fork[0]);
  st.counters["fork_rm_64k_over_1k"] = median(pair[n - 1]) / median(pair[0]);
  st.counters["fork_bytes"] = benchmark::Counter(static_cast<double>(fork_bytes[1]), benchmark::Counter::kDefaults,
                                                 benchmark::Counter::kIs1024);
  if (!m.hybrid && g_deep_copy_full_8k_s > 0) {
    st.counters["deep_copy_over_fork_8k"] = g_deep_copy_full_8k_s / median(fork[1]);
    st.counters["deep_copy_over_fork_rm_8k"] = g_deep_copy_full_8k_s / median(pair[1]);
  }
}

// ---- 2. memory of 16 forks of one prefix -------------------------------------------------

void BM_ForkMemory(benchmark::State& st, std::int64_t prefix) {
  release_prepared();
  const Model m = full_model();
  rwd::SequenceMemory mem;
  double ref = 0;
  for (auto _ : st) {
    // The reference, independently: one sequence of `prefix` tokens alone,
    // plus 16 x 100 tokens at 8 KiB each (2 layers x (keys + values)).
    {
      SeqAtLength one = make_sequence_at(m, prefix);
      ref = static_cast<double>(one.cache->memory().bytes_used) +
            static_cast<double>(kForks * kOwnTokens * 2 * kTokenLayerBytes);
    }
    SeqAtLength s = make_sequence_at(m, prefix);
    std::vector<SeqId> forks;
    for (std::int64_t f = 0; f < kForks; ++f) forks.push_back(s.cache->fork(s.parent));
    // Ragged batches: in round r fork f gets 1 + (f + r) % 7 tokens (0 once
    // it has its 100), until every fork has 100 of its own.
    const Feed feed(kForks * 7, false);
    std::vector<std::int64_t> own(forks.size(), 0);
    for (std::int64_t r = 0;; ++r) {
      std::vector<BatchEntry> entries;
      std::int64_t total = 0;
      for (std::size_t f = 0; f < forks.size(); ++f) {
        const std::int64_t q = std::min(kOwnTokens - own[f], 1 + (static_cast<std::int64_t>(f) + r) % 7);
        entries.push_back({forks[f], q});
        own[f] += q;
        total += q;
      }
      if (total == 0) break;
      seq_forward(*s.cache, entries, feed);
    }
    mem = s.cache->memory();
    benchmark::DoNotOptimize(mem);
  }
  const auto bytes = [](double v) {
    return benchmark::Counter(v, benchmark::Counter::kDefaults, benchmark::Counter::kIs1024);
  };
  st.counters["bytes_reserved"] = bytes(static_cast<double>(mem.bytes_reserved));
  st.counters["bytes_used"] = bytes(static_cast<double>(mem.bytes_used));
  st.counters["blocks_in_use"] = static_cast<double>(mem.blocks_in_use);
  st.counters["blocks_free"] = static_cast<double>(mem.blocks_free);
  st.counters["ref_bytes"] = bytes(ref);
  st.counters["ratio_used"] = static_cast<double>(mem.bytes_used) / ref;
  st.counters["ratio_reserved"] = static_cast<double>(mem.bytes_reserved) / ref;
  const double deep = static_cast<double>(kForks * (prefix + kOwnTokens) * 2 * kTokenLayerBytes);
  st.counters["deep_copy_bytes"] = bytes(deep);
  st.counters["saving_x"] = deep / static_cast<double>(mem.bytes_used);
}

// ---- 3. ragged update: 16 sequences x 1 token vs one sequence ------------------------------

struct RaggedState {
  rwd::Cache single;
  SequenceCache seqs;
  std::vector<SeqId> ids;
  std::vector<BatchEntry> entries;  // every sequence, 1 token each
  Feed one{1, false}, sixteen{kRaggedSeqs, false};
  explicit RaggedState(const Model& m) : single(m.types, m.options), seqs(m.types, m.options) {
    cache_prefill(single, kRaggedLength, false);
    for (std::int64_t i = 0; i < kRaggedSeqs; ++i) {
      ids.push_back(seqs.add_sequence());
      seq_prefill(seqs, ids.back(), kRaggedLength + 17 * i, false);
      entries.push_back({ids.back(), 1});
    }
  }
};

void BM_Ragged(benchmark::State& st) {
  const Model m = full_model();
  auto& s = prepared<RaggedState>("ragged", m);
  const TensorView k1 = s.one.keys(1), v1 = s.one.values(1);
  const TensorView k16 = s.sixteen.keys(kRaggedSeqs), v16 = s.sixteen.values(kRaggedSeqs);
  const BatchEntry first{s.ids[0], 1};
  std::vector<double> single, ragged, seq1;
  bool single_first = true;
  for (auto _ : st) {
    auto run_single = [&] {
      const auto t0 = Clock::now();
      for (std::int64_t t = 0; t < kSteps; ++t) {
        rwd::Forward f = s.single.begin_forward(1);
        benchmark::DoNotOptimize(s.single.update(k1, v1, 0).keys.data);
        benchmark::DoNotOptimize(s.single.update(k1, v1, 1).keys.data);
        f.commit();
      }
      const auto t1 = Clock::now();
      single.push_back(elapsed(t0, t1) / static_cast<double>(kSteps));
      s.single.crop(-kSteps);
    };
    auto run_ragged = [&] {
      const auto t0 = Clock::now();
      for (std::int64_t t = 0; t < kSteps; ++t) {
        rwd::SequenceBatch b = s.seqs.begin_batch(s.entries);
        benchmark::DoNotOptimize(s.seqs.update(k16, v16, 0).data());
        benchmark::DoNotOptimize(s.seqs.update(k16, v16, 1).data());
        b.commit();
      }
      const auto t1 = Clock::now();
      ragged.push_back(elapsed(t0, t1) / static_cast<double>(kSteps * kRaggedSeqs));
      for (const SeqId id : s.ids) s.seqs.crop(id, -kSteps);
    };
    if (single_first) run_single();
    run_ragged();
    if (!single_first) run_single();
    single_first = !single_first;
    // A batch of one entry: the fixed cost of a batch, for comparison.
    const auto t0 = Clock::now();
    for (std::int64_t t = 0; t < kSteps; ++t) {
      rwd::SequenceBatch b = s.seqs.begin_batch(std::span<const BatchEntry>(&first, 1));
      benchmark::DoNotOptimize(s.seqs.update(k1, v1, 0).data());
      benchmark::DoNotOptimize(s.seqs.update(k1, v1, 1).data());
      b.commit();
    }
    const auto t1 = Clock::now();
    seq1.push_back(elapsed(t0, t1) / static_cast<double>(kSteps));
    s.seqs.crop(s.ids[0], -kSteps);
    st.SetIterationTime(ragged.back());
  }
  st.counters["single_ns_per_token"] = median(single) * 1e9;
  st.counters["ragged_ns_per_token"] = median(ragged) * 1e9;
  st.counters["ragged_over_single"] = median(ragged) / median(single);
  st.counters["seq1_ns_per_token"] = median(seq1) * 1e9;
  st.counters["L_single"] = static_cast<double>(s.single.get_seq_length());
}

// ---- 4. per-sequence crop at L = 1k, 8k, 64k with N live sequences -------------------------

struct CropCache {
  SeqAtLength s;
  SeqId target;
  std::int64_t L = 0;
};

struct CropSet {
  std::vector<CropCache> at;
  Feed feed{kCropBatch * kCropK, false};
  CropSet(const Model& m, std::int64_t live) {
    const Feed own(kPrefillChunk, false);
    for (std::int64_t L : kLengths) {
      CropCache c{make_sequence_at(m, L), {}, 0};
      std::vector<SeqId> ids{c.s.parent};
      for (std::int64_t f = 1; f < live; ++f) ids.push_back(c.s.cache->fork(c.s.parent));
      seq_append_all(*c.s.cache, ids, kCropOwn, own);
      c.target = ids.back();
      c.L = c.s.cache->seq_length(c.target);
      at.push_back(std::move(c));
    }
  }
};

std::array<double, 3> g_crop_seqs1_ns{};  // crop_ns per L of the seqs:1 case, for the N > 1 ratios

void BM_Crop(benchmark::State& st, std::int64_t live) {
  const Model m = full_model();
  auto& set = prepared<CropSet>("crop/" + std::to_string(live), m, live);
  const std::size_t n = set.at.size();
  std::vector<std::vector<double>> crop(n);
  std::size_t rotation = 0;
  for (auto _ : st) {
    double total = 0;
    for (std::size_t v = 0; v < n; ++v) {
      const std::size_t i = (v + rotation) % n;
      CropCache& c = set.at[i];
      SequenceCache& cache = *c.s.cache;
      const BatchEntry e{c.target, kCropBatch * kCropK};
      seq_forward(cache, std::span<const BatchEntry>(&e, 1), set.feed);
      cache.check_crop(c.target, -kCropK);  // reloads the sequence's metadata into cache
      const auto t0 = Clock::now();
      for (std::int64_t b = 0; b < kCropBatch; ++b) cache.crop(c.target, -kCropK);
      const auto t1 = Clock::now();
      crop[i].push_back(elapsed(t0, t1) / static_cast<double>(kCropBatch));
      total += crop[i].back();
    }
    ++rotation;
    st.SetIterationTime(total / static_cast<double>(n));
  }
  for (std::size_t i = 0; i < n; ++i) {
    const std::string L = tokens_label(set.at[i].L - kCropOwn);
    const double ns = median(crop[i]) * 1e9;
    st.counters["crop_ns_" + L] = ns;
    if (live == 1) {
      g_crop_seqs1_ns[i] = ns;
    } else if (g_crop_seqs1_ns[i] > 0) {
      st.counters["crop_ns_" + L + "_over_seqs1"] = ns / g_crop_seqs1_ns[i];
    }
  }
  st.counters["crop_64k_over_1k"] = median(crop[n - 1]) / median(crop[0]);
  st.counters["live_sequences"] = static_cast<double>(set.at[0].s.cache->num_sequences());
}

// ---- registration ------------------------------------------------------------------------

void register_all() {
  static const Model full = full_model();
  static const Model hybrid = hybrid_model();
  const auto reg = [](const std::string& name, auto&& fn) {
    return benchmark::RegisterBenchmark(name.c_str(), std::forward<decltype(fn)>(fn));
  };
  // 1. deep copy (first: fork's ratio reads its median), then fork + seq_rm.
  for (const Model* m : {&full, &hybrid}) {
    reg("deep_copy/" + m->name + "/L:8k", [m](benchmark::State& st) { BM_DeepCopy(st, *m, 8192); })
        ->UseManualTime()
        ->Iterations(8)
        ->Unit(benchmark::kMillisecond);
  }
  reg("fork/" + full.name, [](benchmark::State& st) { BM_Fork(st, full); })
      ->UseManualTime()
      ->Iterations(1000)
      ->Unit(benchmark::kMicrosecond);
  reg("fork/" + hybrid.name, [](benchmark::State& st) { BM_Fork(st, hybrid); })
      ->UseManualTime()
      ->Iterations(30)
      ->Unit(benchmark::kMicrosecond);
  // 2. memory.
  for (std::int64_t prefix : {std::int64_t{8192}, std::int64_t{8199}}) {
    reg("memory/16_forks/" + full.name + "/prefix:" + tokens_label(prefix),
        [prefix](benchmark::State& st) { BM_ForkMemory(st, prefix); })
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond);
  }
  // 3. ragged update.
  reg("ragged_update/" + full.name + "/16x1/L:~1k", [](benchmark::State& st) { BM_Ragged(st); })
      ->UseManualTime()
      ->Iterations(2000);
  // 4. crop.
  for (std::int64_t live : {std::int64_t{1}, std::int64_t{16}, std::int64_t{256}}) {
    reg("crop/" + full.name + "/seqs:" + std::to_string(live), [live](benchmark::State& st) { BM_Crop(st, live); })
        ->UseManualTime()
        ->Iterations(1000);
  }
}

}  // namespace

int main(int argc, char** argv) { return rwd::bench::run_benchmarks(argc, argv, register_all); }
