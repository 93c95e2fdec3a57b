// runtime/kernels/kernel_isa.h: which instruction-set copy of the vector
// kernels other than matmul (the delta rule, attention, the element-wise
// SiLU loops, the norms, RoPE, the short convolution) a process runs (not
// installed, not part of runtime/kernels.h's API).
//
// Those kernels are compiled three times in their own translation units
// (functions with __attribute__((target)) that inline one shared body): for
// the baseline, for AVX2 and for AVX-512F. The AVX2 copy works on 8-float
// vectors (one ymm register each) where the others use 16-float ones: GCC
// lowers a 16-float generic vector in AVX2 code through the stack. Every
// copy does the same IEEE operations per element in the same order, so all
// give the same bits; the tests compare them (set_kernel_isa).
#pragma once

namespace rwd::runtime::kernels::detail {

// GCC or Clang on x86-64 Linux, outside the sanitizer builds that define
// REWIND_NO_KERNEL_CLONES (CMakeLists.txt): the AVX2 and AVX-512 copies
// exist.
// Elsewhere only the baseline copy is compiled.
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(REWIND_NO_KERNEL_CLONES)
#define REWIND_KERNEL_ISA_COPIES 1
#endif

// Ordered: a CPU that runs one copy runs every copy before it.
enum class KernelIsa { Baseline = 0, Avx2 = 1, Avx512 = 2 };

// The widest copy this build has and this CPU runs (AVX2 at most when the
// environment sets REWIND_KERNELS_NARROW=1).
KernelIsa kernel_isa_native();

// The copy the kernels run: kernel_isa_native() unless set_kernel_isa chose
// another.
KernelIsa kernel_isa();

// Makes the kernels run `isa`'s copy from now on (for tests that compare the
// copies) and returns true, or returns false and changes nothing when this
// build or CPU cannot run it (`isa` wider than kernel_isa_native()). Not for
// use while kernels run on other threads.
bool set_kernel_isa(KernelIsa isa);

}  // namespace rwd::runtime::kernels::detail
