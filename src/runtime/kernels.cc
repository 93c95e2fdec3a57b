// Implementation notes. Batch invariance (see kernels.h) rests on three
// rules followed everywhere below:
//  - a reduction is written once (dot_inline / dot4 / in-order loops) and
//    its order depends only on the reduced length;
//  - the code path that computes an output element is chosen by the
//    element's index and the sizes, never by the row count or the thread;
//  - OpenMP splits independent outputs (output features, (row, head) pairs,
//    heads), never a sum. `if` clauses only keep tiny calls on the calling
//    thread; they cannot change results.
// matmul computes two input rows at a time where it can (dot4x2), so each
// weight load serves both rows: a K + 1 token verify forward costs less than
// K + 1 single-token forwards (about 0.6 (K + 1) of them for the shipped
// 2.6M-parameter target, whose weights stay in L3). Pairing decides only
// which loads are shared; every output still does dot_inline's arithmetic.
#include "runtime/kernels.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

// Hot loops are also compiled for AVX2 and picked at load time (GCC / Clang
// function multiversioning): about 3x faster matmul than the SSE2 baseline.
// AVX2 without FMA only widens the vectors; every lane still does one
// rounded multiply and one rounded add in the same order, so each clone
// gives the same bits as the baseline.
// Sanitizer builds that instrument the ifunc resolvers themselves (TSan runs
// them before its runtime is up, and crashes) define REWIND_NO_KERNEL_CLONES.
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(REWIND_NO_KERNEL_CLONES)
#define REWIND_KERNEL_CLONES __attribute__((target_clones("avx2", "default")))
#define REWIND_INLINE __attribute__((always_inline)) inline
#else
#define REWIND_KERNEL_CLONES
#define REWIND_INLINE inline
#endif

namespace rwd::runtime::kernels {
namespace {

using std::int64_t;

// Partial sums per reduction: enough independent chains to hide add latency
// and to fill two SSE or one AVX register; fixed so results do not depend
// on the ISA.
constexpr int kLanes = 8;

// Multiply-adds below which a kernel stays on the calling thread (waking the
// team costs a few microseconds).
constexpr int64_t kParallelWork = int64_t{1} << 16;

REWIND_INLINE float combine(const float (&a)[kLanes]) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

// Always inlined so that each cloned caller gets a copy for its own ISA.
REWIND_INLINE float dot_inline(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  }
  float s = combine(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// GCC notes that passing a 32-byte vector by value changes the ABI when AVX
// is off (the SSE2 clone); these helpers are always inlined, so no call
// ever passes one.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

// kLanes floats as one GCC vector: ymm in the AVX2 clone, two xmm in the
// SSE2 baseline. Lane l of an accumulator holds partial sum l of dot_inline,
// and a * b + c on vectors is one rounded multiply and one rounded add per
// lane (the runtime is built with -ffp-contract=off), so the vector code
// does exactly dot_inline's arithmetic.
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

REWIND_INLINE Lanes load_lanes(const float* p) {
  Lanes v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

REWIND_INLINE float combine(Lanes a) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

// Four dot products of x with w0..w3 sharing each load of x. Per product the
// arithmetic is exactly that of dot_inline: same lanes, same tree, same tail.
REWIND_INLINE void dot4(const float* x, const float* w0, const float* w1, const float* w2,
                        const float* w3, int64_t n, float* r) {
  Lanes a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Lanes xv = load_lanes(x + i);
    a0 += xv * load_lanes(w0 + i);
    a1 += xv * load_lanes(w1 + i);
    a2 += xv * load_lanes(w2 + i);
    a3 += xv * load_lanes(w3 + i);
  }
  float s0 = combine(a0), s1 = combine(a1), s2 = combine(a2), s3 = combine(a3);
  for (; i < n; ++i) {
    s0 += x[i] * w0[i];
    s1 += x[i] * w1[i];
    s2 += x[i] * w2[i];
    s3 += x[i] * w3[i];
  }
  r[0] = s0;
  r[1] = s1;
  r[2] = s2;
  r[3] = s3;
}

// dot4 for two input rows at once (x0 into r0[0..4), x1 into r1[0..4)):
// each weight load serves both rows. Per product the arithmetic is again
// exactly dot_inline's, so a row's outputs do not depend on whether it was
// paired with another row.
REWIND_INLINE void dot4x2(const float* x0, const float* x1, const float* w0, const float* w1,
                          const float* w2, const float* w3, int64_t n, float* r0, float* r1) {
  Lanes a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Lanes u = load_lanes(x0 + i), v = load_lanes(x1 + i);
    const Lanes c0 = load_lanes(w0 + i), c1 = load_lanes(w1 + i), c2 = load_lanes(w2 + i),
                c3 = load_lanes(w3 + i);
    a0 += u * c0;
    a1 += u * c1;
    a2 += u * c2;
    a3 += u * c3;
    b0 += v * c0;
    b1 += v * c1;
    b2 += v * c2;
    b3 += v * c3;
  }
  float s0 = combine(a0), s1 = combine(a1), s2 = combine(a2), s3 = combine(a3);
  float t0 = combine(b0), t1 = combine(b1), t2 = combine(b2), t3 = combine(b3);
  for (; i < n; ++i) {
    s0 += x0[i] * w0[i];
    s1 += x0[i] * w1[i];
    s2 += x0[i] * w2[i];
    s3 += x0[i] * w3[i];
    t0 += x1[i] * w0[i];
    t1 += x1[i] * w1[i];
    t2 += x1[i] * w2[i];
    t3 += x1[i] * w3[i];
  }
  r0[0] = s0;
  r0[1] = s1;
  r0[2] = s2;
  r0[3] = s3;
  r1[0] = t0;
  r1[1] = t1;
  r1[2] = t2;
  r1[3] = t3;
}

// Calls f(j) for j in [0, n) with the main part in fixed chunks of kLanes:
// GCC's -O2 cost model vectorises only loops without a scalar epilogue, so
// element-wise loops of unknown length are written this way. For element-
// wise work the chunking changes nothing in the arithmetic.
template <class F>
REWIND_INLINE void for_each_lane_chunked(int64_t n, F&& f) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) f(j + l);
  }
  for (; j < n; ++j) f(j);
}

// 1 / sqrt(mean(x^2) + eps) of one row, in f32 like transformers.
float rms_inverse(const float* x, int64_t dim, double eps) {
  const float mean = dot_inline(x, x, dim) / static_cast<float>(dim);
  return 1.0f / std::sqrt(mean + static_cast<float>(eps));
}

// Output features per block of matmul: the block's weight rows (about
// 64 KiB) stay in L2 while every input row is multiplied by them, so each
// weight row comes from memory once per call. A multiple of 4 so that output
// o is always computed by the dot4 group starting at o - o % 4 (or by the
// single-row tail when out % 4 leaves one): never a path chosen by rows.
int64_t matmul_block(int64_t in) {
  const int64_t rows_in_64k = (int64_t{64} * 1024 / 4) / std::max<int64_t>(in, 1);
  return std::clamp<int64_t>(rows_in_64k / 4 * 4, 4, 64);
}

// Output features [o_begin, o_end) of every row.
REWIND_KERNEL_CLONES
void matmul_block_rows(const float* x, int64_t rows, int64_t in, const float* w, int64_t out,
                       float* y, const float* bias, int64_t o_begin, int64_t o_end) {
  // Rows in pairs (the last one alone when rows is odd): the pairing only
  // decides which loads are shared, never an output's arithmetic.
  int64_t r = 0;
  for (; r + 2 <= rows; r += 2) {
    const float* x0 = x + r * in;
    const float* x1 = x0 + in;
    float* y0 = y + r * out;
    float* y1 = y0 + out;
    int64_t o = o_begin;
    for (; o + 4 <= o_end; o += 4) {
      dot4x2(x0, x1, w + o * in, w + (o + 1) * in, w + (o + 2) * in, w + (o + 3) * in, in, y0 + o,
             y1 + o);
    }
    for (; o < o_end; ++o) {
      y0[o] = dot_inline(x0, w + o * in, in);
      y1[o] = dot_inline(x1, w + o * in, in);
    }
  }
  for (; r < rows; ++r) {
    const float* xr = x + r * in;
    float* yr = y + r * out;
    int64_t o = o_begin;
    for (; o + 4 <= o_end; o += 4) {
      dot4(xr, w + o * in, w + (o + 1) * in, w + (o + 2) * in, w + (o + 3) * in, in, yr + o);
    }
    for (; o < o_end; ++o) yr[o] = dot_inline(xr, w + o * in, in);
  }
  if (bias != nullptr) {
    for (int64_t rr = 0; rr < rows; ++rr) {
      for (int64_t j = o_begin; j < o_end; ++j) y[rr * out + j] += bias[j];
    }
  }
}

// One (query, head) of attention over its n keys, the first at kh / vh.
// weights: scratch [n].
REWIND_KERNEL_CLONES
void attend_one(const float* __restrict qh, const float* kh, int64_t k_pos_stride, const float* vh,
                int64_t v_pos_stride, int64_t n, int64_t head_dim, float scale,
                float* __restrict weights, float* __restrict o) {
  float max_score = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) {
    const float s = dot_inline(qh, kh + j * k_pos_stride, head_dim) * scale;
    weights[j] = s;
    max_score = std::max(max_score, s);
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float e = std::exp(weights[j] - max_score);
    weights[j] = e;
    sum += e;
  }
  // Each o[d] accumulates over positions in order; the vectorised loop is
  // the one over d, so no sum is reassociated.
  std::fill(o, o + head_dim, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const float e = weights[j];
    const float* __restrict vj = vh + j * v_pos_stride;
    for_each_lane_chunked(head_dim, [&](int64_t d) { o[d] += e * vj[d]; });
  }
  const float inv_sum = 1.0f / sum;
  for_each_lane_chunked(head_dim, [&](int64_t d) { o[d] *= inv_sum; });
}

// gated_delta_rule_step on a state already copied to s (in place), so that
// one code path serves both the in-place and the out-of-place case.
// delta: scratch [v_dim].
REWIND_KERNEL_CLONES
void delta_step_inplace(const float* __restrict q, const float* __restrict k,
                        const float* __restrict v, float decay, float beta, int64_t k_dim,
                        int64_t v_dim, float* __restrict s, float* __restrict delta,
                        float* __restrict o) {
  // Decay the state and read its memory of k: delta = S^T k, in order of i.
  std::fill(delta, delta + v_dim, 0.0f);
  for (int64_t i = 0; i < k_dim; ++i) {
    float* __restrict row = s + i * v_dim;
    const float ki = k[i];
    for_each_lane_chunked(v_dim, [&](int64_t j) {
      const float decayed = row[j] * decay;
      row[j] = decayed;
      delta[j] += decayed * ki;
    });
  }
  for_each_lane_chunked(v_dim, [&](int64_t j) { delta[j] = (v[j] - delta[j]) * beta; });
  // Rank-one update, then read out o = S^T q from the new state.
  std::fill(o, o + v_dim, 0.0f);
  for (int64_t i = 0; i < k_dim; ++i) {
    float* __restrict row = s + i * v_dim;
    const float ki = k[i];
    const float qi = q[i];
    for_each_lane_chunked(v_dim, [&](int64_t j) {
      const float updated = row[j] + ki * delta[j];
      row[j] = updated;
      o[j] += updated * qi;
    });
  }
}

}  // namespace

float dot(const float* a, const float* b, int64_t n) { return dot_inline(a, b, n); }

void matmul(const float* x, int64_t rows, int64_t in, const float* w, int64_t out, float* y,
            const float* bias) {
  if (rows <= 0 || out <= 0) return;
  const int64_t block = matmul_block(in);
  const int64_t num_blocks = (out + block - 1) / block;
  const bool parallel = num_blocks > 1 && rows * in * out >= kParallelWork;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t b = 0; b < num_blocks; ++b) {
    matmul_block_rows(x, rows, in, w, out, y, bias, b * block, std::min(out, (b + 1) * block));
  }
}

void rms_norm(const float* x, const float* weight, int64_t rows, int64_t dim, double eps,
              float* y) {
#pragma omp parallel for schedule(static) if (rows > 1 && rows * dim >= kParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    const float inv = rms_inverse(xr, dim, eps);
    for (int64_t i = 0; i < dim; ++i) yr[i] = weight[i] * (xr[i] * inv);
  }
}

void gated_rms_norm(const float* x, const float* z, const float* weight, int64_t rows, int64_t dim,
                    double eps, float* y) {
#pragma omp parallel for schedule(static) if (rows > 1 && rows * dim >= kParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    const float* zr = z + r * dim;
    float* yr = y + r * dim;
    const float inv = rms_inverse(xr, dim, eps);
    for (int64_t i = 0; i < dim; ++i) yr[i] = (weight[i] * (xr[i] * inv)) * silu(zr[i]);
  }
}

void l2_normalize(float* x, int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows > 1 && rows * dim >= kParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = x + r * dim;
    const float inv = 1.0f / std::sqrt(dot_inline(xr, xr, dim) + eps);
    for (int64_t i = 0; i < dim; ++i) xr[i] *= inv;
  }
}

void rope_inplace(float* x, int64_t rows, int64_t heads, int64_t head_dim, const int64_t* positions,
                  double theta, int64_t rotary_dim) {
  if (rotary_dim == 0) rotary_dim = head_dim;
  assert(rotary_dim % 2 == 0 && rotary_dim <= head_dim);
  const auto half = static_cast<std::size_t>(rotary_dim / 2);
#pragma omp parallel if (rows > 1 && rows * heads * head_dim >= kParallelWork)
  {
    std::vector<float> cos_t(half);
    std::vector<float> sin_t(half);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      // The table is a function of the position alone, so a row at position
      // p is rotated by the same f32 values whatever else is in the call.
      const double pos = static_cast<double>(positions[r]);
      for (std::size_t j = 0; j < half; ++j) {
        const double inv_freq =
            std::pow(theta, -2.0 * static_cast<double>(j) / static_cast<double>(rotary_dim));
        const double angle = pos * inv_freq;
        cos_t[j] = static_cast<float>(std::cos(angle));
        sin_t[j] = static_cast<float>(std::sin(angle));
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* xh = x + (r * heads + h) * head_dim;
        for (std::size_t j = 0; j < half; ++j) {
          const float x1 = xh[j];
          const float x2 = xh[j + half];
          xh[j] = x1 * cos_t[j] - x2 * sin_t[j];
          xh[j + half] = x2 * cos_t[j] + x1 * sin_t[j];
        }
      }
    }
  }
}

void attention(const float* q, int64_t q_len, int64_t pos0, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, const StridedKV& k, const StridedKV& v, int64_t kv_offset,
               int64_t kv_len, AttentionMask mask, float* out) {
  assert(num_kv_heads > 0 && num_heads % num_kv_heads == 0);
  const int64_t group = num_heads / num_kv_heads;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  const int64_t kv_last = kv_offset + kv_len - 1;
  const int64_t tasks = q_len * num_heads;
#pragma omp parallel if (tasks > 1 && tasks * kv_len * head_dim >= kParallelWork)
  {
    std::vector<float> weights;
#pragma omp for schedule(static)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t p = pos0 + task / num_heads;
      const int64_t kv_head = (task % num_heads) / group;
      float* o = out + task * head_dim;
      // [lo, hi] is the query's own key range, whatever range was passed in:
      // this is what makes the result batch invariant.
      int64_t lo = kv_offset;
      if (mask.window > 0) lo = std::max(lo, p - mask.window + 1);
      if (mask.chunk > 0) lo = std::max(lo, p - p % mask.chunk);
      const int64_t hi = std::min(p, kv_last);
      if (hi < lo) {
        std::fill(o, o + head_dim, 0.0f);
        continue;
      }
      const int64_t n = hi - lo + 1;
      weights.resize(static_cast<std::size_t>(n));
      attend_one(q + task * head_dim,
                 k.data + kv_head * k.head_stride + (lo - kv_offset) * k.pos_stride, k.pos_stride,
                 v.data + kv_head * v.head_stride + (lo - kv_offset) * v.pos_stride, v.pos_stride,
                 n, head_dim, scale, weights.data(), o);
    }
  }
}

void causal_conv1d(const float* window, int64_t channels, int64_t kernel_size, int64_t q,
                   int64_t channel_stride, int64_t time_stride, const float* weight,
                   const float* bias, bool fuse_silu, float* out) {
  // Channels go in blocks so that the inner loop runs across channels while
  // each out[t, c] still sums over i in order.
  constexpr int64_t kBlock = 256;
  const int64_t blocks = (channels + kBlock - 1) / kBlock;
  const int64_t tasks = q * blocks;
  const bool parallel = tasks > 1 && q * channels * kernel_size >= kParallelWork;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t t = task / blocks;
    const int64_t c0 = (task % blocks) * kBlock;
    const int64_t nc = std::min(kBlock, channels - c0);
    float acc[kBlock] = {};
    for (int64_t i = 0; i < kernel_size; ++i) {
      const float* xs = window + c0 * channel_stride + (t + i) * time_stride;
      const float* wi = weight + c0 * kernel_size + i;
      for (int64_t c = 0; c < nc; ++c) acc[c] += wi[c * kernel_size] * xs[c * channel_stride];
    }
    float* ot = out + t * channels + c0;
    for (int64_t c = 0; c < nc; ++c) {
      float s = acc[c];
      if (bias != nullptr) s += bias[c0 + c];
      ot[c] = fuse_silu ? silu(s) : s;
    }
  }
}

void gated_delta_rule_step(const float* q, const float* k, const float* v, float g, float beta,
                           int64_t k_dim, int64_t v_dim, const float* state_in, float* state_out,
                           float* o) {
  // Per-thread scratch: the step is called per (head, token) in hot loops.
  thread_local std::vector<float> delta;
  delta.resize(static_cast<std::size_t>(v_dim));
  if (state_out != state_in) std::copy(state_in, state_in + k_dim * v_dim, state_out);
  delta_step_inplace(q, k, v, std::exp(g), beta, k_dim, v_dim, state_out, delta.data(), o);
}

void gated_delta_rule(const float* q, const float* k, const float* v, const float* g,
                      const float* beta, int64_t tokens, int64_t num_v_heads, int64_t num_k_heads,
                      int64_t k_dim, int64_t v_dim, const float* state_in, float* const* state_out,
                      float* out) {
  assert(num_k_heads > 0 && num_v_heads % num_k_heads == 0);
  const int64_t ratio = num_v_heads / num_k_heads;
  const int64_t head_state = k_dim * v_dim;
  const bool parallel = num_v_heads > 1 && tokens * num_v_heads * head_state >= kParallelWork;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t h = 0; h < num_v_heads; ++h) {
    const int64_t kh = h / ratio;
    for (int64_t t = 0; t < tokens; ++t) {
      const float* prev = (t == 0 ? state_in : state_out[t - 1]) + h * head_state;
      const int64_t qk = (t * num_k_heads + kh) * k_dim;
      const int64_t vo = t * num_v_heads + h;
      gated_delta_rule_step(q + qk, k + qk, v + vo * v_dim, g[vo], beta[vo], k_dim, v_dim, prev,
                            state_out[t] + h * head_state, out + vo * v_dim);
    }
  }
}

void silu_inplace(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = silu(x[i]);
}

void swiglu(const float* gate, const float* up, int64_t n, float* out) {
#pragma omp parallel for schedule(static) if (n >= kParallelWork)
  for (int64_t i = 0; i < n; ++i) out[i] = silu(gate[i]) * up[i];
}

void add_inplace(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void scale_inplace(float* x, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

int64_t argmax(const float* x, int64_t n) {
  int64_t best = 0;
  bool found = false;
  for (int64_t i = 0; i < n; ++i) {
    // NaN fails both comparisons; strict > keeps the first of equal maxima.
    if (!found ? x[i] == x[i] : x[i] > x[best]) {
      best = i;
      found = true;
    }
  }
  return best;
}

void softmax(const float* x, int64_t n, float* y) {
  float max_value = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) max_value = std::max(max_value, x[i]);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const float e = std::exp(x[i] - max_value);
    y[i] = e;
    sum += e;
  }
  const double inv = 1.0 / sum;
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(y[i] * inv);
}

}  // namespace rwd::runtime::kernels
