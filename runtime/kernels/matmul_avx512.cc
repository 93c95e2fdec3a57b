// matmul's AVX-512F copy (matmul_internal.h): a panel row is one 512-bit
// register, and 32 registers hold up to 8 rows of accumulators. Everything
// from the push_options on is compiled for AVX-512F; the shared headers are
// included before it, so they stay baseline code (see matmul_internal.h).
#include "matmul_internal.h"

#if defined(REWIND_MATMUL_ISA_KERNELS)
#include <immintrin.h>

#include <type_traits>

#pragma GCC push_options
#pragma GCC target("avx512f")

namespace rwd::runtime::kernels::detail::avx512 {
namespace {

// load_regs is defined inside the target region, as every function that
// inlines this copy's loads must be.
using Reg = PanelRow;
constexpr int kRegs = 1;
template <class E>
REWIND_INLINE void load_regs(const typename E::Stored* p, Reg* out) {
  out[0] = E::load(p);
}
struct F16Panels {
  using Stored = std::uint16_t;
  REWIND_INLINE static PanelRow load(const std::uint16_t* p) {
    // The masked form with every lane set: _mm512_cvtph_ps starts from an
    // undefined vector that GCC 12 reports as maybe-uninitialized.
    const __m512 f = _mm512_maskz_cvtph_ps(
        0xFFFF, _mm256_loadu_si256(static_cast<const __m256i*>(static_cast<const void*>(p))));
    PanelRow v;
    __builtin_memcpy(&v, &f, sizeof v);
    return v;
  }
};
// Q8 rows with the AVX-512F widening (the generic Q8Panels' int8 to float
// conversion compiled to one lane at a time here).
struct Q8Panels {
  static constexpr bool kQ8 = true;
  REWIND_INLINE static void load_q8_scales(const unsigned char* block, PanelRow* out) {
    out[0] = detail::Q8Panels::scales(block);
  }
  REWIND_INLINE static void load_q8(const unsigned char* row, const PanelRow* scale, PanelRow* out) {
    // Masked forms with every lane set, as in F16Panels (GCC 12's
    // maybe-uninitialized on the unmasked ones).
    const __m512i q = _mm512_maskz_cvtepi8_epi32(
        0xFFFF, _mm_loadu_si128(static_cast<const __m128i*>(static_cast<const void*>(row))));
    __m512 s;
    __builtin_memcpy(&s, scale, sizeof s);
    const __m512 w = _mm512_mul_ps(_mm512_maskz_cvtepi32_ps(0xFFFF, q), s);
    __builtin_memcpy(out, &w, sizeof w);
  }
};
REWIND_INLINE PanelRow multiply_add(float x, PanelRow w, PanelRow acc) {
  __m512 wv, av;
  __builtin_memcpy(&wv, &w, sizeof wv);
  __builtin_memcpy(&av, &acc, sizeof av);
  const __m512 r = _mm512_fmadd_ps(_mm512_set1_ps(x), wv, av);
  PanelRow out;
  __builtin_memcpy(&out, &r, sizeof out);
  return out;
}
constexpr bool kWide = true;

}  // namespace

#include "matmul_micro.inc"

}  // namespace rwd::runtime::kernels::detail::avx512

#pragma GCC pop_options
#endif  // REWIND_MATMUL_ISA_KERNELS
