// The element-wise and sampling kernels (SiLU, SwiGLU, residual adds,
// scaling, argmax, softmax) and the exported fixed-order dot product.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "internal.h"

namespace rwd::runtime::kernels {

using namespace detail;

namespace {

// out[i] = silu(gate[i]) * up[i] for i < n, or silu(gate[i]) when up is
// null. The out-of-line home of the element-wise SiLU loops, compiled per
// instruction set (kernel_isa.h), so that exp_of runs 16 lanes wide (when
// `kWide`: one AVX-512 vector), then 8 (one AVX2 vector), then one at a
// time: the same arithmetic in every lane.
// Clang checks the vector ABI of every call made directly from a function
// compiled for another instruction set, even to always-inlined helpers, and
// rejects passing Lanes by value there; calls made from inside an inlined
// helper pass. So each copy below only calls the helper that holds its body.
template <bool kWide>
REWIND_INLINE void swiglu_span_body(const float* gate, const float* up, int64_t n, float* out) {
  int64_t i = 0;
  if constexpr (kWide) {
    for (; i + kPanel <= n; i += kPanel) {
      PanelRow v = silu_of<PanelRow, PanelRowBits>(F32Panels::load(gate + i));
      if (up != nullptr) v *= F32Panels::load(up + i);
      __builtin_memcpy(out + i, &v, sizeof v);
    }
  }
  for (; i + kLanes <= n; i += kLanes) {
    Lanes v = silu_lanes(load_lanes(gate + i));
    if (up != nullptr) v *= load_lanes(up + i);
    __builtin_memcpy(out + i, &v, sizeof v);
  }
  for (; i < n; ++i) out[i] = up != nullptr ? silu(gate[i]) * up[i] : silu(gate[i]);
}

void swiglu_span_baseline(const float* gate, const float* up, int64_t n, float* out) {
  swiglu_span_body<true>(gate, up, n, out);
}
#if defined(REWIND_KERNEL_ISA_COPIES)
REWIND_TARGET_AVX2
void swiglu_span_avx2(const float* gate, const float* up, int64_t n, float* out) {
  swiglu_span_body<false>(gate, up, n, out);
}
REWIND_TARGET_AVX512
void swiglu_span_avx512(const float* gate, const float* up, int64_t n, float* out) {
  swiglu_span_body<true>(gate, up, n, out);
}
#endif

void swiglu_span(const float* gate, const float* up, int64_t n, float* out) {
  switch (kernel_isa()) {
#if defined(REWIND_KERNEL_ISA_COPIES)
    case KernelIsa::Avx512: swiglu_span_avx512(gate, up, n, out); return;
    case KernelIsa::Avx2: swiglu_span_avx2(gate, up, n, out); return;
#endif
    default: swiglu_span_baseline(gate, up, n, out); return;
  }
}

}  // namespace

float dot(const float* a, const float* b, int64_t n) { return dot_inline(a, b, n); }

void silu_inplace(float* x, int64_t n) { swiglu_span(x, nullptr, n, x); }

void swiglu(const float* gate, const float* up, int64_t n, float* out) {
  constexpr int64_t kChunk = 4096;
  parallel_for((n + kChunk - 1) / kChunk, n >= kParallelWork, [&](int64_t c) {
    const int64_t begin = c * kChunk;
    swiglu_span(gate + begin, up + begin, std::min(n, begin + kChunk) - begin, out + begin);
  });
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
