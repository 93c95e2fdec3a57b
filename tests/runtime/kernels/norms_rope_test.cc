// Tests of the normalisations and RoPE (runtime/kernels.h; the kernels in runtime/kernels/).
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

// ---- normalisation --------------------------------------------------------------

double ref_inv_rms(const float* x, std::int64_t dim, double eps) {
  double ss = 0.0;
  for (std::int64_t i = 0; i < dim; ++i) ss += static_cast<double>(x[i]) * x[i];
  return 1.0 / std::sqrt(ss / static_cast<double>(dim) + eps);
}

TEST(KernelsNorm, RmsNormMatchesReferenceAndIsRowInvariant) {
  const std::int64_t rows = 6, dim = 77;
  const Vec x = random_vec(static_cast<std::size_t>(rows * dim), 11, -3.0f, 3.0f);
  const Vec weight = random_vec(static_cast<std::size_t>(dim), 12, 0.5f, 1.5f);
  Vec y(x.size());
  rms_norm(x.data(), weight.data(), rows, dim, 1e-6, y.data());
  for (std::int64_t r = 0; r < rows; ++r) {
    const double inv = ref_inv_rms(x.data() + r * dim, dim, 1e-6);
    for (std::int64_t i = 0; i < dim; ++i) {
      const std::size_t at = static_cast<std::size_t>(r * dim + i);
      const double ref = weight[static_cast<std::size_t>(i)] * (x[at] * inv);
      // Sum of squares ~ dim * u relative, plus a handful of roundings.
      EXPECT_NEAR(y[at], ref, (static_cast<double>(dim) + 8.0) * kUnit * std::abs(ref) + 1e-30);
    }
  }
  Vec alone(x.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    rms_norm(x.data() + r * dim, weight.data(), 1, dim, 1e-6, alone.data() + r * dim);
  }
  EXPECT_TRUE(same_bits(y, alone));
  Vec in_place = x;
  rms_norm(in_place.data(), weight.data(), rows, dim, 1e-6, in_place.data());
  EXPECT_TRUE(same_bits(y, in_place));
}

TEST(KernelsNorm, GatedRmsNormMatchesReference) {
  const std::int64_t rows = 4, dim = 40;
  const Vec x = random_vec(static_cast<std::size_t>(rows * dim), 13, -2.0f, 2.0f);
  const Vec z = random_vec(x.size(), 14, -4.0f, 4.0f);
  const Vec weight = random_vec(static_cast<std::size_t>(dim), 15, 0.5f, 1.5f);
  Vec y(x.size());
  gated_rms_norm(x.data(), z.data(), weight.data(), rows, dim, 1e-6, y.data());
  for (std::int64_t r = 0; r < rows; ++r) {
    const double inv = ref_inv_rms(x.data() + r * dim, dim, 1e-6);
    for (std::int64_t i = 0; i < dim; ++i) {
      const std::size_t at = static_cast<std::size_t>(r * dim + i);
      const double zz = z[at];
      const double ref = weight[static_cast<std::size_t>(i)] * x[at] * inv * zz / (1.0 + std::exp(-zz));
      EXPECT_NEAR(y[at], ref, (static_cast<double>(dim) + 16.0) * kUnit * std::abs(ref) + 1e-30);
    }
  }
  Vec alone(x.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    gated_rms_norm(x.data() + r * dim, z.data() + r * dim, weight.data(), 1, dim, 1e-6, alone.data() + r * dim);
  }
  EXPECT_TRUE(same_bits(y, alone));
}

TEST(KernelsNorm, L2NormalizeMatchesReference) {
  const std::int64_t rows = 5, dim = 33;
  const Vec x = random_vec(static_cast<std::size_t>(rows * dim), 16, -2.0f, 2.0f);
  Vec y = x;
  l2_normalize(y.data(), rows, dim, 1e-6f);
  for (std::int64_t r = 0; r < rows; ++r) {
    double ss = 0.0;
    for (std::int64_t i = 0; i < dim; ++i) {
      ss += static_cast<double>(x[static_cast<std::size_t>(r * dim + i)]) * x[static_cast<std::size_t>(r * dim + i)];
    }
    const double inv = 1.0 / std::sqrt(ss + 1e-6);
    for (std::int64_t i = 0; i < dim; ++i) {
      const std::size_t at = static_cast<std::size_t>(r * dim + i);
      EXPECT_NEAR(y[at], x[at] * inv, (static_cast<double>(dim) + 8.0) * kUnit);
    }
  }
  Vec zeros(8, 0.0f);  // eps keeps a zero row finite
  l2_normalize(zeros.data(), 1, 8, 1e-6f);
  EXPECT_EQ(zeros, Vec(8, 0.0f));
}

// ---- rope -------------------------------------------------------------------------

TEST(KernelsRope, MatchesReferenceWithPartialRotary) {
  const std::int64_t rows = 4, heads = 3, head_dim = 16;
  const std::int64_t positions[rows] = {0, 1, 17, 4099};
  for (const std::int64_t rotary_dim : {std::int64_t{0}, std::int64_t{8}}) {
    const std::int64_t rd = rotary_dim == 0 ? head_dim : rotary_dim;
    const Vec x = random_vec(static_cast<std::size_t>(rows * heads * head_dim), 17);
    Vec y = x;
    rope_inplace(y.data(), rows, heads, head_dim, positions, 10000.0, rotary_dim);
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t h = 0; h < heads; ++h) {
        const std::size_t base = static_cast<std::size_t>((r * heads + h) * head_dim);
        for (std::int64_t d = 0; d < head_dim; ++d) {
          double ref = x[base + static_cast<std::size_t>(d)];  // pass-through part
          if (d < rd) {
            const std::int64_t j = d % (rd / 2);
            const double angle = static_cast<double>(positions[r]) *
                                 std::pow(10000.0, -2.0 * static_cast<double>(j) / static_cast<double>(rd));
            const double x1 = x[base + static_cast<std::size_t>(j)];
            const double x2 = x[base + static_cast<std::size_t>(j + rd / 2)];
            ref = d < rd / 2 ? x1 * std::cos(angle) - x2 * std::sin(angle)
                             : x2 * std::cos(angle) + x1 * std::sin(angle);
          }
          // cos / sin rounded to f32, two products and a sum: a few ulps.
          EXPECT_NEAR(y[base + static_cast<std::size_t>(d)], ref, 8.0 * kUnit * 2.0)
              << "rotary_dim " << rotary_dim << " row " << r << " head " << h << " d " << d;
        }
      }
    }
  }
}

// A table copied from a RopeCache holds exactly the angles of the formula,
// computed here in double per element: positions in the first block, across
// a block edge, far apart, and outside the cached range (negative, at and
// past kMaxPositions: computed, not kept), from 4 threads at once (the
// blocks are filled on first use); only the blocks used are held.
TEST(KernelsRope, CacheRowsEqualTheFormulaBitwise) {
  const double theta = 10000.0;
  const std::int64_t rotary_dim = 48, half = rotary_dim / 2;
  const RopeCache cache(theta, rotary_dim);
  EXPECT_EQ(cache.bytes(), 0u);
  const std::vector<std::int64_t> positions = {0,     1,  255,   256,   257,     1000,  4095,
                                               65535, -3, 65536, 65537, 1 << 20, 12345, 7};
  const auto expected = [&](std::int64_t p, std::int64_t j, bool want_sin) {
    const double angle = static_cast<double>(p) *
                         std::pow(theta, -2.0 * static_cast<double>(j) / static_cast<double>(rotary_dim));
    return static_cast<float>(want_sin ? std::sin(angle) : std::cos(angle));
  };
  with_threads(4, [&] {
    std::vector<std::vector<float>> per_thread(4);
#pragma omp parallel for
    for (int t = 0; t < 4; ++t) {
      const RopeTable table(positions.data(), static_cast<std::int64_t>(positions.size()), cache);
      for (std::size_t r = 0; r < positions.size(); ++r) {
        for (std::int64_t j = 0; j < half; ++j) {
          per_thread[static_cast<std::size_t>(t)].push_back(table.cos(static_cast<std::int64_t>(r))[j]);
          per_thread[static_cast<std::size_t>(t)].push_back(table.sin(static_cast<std::int64_t>(r))[j]);
        }
      }
    }
    for (int t = 0; t < 4; ++t) {
      std::size_t at = 0;
      for (const std::int64_t p : positions) {
        for (std::int64_t j = 0; j < half; ++j) {
          const float want[2] = {expected(p, j, false), expected(p, j, true)};
          ASSERT_TRUE(same_bits(per_thread[static_cast<std::size_t>(t)].data() + at, want, 2))
              << "position " << p << " pair " << j << " thread " << t;
          at += 2;
        }
      }
    }
  });
  // Blocks of 256 positions kept: 0 (0, 1, 255, 7), 1 (256, 257), 3 (1000),
  // 15 (4095), 255 (65535), 48 (12345); -3 and 65536 on are not kept.
  EXPECT_EQ(cache.bytes(), 6u * RopeCache::kBlockPositions * rotary_dim * sizeof(float));
  // The same positions through the direct constructor: the same bits.
  const RopeTable direct(positions.data(), static_cast<std::int64_t>(positions.size()), theta, rotary_dim);
  const RopeTable cached(positions.data(), static_cast<std::int64_t>(positions.size()), cache);
  for (std::size_t r = 0; r < positions.size(); ++r) {
    EXPECT_TRUE(same_bits(direct.cos(static_cast<std::int64_t>(r)), cached.cos(static_cast<std::int64_t>(r)),
                          static_cast<std::size_t>(half)));
    EXPECT_TRUE(same_bits(direct.sin(static_cast<std::int64_t>(r)), cached.sin(static_cast<std::int64_t>(r)),
                          static_cast<std::size_t>(half)));
  }
}

TEST(KernelsRope, RowDependsOnlyOnItsPosition) {
  const std::int64_t rows = 5, heads = 2, head_dim = 12;
  const std::int64_t positions[rows] = {7, 8, 9, 10, 11};
  const Vec x = random_vec(static_cast<std::size_t>(rows * heads * head_dim), 18);
  Vec together = x;
  rope_inplace(together.data(), rows, heads, head_dim, positions, 1e6);
  Vec alone = x;
  for (std::int64_t r = 0; r < rows; ++r) {
    rope_inplace(alone.data() + r * heads * head_dim, 1, heads, head_dim, positions + r, 1e6);
  }
  EXPECT_TRUE(same_bits(together, alone));
}

TEST(KernelsNorm, GatedRmsNormEqualsScalarFormulaBitwise) {
  // Each element is (weight * (x * inv)) * silu(z) with the row's
  // inv = 1 / sqrt(dot(x, x) / dim + eps) in f32, whether it falls in the
  // 8-lane main part or the dim % 8 tail; z includes saturating values.
#if defined(__FMA__)
  GTEST_SKIP() << "FMA contraction enabled in this build";
#endif
  const std::int64_t rows = 3;
  for (const std::int64_t dim : kSiluLengths) {
    const std::size_t n = static_cast<std::size_t>(rows * dim);
    const Vec x = random_vec(n, static_cast<std::uint32_t>(500 + dim), -3.0f, 3.0f);
    const Vec z = silu_inputs(n, static_cast<std::uint32_t>(600 + dim));
    const Vec weight = random_vec(static_cast<std::size_t>(dim), 700, 0.5f, 1.5f);
    const double eps = 1e-6;
    Vec expected(n);
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* xr = x.data() + r * dim;
      const float mean = dot(xr, xr, dim) / static_cast<float>(dim);
      const float inv = 1.0f / std::sqrt(mean + static_cast<float>(eps));
      for (std::int64_t i = 0; i < dim; ++i) {
        const std::size_t at = static_cast<std::size_t>(r * dim + i);
        expected[at] = (weight[static_cast<std::size_t>(i)] * (x[at] * inv)) * silu(z[at]);
      }
    }
    Vec y(n);
    gated_rms_norm(x.data(), z.data(), weight.data(), rows, dim, eps, y.data());
    EXPECT_TRUE(same_bits(y, expected)) << "dim " << dim;
    Vec in_x = x;  // y may equal x or z
    gated_rms_norm(in_x.data(), z.data(), weight.data(), rows, dim, eps, in_x.data());
    EXPECT_TRUE(same_bits(in_x, expected)) << "y == x, dim " << dim;
    Vec in_z = z;
    gated_rms_norm(x.data(), in_z.data(), weight.data(), rows, dim, eps, in_z.data());
    EXPECT_TRUE(same_bits(in_z, expected)) << "y == z, dim " << dim;
  }
}

// The sum of squares as every copy of the norms must compute it, written out
// here: eight partial sums over i (lane l takes i = l mod 8), combined as
// ((0 + 4) + (1 + 5)) + ((2 + 6) + (3 + 7)), then the dim % 8 tail in order.
float ref_sum_squares(const float* x, std::int64_t n) {
  float acc[8] = {};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) {
      const float sq = x[i + l] * x[i + l];
      acc[l] = acc[l] + sq;
    }
  }
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < n; ++i) {
    const float sq = x[i] * x[i];
    s = s + sq;
  }
  return s;
}

// Lengths that leave every tail: the 16-float part, the 8-float one and the
// scalar one, alone and together.
constexpr std::int64_t kNormLengths[] = {1, 3, 7, 8, 9, 15, 16, 17, 23, 24, 25, 31, 33, 40, 48, 77, 128, 131};

// rms_norm, gated_rms_norm and l2_normalize on each instruction-set copy
// (kernel_isa.h: baseline, AVX2, AVX-512 where the CPU has them) equal the
// scalar formula bit for bit, in place too.
TEST(KernelsNorm, EveryIsaCopyEqualsScalarFormulaBitwise) {
#if defined(__FMA__)
  GTEST_SKIP() << "FMA contraction enabled in this build";
#endif
  std::vector<detail::KernelIsa> isas = {detail::KernelIsa::Baseline};
  for (const detail::KernelIsa isa : wider_kernel_isas()) isas.push_back(isa);
  const std::int64_t rows = 3;
  const double eps = 1e-6;
  for (const std::int64_t dim : kNormLengths) {
    const std::size_t n = static_cast<std::size_t>(rows * dim);
    const Vec x = random_vec(n, static_cast<std::uint32_t>(800 + dim), -3.0f, 3.0f);
    const Vec z = silu_inputs(n, static_cast<std::uint32_t>(900 + dim));
    const Vec weight = random_vec(static_cast<std::size_t>(dim), 1000, 0.5f, 1.5f);
    Vec want_rms(n), want_gated(n), want_l2(n);
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* xr = x.data() + r * dim;
      const float ss = ref_sum_squares(xr, dim);
      const float mean = ss / static_cast<float>(dim);
      const float inv = 1.0f / std::sqrt(mean + static_cast<float>(eps));
      const float inv_l2 = 1.0f / std::sqrt(ss + 1e-6f);
      for (std::int64_t i = 0; i < dim; ++i) {
        const std::size_t at = static_cast<std::size_t>(r * dim + i);
        const float normed = x[at] * inv;
        const float scaled = weight[static_cast<std::size_t>(i)] * normed;
        want_rms[at] = scaled;
        want_gated[at] = scaled * silu(z[at]);
        want_l2[at] = x[at] * inv_l2;
      }
    }
    for (const detail::KernelIsa isa : isas) {
      with_kernel_isa(isa, [&] {
        Vec y(n);
        rms_norm(x.data(), weight.data(), rows, dim, eps, y.data());
        EXPECT_TRUE(same_bits(y, want_rms)) << "rms_norm, dim " << dim << ", " << isa_name(isa);
        Vec in_place = x;
        rms_norm(in_place.data(), weight.data(), rows, dim, eps, in_place.data());
        EXPECT_TRUE(same_bits(in_place, want_rms)) << "rms_norm in place, dim " << dim << ", " << isa_name(isa);
        gated_rms_norm(x.data(), z.data(), weight.data(), rows, dim, eps, y.data());
        EXPECT_TRUE(same_bits(y, want_gated)) << "gated_rms_norm, dim " << dim << ", " << isa_name(isa);
        Vec in_z = z;
        gated_rms_norm(x.data(), in_z.data(), weight.data(), rows, dim, eps, in_z.data());
        EXPECT_TRUE(same_bits(in_z, want_gated)) << "gated_rms_norm y == z, dim " << dim << ", " << isa_name(isa);
        Vec l2 = x;
        l2_normalize(l2.data(), rows, dim, 1e-6f);
        EXPECT_TRUE(same_bits(l2, want_l2)) << "l2_normalize, dim " << dim << ", " << isa_name(isa);
      });
    }
  }
}

// rope_inplace on each instruction-set copy equals the scalar rotation with
// the table's angles bit for bit: half-widths that leave every tail, partial
// rotary (elements past 2 * half unchanged), several heads per row.
TEST(KernelsRope, EveryIsaCopyEqualsScalarFormulaBitwise) {
#if defined(__FMA__)
  GTEST_SKIP() << "FMA contraction enabled in this build";
#endif
  std::vector<detail::KernelIsa> isas = {detail::KernelIsa::Baseline};
  for (const detail::KernelIsa isa : wider_kernel_isas()) isas.push_back(isa);
  const std::int64_t rows = 3, heads = 3;
  const std::int64_t positions[rows] = {0, 5, 40001};
  for (const std::int64_t half : kNormLengths) {
    for (const std::int64_t extra : {std::int64_t{0}, std::int64_t{5}}) {
      const std::int64_t head_dim = 2 * half + extra;
      const RopeTable table(positions, rows, 10000.0, 2 * half);
      const Vec x = random_vec(static_cast<std::size_t>(rows * heads * head_dim), static_cast<std::uint32_t>(half));
      Vec want = x;
      for (std::int64_t r = 0; r < rows; ++r) {
        for (std::int64_t h = 0; h < heads; ++h) {
          const std::size_t base = static_cast<std::size_t>((r * heads + h) * head_dim);
          for (std::int64_t j = 0; j < half; ++j) {
            const float x1 = x[base + static_cast<std::size_t>(j)];
            const float x2 = x[base + static_cast<std::size_t>(j + half)];
            const float c = table.cos(r)[j], s = table.sin(r)[j];
            const float a = x1 * c, b = x2 * s, d = x2 * c, e = x1 * s;
            want[base + static_cast<std::size_t>(j)] = a - b;
            want[base + static_cast<std::size_t>(j + half)] = d + e;
          }
        }
      }
      for (const detail::KernelIsa isa : isas) {
        Vec y = x;
        with_kernel_isa(isa, [&] { rope_inplace(y.data(), rows, heads, head_dim, table); });
        EXPECT_TRUE(same_bits(y, want)) << "half " << half << ", head_dim " << head_dim << ", " << isa_name(isa);
      }
    }
  }
}

}  // namespace
}  // namespace rwd::runtime::kernels
