// Helpers shared by the kernel tests (tests/runtime/kernels/*_test.cc):
// random inputs, bitwise comparison, a fixed OpenMP thread count, the
// instruction-set copies of the kernels compared, and the SiLU inputs with
// saturating values.
#pragma once

#include <gtest/gtest.h>
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <iterator>
#include <random>
#include <vector>

#include "kernels/kernel_isa.h"

namespace rwd::runtime::kernels::test_support {

using Vec = std::vector<float>;

inline constexpr double kUnit = 1.0 / 16777216.0;  // 2^-24, f32 unit roundoff

inline Vec random_vec(std::size_t n, std::uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  Vec v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

// Bitwise equality with the first differing index in the message.
inline testing::AssertionResult same_bits(const float* a, const float* b, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      return testing::AssertionFailure() << "element " << i << " differs: " << a[i] << " vs " << b[i];
    }
  }
  return testing::AssertionSuccess();
}
inline testing::AssertionResult same_bits(const Vec& a, const Vec& b) {
  if (a.size() != b.size()) return testing::AssertionFailure() << "sizes differ";
  return same_bits(a.data(), b.data(), a.size());
}

// Runs f with exactly `threads` OpenMP threads, restoring the default after.
template <class F>
void with_threads(int threads, F&& f) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  f();
  omp_set_num_threads(saved);
}

inline const char* isa_name(detail::KernelIsa isa) {
  switch (isa) {
    case detail::KernelIsa::Avx512: return "avx512";
    case detail::KernelIsa::Avx2: return "avx2";
    case detail::KernelIsa::Baseline: break;
  }
  return "baseline";
}

// Every instruction-set copy of the kernels (runtime/kernels/kernel_isa.h)
// this build and CPU run other than the baseline, narrowest first.
inline std::vector<detail::KernelIsa> wider_kernel_isas() {
  std::vector<detail::KernelIsa> isas;
  for (const auto isa : {detail::KernelIsa::Avx2, detail::KernelIsa::Avx512}) {
    if (static_cast<int>(isa) <= static_cast<int>(detail::kernel_isa_native())) isas.push_back(isa);
  }
  return isas;
}

// Runs f() with the kernels' `isa` copy chosen, the native one restored after.
template <class F>
auto with_kernel_isa(detail::KernelIsa isa, F&& f) {
  EXPECT_TRUE(detail::set_kernel_isa(isa)) << isa_name(isa);
  struct Restore {
    ~Restore() { detail::set_kernel_isa(detail::kernel_isa_native()); }
  } restore;
  return f();
}

// compute() (returning the floats to compare) under every copy of
// wider_kernel_isas() against the baseline copy's, bit for bit.
template <class F>
testing::AssertionResult same_bits_as_baseline_on_every_isa(F&& compute) {
  const Vec baseline = with_kernel_isa(detail::KernelIsa::Baseline, compute);
  for (const detail::KernelIsa isa : wider_kernel_isas()) {
    const Vec wide = with_kernel_isa(isa, compute);
    testing::AssertionResult same = same_bits(wide, baseline);
    if (!same) return same << " (" << isa_name(isa) << " copy against the baseline)";
  }
  return testing::AssertionSuccess();
}

// Inputs for the SiLU loops: random values with saturating ones (|x| > 88,
// where exp_f32 gives 0 or inf, and the clamp bounds themselves) spread so
// that some land in the 8-lane main part and some in the n % 8 tail.
inline Vec silu_inputs(std::size_t n, std::uint32_t seed) {
  Vec v = random_vec(n, seed, -12.0f, 12.0f);
  const float special[] = {-1000.0f, 1000.0f, -88.5f, 88.5f,  -88.25f, 88.25f, -88.0f, 88.0f,   -87.5f,
                           87.5f,    -87.25f, 87.25f, -87.0f, 87.0f,   0.0f,   -0.0f,  -100.0f, 100.0f};
  for (std::size_t i = 0; i < n; ++i) {
    if (i % 3 == 1) v[i] = special[(i / 3 + seed) % std::size(special)];
  }
  if (n > 0) v[n - 1] = -1000.0f;  // the last tail element saturates
  return v;
}

inline constexpr std::int64_t kSiluLengths[] = {1, 7, 8, 9, 15, 16, 37, 64};

}  // namespace rwd::runtime::kernels::test_support
