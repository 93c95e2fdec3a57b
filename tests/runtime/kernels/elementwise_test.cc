// Tests of exp_f32, the SiLU loops and the element-wise and sampling helpers (runtime/kernels.h; the kernels in
// runtime/kernels/).
//
// Two kinds of checks:
//  - accuracy: each kernel against a naive reference written here, in double
//    where that makes the comparison meaningful. Tolerances are stated per
//    test; sums use a bound proportional to n * 2^-24 * sum |terms| (the
//    classical worst-case bound of f32 summation), so they cannot flake;
//  - batch invariance, bit for bit: a row / token / query computed inside a
//    multi-row call equals the same row computed alone, and results do not
//    depend on the number of OpenMP threads. Speculative decoding is exact
//    only because of these.
#include "runtime/kernels.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

#include "runtime/kernels/test_util.h"

namespace rwd::runtime::kernels {
namespace {

using namespace test_support;

// ---- exp_f32 and the SiLU loops ------------------------------------------------------

// The spacing of floats at f (f finite, nonzero): 2^(e - 24) for |f| in
// [2^(e-1), 2^e).
double ulp_at(float f) {
  int e = 0;
  std::frexp(f, &e);
  return std::ldexp(1.0, e - 24);
}

TEST(KernelsExp, Within1Point3UlpOnItsRange) {
  // Every 61st f32 bit pattern of [-87, 88] (about 37M values), plus the
  // ends: the error against e^x in double, in units of the spacing at the
  // float-rounded exact value.
  std::uint32_t lo_bits = 0, hi_bits = 0;
  const float lo = -87.0f, hi = 88.0f;
  std::memcpy(&lo_bits, &lo, sizeof lo_bits);
  std::memcpy(&hi_bits, &hi, sizeof hi_bits);
  double worst = 0.0;
  float worst_x = 0.0f;
  std::int64_t checked = 0;
  const auto check = [&](float x) {
    const double exact = std::exp(static_cast<double>(x));
    const double err = std::abs(static_cast<double>(exp_f32(x)) - exact) / ulp_at(static_cast<float>(exact));
    if (!(err <= worst)) {  // also catches NaN
      worst = err;
      worst_x = x;
    }
    ++checked;
  };
  constexpr std::uint32_t kStep = 61;
  // Positive floats from +0 up to 88, negative from -0 down to -87 (the
  // sign bit set, magnitude growing with the bits).
  for (std::uint32_t b = 0; b <= hi_bits; b += kStep) {
    float x;
    std::memcpy(&x, &b, sizeof x);
    check(x);
  }
  for (std::uint32_t b = 0x80000000u; b <= lo_bits; b += kStep) {
    float x;
    std::memcpy(&x, &b, sizeof x);
    check(x);
  }
  for (const float x :
       {lo, hi, std::nextafter(lo, 0.0f), std::nextafter(hi, 0.0f), 1.0f, -1.0f, 0.5f, -0.5f, 1e-30f, -1e-30f}) {
    check(x);
  }
  EXPECT_GT(checked, 30000000);
  EXPECT_LE(worst, 1.3) << "at x = " << worst_x;

  const float inf = std::numeric_limits<float>::infinity();
  for (const float x : {-87.5f, std::nextafter(-87.0f, -inf), -1000.0f, -inf}) {
    EXPECT_TRUE(exp_f32(x) == 0.0f && !std::signbit(exp_f32(x))) << x;
  }
  for (const float x : {88.5f, std::nextafter(88.0f, inf), 1000.0f, inf}) {
    EXPECT_EQ(exp_f32(x), inf) << x;
  }
  EXPECT_TRUE(std::isnan(exp_f32(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(std::isnan(exp_f32(-std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(exp_f32(0.0f), 1.0f);
  EXPECT_EQ(exp_f32(-0.0f), 1.0f);
}

TEST(KernelsHelpers, SiluLoopsEqualScalarSiluBitwise) {
  // The loops run exp_f32 8 lanes wide for the main part and the scalar
  // exp_f32 / silu from the header for the n % 8 tail: both must give the
  // scalar's bits at every index, saturated inputs included.
#if defined(__FMA__)
  // The scalar silu inlined here may be contracted differently from the
  // kernels (built with -ffp-contract=off).
  GTEST_SKIP() << "FMA contraction enabled in this build";
#endif
  for (const std::int64_t n : kSiluLengths) {
    const std::size_t un = static_cast<std::size_t>(n);
    const Vec gate = silu_inputs(un, static_cast<std::uint32_t>(200 + n));
    const Vec up = random_vec(un, static_cast<std::uint32_t>(300 + n), -2.0f, 2.0f);
    Vec expected_act(un), expected_out(un);
    for (std::size_t i = 0; i < un; ++i) {
      expected_act[i] = silu(gate[i]);
      expected_out[i] = silu(gate[i]) * up[i];
    }
    Vec act = gate;
    silu_inplace(act.data(), n);
    EXPECT_TRUE(same_bits(act, expected_act)) << "silu_inplace n " << n;
    Vec out(un);
    swiglu(gate.data(), up.data(), n, out.data());
    EXPECT_TRUE(same_bits(out, expected_out)) << "swiglu n " << n;
    Vec in_gate = gate;  // out may equal gate or up
    swiglu(in_gate.data(), up.data(), n, in_gate.data());
    EXPECT_TRUE(same_bits(in_gate, expected_out)) << "swiglu out == gate, n " << n;
    Vec in_up = up;
    swiglu(gate.data(), in_up.data(), n, in_up.data());
    EXPECT_TRUE(same_bits(in_up, expected_out)) << "swiglu out == up, n " << n;
  }
  // Large enough to be split in 4096-element chunks across threads.
  const std::int64_t big = 70001;
  const Vec gate = silu_inputs(static_cast<std::size_t>(big), 400);
  const Vec up = random_vec(gate.size(), 401);
  Vec out(gate.size());
  with_threads(2, [&] { swiglu(gate.data(), up.data(), big, out.data()); });
  for (std::size_t i = 0; i < out.size(); ++i) {
    const float expected = silu(gate[i]) * up[i];
    ASSERT_TRUE(same_bits(&out[i], &expected, 1)) << "swiglu n " << big << " at " << i;
  }
}

// The AVX2 copy of the SiLU loops runs 8 lanes wide, the others 16 then 8:
// every copy must give the baseline's bits, saturated inputs and tails
// included.
TEST(KernelsHelpers, SiluLoopsOnEveryIsaCopyGiveTheBaselineBits) {
  if (wider_kernel_isas().empty()) GTEST_SKIP() << "this CPU runs the baseline copy only";
  for (const std::int64_t n : {1, 7, 8, 9, 15, 16, 17, 24, 31, 37, 64, 100, 4133}) {
    const std::size_t un = static_cast<std::size_t>(n);
    const Vec gate = silu_inputs(un, static_cast<std::uint32_t>(500 + n));
    const Vec up = random_vec(un, static_cast<std::uint32_t>(600 + n), -2.0f, 2.0f);
    EXPECT_TRUE(same_bits_as_baseline_on_every_isa([&] {
      Vec out(un);
      swiglu(gate.data(), up.data(), n, out.data());
      Vec act = gate;
      silu_inplace(act.data(), n);
      out.insert(out.end(), act.begin(), act.end());
      return out;
    })) << "n "
        << n;
  }
}

// ---- helpers ----------------------------------------------------------------------

TEST(KernelsHelpers, ActivationsMatchDoubleAndStayFinite) {
  for (float x = -30.0f; x <= 30.0f; x += 0.37f) {
    const double xd = x;
    const double sig = 1.0 / (1.0 + std::exp(-xd));
    EXPECT_NEAR(sigmoid(x), sig, 4.0 * kUnit * sig) << x;
    EXPECT_NEAR(silu(x), xd * sig, 4.0 * kUnit * std::abs(xd * sig) + 1e-30) << x;
    const double sp = std::log1p(std::exp(xd));
    EXPECT_NEAR(softplus(x), sp, 4.0 * kUnit * sp + 1e-30) << x;
  }
  for (const float x : {-1000.0f, -100.0f, 100.0f, 1000.0f}) {
    EXPECT_TRUE(std::isfinite(sigmoid(x)) && std::isfinite(silu(x)) && std::isfinite(softplus(x))) << x;
  }
  EXPECT_EQ(sigmoid(-1000.0f), 0.0f);
  EXPECT_EQ(sigmoid(1000.0f), 1.0f);
  // silu(x) = x / (1 + exp_f32(-x)): exp_f32(1000) = inf gives the limit -0,
  // exp_f32(-1000) = 0 gives x itself.
  EXPECT_EQ(silu(-1000.0f), 0.0f);
  EXPECT_TRUE(std::signbit(silu(-1000.0f)));
  EXPECT_EQ(silu(1000.0f), 1000.0f);
  EXPECT_EQ(silu(88.5f), 88.5f);
  EXPECT_EQ(softplus(1000.0f), 1000.0f);
}

TEST(KernelsHelpers, ElementWise) {
  const Vec gate = random_vec(37, 110, -5.0f, 5.0f);
  const Vec up = random_vec(37, 111);
  Vec out(37);
  swiglu(gate.data(), up.data(), 37, out.data());
  Vec act = gate;
  silu_inplace(act.data(), 37);
  for (std::size_t i = 0; i < out.size(); ++i) {
    EXPECT_EQ(act[i], silu(gate[i]));
    EXPECT_EQ(out[i], silu(gate[i]) * up[i]);
  }
  Vec y = up;
  add_inplace(y.data(), gate.data(), 37);
  scale_inplace(y.data(), 37, 0.5f);
  for (std::size_t i = 0; i < y.size(); ++i) EXPECT_EQ(y[i], (up[i] + gate[i]) * 0.5f);
}

TEST(KernelsHelpers, ArgmaxFirstMaxWinsAndIgnoresNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(argmax(Vec{1.0f, 3.0f, 2.0f, 3.0f}.data(), 4), 1);
  EXPECT_EQ(argmax(Vec{nan, 1.0f, nan, 2.0f}.data(), 4), 3);
  EXPECT_EQ(argmax(Vec{-inf, -inf}.data(), 2), 0);
  EXPECT_EQ(argmax(Vec{-inf, -5.0f}.data(), 2), 1);
  EXPECT_EQ(argmax(Vec{nan, nan}.data(), 2), 0);
  EXPECT_EQ(argmax(nullptr, 0), 0);
}

TEST(KernelsHelpers, SoftmaxMatchesDouble) {
  const Vec x = random_vec(1000, 120, -20.0f, 20.0f);
  Vec y(x.size());
  softmax(x.data(), 1000, y.data());
  const double mx = *std::max_element(x.begin(), x.end());
  double sum = 0.0;
  for (const float v : x) sum += std::exp(v - mx);
  double total = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double ref = std::exp(x[i] - mx) / sum;
    // x - max rounds in f32 with an error up to |x - max| * u, which exp
    // turns into the same relative error; then a few roundings.
    EXPECT_NEAR(y[i], ref, (std::abs(x[i] - mx) + 8.0) * kUnit * ref + 1e-30);
    total += y[i];
  }
  EXPECT_NEAR(total, 1.0, 1e-5);
  Vec in_place = x;
  softmax(in_place.data(), 1000, in_place.data());
  EXPECT_TRUE(same_bits(y, in_place));
}

}  // namespace
}  // namespace rwd::runtime::kernels
