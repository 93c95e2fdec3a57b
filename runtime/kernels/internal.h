// runtime/kernels/internal.h: what the kernel translation units share
// (not installed, not part of runtime/kernels.h's API).
//
// Batch invariance (see kernels.h) rests on three rules followed by every
// kernel:
//  - a reduction is written once per kind (dot_inline, matmul_micro's
//    in-order sum, in-order loops) and its order depends only on the
//    reduced length;
//  - code specialised for a number of rows (matmul's row groups) or for a
//    vector width (the 8- and 16-lane loops and their scalar tails) does the
//    same IEEE operations per element as every other path;
//  - work is split across threads by independent outputs (output panels,
//    (row, head) pairs, heads), never inside a sum.
//
// Everything here is always inlined or a template: each per-ISA copy
// (kernel_isa.h) and each matmul instruction-set unit gets a copy compiled
// for its own ISA. Include it
// before any `#pragma GCC target` region, so that it is itself compiled for
// the baseline.
#pragma once

#include <cstdint>
#include <memory>
#include <type_traits>

#include "kernel_isa.h"
#include "parallel.h"
#include "runtime/kernels.h"

// Hot loops other than matmul are also compiled for AVX2 and AVX-512F and
// picked at run time: a copy per instruction set (kernel_isa.h:
// REWIND_TARGET_AVX2 and REWIND_TARGET_AVX512 on functions that inline one
// body). The copies only change the width of the vectors; every lane still
// does one rounded multiply and one rounded add in the same order (no FMA
// outside matmul, whose every copy fuses the same way), so each gives the
// same bits as the baseline.
#if defined(REWIND_KERNEL_ISA_COPIES)
#define REWIND_TARGET_AVX2 __attribute__((target("avx2")))
#define REWIND_TARGET_AVX512 __attribute__((target("avx512f")))
#endif
#if defined(__GNUC__)
#define REWIND_INLINE __attribute__((always_inline)) inline
#else
#define REWIND_INLINE inline
#endif

// GCC notes that passing a 32-byte vector by value changes the ABI when AVX
// is off (the SSE2 clone); the helpers that take one are always inlined, so
// no call ever passes one.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace rwd::runtime::kernels::detail {

using std::int64_t;

// Partial sums per reduction: enough independent chains to hide add latency
// and to fill two SSE or one AVX register; fixed so results do not depend
// on the ISA.
inline constexpr int kLanes = 8;

// Multiply-adds below which a kernel stays on the calling thread (waking the
// team costs a few microseconds).
inline constexpr int64_t kParallelWork = int64_t{1} << 16;

// Runs body(i) for i in [0, n) across threads when `worth_it` and more than
// one thread is allowed; otherwise on the calling thread without waking any
// (a few microseconds each time, and a forward runs dozens of kernels).
// Which thread runs which i never changes a result: bodies write disjoint
// outputs.
template <class F>
void parallel_for(int64_t n, bool worth_it, F&& body) {
  const int threads = worth_it && n > 1 ? max_threads() : 1;
  if (threads > 1) {
    using Body = std::remove_reference_t<F>;
    run_parallel(
        n, threads, [](void* ctx, int64_t i) { (*static_cast<Body*>(ctx))(i); },
        const_cast<void*>(static_cast<const void*>(std::addressof(body))));
  } else {
    for (int64_t i = 0; i < n; ++i) body(i);
  }
}

// The fixed tree that combines dot_inline's kLanes partial sums.
REWIND_INLINE float combine(const float (&a)[kLanes]) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

// kernels::dot's arithmetic: kLanes partial sums over i, combine, then the
// n % kLanes remainder in order. Always inlined so that each cloned caller
// gets a copy for its own ISA.
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

// exp_of / silu_of (kernels.h) on kLanes values at once.
typedef std::uint32_t ULanes __attribute__((vector_size(kLanes * sizeof(float))));

REWIND_INLINE Lanes exp_lanes(Lanes x) { return exp_of<Lanes, ULanes>(x); }
REWIND_INLINE Lanes silu_lanes(Lanes x) { return silu_of<Lanes, ULanes>(x); }

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

// 16 floats (a matmul panel row): one AVX-512 vector, two AVX2 ones (which
// GCC moves through the stack: the AVX2 copies of the kernels use Lanes).
inline constexpr int64_t kPanel = PackedMatrix::kPanelWidth;
typedef float PanelRow __attribute__((vector_size(kPanel * sizeof(float))));
typedef std::uint16_t PanelRow16 __attribute__((vector_size(kPanel * sizeof(std::uint16_t))));
typedef std::uint32_t PanelRowBits __attribute__((vector_size(kPanel * sizeof(std::uint32_t))));

REWIND_INLINE PanelRow bits_as_floats(PanelRowBits bits) {
  PanelRow v;
  __builtin_memcpy(&v, &bits, sizeof v);
  return v;
}

REWIND_INLINE PanelRowBits floats_as_bits(PanelRow v) {
  PanelRowBits bits;
  __builtin_memcpy(&bits, &v, sizeof bits);
  return bits;
}

// 16 consecutive floats as one PanelRow (matmul's f32 panel rows; the
// 16-lane loops elsewhere).
struct F32Panels {
  using Stored = float;
  REWIND_INLINE static PanelRow load(const float* p) {
    PanelRow v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
  }
};

}  // namespace rwd::runtime::kernels::detail
