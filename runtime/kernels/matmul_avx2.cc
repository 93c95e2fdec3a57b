// matmul's AVX2 + FMA + F16C copy (matmul_internal.h), the one CPUs without
// AVX-512 run. Everything from the push_options on is compiled for that
// set; the shared headers are included before it, so they stay baseline
// code (see matmul_internal.h).
#include "matmul_internal.h"

#if defined(REWIND_MATMUL_ISA_KERNELS)
#include <immintrin.h>

#include <type_traits>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace rwd::runtime::kernels::detail::avx2 {
namespace {

// A panel row as two 256-bit registers. GCC lowers a 16-float generic
// vector in AVX2 code through the stack (halves stored, the whole reloaded:
// store-forwarding stalls on every multiply-add): the shipped target's
// one-token forward took 1.6 ms on an AVX2-only CPU, and 1,043 us against
// 119 us now on a Zen 4 core told to skip AVX-512 (REWIND_MATMUL_NARROW=1;
// its 5-token forward 2,623 -> 295 us).
struct Acc {
  __m256 lo, hi;
};
using Reg = __m256;
constexpr int kRegs = 2;
template <class E>
REWIND_INLINE void load_regs(const typename E::Stored* p, Reg* out) {
  const Acc a = E::load(p);
  out[0] = a.lo;
  out[1] = a.hi;
}
// y[0, n) = lanes [0, n) of the two registers, + bias[0, n) where bias is
// not null. Neither half goes through a 64-byte generic vector, and a short
// last panel goes through write_partial_panel's call: both, inlined, made
// GCC keep the accumulators of the multiply-add loop in memory (loaded and
// stored around every multiply-add: with the 2 x 32-byte registers alone,
// the shipped target's one-token forward took 336 us, its 3-token one 667
// us; now 119 and 221).
REWIND_INLINE void write_panel(const Reg* a, const float* bias, float* y, int64_t n) {
  if (n == kPanel) {
    __m256 lo = a[0], hi = a[1];
    if (bias != nullptr) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
    }
    _mm256_storeu_ps(y, lo);
    _mm256_storeu_ps(y + 8, hi);
  } else {
    float s[kPanel];
    _mm256_storeu_ps(s, a[0]);
    _mm256_storeu_ps(s + 8, a[1]);
    write_partial_panel(s, bias, y, n);
  }
}
struct F32Panels {
  using Stored = float;
  REWIND_INLINE static Acc load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
};
struct Bf16Panels {
  using Stored = std::uint16_t;
  REWIND_INLINE static __m256 widen(const std::uint16_t* p) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(static_cast<const void*>(p))));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
  REWIND_INLINE static Acc load(const std::uint16_t* p) { return {widen(p), widen(p + 8)}; }
};
struct F16Panels {
  using Stored = std::uint16_t;
  REWIND_INLINE static __m256 widen(const std::uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(static_cast<const void*>(p))));
  }
  REWIND_INLINE static Acc load(const std::uint16_t* p) { return {widen(p), widen(p + 8)}; }
};
// The software widening (the tests' path), split into the two registers.
struct F16SoftwarePanels {
  using Stored = std::uint16_t;
  REWIND_INLINE static Acc load(const std::uint16_t* p) {
    const PanelRow v = detail::F16SoftwarePanels::load(p);
    Acc a;
    __builtin_memcpy(&a.lo, &v, sizeof a.lo);
    __builtin_memcpy(&a.hi, reinterpret_cast<const char*>(&v) + sizeof a.lo, sizeof a.hi);
    return a;
  }
};
// Q8 rows in the two registers (the generic Q8Panels' 16-lane vectors
// would go through the stack, as above).
struct Q8Panels {
  static constexpr bool kQ8 = true;
  REWIND_INLINE static void load_q8_scales(const unsigned char* block, Reg* out) {
    out[0] = Bf16Panels::widen(static_cast<const std::uint16_t*>(static_cast<const void*>(block)));
    out[1] = Bf16Panels::widen(static_cast<const std::uint16_t*>(static_cast<const void*>(block)) + 8);
  }
  REWIND_INLINE static __m256 widen(const unsigned char* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(static_cast<const __m128i*>(static_cast<const void*>(p)))));
  }
  REWIND_INLINE static void load_q8(const unsigned char* row, const Reg* scale, Reg* out) {
    out[0] = _mm256_mul_ps(widen(row), scale[0]);
    out[1] = _mm256_mul_ps(widen(row + 8), scale[1]);
  }
};
REWIND_INLINE Reg multiply_add(float x, Reg w, Reg acc) { return _mm256_fmadd_ps(_mm256_set1_ps(x), w, acc); }
constexpr bool kWide = false;

}  // namespace

#include "matmul_micro.inc"

}  // namespace rwd::runtime::kernels::detail::avx2

#pragma GCC pop_options
#endif  // REWIND_MATMUL_ISA_KERNELS
