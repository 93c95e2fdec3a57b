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
// bf16 with the AVX-512F widening: the generic Bf16Panels' conversion
// compiled here to two 256-bit zero-extensions and an insert per panel row,
// which made a one-row bf16 matmul slower than an f16 one of the same bytes.
struct Bf16Panels {
  using Stored = std::uint16_t;
  REWIND_INLINE static PanelRow load(const std::uint16_t* p) {
    const __m512i u = _mm512_maskz_cvtepu16_epi32(
        0xFFFF, _mm256_loadu_si256(static_cast<const __m256i*>(static_cast<const void*>(p))));
    const __m512i bits = _mm512_maskz_slli_epi32(0xFFFF, u, 16);
    PanelRow v;
    __builtin_memcpy(&v, &bits, sizeof v);
    return v;
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
