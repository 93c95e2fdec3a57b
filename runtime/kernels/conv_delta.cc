// The linear-attention kernels: the short causal convolution and the Gated
// DeltaNet recurrence (one step, and a run of tokens over all heads), each
// in a copy per instruction set (kernel_isa.h).
#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "internal.h"

namespace rwd::runtime::kernels {

using namespace detail;

namespace {

// out[c] = sums[c] + bias[c] (bias may be null), then silu when `fuse_silu`:
// the end of causal_conv1d, element-wise, V floats at a time (PanelRow, or
// Lanes in the AVX2 copy), then one by one.
template <class V, class Bits>
REWIND_INLINE void add_bias_silu_body(const float* sums, const float* bias, int64_t n, bool fuse_silu, float* out) {
  constexpr int64_t kWidth = sizeof(V) / sizeof(float);
  int64_t c = 0;
  for (; c + kWidth <= n; c += kWidth) {
    V v;
    __builtin_memcpy(&v, sums + c, sizeof v);
    if (bias != nullptr) {
      V b;
      __builtin_memcpy(&b, bias + c, sizeof b);
      v += b;
    }
    if (fuse_silu) v = silu_of<V, Bits>(v);
    __builtin_memcpy(out + c, &v, sizeof v);
  }
  for (; c < n; ++c) {
    float v = sums[c];
    if (bias != nullptr) v += bias[c];
    out[c] = fuse_silu ? silu(v) : v;
  }
}

// A block of causal_conv1d's outputs when the window's channels are
// contiguous (channel_stride 1, the cache's layout): out[t, c] for t in
// [t0, t1), c in [0, nc) of the block (pointers already at its first
// channel). `taps`: the block's weights tap-major, taps[i * taps_stride +
// c] = weight[c, i], so that a tap is one load for V channels.
struct ConvBlock {
  const float* window;
  int64_t time_stride;
  const float* taps;
  int64_t taps_stride;
  int64_t kernel_size;
  const float* bias;
  bool fuse_silu;
  int64_t nc, t0, t1;
  float* out;
  int64_t out_stride;
};

// Channels [c, nc) of row t, V floats at a time (V: PanelRow, Lanes or a
// float), the sum in a register: per element exactly causal_conv1d's
// arithmetic, 0 + w[0] x[0] + w[1] x[1] + ... in order of i (each product
// rounded, then the add), then + bias, then silu.
template <class V, class Bits>
REWIND_INLINE int64_t conv_channels(const ConvBlock& b, const float* x, float* out, int64_t c) {
  constexpr int64_t kWidth = sizeof(V) / sizeof(float);
  for (; c + kWidth <= b.nc; c += kWidth) {
    V acc = {};
    for (int64_t i = 0; i < b.kernel_size; ++i) {
      V w, xi;
      __builtin_memcpy(&w, b.taps + i * b.taps_stride + c, sizeof w);
      __builtin_memcpy(&xi, x + i * b.time_stride + c, sizeof xi);
      acc += w * xi;
    }
    if (b.bias != nullptr) {
      V bias;
      __builtin_memcpy(&bias, b.bias + c, sizeof bias);
      acc += bias;
    }
    if (b.fuse_silu) acc = silu_of<V, Bits>(acc);
    __builtin_memcpy(out + c, &acc, sizeof acc);
  }
  return c;
}

// The block's rows, 16 channels at a time when `kWide` (one AVX-512
// vector), then 8 (one AVX2 vector), then one by one.
template <bool kWide>
REWIND_INLINE void conv_block_body(const ConvBlock& b) {
  for (int64_t t = b.t0; t < b.t1; ++t) {
    const float* x = b.window + t * b.time_stride;
    float* out = b.out + t * b.out_stride;
    int64_t c = 0;
    if constexpr (kWide) c = conv_channels<PanelRow, PanelRowBits>(b, x, out, c);
    c = conv_channels<Lanes, ULanes>(b, x, out, c);
    conv_channels<float, std::uint32_t>(b, x, out, c);
  }
}

// Columns [j0, j0 + N * W) of one gated delta step, W the width of V (V: W
// floats, or a float), N vectors side by side (independent chains of adds):
// the old state's rows at s_in + i * in_stride, the new one's at s_out + i *
// out_stride (s_in and s_out pointing at column j0). Column j of the new
// state, kv[j], delta[j] and o[j] depend only on column j of the old one, so
// the step goes column block by column block with kv and o in registers, the
// block (k_dim x N * W floats) staying in L1 between its two passes. Per
// element exactly the arithmetic of the definition: S[i][j] * decay; kv[j]
// summed over i in order from 0; (v[j] - kv[j]) * beta; S[i][j] + k[i] *
// delta[j]; o[j] summed over i in order.
template <class V, int N>
REWIND_INLINE void delta_step_columns(const float* q, const float* k, const float* v, float decay, float beta,
                                      int64_t k_dim, int64_t j0, const float* s_in, int64_t in_stride, float* s_out,
                                      int64_t out_stride, float* o) {
  constexpr int64_t kWidth = sizeof(V) / sizeof(float);
  V kv[N] = {};
  for (int64_t i = 0; i < k_dim; ++i) {
    const float* src = s_in + i * in_stride;
    float* dst = s_out + i * out_stride;
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) {
      V row;
      __builtin_memcpy(&row, src + n * kWidth, sizeof row);
      const V decayed = row * decay;
      __builtin_memcpy(dst + n * kWidth, &decayed, sizeof decayed);
      kv[n] += decayed * k[i];
    }
  }
  V delta[N];
#pragma GCC unroll 4
  for (int n = 0; n < N; ++n) {
    V vv;
    __builtin_memcpy(&vv, v + j0 + n * kWidth, sizeof vv);
    delta[n] = (vv - kv[n]) * beta;
  }
  V out[N] = {};
  for (int64_t i = 0; i < k_dim; ++i) {
    float* row_at = s_out + i * out_stride;
#pragma GCC unroll 4
    for (int n = 0; n < N; ++n) {
      V row;
      __builtin_memcpy(&row, row_at + n * kWidth, sizeof row);
      const V updated = row + k[i] * delta[n];
      __builtin_memcpy(row_at + n * kWidth, &updated, sizeof updated);
      out[n] += updated * q[i];
    }
  }
#pragma GCC unroll 4
  for (int n = 0; n < N; ++n) __builtin_memcpy(o + j0 + n * kWidth, &out[n], sizeof out[n]);
}

// One value head's run of gated delta steps (kernels.h: gated_delta_rule):
// token t reads q + t * qk_stride, k + t * qk_stride, v + t * vo_stride,
// decay[t] (exp(g), taken outside the per-ISA code so that every copy gets
// the same float) and beta[t * beta_stride], reads its old state from
// state_in (t = 0) or state_out[t - 1], plus `offset`, and writes the new
// one to state_out[t] + offset and its output to o + t * vo_stride.
// `block`: room for k_dim x 32 floats.
struct DeltaRun {
  const float* q;
  const float* k;
  int64_t qk_stride;
  const float* v;
  float* o;
  int64_t vo_stride;
  const float* decay;
  const float* beta;
  int64_t beta_stride;
  int64_t tokens, k_dim, v_dim;
  const float* state_in;
  float* const* state_out;
  int64_t offset;
  float* block;
};

// Columns [j0, j0 + N * W) of the run, every token in order: column j of a
// token's state and output depends only on column j of the state before
// it, so a block of columns goes through all the tokens, held in `block`
// (contiguous: the same columns of the state's rows, v_dim floats apart,
// fall into a few L1 sets and evict one another), instead of the whole
// state (64 KiB for k_dim = v_dim = 128) going from L2 and back once per
// token. A token's block is copied out to state_out[t] unless the next
// token overwrites it there (in place); copying keeps the bits, so every
// element sees the same operations as token by token.
template <class V, int N>
REWIND_INLINE void delta_run_columns(const DeltaRun& r, int64_t j0) {
  constexpr int64_t kWidth = N * static_cast<int64_t>(sizeof(V) / sizeof(float));
  if (r.tokens == 1) {
    delta_step_columns<V, N>(r.q, r.k, r.v, r.decay[0], r.beta[0], r.k_dim, j0, r.state_in + r.offset + j0, r.v_dim,
                             r.state_out[0] + r.offset + j0, r.v_dim, r.o);
    return;
  }
  for (int64_t t = 0; t < r.tokens; ++t) {
    const bool first = t == 0;
    delta_step_columns<V, N>(r.q + t * r.qk_stride, r.k + t * r.qk_stride, r.v + t * r.vo_stride, r.decay[t],
                             r.beta[t * r.beta_stride], r.k_dim, j0, first ? r.state_in + r.offset + j0 : r.block,
                             first ? r.v_dim : kWidth, r.block, kWidth, r.o + t * r.vo_stride);
    if (t + 1 == r.tokens || r.state_out[t + 1] != r.state_out[t]) {
      float* dst = r.state_out[t] + r.offset + j0;
      for (int64_t i = 0; i < r.k_dim; ++i) {
        __builtin_memcpy(dst + i * r.v_dim, r.block + i * kWidth, sizeof(float) * static_cast<std::size_t>(kWidth));
      }
    }
  }
}

// The run column block by column block. `kWide`: 16-float vectors first
// (the baseline and AVX-512 copies); otherwise (AVX2) blocks of four 8-float
// vectors, enough independent chains to cover the latency of the adds in 16
// registers.
template <bool kWide>
REWIND_INLINE void delta_run_body(const DeltaRun& r) {
  int64_t j0 = 0;
  if constexpr (kWide) {
    for (; j0 + kPanel <= r.v_dim; j0 += kPanel) delta_run_columns<PanelRow, 1>(r, j0);
  } else {
    for (; j0 + 4 * kLanes <= r.v_dim; j0 += 4 * kLanes) delta_run_columns<Lanes, 4>(r, j0);
    for (; j0 + 2 * kLanes <= r.v_dim; j0 += 2 * kLanes) delta_run_columns<Lanes, 2>(r, j0);
  }
  for (; j0 + kLanes <= r.v_dim; j0 += kLanes) delta_run_columns<Lanes, 1>(r, j0);
  for (; j0 < r.v_dim; ++j0) delta_run_columns<float, 1>(r, j0);
}

// The copies per instruction set (kernel_isa.h). Each only calls its body
// (Clang checks the vector ABI of calls made directly from a function whose
// target differs from its callee's).
void add_bias_silu_baseline(const float* sums, const float* bias, int64_t n, bool fuse_silu, float* out) {
  add_bias_silu_body<PanelRow, PanelRowBits>(sums, bias, n, fuse_silu, out);
}
void delta_run_baseline(const DeltaRun& r) { delta_run_body<true>(r); }
void conv_block_baseline(const ConvBlock& b) { conv_block_body<false>(b); }
#if defined(REWIND_KERNEL_ISA_COPIES)
REWIND_TARGET_AVX2
void add_bias_silu_avx2(const float* sums, const float* bias, int64_t n, bool fuse_silu, float* out) {
  add_bias_silu_body<Lanes, ULanes>(sums, bias, n, fuse_silu, out);
}
REWIND_TARGET_AVX2
void delta_run_avx2(const DeltaRun& r) { delta_run_body<false>(r); }
REWIND_TARGET_AVX2
void conv_block_avx2(const ConvBlock& b) { conv_block_body<false>(b); }
REWIND_TARGET_AVX512
void add_bias_silu_avx512(const float* sums, const float* bias, int64_t n, bool fuse_silu, float* out) {
  add_bias_silu_body<PanelRow, PanelRowBits>(sums, bias, n, fuse_silu, out);
}
REWIND_TARGET_AVX512
void delta_run_avx512(const DeltaRun& r) { delta_run_body<true>(r); }
REWIND_TARGET_AVX512
void conv_block_avx512(const ConvBlock& b) { conv_block_body<true>(b); }
#endif

void add_bias_silu(const float* sums, const float* bias, int64_t n, bool fuse_silu, float* out) {
  switch (kernel_isa()) {
#if defined(REWIND_KERNEL_ISA_COPIES)
    case KernelIsa::Avx512: add_bias_silu_avx512(sums, bias, n, fuse_silu, out); return;
    case KernelIsa::Avx2: add_bias_silu_avx2(sums, bias, n, fuse_silu, out); return;
#endif
    default: add_bias_silu_baseline(sums, bias, n, fuse_silu, out); return;
  }
}

void delta_run(const DeltaRun& r) {
  switch (kernel_isa()) {
#if defined(REWIND_KERNEL_ISA_COPIES)
    case KernelIsa::Avx512: delta_run_avx512(r); return;
    case KernelIsa::Avx2: delta_run_avx2(r); return;
#endif
    default: delta_run_baseline(r); return;
  }
}

void conv_block(const ConvBlock& b) {
  switch (kernel_isa()) {
#if defined(REWIND_KERNEL_ISA_COPIES)
    case KernelIsa::Avx512: conv_block_avx512(b); return;
    case KernelIsa::Avx2: conv_block_avx2(b); return;
#endif
    default: conv_block_baseline(b); return;
  }
}

// Channels in blocks of kBlock, rows in tasks of up to kConvRows (so that a
// long prompt spreads over the threads as well as a wide layer does).
constexpr int64_t kBlock = 256;
constexpr int64_t kConvRows = 64;

// Windows whose channels are not contiguous (channel stride other than 1),
// and causal_conv1d's calls of fewer than 4 rows: channels in blocks so
// that the inner loop runs across channels while each out[t, c] still sums
// over i in order, the sums in an array. Tap i of channel c is at
// weight[i * channels + c] when kTapMajor, else weight[c * kernel_size + i].
template <bool kTapMajor>
void conv_any_layout(const float* window, int64_t channels, int64_t kernel_size, int64_t q, int64_t channel_stride,
                     int64_t time_stride, const float* weight, const float* bias, bool fuse_silu, float* out) {
  const int64_t c_step = kTapMajor ? 1 : kernel_size, i_step = kTapMajor ? channels : 1;
  const int64_t blocks = (channels + kBlock - 1) / kBlock;
  parallel_for(q * blocks, q * channels * kernel_size >= kParallelWork, [&](int64_t task) {
    const int64_t t = task / blocks;
    const int64_t c0 = (task % blocks) * kBlock;
    const int64_t nc = std::min(kBlock, channels - c0);
    float acc[kBlock] = {};
    for (int64_t i = 0; i < kernel_size; ++i) {
      const float* xs = window + c0 * channel_stride + (t + i) * time_stride;
      const float* wi = weight + c0 * c_step + i * i_step;
      for (int64_t c = 0; c < nc; ++c) acc[c] += wi[c * c_step] * xs[c * channel_stride];
    }
    add_bias_silu(acc, bias != nullptr ? bias + c0 : nullptr, nc, fuse_silu, out + t * channels + c0);
  });
}

}  // namespace

void causal_conv1d(const float* window, int64_t channels, int64_t kernel_size, int64_t q, int64_t channel_stride,
                   int64_t time_stride, const float* weight, const float* bias, bool fuse_silu, float* out) {
  constexpr int64_t kMinRowsToTranspose = 4;
  if (channel_stride != 1 || q < kMinRowsToTranspose) {
    // For fewer rows, transposing the weights per call costs more than the
    // vectors save (causal_conv1d_taps takes them transposed once).
    conv_any_layout<false>(window, channels, kernel_size, q, channel_stride, time_stride, weight, bias, fuse_silu, out);
    return;
  }
  // Tasks of up to kConvRows rows of one channel block, whose weights are
  // transposed once per task.
  const int64_t blocks = (channels + kBlock - 1) / kBlock;
  const int64_t row_tasks = (q + kConvRows - 1) / kConvRows;
  parallel_for(blocks * row_tasks, q * channels * kernel_size >= kParallelWork, [&](int64_t task) {
    const int64_t c0 = (task % blocks) * kBlock;
    const int64_t t0 = (task / blocks) * kConvRows;
    const int64_t nc = std::min(kBlock, channels - c0);
    thread_local std::vector<float> taps;
    taps.resize(static_cast<std::size_t>(kernel_size * kBlock));
    for (int64_t c = 0; c < nc; ++c) {
      for (int64_t i = 0; i < kernel_size; ++i)
        taps[static_cast<std::size_t>(i * nc + c)] = weight[(c0 + c) * kernel_size + i];
    }
    conv_block({window + c0, time_stride, taps.data(), nc, kernel_size, bias != nullptr ? bias + c0 : nullptr,
                fuse_silu, nc, t0, std::min(q, t0 + kConvRows), out + c0, channels});
  });
}

void causal_conv1d_taps(const float* window, int64_t channels, int64_t kernel_size, int64_t q, int64_t channel_stride,
                        int64_t time_stride, const float* taps, const float* bias, bool fuse_silu, float* out) {
  if (channel_stride != 1) {
    conv_any_layout<true>(window, channels, kernel_size, q, channel_stride, time_stride, taps, bias, fuse_silu, out);
    return;
  }
  const int64_t blocks = (channels + kBlock - 1) / kBlock;
  const int64_t row_tasks = (q + kConvRows - 1) / kConvRows;
  parallel_for(blocks * row_tasks, q * channels * kernel_size >= kParallelWork, [&](int64_t task) {
    const int64_t c0 = (task % blocks) * kBlock;
    const int64_t t0 = (task / blocks) * kConvRows;
    conv_block({window + c0, time_stride, taps + c0, channels, kernel_size, bias != nullptr ? bias + c0 : nullptr,
                fuse_silu, std::min(kBlock, channels - c0), t0, std::min(q, t0 + kConvRows), out + c0, channels});
  });
}

void gated_delta_rule_step(const float* q, const float* k, const float* v, float g, float beta, int64_t k_dim,
                           int64_t v_dim, const float* state_in, float* state_out, float* o) {
  const float decay = std::exp(g);
  float* const out_states[1] = {state_out};
  delta_run({q, k, 0, v, o, 0, &decay, &beta, 0, 1, k_dim, v_dim, state_in, out_states, 0, nullptr});
}

void gated_delta_rule(const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t tokens,
                      int64_t num_v_heads, int64_t num_k_heads, int64_t k_dim, int64_t v_dim, const float* state_in,
                      float* const* state_out, float* out) {
  assert(num_k_heads > 0 && num_v_heads % num_k_heads == 0);
  if (tokens <= 0) return;
  const int64_t ratio = num_v_heads / num_k_heads;
  const int64_t head_state = k_dim * v_dim;
  parallel_for(num_v_heads, tokens * num_v_heads * head_state >= kParallelWork, [&](int64_t h) {
    thread_local std::vector<float> decay;
    decay.resize(static_cast<std::size_t>(tokens));
    for (int64_t t = 0; t < tokens; ++t) decay[static_cast<std::size_t>(t)] = std::exp(g[t * num_v_heads + h]);
    const int64_t qk = (h / ratio) * k_dim;
    thread_local std::vector<float> block;
    block.resize(static_cast<std::size_t>(k_dim * 4 * kLanes));
    delta_run({q + qk, k + qk, num_k_heads * k_dim, v + h * v_dim, out + h * v_dim, num_v_heads * v_dim, decay.data(),
               beta + h, num_v_heads, tokens, k_dim, v_dim, state_in, state_out, h * head_state, block.data()});
  });
}

}  // namespace rwd::runtime::kernels
