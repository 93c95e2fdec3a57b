// Which of matmul's copies (matmul_internal.h) this process runs: chosen
// once from the CPU and the REWIND_MATMUL_* environment overrides.
#include <cstdlib>
#include <string_view>

#include "matmul_internal.h"

#if defined(REWIND_MATMUL_ISA_KERNELS)
#include <cpuid.h>
#endif

namespace rwd::runtime::kernels::detail {
namespace {

bool environment_flag(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && std::string_view(value) == "1";
}

}  // namespace

MatmulIsa matmul_isa() {
#if defined(REWIND_MATMUL_ISA_KERNELS)
  static const MatmulIsa isa = [] {
    if (environment_flag("REWIND_MATMUL_BASELINE")) return MatmulIsa::Baseline;
    const bool skip_avx512 = environment_flag("REWIND_MATMUL_NARROW");
    if (__builtin_cpu_supports("avx512f") && !skip_avx512) return MatmulIsa::Avx512;
    // F16C from CPUID leaf 1 (clang's __builtin_cpu_supports has no "f16c").
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) return MatmulIsa::Avx2;
    return MatmulIsa::Baseline;
  }();
  return isa;
#else
  return MatmulIsa::Baseline;
#endif
}

MatmulIsa matmul_q8_isa() {
#if defined(REWIND_MATMUL_ISA_KERNELS)
  static const MatmulIsa isa = [] {
    const MatmulIsa wide = matmul_isa();
    if (wide == MatmulIsa::Avx512 && __builtin_cpu_supports("avx512vnni")) return MatmulIsa::Avx512;
    if (wide != MatmulIsa::Baseline && __builtin_cpu_supports("avx2")) return MatmulIsa::Avx2;
    return MatmulIsa::Baseline;
  }();
  return isa;
#else
  return MatmulIsa::Baseline;
#endif
}

void matmul_q8_block(const Q8Rows& x, int64_t rows, const PackedMatrix& w, float* y, const float* bias, int64_t p_begin,
                     int64_t p_end) {
  switch (matmul_q8_isa()) {
#if defined(REWIND_MATMUL_ISA_KERNELS)
    case MatmulIsa::Avx512: avx512_vnni::matmul_q8_block(x, rows, w, y, bias, p_begin, p_end); return;
    case MatmulIsa::Avx2: avx2::matmul_q8_block(x, rows, w, y, bias, p_begin, p_end); return;
#else
    case MatmulIsa::Avx512:
    case MatmulIsa::Avx2:
#endif
    case MatmulIsa::Baseline: break;
  }
  baseline::matmul_q8_block(x, rows, w, y, bias, p_begin, p_end);
}

bool f16_software_forced() {
  static const bool forced = environment_flag("REWIND_MATMUL_F16_SOFTWARE");
  return forced;
}

void matmul_block(const float* x, int64_t rows, const PackedMatrix& w, float* y, const float* bias, int64_t p_begin,
                  int64_t p_end, int64_t ahead) {
  const bool f16_software = f16_software_forced();
  switch (matmul_isa()) {
#if defined(REWIND_MATMUL_ISA_KERNELS)
    case MatmulIsa::Avx512: avx512::matmul_block(x, rows, w, y, bias, p_begin, p_end, ahead, f16_software); return;
    case MatmulIsa::Avx2: avx2::matmul_block(x, rows, w, y, bias, p_begin, p_end, ahead, f16_software); return;
#else
    case MatmulIsa::Avx512:
    case MatmulIsa::Avx2:
#endif
    case MatmulIsa::Baseline: break;
  }
  baseline::matmul_block(x, rows, w, y, bias, p_begin, p_end, ahead, f16_software);
}

}  // namespace rwd::runtime::kernels::detail
