// The linear-attention kernels: the short causal convolution and the Gated
// DeltaNet recurrence (one step, and a run of tokens over all heads).
#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>

#include "internal.h"

namespace rwd::runtime::kernels {

using namespace detail;

namespace {

// out[c] = sums[c] + bias[c] (bias may be null), then silu when `fuse_silu`:
// the end of causal_conv1d, element-wise.
REWIND_INLINE void add_bias_silu_body(const float* sums, const float* bias, int64_t n, bool fuse_silu, float* out) {
  int64_t c = 0;
  for (; c + kPanel <= n; c += kPanel) {
    PanelRow v = F32Panels::load(sums + c);
    if (bias != nullptr) v += F32Panels::load(bias + c);
    if (fuse_silu) v = silu_of<PanelRow, PanelRowBits>(v);
    __builtin_memcpy(out + c, &v, sizeof v);
  }
  for (; c < n; ++c) {
    float v = sums[c];
    if (bias != nullptr) v += bias[c];
    out[c] = fuse_silu ? silu(v) : v;
  }
}

REWIND_WIDE_KERNEL_CLONES
void add_bias_silu(const float* sums, const float* bias, int64_t n, bool fuse_silu, float* out) {
  add_bias_silu_body(sums, bias, n, fuse_silu, out);
}

// Columns [j0, j0 + W) of one gated delta step, W a vector width (V: W
// floats). Column j of the new state, kv[j], delta[j] and o[j] depend only
// on column j of the old one, so the step goes column block by column block
// with kv and o in registers, the block (k_dim x W floats) staying in L1
// between its two passes. Per element exactly the arithmetic of the
// definition: S[i][j] * decay; kv[j] summed over i in order from 0; (v[j] -
// kv[j]) * beta; S[i][j] + k[i] * delta[j]; o[j] summed over i in order.
template <class V>
REWIND_INLINE void delta_step_columns(const float* q, const float* k, const float* v, float decay, float beta,
                                      int64_t k_dim, int64_t v_dim, int64_t j0, const float* s_in, float* s_out,
                                      float* o) {
  V kv = {};
  for (int64_t i = 0; i < k_dim; ++i) {
    V row;
    __builtin_memcpy(&row, s_in + i * v_dim + j0, sizeof row);
    const V decayed = row * decay;
    __builtin_memcpy(s_out + i * v_dim + j0, &decayed, sizeof decayed);
    kv += decayed * k[i];
  }
  V vv;
  __builtin_memcpy(&vv, v + j0, sizeof vv);
  const V delta = (vv - kv) * beta;
  V out = {};
  for (int64_t i = 0; i < k_dim; ++i) {
    V row;
    __builtin_memcpy(&row, s_out + i * v_dim + j0, sizeof row);
    const V updated = row + k[i] * delta;
    __builtin_memcpy(s_out + i * v_dim + j0, &updated, sizeof updated);
    out += updated * q[i];
  }
  __builtin_memcpy(o + j0, &out, sizeof out);
}

typedef float Single __attribute__((vector_size(sizeof(float))));

// One gated delta step (kernels.h: gated_delta_rule_step) reading the old
// state from s_in and writing the new one to s_out, which may be s_in
// itself: each element is read before it is written, and no copy of the
// state is made first.
REWIND_WIDE_KERNEL_CLONES
void delta_step(const float* __restrict q, const float* __restrict k, const float* __restrict v, float decay,
                float beta, int64_t k_dim, int64_t v_dim, const float* s_in, float* s_out, float* __restrict o) {
  int64_t j0 = 0;
  for (; j0 + kPanel <= v_dim; j0 += kPanel)
    delta_step_columns<PanelRow>(q, k, v, decay, beta, k_dim, v_dim, j0, s_in, s_out, o);
  for (; j0 + kLanes <= v_dim; j0 += kLanes)
    delta_step_columns<Lanes>(q, k, v, decay, beta, k_dim, v_dim, j0, s_in, s_out, o);
  for (; j0 < v_dim; ++j0) delta_step_columns<Single>(q, k, v, decay, beta, k_dim, v_dim, j0, s_in, s_out, o);
}

}  // namespace

void causal_conv1d(const float* window, int64_t channels, int64_t kernel_size, int64_t q, int64_t channel_stride,
                   int64_t time_stride, const float* weight, const float* bias, bool fuse_silu, float* out) {
  // Channels go in blocks so that the inner loop runs across channels while
  // each out[t, c] still sums over i in order.
  constexpr int64_t kBlock = 256;
  const int64_t blocks = (channels + kBlock - 1) / kBlock;
  const int64_t tasks = q * blocks;
  parallel_for(tasks, q * channels * kernel_size >= kParallelWork, [&](int64_t task) {
    const int64_t t = task / blocks;
    const int64_t c0 = (task % blocks) * kBlock;
    const int64_t nc = std::min(kBlock, channels - c0);
    float acc[kBlock] = {};
    for (int64_t i = 0; i < kernel_size; ++i) {
      const float* xs = window + c0 * channel_stride + (t + i) * time_stride;
      const float* wi = weight + c0 * kernel_size + i;
      for (int64_t c = 0; c < nc; ++c) acc[c] += wi[c * kernel_size] * xs[c * channel_stride];
    }
    add_bias_silu(acc, bias != nullptr ? bias + c0 : nullptr, nc, fuse_silu, out + t * channels + c0);
  });
}

void gated_delta_rule_step(const float* q, const float* k, const float* v, float g, float beta, int64_t k_dim,
                           int64_t v_dim, const float* state_in, float* state_out, float* o) {
  delta_step(q, k, v, std::exp(g), beta, k_dim, v_dim, state_in, state_out, o);
}

void gated_delta_rule(const float* q, const float* k, const float* v, const float* g, const float* beta, int64_t tokens,
                      int64_t num_v_heads, int64_t num_k_heads, int64_t k_dim, int64_t v_dim, const float* state_in,
                      float* const* state_out, float* out) {
  assert(num_k_heads > 0 && num_v_heads % num_k_heads == 0);
  const int64_t ratio = num_v_heads / num_k_heads;
  const int64_t head_state = k_dim * v_dim;
  parallel_for(num_v_heads, tokens * num_v_heads * head_state >= kParallelWork, [&](int64_t h) {
    const int64_t kh = h / ratio;
    for (int64_t t = 0; t < tokens; ++t) {
      const float* prev = (t == 0 ? state_in : state_out[t - 1]) + h * head_state;
      const int64_t qk = (t * num_k_heads + kh) * k_dim;
      const int64_t vo = t * num_v_heads + h;
      gated_delta_rule_step(q + qk, k + qk, v + vo * v_dim, g[vo], beta[vo], k_dim, v_dim, prev,
                            state_out[t] + h * head_state, out + vo * v_dim);
    }
  });
}

}  // namespace rwd::runtime::kernels
