// matmul over Q8 panels with AVX-512 VNNI (matmul_q8.inc): one vpdpbusd
// adds the four products of 16 outputs' stored bytes (q + 128, unsigned)
// with four activation values (signed) to 16 int32 sums, exactly; each sum
// starts at -128 times the block's activation sum, which takes the 128 of
// every stored byte back out. Its own translation unit, compiled for
// AVX-512F + VNNI, because matmul's AVX-512 copy also serves CPUs with
// AVX-512F and no VNNI (those take the AVX2 Q8 copy, matmul_dispatch.cc).
#include "matmul_internal.h"

#if defined(REWIND_MATMUL_ISA_KERNELS)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vnni")

namespace rwd::runtime::kernels::detail::avx512_vnni {
namespace {

struct Q8Dot {
  using IAcc = __m512i;
  using Bx = __m512i;
  REWIND_INLINE static IAcc start(std::int32_t sum) { return _mm512_set1_epi32(-128 * sum); }
  REWIND_INLINE static Bx broadcast(const std::int8_t* q4) {
    std::int32_t four;
    __builtin_memcpy(&four, q4, sizeof four);
    return _mm512_set1_epi32(four);
  }
  REWIND_INLINE static IAcc dot(IAcc acc, const unsigned char* w64, Bx bx) {
    return _mm512_dpbusd_epi32(acc, _mm512_loadu_si512(w64), bx);
  }
  REWIND_INLINE static void finish(IAcc acc, const unsigned char* scales, float d, float* f) {
    // Masked forms with every lane set: GCC 12 reports the unmasked ones'
    // undefined starting vectors as maybe-uninitialized.
    const __m512i h = _mm512_maskz_cvtepu16_epi32(
        0xFFFF, _mm256_loadu_si256(static_cast<const __m256i*>(static_cast<const void*>(scales))));
    const __m512 s = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, h, 16));
    const __m512 sum = _mm512_maskz_cvtepi32_ps(0xFFFF, acc);
    _mm512_store_ps(f, _mm512_fmadd_ps(sum, _mm512_mul_ps(s, _mm512_set1_ps(d)), _mm512_load_ps(f)));
  }
};
// 32 registers: the int32 sums of R x V panels and R broadcasts.
constexpr int kQ8MaxRows = 6;
constexpr int q8_panels_for_rows(int rows) { return rows <= 2 ? 4 : (rows <= 4 ? 3 : 2); }

}  // namespace

#include "matmul_q8.inc"

}  // namespace rwd::runtime::kernels::detail::avx512_vnni

#pragma GCC pop_options
#endif  // REWIND_MATMUL_ISA_KERNELS
