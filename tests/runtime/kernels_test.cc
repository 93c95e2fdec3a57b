// Tests of the f32 compute kernels (runtime/kernels.h).
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

namespace rwd::runtime::kernels {
namespace {

using Vec = std::vector<float>;

constexpr double kUnit = 1.0 / 16777216.0;  // 2^-24, f32 unit roundoff

Vec random_vec(std::size_t n, std::uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  Vec v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

// Bitwise equality with the first differing index in the message.
testing::AssertionResult same_bits(const float* a, const float* b, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      return testing::AssertionFailure()
             << "element " << i << " differs: " << a[i] << " vs " << b[i];
    }
  }
  return testing::AssertionSuccess();
}
testing::AssertionResult same_bits(const Vec& a, const Vec& b) {
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

// ---- matmul ---------------------------------------------------------------------

struct MatmulCase {
  std::int64_t rows, in, out;
};

// The contract of one matmul output, written naively: an in-order chain of
// fused multiply-adds s = fma(x[r, i], w[o, i], s) from 0.0f (one rounding
// per term), then the bias added. w: [out, in] as given to PackedMatrix.
Vec naive_matmul(const Vec& x, std::int64_t rows, const Vec& w, std::int64_t out, std::int64_t in,
                 const float* bias) {
  Vec y(static_cast<std::size_t>(rows * out));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t o = 0; o < out; ++o) {
      float s = 0.0f;
      for (std::int64_t i = 0; i < in; ++i) {
        s = std::fma(x[static_cast<std::size_t>(r * in + i)], w[static_cast<std::size_t>(o * in + i)], s);
      }
      if (bias != nullptr) s = s + bias[o];
      y[static_cast<std::size_t>(r * out + o)] = s;
    }
  }
  return y;
}

TEST(KernelsMatmul, MatchesDoubleReference) {
  // Sizes cover in % 8 != 0, out % 8 != 0 (a padded last panel), one panel
  // only, and several blocks of panels.
  for (const MatmulCase c : {MatmulCase{1, 1, 1}, MatmulCase{3, 37, 13}, MatmulCase{5, 259, 67},
                             MatmulCase{9, 1024, 130}}) {
    const Vec x = random_vec(static_cast<std::size_t>(c.rows * c.in), 1);
    const Vec w = random_vec(static_cast<std::size_t>(c.out * c.in), 2);
    const Vec bias = random_vec(static_cast<std::size_t>(c.out), 3);
    const PackedMatrix pw(w.data(), c.out, c.in);
    Vec y(static_cast<std::size_t>(c.rows * c.out));
    matmul(x.data(), c.rows, pw, y.data(), bias.data());
    for (std::int64_t r = 0; r < c.rows; ++r) {
      for (std::int64_t o = 0; o < c.out; ++o) {
        double ref = bias[static_cast<std::size_t>(o)], abs_sum = std::abs(ref);
        for (std::int64_t i = 0; i < c.in; ++i) {
          const double t = static_cast<double>(x[static_cast<std::size_t>(r * c.in + i)]) *
                           w[static_cast<std::size_t>(o * c.in + i)];
          ref += t;
          abs_sum += std::abs(t);
        }
        // Worst-case f32 summation bound for in + 1 terms, plus the products.
        const double tol = static_cast<double>(c.in + 2) * kUnit * abs_sum + 1e-30;
        ASSERT_NEAR(y[static_cast<std::size_t>(r * c.out + o)], ref, tol)
            << "rows " << c.rows << " in " << c.in << " out " << c.out << " at " << r << "," << o;
      }
    }
  }
}

TEST(KernelsMatmul, RowsComputedTogetherEqualRowsAloneBitwise) {
  // Every row count 1..17, so every row-group size 1..8 (AVX-512 groups up
  // to 8 rows of a streamed matrix, up to 6 of the others, as AVX2 and the
  // baseline) and uneven splits (groups of 6: 7 = 4 + 3, 13 = 5 + 4 + 4;
  // of 8: 9 = 5 + 4, 17 = 6 + 6 + 5) occur, on
  // shapes whose blocks use each
  // micro-kernel width: in = 515 gives 3-panel blocks (threaded), in = 203
  // 10-panel blocks (the 4-panel kernel of 1-2 rows runs), in = 13 one block.
  // out % 8 != 0 everywhere (a padded last panel), in % 8 != 0. The first
  // matrix (540 KB) is large enough for matmul's software prefetch.
  for (const MatmulCase c : {MatmulCase{17, 515, 262}, MatmulCase{17, 203, 179},
                             MatmulCase{17, 13, 21}}) {
    const Vec x = random_vec(static_cast<std::size_t>(c.rows * c.in), 4);
    const Vec w = random_vec(static_cast<std::size_t>(c.out * c.in), 5);
    const Vec bias = random_vec(static_cast<std::size_t>(c.out), 6);
    const PackedMatrix pw(w.data(), c.out, c.in);
    for (const float* b : {static_cast<const float*>(nullptr), bias.data()}) {
      Vec alone(static_cast<std::size_t>(c.rows * c.out));
      for (std::int64_t r = 0; r < c.rows; ++r) {
        matmul(x.data() + r * c.in, 1, pw, alone.data() + r * c.out, b);
      }
      for (std::int64_t rows = 1; rows <= c.rows; ++rows) {
        Vec together(static_cast<std::size_t>(rows * c.out));
        matmul(x.data(), rows, pw, together.data(), b);
        for (std::int64_t r = 0; r < rows; ++r) {
          EXPECT_TRUE(same_bits(together.data() + r * c.out, alone.data() + r * c.out,
                                static_cast<std::size_t>(c.out)))
              << "in " << c.in << " out " << c.out << " bias " << (b != nullptr) << ": row " << r
              << " of " << rows;
        }
      }
      // Any subset of rows: rows 3..9 as one call (7 rows: 4 + 3).
      Vec middle(static_cast<std::size_t>(7 * c.out));
      matmul(x.data() + 3 * c.in, 7, pw, middle.data(), b);
      EXPECT_TRUE(same_bits(middle.data(), alone.data() + 3 * c.out, middle.size()))
          << "in " << c.in << " out " << c.out;
    }
  }
}

TEST(KernelsMatmul, IndependentOfThreadCount) {
  const std::int64_t rows = 5, in = 700, out = 301;
  const Vec x = random_vec(static_cast<std::size_t>(rows * in), 6);
  const Vec w = random_vec(static_cast<std::size_t>(out * in), 7);
  const Vec bias = random_vec(static_cast<std::size_t>(out), 8);
  const PackedMatrix pw(w.data(), out, in);
  Vec one(static_cast<std::size_t>(rows * out)), two(one.size()), three(one.size());
  Vec single_one(static_cast<std::size_t>(out)), single_two(single_one.size());
  with_threads(1, [&] {
    matmul(x.data(), rows, pw, one.data(), bias.data());
    matmul(x.data(), 1, pw, single_one.data(), bias.data());
  });
  with_threads(2, [&] {
    matmul(x.data(), rows, pw, two.data(), bias.data());
    matmul(x.data(), 1, pw, single_two.data(), bias.data());
  });
  with_threads(3, [&] { matmul(x.data(), rows, pw, three.data(), bias.data()); });
  EXPECT_TRUE(same_bits(one, two));
  EXPECT_TRUE(same_bits(one, three));
  EXPECT_TRUE(same_bits(single_one, single_two));
  EXPECT_TRUE(same_bits(single_one.data(), one.data(), single_one.size()));
}

TEST(KernelsMatmul, EveryOutputEqualsNaiveInOrderSumBitwise) {
  // The documented arithmetic of every output, whatever the row group,
  // panel, micro-kernel width or instruction set computed it: a copy or path
  // that reassociated, used a separate multiply and add, started from the
  // bias, or mixed up padding shows up here (make test runs it again with
  // REWIND_MATMUL_NARROW=1 and REWIND_MATMUL_F16_SOFTWARE=1). The reference
  // calls std::fma, exact by definition, so no contraction setting changes
  // it.
  // (515 x 262 f32 is streamed, i.e. prefetched: 13 rows run in groups of
  // 7 and 6, and 5 rows alone, with four panels in flight.)
  for (const MatmulCase c : {MatmulCase{7, 203, 23}, MatmulCase{13, 515, 262}, MatmulCase{5, 515, 262},
                             MatmulCase{16, 203, 23}, MatmulCase{6, 8, 8}, MatmulCase{2, 1, 9}}) {
    const Vec x = random_vec(static_cast<std::size_t>(c.rows * c.in), 9);
    const Vec w = random_vec(static_cast<std::size_t>(c.out * c.in), 10);
    const Vec bias = random_vec(static_cast<std::size_t>(c.out), 11);
    const PackedMatrix pw(w.data(), c.out, c.in);
    for (const float* b : {static_cast<const float*>(nullptr), bias.data()}) {
      Vec y(static_cast<std::size_t>(c.rows * c.out));
      matmul(x.data(), c.rows, pw, y.data(), b);
      const Vec ref = naive_matmul(x, c.rows, w, c.out, c.in, b);
      EXPECT_TRUE(same_bits(y, ref))
          << "rows " << c.rows << " in " << c.in << " out " << c.out << " bias " << (b != nullptr);
    }
  }
}

// A matrix of 2 MiB or more sits in memory asked to be in huge pages (the
// whole ones; the tail in small pages): the same products, bit for bit, and
// the storage follows a move (its deleter frees it with the alignment it
// was allocated with: ASan checks the pairing).
TEST(KernelsMatmul, MatrixOfHugePagesComputesTheSameAndMoves) {
  const std::int64_t rows = 3, in = 600, out = 1000;  // 63 panels x 600 x 16 floats: 2.42 MB
  const Vec x = random_vec(static_cast<std::size_t>(rows * in), 21);
  const Vec w = random_vec(static_cast<std::size_t>(out * in), 22);
  PackedMatrix pw(w.data(), out, in);
  ASSERT_GE(pw.bytes(), std::size_t{2} << 20);
  const Vec ref = naive_matmul(x, rows, w, out, in, nullptr);
  Vec y(static_cast<std::size_t>(rows * out));
  matmul(x.data(), rows, pw, y.data());
  EXPECT_TRUE(same_bits(y, ref));
  const PackedMatrix moved = std::move(pw);
  std::fill(y.begin(), y.end(), 0.0f);
  matmul(x.data(), rows, moved, y.data());
  EXPECT_TRUE(same_bits(y, ref));
  PackedMatrix small(w.data(), 4, 8);  // below 2 MiB: the other allocation
  small = PackedMatrix(w.data(), out, in);  // frees the small one, takes the big one
  matmul(x.data(), rows, small, y.data());
  EXPECT_TRUE(same_bits(y, ref));
}

TEST(KernelsMatmul, EmptyShapes) {
  const Vec w = random_vec(12, 12);
  const PackedMatrix pw(w.data(), 3, 4);
  const Vec bias = {1.0f, 2.0f, 3.0f};
  Vec y(6, -7.0f);
  matmul(nullptr, 0, pw, y.data(), bias.data());  // no rows: nothing written
  EXPECT_EQ(y, Vec(6, -7.0f));
  const Vec x(2, 0.5f);
  const PackedMatrix no_inputs(nullptr, 3, 0);
  EXPECT_EQ(no_inputs.panels(), 1);
  EXPECT_EQ(no_inputs.bytes(), 0u);
  matmul(x.data(), 2, no_inputs, y.data(), bias.data());  // in = 0: y = bias
  EXPECT_EQ(y, (Vec{1.0f, 2.0f, 3.0f, 1.0f, 2.0f, 3.0f}));
  matmul(x.data(), 2, no_inputs, y.data());  // in = 0, no bias: y = 0
  EXPECT_EQ(y, Vec(6, 0.0f));
  Vec untouched(4, -7.0f);
  const PackedMatrix no_outputs(nullptr, 0, 2);  // out = 0: nothing written
  matmul(x.data(), 2, no_outputs, untouched.data());
  EXPECT_EQ(untouched, Vec(4, -7.0f));
  const PackedMatrix empty;
  EXPECT_EQ(empty.out(), 0);
  EXPECT_EQ(empty.in(), 0);
  EXPECT_EQ(empty.panels(), 0);
  EXPECT_EQ(empty.bytes(), 0u);
  matmul(x.data(), 2, empty, untouched.data());
  EXPECT_EQ(untouched, Vec(4, -7.0f));
}

TEST(KernelsMatmul, PackedMatrixHoldsTheWeightsInPanels) {
  const std::int64_t out = 21, in = 5;  // one full panel of 16 and one of 5
  const Vec w = random_vec(static_cast<std::size_t>(out * in), 13);
  PackedMatrix pw(w.data(), out, in);
  EXPECT_EQ(pw.out(), out);
  EXPECT_EQ(pw.in(), in);
  EXPECT_EQ(pw.panels(), 2);
  EXPECT_EQ(pw.bytes(), std::size_t{2 * 5 * 16 * 4});
  for (std::int64_t o = 0; o < out; ++o) {
    for (std::int64_t i = 0; i < in; ++i) {
      const float v = pw.at(o, i);
      EXPECT_TRUE(same_bits(&v, &w[static_cast<std::size_t>(o * in + i)], 1)) << o << "," << i;
    }
  }
  // Panel layout as documented: w[p * 16 + l, i] at element i * 16 + l, zeros
  // past out; the storage (panel 0) starts 64-byte aligned.
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(pw.panel(0)) % 64, 0u);
  for (std::int64_t p = 0; p < pw.panels(); ++p) {
    for (std::int64_t i = 0; i < in; ++i) {
      for (std::int64_t l = 0; l < PackedMatrix::kPanelWidth; ++l) {
        const std::int64_t o = p * PackedMatrix::kPanelWidth + l;
        const float expected = o < out ? w[static_cast<std::size_t>(o * in + i)] : 0.0f;
        const float got = pw.panel(p)[i * PackedMatrix::kPanelWidth + l];
        EXPECT_TRUE(same_bits(&got, &expected, 1)) << "panel " << p << " i " << i << " l " << l;
      }
    }
  }
  // The packed copy owns its storage: the source can change or go away.
  const Vec x = random_vec(static_cast<std::size_t>(3 * in), 14);
  Vec before(static_cast<std::size_t>(3 * out));
  {
    Vec scratch = w;
    const PackedMatrix from_scratch(scratch.data(), out, in);
    std::fill(scratch.begin(), scratch.end(), 99.0f);
    matmul(x.data(), 3, from_scratch, before.data());
  }
  Vec direct(before.size());
  matmul(x.data(), 3, pw, direct.data());
  EXPECT_TRUE(same_bits(before, direct));

  // Moved to: same shape and results; the moved-from matrix can be destroyed
  // or assigned again.
  PackedMatrix moved(std::move(pw));
  EXPECT_EQ(moved.out(), out);
  EXPECT_EQ(moved.in(), in);
  EXPECT_EQ(moved.bytes(), std::size_t{2 * 5 * 16 * 4});
  Vec after(before.size());
  matmul(x.data(), 3, moved, after.data());
  EXPECT_TRUE(same_bits(before, after));
  // The moved-from matrix is the empty one: matmul writes nothing.
  EXPECT_EQ(pw.out(), 0);
  EXPECT_EQ(pw.in(), 0);
  EXPECT_EQ(pw.bytes(), std::size_t{0});
  Vec untouched(4, -3.0f);
  matmul(x.data(), 1, pw, untouched.data());
  EXPECT_EQ(untouched, Vec(4, -3.0f));
  const Vec w2 = random_vec(static_cast<std::size_t>(17 * 2), 15);
  pw = PackedMatrix(w2.data(), 17, 2);
  EXPECT_EQ(pw.out(), 17);
  EXPECT_EQ(pw.panels(), 2);
  EXPECT_EQ(pw.at(16, 1), w2[33]);
  PackedMatrix assigned;
  assigned = std::move(moved);
  Vec assigned_y(before.size());
  matmul(x.data(), 3, assigned, assigned_y.data());
  EXPECT_TRUE(same_bits(before, assigned_y));
  EXPECT_EQ(moved.out(), 0);
  EXPECT_EQ(moved.bytes(), std::size_t{0});
  static_assert(!std::is_copy_constructible_v<PackedMatrix>);
  static_assert(std::is_nothrow_move_constructible_v<PackedMatrix>);
}

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
      const double ref =
          weight[static_cast<std::size_t>(i)] * x[at] * inv * zz / (1.0 + std::exp(-zz));
      EXPECT_NEAR(y[at], ref, (static_cast<double>(dim) + 16.0) * kUnit * std::abs(ref) + 1e-30);
    }
  }
  Vec alone(x.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    gated_rms_norm(x.data() + r * dim, z.data() + r * dim, weight.data(), 1, dim, 1e-6,
                   alone.data() + r * dim);
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
      ss += static_cast<double>(x[static_cast<std::size_t>(r * dim + i)]) *
            x[static_cast<std::size_t>(r * dim + i)];
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
            const double angle =
                static_cast<double>(positions[r]) *
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
  const std::vector<std::int64_t> positions = {0, 1, 255, 256, 257, 1000, 4095, 65535, -3, 65536, 65537, 1 << 20, 12345, 7};
  const auto expected = [&](std::int64_t p, std::int64_t j, bool want_sin) {
    const double angle =
        static_cast<double>(p) * std::pow(theta, -2.0 * static_cast<double>(j) / static_cast<double>(rotary_dim));
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

// ---- attention --------------------------------------------------------------------

// Keys / values stored the way the cache returns them: token-major rows of
// [B, H, D], here with B = 2 and sequence b = 1 used, so that the position
// stride (B * H * D) differs from H * D.
struct KVStore {
  std::int64_t batch = 2, heads, dim, len;
  Vec keys, values;
  KVStore(std::int64_t h, std::int64_t d, std::int64_t n, std::uint32_t seed)
      : heads(h),
        dim(d),
        len(n),
        keys(random_vec(static_cast<std::size_t>(2 * h * d * n), seed)),
        values(random_vec(static_cast<std::size_t>(2 * h * d * n), seed + 1)) {}
  // Element (position p, head h, d) of sequence 1.
  std::size_t at(std::int64_t p, std::int64_t h, std::int64_t d) const {
    return static_cast<std::size_t>(p * batch * heads * dim + heads * dim + h * dim + d);
  }
  // Strided view of positions [first, ...).
  StridedKV k(std::int64_t first) const {
    return {keys.data() + at(first, 0, 0), dim, batch * heads * dim};
  }
  StridedKV v(std::int64_t first) const {
    return {values.data() + at(first, 0, 0), dim, batch * heads * dim};
  }
};

// The keys [lo, hi] a query at position p attends to (hi < lo: none).
std::pair<std::int64_t, std::int64_t> key_range(std::int64_t p, std::int64_t kv_offset, std::int64_t kv_len,
                                                AttentionMask mask) {
  std::int64_t lo = kv_offset;
  if (mask.window > 0) lo = std::max(lo, p - mask.window + 1);
  if (mask.chunk > 0) lo = std::max(lo, p / mask.chunk * mask.chunk);
  return {lo, std::min(p, kv_offset + kv_len - 1)};
}

// Direct softmax attention in double over [lo, p].
Vec ref_attention(const Vec& q, std::int64_t q_len, std::int64_t pos0, std::int64_t num_heads,
                  const KVStore& kv, std::int64_t kv_offset, std::int64_t kv_len,
                  AttentionMask mask) {
  const std::int64_t d_dim = kv.dim, group = num_heads / kv.heads;
  Vec out(static_cast<std::size_t>(q_len * num_heads * d_dim), 0.0f);
  for (std::int64_t t = 0; t < q_len; ++t) {
    const std::int64_t p = pos0 + t;
    for (std::int64_t h = 0; h < num_heads; ++h) {
      const auto [lo, hi] = key_range(p, kv_offset, kv_len, mask);
      std::vector<double> s;
      double mx = -1e300;
      for (std::int64_t j = lo; j <= hi; ++j) {
        double acc = 0.0;
        for (std::int64_t d = 0; d < d_dim; ++d) {
          acc += static_cast<double>(q[static_cast<std::size_t>((t * num_heads + h) * d_dim + d)]) *
                 kv.keys[kv.at(j, h / group, d)];
        }
        s.push_back(acc / std::sqrt(static_cast<double>(d_dim)));
        mx = std::max(mx, s.back());
      }
      double sum = 0.0;
      for (double& e : s) sum += (e = std::exp(e - mx));
      for (std::int64_t d = 0; d < d_dim; ++d) {
        double acc = 0.0;
        for (std::int64_t j = lo; j <= hi; ++j) {
          acc += s[static_cast<std::size_t>(j - lo)] * kv.values[kv.at(j, h / group, d)];
        }
        out[static_cast<std::size_t>((t * num_heads + h) * d_dim + d)] =
            static_cast<float>(s.empty() ? 0.0 : acc / sum);
      }
    }
  }
  return out;
}

struct AttentionCase {
  const char* name;
  std::int64_t num_heads, num_kv_heads, head_dim;
  AttentionMask mask;
};

const AttentionCase kAttentionCases[] = {
    {"full_mha", 2, 2, 16, {}},
    {"full_gqa", 6, 2, 20, {}},
    {"sliding_gqa", 4, 1, 12, {5, 0}},
    {"chunked", 2, 1, 8, {0, 4}},
};

TEST(KernelsAttention, MatchesDirectSoftmaxReference) {
  for (const AttentionCase& c : kAttentionCases) {
    const std::int64_t total = 23, q_len = 6, pos0 = total - q_len;
    const KVStore kv(c.num_kv_heads, c.head_dim, total, 20);
    const Vec q = random_vec(static_cast<std::size_t>(q_len * c.num_heads * c.head_dim), 22);
    // Keys from position 3 on: with the full mask the first keys are cut
    // off on purpose (the kernel must respect kv_offset).
    const std::int64_t kv_offset = 3, kv_len = total - kv_offset;
    Vec out(q.size());
    attention(q.data(), q_len, pos0, c.num_heads, c.num_kv_heads, c.head_dim, kv.k(kv_offset),
              kv.v(kv_offset), kv_offset, kv_len, c.mask, out.data());
    const Vec ref = ref_attention(q, q_len, pos0, c.num_heads, kv, kv_offset, kv_len, c.mask);
    // Scores from f32 dots (|s| < head_dim), f32 exp / sum / weighted sum of
    // values in [-1, 1]: a few 1e-7 in practice; 2e-6 leaves a margin.
    for (std::size_t i = 0; i < out.size(); ++i) {
      ASSERT_NEAR(out[i], ref[i], 2e-6) << c.name << " element " << i;
    }
  }
}

// The documented f32 arithmetic of one (query, head), written plainly: a
// score is the dot product in 8 partial sums (lane l takes d = l, l + 8,
// ...), combined as ((0 + 4) + (1 + 5)) + ((2 + 6) + (3 + 7)), then the
// tail in order, times 1 / sqrt(head_dim); e_j = exp_f32(s_j - max); the sum
// of e and each o[d] = sum of e_j * v_j[d] go in order of position from 0;
// o[d] *= 1 / sum.
Vec in_order_attention(const Vec& q, std::int64_t q_len, std::int64_t pos0, std::int64_t num_heads,
                       const KVStore& kv, std::int64_t kv_offset, std::int64_t kv_len, AttentionMask mask) {
  const std::int64_t d_dim = kv.dim, group = num_heads / kv.heads;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(d_dim)));
  Vec out(static_cast<std::size_t>(q_len * num_heads * d_dim), 0.0f);
  for (std::int64_t t = 0; t < q_len; ++t) {
    const std::int64_t p = pos0 + t;
    for (std::int64_t h = 0; h < num_heads; ++h) {
      const auto [lo, hi] = key_range(p, kv_offset, kv_len, mask);
      if (hi < lo) continue;
      const float* qh = q.data() + (t * num_heads + h) * d_dim;
      std::vector<float> e;
      float mx = -std::numeric_limits<float>::infinity();
      for (std::int64_t j = lo; j <= hi; ++j) {
        const float* kj = kv.keys.data() + kv.at(j, h / group, 0);
        float lane[8] = {};
        std::int64_t d = 0;
        for (; d + 8 <= d_dim; d += 8) {
          for (int l = 0; l < 8; ++l) lane[l] += qh[d + l] * kj[d + l];
        }
        float dot = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
        for (; d < d_dim; ++d) dot += qh[d] * kj[d];
        e.push_back(dot * scale);
        mx = std::max(mx, e.back());
      }
      float sum = 0.0f;
      for (float& x : e) {
        x = kernels::exp_f32(x - mx);
        sum += x;
      }
      const float inv = 1.0f / sum;
      for (std::int64_t d = 0; d < d_dim; ++d) {
        float acc = 0.0f;
        for (std::int64_t j = lo; j <= hi; ++j) {
          acc += e[static_cast<std::size_t>(j - lo)] * kv.values[kv.at(j, h / group, d)];
        }
        out[static_cast<std::size_t>((t * num_heads + h) * d_dim + d)] = acc * inv;
      }
    }
  }
  return out;
}

// Whatever grouping the kernel uses (four keys' sums combined together, the
// maximum per lane, the sum of e taken during the pass over the values,
// 16-wide value vectors in its AVX-512 clone, rows taken together over
// blocks of 64 keys, with each sum stored and resumed at every block),
// every output is the plain arithmetic above, bit for bit: head dims with
// and without a tail of 8, key counts with and without a tail of 4, one
// head per KV head and several (odd groups: a head without a pair; 40: more
// head pairs than one task takes), rows alone and in row blocks (9 and 19
// rows: blocks of up to 8), key ranges within one block and across several
// (the 203-key store), rows whose ranges start at different keys (windows,
// chunks) and rows without any key (kv_offset past their position).
TEST(KernelsAttention, EqualsTheDocumentedInOrderArithmeticBitwise) {
#if defined(__FMA__)
  GTEST_SKIP() << "FMA contraction enabled in this build";
#endif
  const AttentionCase cases[] = {
      {"d48_gqa", 4, 2, 48, {}},        {"d13_mha", 2, 2, 13, {}},   {"d24_sliding", 3, 1, 24, {7, 0}},
      {"d5_chunked", 2, 1, 5, {0, 6}},  {"d64_gqa", 4, 1, 64, {}},   {"d136", 1, 1, 136, {}},
      {"d16_sliding100", 6, 2, 16, {100, 0}}, {"d8_chunked70", 5, 1, 8, {0, 70}}, {"d8_g40", 40, 1, 8, {}},
  };
  for (const AttentionCase& c : cases) {
    for (const std::int64_t total : {std::int64_t{41}, std::int64_t{203}}) {
      for (const std::int64_t q_len : {std::int64_t{1}, std::int64_t{9}, std::int64_t{19}}) {
        const std::int64_t pos0 = total - q_len;
        const KVStore kv(c.num_kv_heads, c.head_dim, total, 31);
        const Vec q = random_vec(static_cast<std::size_t>(q_len * c.num_heads * c.head_dim), 32, -2.0f, 2.0f);
        for (const std::int64_t kv_offset : {std::int64_t{0}, std::int64_t{2}, pos0 + 3}) {
          if (kv_offset >= total) continue;  // one row: no position past it
          const std::int64_t kv_len = total - kv_offset;
          Vec out(q.size());
          attention(q.data(), q_len, pos0, c.num_heads, c.num_kv_heads, c.head_dim, kv.k(kv_offset),
                    kv.v(kv_offset), kv_offset, kv_len, c.mask, out.data());
          const Vec ref = in_order_attention(q, q_len, pos0, c.num_heads, kv, kv_offset, kv_len, c.mask);
          EXPECT_TRUE(same_bits(out, ref))
              << c.name << " total " << total << " q_len " << q_len << " kv_offset " << kv_offset;
        }
      }
    }
  }
}

TEST(KernelsAttention, QueryInWideRangeEqualsQueryOverItsOwnWindowBitwise) {
  for (const AttentionCase& c : kAttentionCases) {
    // A verification forward: q_len queries at pos0.. over all keys [0, total)
    // versus each query alone over exactly the keys it attends to.
    const std::int64_t total = 19, q_len = 7, pos0 = total - q_len;
    const KVStore kv(c.num_kv_heads, c.head_dim, total, 30);
    const Vec q = random_vec(static_cast<std::size_t>(q_len * c.num_heads * c.head_dim), 32);
    const std::size_t row = static_cast<std::size_t>(c.num_heads * c.head_dim);
    Vec many(q.size());
    attention(q.data(), q_len, pos0, c.num_heads, c.num_kv_heads, c.head_dim, kv.k(0), kv.v(0), 0,
              total, c.mask, many.data());
    for (std::int64_t t = 0; t < q_len; ++t) {
      const std::int64_t p = pos0 + t;
      std::int64_t lo = 0;
      if (c.mask.window > 0) lo = std::max<std::int64_t>(0, p - c.mask.window + 1);
      if (c.mask.chunk > 0) lo = p / c.mask.chunk * c.mask.chunk;
      Vec one(row);
      attention(q.data() + static_cast<std::size_t>(t) * row, 1, p, c.num_heads, c.num_kv_heads,
                c.head_dim, kv.k(lo), kv.v(lo), lo, p - lo + 1, c.mask, one.data());
      EXPECT_TRUE(same_bits(one.data(), many.data() + static_cast<std::size_t>(t) * row, row))
          << c.name << " query " << t;
      // The same single query with every key up to p passed in.
      Vec wide(row);
      attention(q.data() + static_cast<std::size_t>(t) * row, 1, p, c.num_heads, c.num_kv_heads,
                c.head_dim, kv.k(0), kv.v(0), 0, total, c.mask, wide.data());
      EXPECT_TRUE(same_bits(one, wide)) << c.name << " query " << t;
    }
  }
}

// Keys and values scattered over runs (a paged cache's blocks, here copies
// of the positions in separate buffers, in runs of 1 to 5 positions) give
// bit for bit what one strided buffer gives, for every mask.
TEST(KernelsAttention, PagedRunsEqualOneStridedBufferBitwise) {
  // 29 keys: within one block of attend_units; 150 with 12 rows: rows
  // taken together over blocks that start and end inside runs.
  for (const auto& [total, q_len] : {std::pair<std::int64_t, std::int64_t>{29, 5}, {150, 12}}) {
    for (const AttentionCase& c : kAttentionCases) {
      const std::int64_t pos0 = total - q_len, kv_offset = 2;
      const KVStore kv(c.num_kv_heads, c.head_dim, total, 40);
      const Vec q = random_vec(static_cast<std::size_t>(q_len * c.num_heads * c.head_dim), 42);
      Vec strided(q.size()), paged(q.size());
      attention(q.data(), q_len, pos0, c.num_heads, c.num_kv_heads, c.head_dim, kv.k(kv_offset), kv.v(kv_offset),
                kv_offset, total - kv_offset, c.mask, strided.data());
      // Runs in their own buffers, rows H * D apart (another stride than the
      // store's), lengths cycling 1..5.
      const std::int64_t row = c.num_kv_heads * c.head_dim;
      std::vector<Vec> keys, values;
      std::vector<KVRun> runs;
      std::int64_t p = kv_offset, len = 1;
      while (p < total) {
        const std::int64_t n = std::min(len, total - p);
        Vec k(static_cast<std::size_t>(n * row)), v(k.size());
        for (std::int64_t j = 0; j < n; ++j)
          for (std::int64_t h = 0; h < c.num_kv_heads; ++h)
            for (std::int64_t d = 0; d < c.head_dim; ++d) {
              k[static_cast<std::size_t>(j * row + h * c.head_dim + d)] = kv.keys[kv.at(p + j, h, d)];
              v[static_cast<std::size_t>(j * row + h * c.head_dim + d)] = kv.values[kv.at(p + j, h, d)];
            }
        keys.push_back(std::move(k));
        values.push_back(std::move(v));
        p += n;
        len = len % 5 + 1;
      }
      for (std::size_t r = 0; r < keys.size(); ++r)
        runs.push_back({keys[r].data(), values[r].data(), static_cast<std::int64_t>(keys[r].size()) / row});
      const StridedKV strides{nullptr, c.head_dim, row};
      attention_paged(q.data(), q_len, pos0, c.num_heads, c.num_kv_heads, c.head_dim, runs, strides, strides, kv_offset,
                      total - kv_offset, c.mask, paged.data());
      EXPECT_TRUE(same_bits(strided, paged)) << c.name << " total " << total;
    }
  }
}

TEST(KernelsAttention, IndependentOfThreadCount) {
  const std::int64_t total = 300, q_len = 9, heads = 8, kv_heads = 2, dim = 32;
  const KVStore kv(kv_heads, dim, total, 40);
  const Vec q = random_vec(static_cast<std::size_t>(q_len * heads * dim), 42);
  Vec one(q.size()), two(q.size());
  with_threads(1, [&] {
    attention(q.data(), q_len, total - q_len, heads, kv_heads, dim, kv.k(0), kv.v(0), 0, total, {},
              one.data());
  });
  with_threads(2, [&] {
    attention(q.data(), q_len, total - q_len, heads, kv_heads, dim, kv.k(0), kv.v(0), 0, total, {},
              two.data());
  });
  EXPECT_TRUE(same_bits(one, two));
}

TEST(KernelsAttention, QueryWithoutKeysGetsZeros) {
  const KVStore kv(1, 8, 4, 50);
  const Vec q = random_vec(8, 51);
  Vec out(8, 5.0f);
  // Query at position 1, keys only from position 2 on.
  attention(q.data(), 1, 1, 1, 1, 8, kv.k(2), kv.v(2), 2, 2, {}, out.data());
  EXPECT_EQ(out, Vec(8, 0.0f));
}

// ---- causal conv ------------------------------------------------------------------

TEST(KernelsConv, MatchesNaiveAndTokenAlone) {
  // Window as the cache returns it: [B=2, C, K-1+q] token-major, so element
  // (c, s) of sequence 1 is at s * B * C + C + c.
  const std::int64_t batch = 2, channels = 300, kernel = 4, q = 5, span = kernel - 1 + q;
  const Vec storage =
      random_vec(static_cast<std::size_t>(span * batch * channels), 60, -2.0f, 2.0f);
  const float* window = storage.data() + channels;
  const std::int64_t ts = batch * channels;
  const Vec weight = random_vec(static_cast<std::size_t>(channels * kernel), 61);
  const Vec bias = random_vec(static_cast<std::size_t>(channels), 62);
  for (const bool fuse : {false, true}) {
    for (const float* b : {static_cast<const float*>(nullptr), bias.data()}) {
      Vec out(static_cast<std::size_t>(q * channels));
      causal_conv1d(window, channels, kernel, q, 1, ts, weight.data(), b, fuse, out.data());
      for (std::int64_t t = 0; t < q; ++t) {
        for (std::int64_t c = 0; c < channels; ++c) {
          double ref = b != nullptr ? b[c] : 0.0, abs_sum = std::abs(ref);
          for (std::int64_t i = 0; i < kernel; ++i) {
            const double term =
                static_cast<double>(weight[static_cast<std::size_t>(c * kernel + i)]) *
                window[(t + i) * ts + c];
            ref += term;
            abs_sum += std::abs(term);
          }
          double tol = (kernel + 2) * kUnit * abs_sum + 1e-30;
          if (fuse) {
            tol += 8.0 * kUnit * std::abs(ref);
            ref = ref / (1.0 + std::exp(-ref));
          }
          ASSERT_NEAR(out[static_cast<std::size_t>(t * channels + c)], ref, tol)
              << "fuse " << fuse << " t " << t << " c " << c;
        }
      }
#if !defined(__FMA__)
      // Bit for bit the documented f32 arithmetic: the K products summed in
      // order from 0, then the bias, then silu (scalar), whatever vectors
      // the kernel uses (300 channels: 16-wide blocks and a tail).
      Vec plain(out.size());
      for (std::int64_t t = 0; t < q; ++t) {
        for (std::int64_t c = 0; c < channels; ++c) {
          float acc = 0.0f;
          for (std::int64_t i = 0; i < kernel; ++i) {
            acc += weight[static_cast<std::size_t>(c * kernel + i)] * window[(t + i) * ts + c];
          }
          if (b != nullptr) acc += b[c];
          plain[static_cast<std::size_t>(t * channels + c)] = fuse ? kernels::silu(acc) : acc;
        }
      }
      EXPECT_TRUE(same_bits(out, plain)) << "fuse " << fuse << " bias " << (b != nullptr);
#endif
      // Decoding token t alone sees the window shifted by t.
      for (std::int64_t t = 0; t < q; ++t) {
        Vec one(static_cast<std::size_t>(channels));
        causal_conv1d(window + t * ts, channels, kernel, 1, 1, ts, weight.data(), b, fuse,
                      one.data());
        EXPECT_TRUE(same_bits(one.data(), out.data() + t * channels, one.size())) << t;
      }
    }
  }
}

TEST(KernelsConv, ChannelMajorWindow) {
  // A [C, K-1+q] contiguous window: channel stride K-1+q, time stride 1.
  const std::int64_t channels = 3, kernel = 2, q = 3, span = kernel - 1 + q;
  const Vec window = random_vec(static_cast<std::size_t>(channels * span), 63);
  const Vec weight = random_vec(static_cast<std::size_t>(channels * kernel), 64);
  Vec out(static_cast<std::size_t>(q * channels));
  causal_conv1d(window.data(), channels, kernel, q, span, 1, weight.data(), nullptr, false,
                out.data());
  for (std::int64_t t = 0; t < q; ++t) {
    for (std::int64_t c = 0; c < channels; ++c) {
      const float ref = 0.0f +
                        weight[static_cast<std::size_t>(c * kernel)] *
                            window[static_cast<std::size_t>(c * span + t)] +
                        weight[static_cast<std::size_t>(c * kernel + 1)] *
                            window[static_cast<std::size_t>(c * span + t + 1)];
      EXPECT_FLOAT_EQ(out[static_cast<std::size_t>(t * channels + c)], ref);
    }
  }
}

// ---- gated delta rule -----------------------------------------------------------

struct DeltaInputs {
  std::int64_t tokens, nv, nk, kd, vd;
  Vec q, k, v, g, beta, state0;
  DeltaInputs(std::int64_t t, std::int64_t v_heads, std::int64_t k_heads, std::int64_t k_dim,
              std::int64_t v_dim, std::uint32_t seed)
      : tokens(t), nv(v_heads), nk(k_heads), kd(k_dim), vd(v_dim) {
    q = random_vec(static_cast<std::size_t>(t * k_heads * k_dim), seed);
    k = random_vec(q.size(), seed + 1);
    v = random_vec(static_cast<std::size_t>(t * v_heads * v_dim), seed + 2);
    Vec graw = random_vec(static_cast<std::size_t>(t * v_heads), seed + 3, -4.0f, 2.0f);
    Vec braw = random_vec(graw.size(), seed + 4, -3.0f, 3.0f);
    // As Qwen3-Next prepares them: q, k L2-normalised, q scaled, g <= 0
    // (-exp(A) * softplus(a)), beta = sigmoid(b).
    l2_normalize(q.data(), t * k_heads, k_dim, 1e-6f);
    l2_normalize(k.data(), t * k_heads, k_dim, 1e-6f);
    scale_inplace(q.data(), static_cast<std::int64_t>(q.size()),
                  static_cast<float>(1.0 / std::sqrt(static_cast<double>(k_dim))));
    for (std::size_t i = 0; i < graw.size(); ++i) {
      graw[i] = -0.7f * softplus(graw[i]);
      braw[i] = sigmoid(braw[i]);
    }
    g = graw;
    beta = braw;
    state0 = random_vec(static_cast<std::size_t>(v_heads * k_dim * v_dim), seed + 5, -0.5f, 0.5f);
  }
  std::size_t state_size() const { return state0.size(); }
};

// Runs gated_delta_rule over tokens [t0, t0 + n) from `state`, appending the
// n new states to `states` and the outputs to `out`.
void run_delta(const DeltaInputs& in, std::int64_t t0, std::int64_t n, const float* state,
               std::vector<Vec>& states, Vec& out) {
  std::vector<Vec> fresh(static_cast<std::size_t>(n), Vec(in.state_size()));
  std::vector<float*> ptrs;
  for (Vec& s : fresh) ptrs.push_back(s.data());
  Vec o(static_cast<std::size_t>(n * in.nv * in.vd));
  gated_delta_rule(in.q.data() + t0 * in.nk * in.kd, in.k.data() + t0 * in.nk * in.kd,
                   in.v.data() + t0 * in.nv * in.vd, in.g.data() + t0 * in.nv,
                   in.beta.data() + t0 * in.nv, n, in.nv, in.nk, in.kd, in.vd, state, ptrs.data(),
                   o.data());
  for (Vec& s : fresh) states.push_back(std::move(s));
  out.insert(out.end(), o.begin(), o.end());
}

TEST(KernelsGatedDelta, MatchesStepByStepDoubleReference) {
  const DeltaInputs in(6, 4, 2, 12, 20, 70);
  std::vector<Vec> states;
  Vec out;
  run_delta(in, 0, in.tokens, in.state0.data(), states, out);

  std::vector<double> s(in.state0.begin(), in.state0.end());
  const std::int64_t ratio = in.nv / in.nk;
  for (std::int64_t t = 0; t < in.tokens; ++t) {
    for (std::int64_t h = 0; h < in.nv; ++h) {
      double* S = s.data() + h * in.kd * in.vd;
      const float* q = in.q.data() + (t * in.nk + h / ratio) * in.kd;
      const float* k = in.k.data() + (t * in.nk + h / ratio) * in.kd;
      const float* v = in.v.data() + (t * in.nv + h) * in.vd;
      const double decay =
          std::exp(static_cast<double>(in.g[static_cast<std::size_t>(t * in.nv + h)]));
      const double beta = in.beta[static_cast<std::size_t>(t * in.nv + h)];
      for (std::int64_t i = 0; i < in.kd * in.vd; ++i) S[i] *= decay;
      for (std::int64_t j = 0; j < in.vd; ++j) {
        double mem = 0.0;
        for (std::int64_t i = 0; i < in.kd; ++i) mem += S[i * in.vd + j] * k[i];
        const double delta = (v[j] - mem) * beta;
        for (std::int64_t i = 0; i < in.kd; ++i) S[i * in.vd + j] += k[i] * delta;
      }
      for (std::int64_t j = 0; j < in.vd; ++j) {
        double o = 0.0;
        for (std::int64_t i = 0; i < in.kd; ++i) o += S[i * in.vd + j] * q[i];
        // |S| stays O(1) (decay <= 1, beta < 1, unit keys): absolute 1e-5
        // covers k_dim-term f32 sums compounded over 6 tokens.
        ASSERT_NEAR(out[static_cast<std::size_t>((t * in.nv + h) * in.vd + j)], o, 1e-5)
            << "token " << t << " head " << h << " j " << j;
      }
    }
    for (std::size_t i = 0; i < s.size(); ++i) {
      ASSERT_NEAR(states[static_cast<std::size_t>(t)][i], s[i], 1e-5)
          << "state " << t << " at " << i;
    }
  }
}

// One step against the definition's f32 arithmetic written plainly (every
// sum over i in order from 0, no reassociation), bit for bit, whatever
// column blocks the kernel uses: value dims of 48 (three 16-wide blocks), 27
// (16 + 8 + 3 single columns) and 5, in place and out of place.
TEST(KernelsGatedDelta, StepEqualsTheDefinitionInF32Bitwise) {
#if defined(__FMA__)
  GTEST_SKIP() << "FMA contraction enabled in this build";
#endif
  for (const std::int64_t vd : {std::int64_t{48}, std::int64_t{27}, std::int64_t{5}}) {
    const DeltaInputs in(1, 1, 1, 19, vd, 100 + static_cast<std::uint32_t>(vd));
    const std::int64_t kd = in.kd;
    const float* q = in.q.data();
    const float* k = in.k.data();
    const float* v = in.v.data();
    const float decay = std::exp(in.g[0]), beta = in.beta[0];
    Vec S(in.state0.begin(), in.state0.begin() + kd * vd), want_o(static_cast<std::size_t>(vd));
    for (std::int64_t j = 0; j < vd; ++j) {
      float kv = 0.0f;
      for (std::int64_t i = 0; i < kd; ++i) {
        float& sij = S[static_cast<std::size_t>(i * vd + j)];
        sij = sij * decay;
        kv += sij * k[i];
      }
      const float delta = (v[j] - kv) * beta;
      float o = 0.0f;
      for (std::int64_t i = 0; i < kd; ++i) {
        float& sij = S[static_cast<std::size_t>(i * vd + j)];
        sij = sij + k[i] * delta;
        o += sij * q[i];
      }
      want_o[static_cast<std::size_t>(j)] = o;
    }
    Vec s_in(in.state0.begin(), in.state0.begin() + kd * vd), s_out(s_in.size()), o(want_o.size());
    gated_delta_rule_step(q, k, v, in.g[0], beta, kd, vd, s_in.data(), s_out.data(), o.data());
    EXPECT_TRUE(same_bits(s_out, S)) << "v_dim " << vd;
    EXPECT_TRUE(same_bits(o, want_o)) << "v_dim " << vd;
    gated_delta_rule_step(q, k, v, in.g[0], beta, kd, vd, s_in.data(), s_in.data(), o.data());
    EXPECT_TRUE(same_bits(s_in, S)) << "in place, v_dim " << vd;
    EXPECT_TRUE(same_bits(o, want_o)) << "in place, v_dim " << vd;
  }
}

TEST(KernelsGatedDelta, TokensTogetherEqualTokensOneByOneBitwise) {
  const DeltaInputs in(7, 4, 1, 16, 24, 80);
  std::vector<Vec> states_all;
  Vec out_all;
  run_delta(in, 0, in.tokens, in.state0.data(), states_all, out_all);

  std::vector<Vec> states_one;
  Vec out_one;
  for (std::int64_t t = 0; t < in.tokens; ++t) {
    const float* prev = t == 0 ? in.state0.data() : states_one.back().data();
    run_delta(in, t, 1, prev, states_one, out_one);
  }
  EXPECT_TRUE(same_bits(out_all, out_one));
  for (std::size_t t = 0; t < states_all.size(); ++t) {
    EXPECT_TRUE(same_bits(states_all[t], states_one[t])) << "state after token " << t;
  }
  // A split 3 + 4, as a prefix forward followed by a verification.
  std::vector<Vec> states_split;
  Vec out_split;
  run_delta(in, 0, 3, in.state0.data(), states_split, out_split);
  run_delta(in, 3, 4, states_split.back().data(), states_split, out_split);
  EXPECT_TRUE(same_bits(out_all, out_split));
  EXPECT_TRUE(same_bits(states_all.back(), states_split.back()));
}

TEST(KernelsGatedDelta, InPlaceEqualsOutOfPlaceBitwise) {
  const DeltaInputs in(5, 3, 3, 10, 9, 90);
  std::vector<Vec> states;
  Vec out;
  run_delta(in, 0, in.tokens, in.state0.data(), states, out);

  // Without recording the cache hands out one slot: state_in == every state_out[t].
  Vec slot = in.state0;
  std::vector<float*> ptrs(static_cast<std::size_t>(in.tokens), slot.data());
  Vec out_in_place(out.size());
  gated_delta_rule(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), in.tokens,
                   in.nv, in.nk, in.kd, in.vd, slot.data(), ptrs.data(), out_in_place.data());
  EXPECT_TRUE(same_bits(out, out_in_place));
  EXPECT_TRUE(same_bits(states.back(), slot));

  // The single-head step, in place and out of place.
  Vec s_in(in.state0.begin(), in.state0.begin() + in.kd * in.vd), s_out(s_in.size());
  Vec o1(static_cast<std::size_t>(in.vd)), o2(o1.size());
  gated_delta_rule_step(in.q.data(), in.k.data(), in.v.data(), in.g[0], in.beta[0], in.kd, in.vd,
                        s_in.data(), s_out.data(), o1.data());
  gated_delta_rule_step(in.q.data(), in.k.data(), in.v.data(), in.g[0], in.beta[0], in.kd, in.vd,
                        s_in.data(), s_in.data(), o2.data());
  EXPECT_TRUE(same_bits(s_out, s_in));
  EXPECT_TRUE(same_bits(o1, o2));
  EXPECT_TRUE(same_bits(o1.data(), out.data(), o1.size()));
}

TEST(KernelsGatedDelta, IndependentOfThreadCount) {
  const DeltaInputs in(4, 8, 4, 64, 64, 100);  // large enough to run threaded
  std::vector<Vec> s1, s2;
  Vec o1, o2;
  with_threads(1, [&] { run_delta(in, 0, in.tokens, in.state0.data(), s1, o1); });
  with_threads(2, [&] { run_delta(in, 0, in.tokens, in.state0.data(), s2, o2); });
  EXPECT_TRUE(same_bits(o1, o2));
  EXPECT_TRUE(same_bits(s1.back(), s2.back()));
}

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
    const double err = std::abs(static_cast<double>(exp_f32(x)) - exact) /
                       ulp_at(static_cast<float>(exact));
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
  for (const float x : {lo, hi, std::nextafter(lo, 0.0f), std::nextafter(hi, 0.0f), 1.0f, -1.0f,
                        0.5f, -0.5f, 1e-30f, -1e-30f}) {
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

// Inputs for the SiLU loops: random values with saturating ones (|x| > 88,
// where exp_f32 gives 0 or inf, and the clamp bounds themselves) spread so
// that some land in the 8-lane main part and some in the n % 8 tail.
Vec silu_inputs(std::size_t n, std::uint32_t seed) {
  Vec v = random_vec(n, seed, -12.0f, 12.0f);
  const float special[] = {-1000.0f, 1000.0f, -88.5f, 88.5f, -88.25f, 88.25f, -88.0f, 88.0f,
                           -87.5f,   87.5f,   -87.25f, 87.25f, -87.0f, 87.0f, 0.0f, -0.0f,
                           -100.0f,  100.0f};
  for (std::size_t i = 0; i < n; ++i) {
    if (i % 3 == 1) v[i] = special[(i / 3 + seed) % std::size(special)];
  }
  if (n > 0) v[n - 1] = -1000.0f;  // the last tail element saturates
  return v;
}

constexpr std::int64_t kSiluLengths[] = {1, 7, 8, 9, 15, 16, 37, 64};

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
    EXPECT_TRUE(std::isfinite(sigmoid(x)) && std::isfinite(silu(x)) && std::isfinite(softplus(x)))
        << x;
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
