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

}  // namespace
}  // namespace rwd::runtime::kernels
