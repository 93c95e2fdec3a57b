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

}  // namespace

#include "matmul_micro.inc"

}  // namespace rwd::runtime::kernels::detail::baseline
