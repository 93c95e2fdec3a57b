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
REWIND_INLINE Reg multiply_add(float x, Reg w, Reg acc) { return _mm256_fmadd_ps(_mm256_set1_ps(x), w, acc); }
constexpr bool kWide = false;

// Q8 with AVX2's u8 x s8 multiply (vpmaddubsw), whose pair sums saturate at
// 16 bits: the stored bytes q + 128 times an activation could reach 64770,
// so the weights are first made signed (q, the byte xor 128) and given the
// activation's sign (vpsignb), and the activation's magnitude is the
// unsigned operand: pairs of q * x then stay within 2 * 127 * 127.
struct Q8Dot {
  struct IAcc {
    __m256i lo, hi;
  };
  struct Bx {
    __m256i q, magnitude;
  };
  REWIND_INLINE static IAcc start(std::int32_t) { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
  REWIND_INLINE static Bx broadcast(const std::int8_t* q4) {
    std::int32_t four;
    __builtin_memcpy(&four, q4, sizeof four);
    const __m256i q = _mm256_set1_epi32(four);
    return {q, _mm256_sign_epi8(q, q)};
  }
  // 8 outputs' sums of 4 products from 32 stored bytes.
  REWIND_INLINE static __m256i dot8(const unsigned char* w32, const Bx& bx) {
    const __m256i stored = _mm256_loadu_si256(static_cast<const __m256i*>(static_cast<const void*>(w32)));
    const __m256i q = _mm256_xor_si256(stored, _mm256_set1_epi8(static_cast<char>(0x80)));
    const __m256i pairs = _mm256_maddubs_epi16(bx.magnitude, _mm256_sign_epi8(q, bx.q));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  }
  REWIND_INLINE static IAcc dot(IAcc acc, const unsigned char* w64, const Bx& bx) {
    return {_mm256_add_epi32(acc.lo, dot8(w64, bx)), _mm256_add_epi32(acc.hi, dot8(w64 + 32, bx))};
  }
  REWIND_INLINE static void finish(const IAcc& acc, const unsigned char* scales, float d, float* f) {
    const __m256 dv = _mm256_set1_ps(d);
    const auto* s = static_cast<const std::uint16_t*>(static_cast<const void*>(scales));
    const __m256 lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc.lo), _mm256_mul_ps(Bf16Panels::widen(s), dv),
                                      _mm256_load_ps(f));
    const __m256 hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc.hi), _mm256_mul_ps(Bf16Panels::widen(s + 8), dv),
                                      _mm256_load_ps(f + 8));
    _mm256_store_ps(f, lo);
    _mm256_store_ps(f + 8, hi);
  }
};
// 16 registers: two rows of two panels hold 8 sums and 4 broadcasts.
constexpr int kQ8MaxRows = 4;
constexpr int q8_panels_for_rows(int rows) { return rows <= 2 ? 2 : 1; }

}  // namespace

#include "matmul_micro.inc"
#include "matmul_q8.inc"

}  // namespace rwd::runtime::kernels::detail::avx2

#pragma GCC pop_options
#endif  // REWIND_MATMUL_ISA_KERNELS
