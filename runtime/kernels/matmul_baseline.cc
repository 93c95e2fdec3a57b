// matmul's portable copy (matmul_internal.h): the same fused multiply-adds
// as the AVX2 and AVX-512 copies, through fmaf (a library call where the CPU
// has no FMA: exact, and slow), for CPUs without AVX2 + FMA + F16C and for
// builds other than GCC on x86-64.
#include <type_traits>

#include "matmul_internal.h"

namespace rwd::runtime::kernels::detail::baseline {
namespace {

using Reg = PanelRow;
constexpr int kRegs = 1;
template <class E>
REWIND_INLINE void load_regs(const typename E::Stored* p, Reg* out) {
  out[0] = E::load(p);
}
using F16Panels = F16SoftwarePanels;
// fmaf per lane: one rounding, as the FMA instructions of the other copies.
REWIND_INLINE PanelRow multiply_add(float x, PanelRow w, PanelRow acc) {
  PanelRow out;
  for (int l = 0; l < kPanel; ++l) out[l] = __builtin_fmaf(x, w[l], acc[l]);
  return out;
}
constexpr bool kWide = false;

// Q8 in plain integer arithmetic, one lane at a time, from the values q
// (the stored byte minus 128).
struct Q8Dot {
  struct IAcc {
    std::int32_t v[kPanel];
  };
  struct Bx {
    std::int32_t q[4];
  };
  REWIND_INLINE static IAcc start(std::int32_t) { return IAcc{}; }
  REWIND_INLINE static Bx broadcast(const std::int8_t* q4) { return Bx{{q4[0], q4[1], q4[2], q4[3]}}; }
  REWIND_INLINE static IAcc dot(IAcc acc, const unsigned char* w64, const Bx& bx) {
    for (int l = 0; l < kPanel; ++l) {
      for (int j = 0; j < 4; ++j) acc.v[l] += (static_cast<std::int32_t>(w64[l * 4 + j]) - 128) * bx.q[j];
    }
    return acc;
  }
  REWIND_INLINE static void finish(const IAcc& acc, const unsigned char* scales, float d, float* f) {
    for (int l = 0; l < kPanel; ++l) {
      std::uint16_t h;
      __builtin_memcpy(&h, scales + 2 * l, sizeof h);
      f[l] = __builtin_fmaf(static_cast<float>(acc.v[l]), bf16_to_f32(h) * d, f[l]);
    }
  }
};
constexpr int kQ8MaxRows = 4;
constexpr int q8_panels_for_rows(int) { return 1; }

}  // namespace

#include "matmul_micro.inc"
#include "matmul_q8.inc"

}  // namespace rwd::runtime::kernels::detail::baseline
