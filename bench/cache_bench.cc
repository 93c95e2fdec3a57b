// rewind_bench: what the cache costs per operation, next to what it replaces.
//
// Shapes are those of current models: 8 KV heads x 128 head dim (f16, f32),
// batch 1; conv states of 8192 channels, K = 4; recurrent states
// [32, 128, 128] f32 (Qwen3.5-sized, 2 MiB). docs/performance.md describes
// every case, the timing method, and the figures on the reference machine.
//
// Families (names are "family/kind/.../L:<tokens>"):
//   update/...           steady-state update of q tokens at length L, then
//                        crop(-q) back to L (update + crop pair)
//   memcpy/...           memcpy of the same bytes (the physical limit)
//   concat_alloc/...     transformers DynamicLayer.update (torch.cat): a new
//                        (L+q)-token buffer every step, history copied in
//   concat_copy/...      the same copy into a preallocated buffer (torch.cat
//                        under a caching allocator: copy cost only)
//   update_conv/...      conv-state update, then crop(-q)
//   growth/...           the one update that reallocates a dynamic buffer
//   update_recurrent/... begin_recurrent_update + memcpy into next(t) +
//                        commit, then crop(-q)
//   crop/...             crop(-4) and crop(0) at L = 1k, 8k, 64k (manual
//                        timing over batches of crops, counters per L)
//   state_copy/...       memcpy of one recurrent state (checkpoint/restore)
//   spec_round/...       one speculative round on a 32-layer hybrid cache
//   memory/...           bytes per layer after 20k generated tokens
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.h"
#include "rewind/cache.h"

namespace {

using rwd::DType;
using rwd::Layer;
using rwd::LayerKind;
using rwd::LayerOptions;
using rwd::Tensor;
using rwd::TensorView;
using namespace rwd::bench;

constexpr std::size_t kStateBytes = static_cast<std::size_t>(kStateHeads * kStateDim * kStateDim) * 4;  // 2 MiB
constexpr std::int64_t kWindow = 4096;                                                                  // sliding W
constexpr std::int64_t kChunk = 8192;                                                                   // chunked C
constexpr std::int64_t kRecord = 16;  // R of the update cases

// crop: each timed batch removes kCropBatch x kCropK tokens, so layers record
// that many.
constexpr std::int64_t kCropK = 4;
constexpr std::int64_t kCropBatch = 16;
constexpr std::int64_t kCropRecord = kCropK * kCropBatch;

// spec_round: K drafted tokens, K + 1 verified per round.
constexpr std::int64_t kDraft = 4;
constexpr std::int64_t kSpecLength = 4096;

std::size_t token_bytes(DType t) {  // one token of keys (or of values)
  return static_cast<std::size_t>(kHeads * kHeadDim) * rwd::dtype_size(t);
}

void fill(const Tensor& t, unsigned char byte) {
  if (t.bytes() > 0) std::memset(t.view().data, byte, t.bytes());
}

// Inputs for up to `cap` tokens, in the layouts a transformers model hands
// over: keys / values [B, H, q, D] viewed on the [B, q, H, D] projection
// output (`.view(B, q, H, D).transpose(1, 2)`), conv inputs [B, C, q] viewed on
// [B, q, C] (`.transpose(1, 2)`).
struct Feed {
  DType dtype = DType::F16;
  std::int64_t cap = 0;
  Tensor k, v, x;

  Feed(DType dt, std::int64_t capacity, bool attention, bool conv) : dtype(dt), cap(capacity) {
    if (attention) {
      k = Tensor(dt, {1, cap, kHeads, kHeadDim});
      v = Tensor(dt, {1, cap, kHeads, kHeadDim});
      fill(k, 0x31);
      fill(v, 0x32);
    }
    if (conv) {
      x = Tensor(dt, {1, cap, kConvChannels});
      fill(x, 0x33);
    }
  }
  TensorView keys(std::int64_t n) const { return heads_view(k, n); }
  TensorView values(std::int64_t n) const { return heads_view(v, n); }
  TensorView conv(std::int64_t n) const {
    return TensorView::strided(x.view().data, dtype, {1, kConvChannels, n}, {cap * kConvChannels, 1, kConvChannels});
  }

 private:
  TensorView heads_view(const Tensor& t, std::int64_t n) const {
    return TensorView::strided(t.view().data, dtype, {1, kHeads, n, kHeadDim},
                               {cap * kHeads * kHeadDim, kHeadDim, kHeads * kHeadDim, 1});
  }
};

bool has_conv(const Layer& layer) { return layer.is_linear() && !layer.options().conv_channels.empty(); }
bool has_recurrent(const Layer& layer) {
  return layer.is_linear() && layer.kind() != LayerKind::Conv && !layer.options().recurrent_shapes.empty();
}

// Layer `i` of a cache, with the per-layer calls of a Layer (the cache
// owns its layers; every change goes through it).
struct CacheLayer {
  rwd::Cache& cache;
  int i;
  const Layer& get() const { return cache.layer(i); }
  rwd::KeyValueView update(const TensorView& k, const TensorView& v) { return cache.update(k, v, i); }
  TensorView update_conv_state(const TensorView& x) { return cache.update_conv_state(x, i); }
  rwd::RecurrentUpdate begin_recurrent_update(std::int64_t q) { return cache.begin_recurrent_update(q, i); }
  std::int64_t get_seq_length() const { return cache.get_seq_length(i); }
};

const Layer& layer_of(const Layer& layer) { return layer; }
const Layer& layer_of(const CacheLayer& target) { return target.get(); }

// Appends n <= feed.cap tokens to every part of `target` (a Layer or a
// CacheLayer). Recurrent states go through begin_recurrent_update / commit;
// when `state_src` is given it is copied into every slot S(L+1)..S(L+n), as
// a kernel writes them.
template <typename Target>
void append(Target&& target, const Feed& feed, std::int64_t n, const void* state_src = nullptr) {
  const Layer& layer = layer_of(target);
  if (layer.has_attention()) {
    const rwd::KeyValueView kv = target.update(feed.keys(n), feed.values(n));
    benchmark::DoNotOptimize(kv.keys.data);
  }
  if (has_conv(layer)) {
    const TensorView window = target.update_conv_state(feed.conv(n));
    benchmark::DoNotOptimize(window.data);
  }
  if (has_recurrent(layer)) {
    rwd::RecurrentUpdate u = target.begin_recurrent_update(n);
    if (state_src != nullptr) {
      for (std::int64_t t = 1; t <= n; ++t) std::memcpy(u.next(t).data, state_src, kStateBytes);
    }
    u.commit();
  }
}

// Fills `target` to L tokens, feed.cap at a time (recurrent states are
// advanced without writing: their contents do not matter here).
template <typename Target>
void prefill(Target&& target, const Feed& feed, std::int64_t L) {
  while (target.get_seq_length() < L) append(target, feed, std::min(feed.cap, L - target.get_seq_length()));
}
void prefill(Layer& layer, DType dt, std::int64_t L) {
  if (L <= layer.get_seq_length()) return;
  const Feed feed(dt, std::min(L, kPrefillChunk), layer.has_attention(), has_conv(layer));
  prefill(layer, feed, L);
}

// ---- layer kinds ----------------------------------------------------------------

enum class Kind { FullDynamic, FullStatic, Sliding, Chunked, Conv, Recurrent, Hybrid };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::FullDynamic: return "full_dynamic";
    case Kind::FullStatic: return "full_static";
    case Kind::Sliding: return "sliding_W4096";
    case Kind::Chunked: return "chunked_C8192";
    case Kind::Conv: return "conv";
    case Kind::Recurrent: return "recurrent";
    case Kind::Hybrid: return "hybrid";
  }
  return "?";
}

bool kind_needs_recording(Kind k) { return k != Kind::FullDynamic && k != Kind::FullStatic; }

LayerOptions attention_options(DType dt) {
  LayerOptions o;
  o.dtype = dt;
  o.num_kv_heads = kHeads;
  o.key_dim = kHeadDim;
  return o;
}
void add_conv(LayerOptions& o) {
  o.conv_kernel_size = kConvKernel;
  o.conv_channels = {kConvChannels};
}
void add_recurrent(LayerOptions& o) {
  o.recurrent_shapes = {{kStateHeads, kStateDim, kStateDim}};
  o.recurrent_dtype = DType::F32;
}

// A layer of kind `k` that will hold up to `max_tokens` (static capacity).
Layer make_layer(Kind k, DType dt, std::int64_t max_tokens) {
  LayerOptions o = attention_options(dt);
  switch (k) {
    case Kind::FullDynamic: return Layer(LayerKind::FullAttention, o);
    case Kind::FullStatic: o.static_capacity = max_tokens; return Layer(LayerKind::FullAttention, o);
    case Kind::Sliding: o.sliding_window = kWindow; return Layer(LayerKind::SlidingAttention, o);
    case Kind::Chunked: o.chunk_size = kChunk; return Layer(LayerKind::ChunkedAttention, o);
    case Kind::Conv: {
      LayerOptions c;
      c.dtype = dt;
      add_conv(c);
      return Layer(LayerKind::Conv, c);
    }
    case Kind::Recurrent: {
      LayerOptions r;
      add_recurrent(r);
      return Layer(LayerKind::LinearAttention, r);
    }
    case Kind::Hybrid:
      add_conv(o);
      add_recurrent(o);
      return Layer(LayerKind::Hybrid, o);
  }
  return Layer(LayerKind::FullAttention, o);
}

// A layer of kind `k` filled to L tokens, recording R (R < 0: not recording),
// with a feed of `q` tokens, warmed by a few update + crop(-q) cycles (the
// first may grow the buffer).
struct LayerAtLength {
  Layer layer;
  Feed feed;
  Tensor state_src;
  LayerAtLength(Kind k, DType dt, std::int64_t L, std::int64_t q, std::int64_t R, std::int64_t headroom)
      : layer(make_layer(k, dt, L + headroom)), feed(dt, q, layer.has_attention(), has_conv(layer)),
        state_src(DType::F32, {1, kStateHeads, kStateDim, kStateDim}) {
    fill(state_src, 0x3c);
    if (R >= 0) layer.activate_past_recording(R);
    prefill(layer, dt, L);
    for (int i = 0; i < 3; ++i) {
      append(layer, feed, q, has_recurrent(layer) ? state_src.view().data : nullptr);
      layer.crop(-q);
    }
  }
};

// ---- 1. update at length L ------------------------------------------------------

void BM_Update(benchmark::State& st, const std::string& key, Kind kind, DType dt, std::int64_t L, std::int64_t q) {
  // Sliding / chunked layers must record at least q tokens to crop them back.
  const std::int64_t R = kind_needs_recording(kind) ? std::max(kRecord, q) : -1;
  auto& s = prepared<LayerAtLength>(key, kind, dt, L, q, R, 256);
  const TensorView keys = s.feed.keys(q);
  const TensorView values = s.feed.values(q);
  for (auto _ : st) {
    const rwd::KeyValueView kv = s.layer.update(keys, values);
    benchmark::DoNotOptimize(kv.keys.data);
    s.layer.crop(-q);
  }
  st.SetBytesProcessed(st.iterations() * static_cast<std::int64_t>(2 * static_cast<std::size_t>(q) * token_bytes(dt)));
  st.counters["L"] = static_cast<double>(s.layer.get_seq_length());
}

struct Buffers {
  std::vector<std::unique_ptr<std::byte[]>> buffers;
  explicit Buffers(std::initializer_list<std::size_t> sizes) {
    for (std::size_t n : sizes) buffers.push_back(std::make_unique<std::byte[]>(n));  // zeroed: pages touched
  }
  std::byte* operator[](std::size_t i) const { return buffers[i].get(); }
};

// memcpy of the bytes an update of q tokens writes (keys and values).
void BM_Memcpy(benchmark::State& st, DType dt, std::int64_t q) {
  const std::size_t n = static_cast<std::size_t>(q) * token_bytes(dt);
  const Buffers b{n, n, n, n};
  std::memset(b[0], 0x31, n);
  std::memset(b[1], 0x32, n);
  for (auto _ : st) {
    std::memcpy(b[2], b[0], n);
    std::memcpy(b[3], b[1], n);
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(st.iterations() * static_cast<std::int64_t>(2 * n));
}

// transformers' DynamicLayer.update: keys = torch.cat([keys, new], dim=-2) on
// [B, H, L, D]; per head, L rows of history then q new rows into a new
// (L+q)-token buffer. The history stays at L tokens, as after the crop.
struct ConcatState {
  std::size_t row;  // one token of one head
  std::int64_t L, q;
  Buffers data;  // history K, V [H, L, D]; new K, V [H, q, D]; out K, V [H, L+q, D]
  ConcatState(DType dt, std::int64_t length, std::int64_t tokens, bool preallocate_out)
      : row(static_cast<std::size_t>(kHeadDim) * rwd::dtype_size(dt)), L(length),
        q(tokens), data{bytes(L),
                        bytes(L),
                        bytes(q),
                        bytes(q),
                        preallocate_out ? bytes(L + q) : 0,
                        preallocate_out ? bytes(L + q) : 0} {}
  std::size_t bytes(std::int64_t n) const { return static_cast<std::size_t>(kHeads * n) * row; }
  void concat(std::byte* out, const std::byte* history, const std::byte* fresh) const {
    const std::size_t hist = static_cast<std::size_t>(L) * row;
    const std::size_t add = static_cast<std::size_t>(q) * row;
    for (std::int64_t h = 0; h < kHeads; ++h) {
      const auto hh = static_cast<std::size_t>(h);
      std::byte* dst = out + hh * (hist + add);
      std::memcpy(dst, history + hh * hist, hist);
      std::memcpy(dst + hist, fresh + hh * add, add);
    }
  }
};

void BM_Concat(benchmark::State& st, const std::string& key, DType dt, std::int64_t L, std::int64_t q, bool allocate) {
  auto& c = prepared<ConcatState>(key, dt, L, q, !allocate);
  const std::size_t out_bytes = c.bytes(L + q);
  for (auto _ : st) {
    if (allocate) {  // torch.empty + cat; the old buffer is freed
      auto* k = static_cast<std::byte*>(std::malloc(out_bytes));
      auto* v = static_cast<std::byte*>(std::malloc(out_bytes));
      if (k == nullptr || v == nullptr) {
        st.SkipWithError("out of memory");
        std::free(k);
        std::free(v);
        break;
      }
      c.concat(k, c.data[0], c.data[2]);
      c.concat(v, c.data[1], c.data[3]);
      benchmark::DoNotOptimize(k);
      benchmark::DoNotOptimize(v);
      benchmark::ClobberMemory();
      std::free(k);
      std::free(v);
    } else {
      c.concat(c.data[4], c.data[0], c.data[2]);
      c.concat(c.data[5], c.data[1], c.data[3]);
      benchmark::ClobberMemory();
    }
  }
  st.SetBytesProcessed(st.iterations() * static_cast<std::int64_t>(2 * out_bytes));
  st.counters["L"] = static_cast<double>(L);
}

// Conv-state update of q tokens on a recording conv layer at L, then crop(-q).
void BM_UpdateConv(benchmark::State& st, const std::string& key, DType dt, std::int64_t L, std::int64_t q) {
  auto& s = prepared<LayerAtLength>(key, Kind::Conv, dt, L, q, std::max(kRecord, q), 0);
  const TensorView x = s.feed.conv(q);
  for (auto _ : st) {
    const TensorView window = s.layer.update_conv_state(x);
    benchmark::DoNotOptimize(window.data);
    s.layer.crop(-q);
  }
  st.SetBytesProcessed(st.iterations() * q * kConvChannels * static_cast<std::int64_t>(rwd::dtype_size(dt)));
  st.counters["L"] = static_cast<double>(s.layer.get_seq_length());
}

void BM_MemcpyConv(benchmark::State& st, DType dt, std::int64_t q) {
  const std::size_t n = static_cast<std::size_t>(q * kConvChannels) * rwd::dtype_size(dt);
  const Buffers b{n, n};
  std::memset(b[0], 0x33, n);
  for (auto _ : st) {
    std::memcpy(b[1], b[0], n);
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(st.iterations() * static_cast<std::int64_t>(n));
}

// Recurrent write: the kernel writes S(L+1)..S(L+q) into the slots the cache
// hands out (memcpy of a 2 MiB state each), commit, then crop(-q).
void BM_UpdateRecurrent(benchmark::State& st, const std::string& key, std::int64_t L, std::int64_t q) {
  auto& s = prepared<LayerAtLength>(key, Kind::Recurrent, DType::F32, L, q, std::max(kRecord, q), 0);
  const void* src = s.state_src.view().data;
  for (auto _ : st) {
    rwd::RecurrentUpdate u = s.layer.begin_recurrent_update(q);
    for (std::int64_t t = 1; t <= q; ++t) std::memcpy(u.next(t).data, src, kStateBytes);
    u.commit();
    s.layer.crop(-q);
  }
  st.SetBytesProcessed(st.iterations() * q * static_cast<std::int64_t>(kStateBytes));
  st.counters["L"] = static_cast<double>(s.layer.get_seq_length());
}

// q memcpys of one state into q distinct destinations (as the q slots are).
void BM_MemcpyRecurrent(benchmark::State& st, std::int64_t q) {
  const Buffers src{kStateBytes};
  std::memset(src[0], 0x3c, kStateBytes);
  std::vector<std::unique_ptr<std::byte[]>> dst;
  for (std::int64_t t = 0; t < q; ++t) dst.push_back(std::make_unique<std::byte[]>(kStateBytes));
  for (auto _ : st) {
    for (auto& d : dst) std::memcpy(d.get(), src[0], kStateBytes);
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(st.iterations() * q * static_cast<std::int64_t>(kStateBytes));
}

// Steady-state figures above exclude reallocation. A dynamic full-attention
// buffer doubles when full: this times the one update that reallocates (new
// buffer, not zero-filled, and a copy of the retained rows) at about 60k tokens, and
// spreads it over the tokens the new room holds until the next growth.
double process_cpu_seconds() {
  timespec t{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

void BM_Growth(benchmark::State& st, DType dt) {
  release_prepared();
  const std::size_t row = token_bytes(dt);
  std::vector<double> growth_cpu;
  std::int64_t at = 0, room = 0;
  for (auto _ : st) {
    st.PauseTiming();
    auto layer = std::make_unique<Layer>(make_layer(Kind::FullDynamic, dt, 0));
    {
      const Feed feed(dt, kPrefillChunk, true, false);
      prefill(*layer, feed, 32768);
      const auto slots = static_cast<std::int64_t>(layer->memory().bytes_reserved / (2 * row));
      prefill(*layer, feed, slots);  // exactly full: the next token reallocates
      at = slots;
    }
    const Feed one(dt, 1, true, false);
    st.ResumeTiming();
    const double c0 = process_cpu_seconds();
    const rwd::KeyValueView kv = layer->update(one.keys(1), one.values(1));
    benchmark::DoNotOptimize(kv.keys.data);
    const double c1 = process_cpu_seconds();
    st.PauseTiming();
    growth_cpu.push_back(c1 - c0);
    room = static_cast<std::int64_t>(layer->memory().bytes_reserved / (2 * row)) - at;
    layer.reset();
    st.ResumeTiming();
  }
  st.counters["L"] = static_cast<double>(at);
  st.counters["new_room_tokens"] = static_cast<double>(room);
  st.counters["amortised_ns_per_token"] = median(growth_cpu) * 1e9 /
                                          static_cast<double>(std::max<std::int64_t>(room, 1));
}

// ---- 2. crop at length L -----------------------------------------------------------

// crop(-k) is a few index moves (tens of ns); a crop removes tokens, so they
// must be appended again between crops, and pausing the timer around each
// append costs more than the crop. Instead one benchmark per kind holds three
// layers, at L = 1k, 8k and 64k, and each iteration visits all three (in a
// rotating order): append kCropBatch x kCropK tokens untimed, then time
// kCropBatch consecutive crop(-kCropK) with one pair of clock reads (their own
// cost, calibrated at start-up, is subtracted), which brings the layer back
// to L, then kCropBatch consecutive crop(0) the same way (the first of them
// drops the history the appends recorded, the others find the layer minimal
// and do the same checks and index moves).
//
// Visiting the three lengths in the same iteration means whatever else runs
// on the machine affects them alike, so their ratio is a fair flatness test.
// The appends (a conv part's take milliseconds) evict the layer's metadata
// from the CPU caches; an untimed check_crop before each batch reloads it, so
// every kind is measured warm and the figures compare the work itself (the
// cold case, a crop right after a forward pass, is in spec_round). A batch is
// now and then descheduled, which inflates means: the counters are medians
// over batches, in ns per crop. The Time column is the mean per crop(-k)
// over all three lengths.
const std::vector<std::int64_t> kCropLengths{1024, 8192, 65536};

struct CropSet {
  std::vector<std::unique_ptr<LayerAtLength>> at;
  explicit CropSet(Kind k) {
    for (std::int64_t L : kCropLengths) {
      at.push_back(std::make_unique<LayerAtLength>(k, DType::F16, L, kCropK, kCropRecord, kCropRecord + 256));
    }
  }
};

double time_batch(Layer& layer, std::int64_t n) {
  layer.check_crop(n);  // brings the layer's metadata back into cache (see above)
  const auto t0 = Clock::now();
  for (std::int64_t i = 0; i < kCropBatch; ++i) layer.crop(n);
  const auto t1 = Clock::now();
  return std::max(0.0, seconds(t1 - t0) - g_clock_overhead_s) / static_cast<double>(kCropBatch);
}

void BM_Crop(benchmark::State& st, Kind kind) {
  auto& set = prepared<CropSet>(std::string("crop/") + kind_name(kind), kind);
  const std::size_t n = set.at.size();
  std::vector<std::vector<double>> minus_k(n), zero(n);
  std::size_t rotation = 0;
  for (auto _ : st) {
    double total = 0;
    for (std::size_t v = 0; v < n; ++v) {
      const std::size_t i = (v + rotation) % n;
      LayerAtLength& s = *set.at[i];
      for (std::int64_t b = 0; b < kCropBatch; ++b) append(s.layer, s.feed, kCropK);
      const double k = time_batch(s.layer, -kCropK);
      minus_k[i].push_back(k);
      zero[i].push_back(time_batch(s.layer, 0));
      total += k;
    }
    ++rotation;
    st.SetIterationTime(total / static_cast<double>(n));
  }
  for (std::size_t i = 0; i < n; ++i) {
    const std::string L = tokens_label(set.at[i]->layer.get_seq_length());
    st.counters["crop_k_ns_" + L] = median(minus_k[i]) * 1e9;
    st.counters["crop_0_ns_" + L] = median(zero[i]) * 1e9;
  }
  st.counters["crop_k_64k_over_1k"] = median(minus_k[n - 1]) / median(minus_k[0]);
  st.counters["crop_0_64k_over_1k"] = median(zero[n - 1]) / median(zero[0]);
}

// ---- 3. recurrent rollback vs state copy ------------------------------------------

// What a checkpoint / restore of a recurrent state costs per state: one copy.
void BM_StateCopy(benchmark::State& st) {
  const Buffers b{kStateBytes, kStateBytes};
  std::memset(b[0], 0x3c, kStateBytes);
  for (auto _ : st) {
    std::memcpy(b[1], b[0], kStateBytes);
    benchmark::ClobberMemory();
  }
  st.SetBytesProcessed(st.iterations() * static_cast<std::int64_t>(kStateBytes));
}

// ---- 4. speculative round on a 32-layer hybrid cache ---------------------------------

// Qwen3.5-like: 3 linear_attention layers then 1 full_attention, x 8.
std::vector<std::string> spec_layer_types() {
  std::vector<std::string> types;
  for (int i = 0; i < 32; ++i) types.emplace_back(i % 4 == 3 ? "full_attention" : "linear_attention");
  return types;
}

struct SpecState {
  rwd::Cache cache;
  Feed feed;
  Tensor state_src;
  std::mt19937 rng{12345};
  SpecState()
      : cache(spec_layer_types(), options()), feed(DType::F16, kDraft + 1, true, true),
        state_src(DType::F32, {1, kStateHeads, kStateDim, kStateDim}) {
    fill(state_src, 0x3c);
    cache.activate_past_recording(kDraft);
    // One prompt of kSpecLength tokens per layer: a dynamic full-attention
    // buffer then holds 2 x kSpecLength slots, so the rounds measured below
    // (L drifts up by < 4k tokens over all of them) never reallocate; growth
    // is amortised and is not what a round costs at steady state.
    const Feed prompt(DType::F16, kSpecLength, true, true);
    for (int i = 0; i < cache.num_layers(); ++i) prefill(CacheLayer{cache, i}, prompt, kSpecLength);
  }
  static LayerOptions options() {
    LayerOptions o = attention_options(DType::F16);
    add_conv(o);
    add_recurrent(o);
    return o;
  }
};

// One round: every layer takes K + 1 tokens (attention keys / values, conv
// inputs, recurrent slots), then crop(-j), j uniform in 0..K rejected drafts
// (crop(0) when all are accepted). L grows by K + 1 - j per round. Each phase
// is timed per round; counters report the median over rounds (robust against
// the rounds a shared machine deschedules).
void BM_SpecRound(benchmark::State& st, bool write_states) {
  auto& s = prepared<SpecState>("spec_round");
  const std::int64_t q = kDraft + 1;
  std::uniform_int_distribution<std::int64_t> rejected(0, kDraft);
  const TensorView keys = s.feed.keys(q);
  const TensorView values = s.feed.values(q);
  const TensorView x = s.feed.conv(q);
  const void* src = s.state_src.view().data;
  const std::int64_t L0 = s.cache.get_seq_length();
  std::vector<double> attn, conv, rec, crop, round;
  for (auto _ : st) {
    double a = 0, c = 0, r = 0;
    const auto start = Clock::now();
    for (int i = 0; i < s.cache.num_layers(); ++i) {
      const auto t0 = Clock::now();
      if (s.cache.layer(i).has_attention()) {
        const rwd::KeyValueView kv = s.cache.update(keys, values, i);
        benchmark::DoNotOptimize(kv.keys.data);
        a += seconds(Clock::now() - t0);
        continue;
      }
      const TensorView window = s.cache.update_conv_state(x, i);
      benchmark::DoNotOptimize(window.data);
      const auto t1 = Clock::now();
      rwd::RecurrentUpdate u = s.cache.begin_recurrent_update(q, i);
      if (write_states) {
        for (std::int64_t t = 1; t <= q; ++t) std::memcpy(u.next(t).data, src, kStateBytes);
      }
      u.commit();
      const auto t2 = Clock::now();
      c += seconds(t1 - t0);
      r += seconds(t2 - t1);
    }
    const std::int64_t j = rejected(s.rng);
    const auto t0 = Clock::now();
    s.cache.crop(-j);
    const auto t1 = Clock::now();
    attn.push_back(a);
    conv.push_back(c);
    rec.push_back(r);
    crop.push_back(seconds(t1 - t0) - g_clock_overhead_s);
    round.push_back(seconds(t1 - start));
  }
  st.counters["round_us"] = median(round) * 1e6;
  st.counters["attn_update_us"] = median(attn) * 1e6;
  st.counters["conv_update_us"] = median(conv) * 1e6;
  st.counters["recurrent_us"] = median(rec) * 1e6;
  st.counters["crop_ns"] = median(crop) * 1e9;
  st.counters["L_start"] = static_cast<double>(L0);
  st.counters["L_end"] = static_cast<double>(s.cache.get_seq_length());
}

// ---- 5. memory after 20k generated tokens ------------------------------------------

// Generates 20k tokens in speculative rounds (K + 1 = 5 tokens, crop(-j),
// j uniform in 0..4) with recording R = 8 on one layer of each kind, and
// reports what every layer holds at the end and at its peak.
void BM_Memory(benchmark::State& st) {
  const std::vector<std::string> types{"full_attention", "sliding_attention", "chunked_attention", "conv",
                                       "linear_attention"};
  constexpr std::int64_t kTokens = 20000;
  constexpr std::int64_t kR = 8;
  LayerOptions o = attention_options(DType::F16);
  o.sliding_window = 1024;
  o.chunk_size = 512;
  add_conv(o);
  add_recurrent(o);
  rwd::MemoryReport last;
  std::vector<std::size_t> peak(types.size(), 0);
  for (auto _ : st) {
    rwd::Cache cache(types, o);
    cache.activate_past_recording(kR);
    const Feed feed(DType::F16, kDraft + 1, true, true);
    std::mt19937 rng(7);
    std::uniform_int_distribution<std::int64_t> rejected(0, kDraft);
    std::fill(peak.begin(), peak.end(), 0);
    while (cache.get_seq_length() < kTokens) {
      for (int i = 0; i < cache.num_layers(); ++i) append(CacheLayer{cache, i}, feed, kDraft + 1);
      cache.crop(-rejected(rng));
      for (int i = 0; i < cache.num_layers(); ++i) {
        const auto u = static_cast<std::size_t>(i);
        peak[u] = std::max(peak[u], cache.layer(i).memory().bytes_reserved);
      }
    }
    last = cache.memory();
    st.counters["L"] = static_cast<double>(cache.get_seq_length());
  }
  constexpr double kMiB = 1024.0 * 1024.0;
  static bool printed = false;
  for (std::size_t i = 0; i < last.layers.size(); ++i) {
    const auto& m = last.layers[i];
    const std::string prefix = std::to_string(i) + "_" + m.kind;
    st.counters[prefix + "_used_MiB"] = static_cast<double>(m.bytes_used) / kMiB;
    st.counters[prefix + "_reserved_MiB"] = static_cast<double>(m.bytes_reserved) / kMiB;
    st.counters[prefix + "_peak_MiB"] = static_cast<double>(peak[i]) / kMiB;
  }
  st.counters["total_reserved_MiB"] = static_cast<double>(last.bytes_reserved) / kMiB;
  st.counters["total_used_MiB"] = static_cast<double>(last.bytes_used) / kMiB;
  if (!printed && !last.layers.empty()) {
    printed = true;
    std::printf("\nmemory after %lld generated tokens, recording R = %lld (MiB):\n", static_cast<long long>(kTokens),
                static_cast<long long>(kR));
    std::printf("  %-2s %-18s %12s %12s %12s\n", "#", "kind", "used", "reserved", "peak reserved");
    for (std::size_t i = 0; i < last.layers.size(); ++i) {
      const auto& m = last.layers[i];
      std::printf("  %-2zu %-18s %12.3f %12.3f %12.3f\n", i, m.kind.c_str(), static_cast<double>(m.bytes_used) / kMiB,
                  static_cast<double>(m.bytes_reserved) / kMiB, static_cast<double>(peak[i]) / kMiB);
    }
    std::printf("  total                 %12.3f %12.3f\n\n", static_cast<double>(last.bytes_used) / kMiB,
                static_cast<double>(last.bytes_reserved) / kMiB);
    std::fflush(stdout);
  }
}

// ---- registration --------------------------------------------------------------------

const char* dtype_label(DType dt) { return dt == DType::F16 ? "f16" : "f32"; }

void register_all() {
  const std::vector<std::int64_t> lengths{1024, 8192, 65536};
  const std::vector<std::int64_t> queries{1, 8, 128};
  const std::vector<Kind> attention_kinds{Kind::FullDynamic, Kind::FullStatic, Kind::Sliding, Kind::Chunked};
  const auto reg = [](const std::string& name, auto&& fn) {
    return benchmark::RegisterBenchmark(name.c_str(), std::forward<decltype(fn)>(fn));
  };

  // 1. update vs memcpy vs concatenation.
  for (DType dt : {DType::F16, DType::F32}) {
    for (std::int64_t q : queries) {
      const std::string tail = std::string("/") + dtype_label(dt) + "/q:" + std::to_string(q);
      reg("memcpy" + tail, [dt, q](benchmark::State& st) { BM_Memcpy(st, dt, q); });
      for (std::int64_t L : lengths) {
        const std::string at = tail + "/L:" + tokens_label(L);
        for (Kind k : attention_kinds) {
          const std::string name = std::string("update/") + kind_name(k) + at;
          reg(name, [name, k, dt, L, q](benchmark::State& st) { BM_Update(st, name, k, dt, L, q); });
        }
        const std::string copy = "concat_copy" + at;
        reg(copy, [copy, dt, L, q](benchmark::State& st) { BM_Concat(st, copy, dt, L, q, false); });
        const std::string alloc = "concat_alloc" + at;
        reg(alloc, [alloc, dt, L, q](benchmark::State& st) { BM_Concat(st, alloc, dt, L, q, true); });
      }
    }
  }
  for (std::int64_t q : queries) {
    const std::string tail = "/f16/q:" + std::to_string(q);
    reg("memcpy_conv" + tail, [q](benchmark::State& st) { BM_MemcpyConv(st, DType::F16, q); });
    const std::string name = "update_conv" + tail + "/L:1k";
    reg(name, [name, q](benchmark::State& st) { BM_UpdateConv(st, name, DType::F16, 1024, q); });
  }
  for (DType dt : {DType::F16, DType::F32}) {
    reg(std::string("growth/full_dynamic/") + dtype_label(dt), [dt](benchmark::State& st) { BM_Growth(st, dt); })
        ->Iterations(3)
        ->Unit(benchmark::kMillisecond);
  }
  for (std::int64_t q : {std::int64_t{1}, std::int64_t{8}}) {
    const std::string tail = "/f32/q:" + std::to_string(q);
    reg("memcpy_recurrent" + tail, [q](benchmark::State& st) { BM_MemcpyRecurrent(st, q); });
    const std::string name = "update_recurrent" + tail + "/L:1k";
    reg(name, [name, q](benchmark::State& st) { BM_UpdateRecurrent(st, name, 1024, q); });
  }

  // 2 and 3. crop(-4) and crop(0) per kind at L = 1k, 8k, 64k; state copy.
  for (Kind k :
       {Kind::FullDynamic, Kind::FullStatic, Kind::Sliding, Kind::Chunked, Kind::Conv, Kind::Recurrent, Kind::Hybrid}) {
    // Appending a batch to a conv part is slow (see docs/performance.md): fewer iterations there.
    const bool slow_append = k == Kind::Conv || k == Kind::Hybrid;
    reg(std::string("crop/") + kind_name(k), [k](benchmark::State& st) { BM_Crop(st, k); })
        ->UseManualTime()
        ->Iterations(slow_append ? 100 : 1000);
  }
  reg("state_copy/f32/32x128x128", [](benchmark::State& st) { BM_StateCopy(st); });

  // 4. speculative rounds; 5. memory.
  reg("spec_round/32_layers/bookkeeping", [](benchmark::State& st) { BM_SpecRound(st, false); })
      ->Iterations(200)
      ->Unit(benchmark::kMicrosecond);
  reg("spec_round/32_layers/with_state_writes", [](benchmark::State& st) { BM_SpecRound(st, true); })
      ->Iterations(20)
      ->Unit(benchmark::kMicrosecond);
  reg("memory/hybrid_5_layers/20k_tokens",
      [](benchmark::State& st) {
        release_prepared();
        BM_Memory(st);
      })
      ->Iterations(1)
      ->Repetitions(1)
      ->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) { return rwd::bench::run_benchmarks(argc, argv, register_all); }
