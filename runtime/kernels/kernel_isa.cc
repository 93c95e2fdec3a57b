// Which copy of the multi-ISA kernels runs (kernel_isa.h): chosen once from
// the CPU, replaceable by the tests.
#include "kernel_isa.h"

#include <atomic>
#include <cstdlib>
#include <string_view>

namespace rwd::runtime::kernels::detail {
namespace {

KernelIsa detect() {
#if defined(REWIND_KERNEL_ISA_COPIES)
  // REWIND_KERNELS_NARROW=1: the AVX2 copy on a CPU with AVX-512 (to
  // measure it there), as REWIND_MATMUL_NARROW does for matmul.
  const char* narrow = std::getenv("REWIND_KERNELS_NARROW");
  const bool skip_avx512 = narrow != nullptr && std::string_view(narrow) == "1";
  if (__builtin_cpu_supports("avx512f") && !skip_avx512) return KernelIsa::Avx512;
  if (__builtin_cpu_supports("avx2")) return KernelIsa::Avx2;
#endif
  return KernelIsa::Baseline;
}

std::atomic<KernelIsa>& current() {
  static std::atomic<KernelIsa> isa{kernel_isa_native()};
  return isa;
}

}  // namespace

KernelIsa kernel_isa_native() {
  static const KernelIsa native = detect();
  return native;
}

KernelIsa kernel_isa() { return current().load(std::memory_order_relaxed); }

bool set_kernel_isa(KernelIsa isa) {
  if (static_cast<int>(isa) > static_cast<int>(kernel_isa_native())) return false;
  current().store(isa, std::memory_order_relaxed);
  return true;
}

}  // namespace rwd::runtime::kernels::detail
