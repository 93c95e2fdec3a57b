// Tests of matmul and PackedMatrix (runtime/kernels.h; the kernels in runtime/kernels/).
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

// ---- matmul ---------------------------------------------------------------------

struct MatmulCase {
  std::int64_t rows, in, out;
};

// The contract of one matmul output, written naively: an in-order chain of
// fused multiply-adds s = fma(x[r, i], w[o, i], s) from 0.0f (one rounding
// per term), then the bias added. w: [out, in] as given to PackedMatrix.
Vec naive_matmul(const Vec& x, std::int64_t rows, const Vec& w, std::int64_t out, std::int64_t in, const float* bias) {
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
  for (const MatmulCase c :
       {MatmulCase{1, 1, 1}, MatmulCase{3, 37, 13}, MatmulCase{5, 259, 67}, MatmulCase{9, 1024, 130}}) {
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
  for (const MatmulCase c : {MatmulCase{17, 515, 262}, MatmulCase{17, 203, 179}, MatmulCase{17, 13, 21}}) {
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
          EXPECT_TRUE(same_bits(together.data() + r * c.out, alone.data() + r * c.out, static_cast<std::size_t>(c.out)))
              << "in " << c.in << " out " << c.out << " bias " << (b != nullptr) << ": row " << r << " of " << rows;
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
      EXPECT_TRUE(same_bits(y, ref)) << "rows " << c.rows << " in " << c.in << " out " << c.out << " bias "
                                     << (b != nullptr);
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
  PackedMatrix small(w.data(), 4, 8);       // below 2 MiB: the other allocation
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

}  // namespace
}  // namespace rwd::runtime::kernels
