// Tests of Q8 weights (kernels::PackedMatrix::from_q8 and matmul over them,
// runtime/kernels.h): the quantization's per-block error bound, matmul bit
// for bit against an independent scalar reference of its int8 contract and
// within the activations' quantization error of the f32 matmul of the
// dequantized values, and batch / thread invariance. Named KernelsMatmulQ8 so that
// `make test` also runs them on the baseline and AVX2 copies.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "rewind/dtype.h"
#include "runtime/kernels.h"
#include "runtime/kernels/test_util.h"

namespace rwd::runtime::kernels {
namespace {

using namespace test_support;
using Element = PackedMatrix::Element;

// The scale and the int8 of w[o, i] read from the documented Q8 panel
// layout (kernels.h), not through PackedMatrix::at.
float stored_scale(const PackedMatrix& m, std::int64_t o, std::int64_t i) {
  const auto* block = static_cast<const unsigned char*>(m.panel_data(o / PackedMatrix::kPanelWidth)) +
                      i / PackedMatrix::kQ8Block * PackedMatrix::kQ8BlockBytes;
  std::uint16_t bits;
  std::memcpy(&bits, block + o % PackedMatrix::kPanelWidth * 2, sizeof bits);
  return bf16_to_f32(bits);
}
// The stored byte is q + 128, inputs in groups of 4 per output, 16
// outputs per 64 bytes after the block's 32 bytes of scales.
int stored_q(const PackedMatrix& m, std::int64_t o, std::int64_t i) {
  const auto* block = static_cast<const unsigned char*>(m.panel_data(o / PackedMatrix::kPanelWidth)) +
                      i / PackedMatrix::kQ8Block * PackedMatrix::kQ8BlockBytes;
  const std::int64_t k = i % PackedMatrix::kQ8Block, l = o % PackedMatrix::kPanelWidth;
  return static_cast<int>(block[32 + k / 4 * 64 + l * 4 + k % 4]) - 128;
}

// w: [out, in] with rows of very different magnitudes, an all-zero block
// and exact zeros inside blocks.
Vec test_weights(std::int64_t out, std::int64_t in, std::uint32_t seed) {
  Vec w = random_vec(static_cast<std::size_t>(out * in), seed);
  for (std::int64_t o = 0; o < out; ++o) {
    const float scale = std::ldexp(1.0f, static_cast<int>(o % 7) * 3 - 12);  // 2^-12 .. 2^6
    for (std::int64_t i = 0; i < in; ++i) {
      float& v = w[static_cast<std::size_t>(o * in + i)];
      v *= scale;
      if ((o * in + i) % 11 == 3) v = 0.0f;
      if (o == 1 && i < PackedMatrix::kQ8Block) v = 0.0f;  // one all-zero block
    }
  }
  return w;
}

TEST(KernelsMatmulQ8, QuantizationIsWithinHalfAScaleOfEveryWeight) {
  for (const auto& [out, in] : {std::pair<std::int64_t, std::int64_t>{37, 75}, {16, 32}, {5, 1}, {17, 64}, {3, 33}}) {
    const Vec w = test_weights(out, in, static_cast<std::uint32_t>(out * 100 + in));
    const PackedMatrix m = PackedMatrix::from_q8(w.data(), Element::F32, out, in);
    ASSERT_EQ(m.element(), Element::Q8);
    ASSERT_EQ(m.bytes(), static_cast<std::size_t>(m.panels() * ((in + 31) / 32) * PackedMatrix::kQ8BlockBytes));
    for (std::int64_t o = 0; o < out; ++o) {
      for (std::int64_t b = 0; b * 32 < in; ++b) {
        double max_abs = 0.0;
        for (std::int64_t i = b * 32; i < std::min(in, b * 32 + 32); ++i) {
          max_abs = std::max(max_abs, std::fabs(static_cast<double>(w[static_cast<std::size_t>(o * in + i)])));
        }
        const double s = stored_scale(m, o, b * 32);
        if (max_abs == 0.0) {
          EXPECT_EQ(s, 0.0) << o << ", block " << b;
        } else {
          // The smallest bf16 at or above max_abs / 127: within one bf16 step.
          EXPECT_GE(s, max_abs / 127.0) << o << ", block " << b;
          EXPECT_LT(s, max_abs / 127.0 * (1.0 + 1.0 / 128.0)) << o << ", block " << b;
        }
        for (std::int64_t i = b * 32; i < std::min(in, b * 32 + 32); ++i) {
          const double v = w[static_cast<std::size_t>(o * in + i)];
          const int q = stored_q(m, o, i);
          ASSERT_LE(std::abs(q), 127);
          EXPECT_LE(std::fabs(v - q * s), s / 2) << o << ", " << i;
          EXPECT_EQ(static_cast<double>(m.at(o, i)), q * s) << "q * s is exact in f32";
        }
      }
    }
  }
}

TEST(KernelsMatmulQ8, HalfPrecisionSourcesQuantizeTheirExactValues) {
  const std::int64_t out = 19, in = 70;
  const Vec w = test_weights(out, in, 7);
  std::vector<std::uint16_t> b(w.size()), h(w.size());
  Vec wb(w.size()), wh(w.size());
  for (std::size_t k = 0; k < w.size(); ++k) {
    b[k] = f32_to_bf16(w[k]);
    h[k] = f32_to_f16(w[k]);
    wb[k] = bf16_to_f32(b[k]);
    wh[k] = f16_to_f32(h[k]);
  }
  const PackedMatrix from_b = PackedMatrix::from_q8(b.data(), Element::BF16, out, in);
  const PackedMatrix from_wb = PackedMatrix::from_q8(wb.data(), Element::F32, out, in);
  const PackedMatrix from_h = PackedMatrix::from_q8(h.data(), Element::F16, out, in);
  const PackedMatrix from_wh = PackedMatrix::from_q8(wh.data(), Element::F32, out, in);
  ASSERT_EQ(from_b.bytes(), from_wb.bytes());
  EXPECT_EQ(0, std::memcmp(from_b.panel_data(0), from_wb.panel_data(0), from_b.bytes()));
  EXPECT_EQ(0, std::memcmp(from_h.panel_data(0), from_wh.panel_data(0), from_h.bytes()));
}

// The contract (docs/quantization.md), independently: each row's blocks of
// 32 inputs quantized with d = max|x| / 127 and q = the nearest integer to
// x / d (in f32), the block's products summed in integers, then per block
// in order one fma of that sum by (weight scale * d) onto the output.
Vec scalar_reference(const Vec& x, std::int64_t rows, const PackedMatrix& m, const float* bias) {
  const std::int64_t out = m.out(), in = m.in(), blocks = (in + 31) / 32;
  Vec y(static_cast<std::size_t>(rows * out));
  for (std::int64_t r = 0; r < rows; ++r) {
    std::vector<int> qx(static_cast<std::size_t>(blocks * 32), 0);
    Vec d(static_cast<std::size_t>(blocks), 0.0f);
    for (std::int64_t b = 0; b < blocks; ++b) {
      float a = 0.0f;
      bool finite = true;
      for (std::int64_t i = b * 32; i < std::min(in, b * 32 + 32); ++i) {
        const float v = x[static_cast<std::size_t>(r * in + i)];
        if (!std::isfinite(v)) finite = false;
        a = std::max(a, std::fabs(v));
      }
      if (!finite) {
        d[static_cast<std::size_t>(b)] = std::nanf("");
        continue;
      }
      if (a == 0.0f) continue;
      const float db = a / 127.0f;
      d[static_cast<std::size_t>(b)] = db;
      for (std::int64_t i = b * 32; i < std::min(in, b * 32 + 32); ++i) {
        const float t = x[static_cast<std::size_t>(r * in + i)] / db;
        qx[static_cast<std::size_t>(i)] = static_cast<int>(std::nearbyint(t));
      }
    }
    for (std::int64_t o = 0; o < out; ++o) {
      float s = 0.0f;
      for (std::int64_t b = 0; b < blocks; ++b) {
        long sum = 0;
        for (std::int64_t i = b * 32; i < std::min(in, b * 32 + 32); ++i) {
          sum += static_cast<long>(stored_q(m, o, i)) * qx[static_cast<std::size_t>(i)];
        }
        s = std::fma(static_cast<float>(sum), stored_scale(m, o, b * 32) * d[static_cast<std::size_t>(b)], s);
      }
      if (bias != nullptr) s = s + bias[o];
      y[static_cast<std::size_t>(r * out + o)] = s;
    }
  }
  return y;
}

// How far the Q8 result may be from the f32 matmul of the dequantized
// weights: each input moves by at most d / 2 when quantized, so an output
// by at most the sum over blocks of d / 2 times the block's |w|, plus the
// f32 sums' own rounding.
double activation_error_bound(const Vec& x, std::int64_t r, const PackedMatrix& m, std::int64_t o) {
  const std::int64_t in = m.in();
  double bound = 0.0, magnitude = 0.0;
  for (std::int64_t b = 0; b * 32 < in; ++b) {
    double a = 0.0, wsum = 0.0;
    for (std::int64_t i = b * 32; i < std::min(in, b * 32 + 32); ++i) {
      const double xv = x[static_cast<std::size_t>(r * in + i)], wv = m.at(o, i);
      a = std::max(a, std::fabs(xv));
      wsum += std::fabs(wv);
      magnitude += std::fabs(xv * wv);
    }
    bound += a / 127.0 / 2.0 * wsum;
  }
  return bound * (1.0 + 1e-5) + magnitude * 1e-5;
}

TEST(KernelsMatmulQ8, EqualsTheScalarReferenceAndIsNearTheF32MatmulOfTheDequantizedWeights) {
  struct Case {
    std::int64_t rows, in, out;
  };
  // in: below, at and past one block, and blocks with a short last one;
  // out: a short last panel, one panel, several; rows: every group size of
  // the row grouping and sizes that split into uneven groups.
  for (const Case c : {Case{1, 1, 1}, Case{3, 31, 15}, Case{2, 32, 16}, Case{5, 33, 17}, Case{7, 75, 40},
                       Case{13, 200, 33}, Case{1, 96, 70}, Case{9, 65, 64}, Case{4, 128, 80}}) {
    const Vec w = test_weights(c.out, c.in, static_cast<std::uint32_t>(c.in * 7 + c.out));
    Vec x = random_vec(static_cast<std::size_t>(c.rows * c.in), static_cast<std::uint32_t>(c.rows + 5));
    // Rows of very different magnitudes, a block of zeros, exact ties.
    for (std::int64_t r = 0; r < c.rows; ++r) {
      for (std::int64_t i = 0; i < c.in; ++i) {
        float& v = x[static_cast<std::size_t>(r * c.in + i)];
        v = std::ldexp(v, static_cast<int>(r % 5) * 4 - 8);
        if (r == 1 && i < 32) v = 0.0f;
      }
    }
    const Vec bias = random_vec(static_cast<std::size_t>(c.out), 99);
    const PackedMatrix q = PackedMatrix::from_q8(w.data(), Element::F32, c.out, c.in);
    Vec dequantized(w.size());
    for (std::int64_t o = 0; o < c.out; ++o) q.row(o, dequantized.data() + o * c.in);
    const PackedMatrix f(dequantized.data(), c.out, c.in);
    for (const float* b : {static_cast<const float*>(nullptr), bias.data()}) {
      Vec yq(static_cast<std::size_t>(c.rows * c.out)), yf(yq.size());
      matmul(x.data(), c.rows, q, yq.data(), b);
      matmul(x.data(), c.rows, f, yf.data(), b);
      EXPECT_TRUE(same_bits(yq, scalar_reference(x, c.rows, q, b))) << c.rows << " x " << c.in << " -> " << c.out;
      for (std::int64_t r = 0; r < c.rows; ++r) {
        for (std::int64_t o = 0; o < c.out; ++o) {
          const auto k = static_cast<std::size_t>(r * c.out + o);
          EXPECT_LE(std::fabs(static_cast<double>(yq[k]) - yf[k]), activation_error_bound(x, r, q, o))
              << c.rows << " x " << c.in << " -> " << c.out << " [" << r << ", " << o << "]";
        }
      }
    }
  }
}

TEST(KernelsMatmulQ8, ActivationsAtTheInt8LimitsAndNonFiniteInputs) {
  const std::int64_t in = 64, out = 20, rows = 4;
  // Weights and activations that quantize to +-127 everywhere: the largest
  // int32 sums the kernels meet.
  Vec w(static_cast<std::size_t>(out * in)), x(static_cast<std::size_t>(rows * in));
  for (std::size_t k = 0; k < w.size(); ++k) w[k] = (k % 3 == 0) ? -1.0f : 1.0f;
  for (std::size_t k = 0; k < x.size(); ++k) x[k] = (k % 5 == 0) ? -2.5f : 2.5f;
  x[static_cast<std::size_t>(1 * in + 40)] = std::numeric_limits<float>::infinity();  // row 1, block 1
  x[static_cast<std::size_t>(2 * in + 3)] = std::nanf("");                            // row 2, block 0
  const PackedMatrix q = PackedMatrix::from_q8(w.data(), Element::F32, out, in);
  Vec y(static_cast<std::size_t>(rows * out));
  matmul(x.data(), rows, q, y.data());
  EXPECT_TRUE(same_bits(y, scalar_reference(x, rows, q, nullptr)));
  for (std::int64_t o = 0; o < out; ++o) {
    double exact = 0.0;
    for (std::int64_t i = 0; i < in; ++i) exact += static_cast<double>(w[o * in + i]) * x[i];
    // Both roundings (the scales up to the next bf16, d to f32) are
    // relative ones of at most 2^-8 and 2^-24.
    EXPECT_NEAR(y[static_cast<std::size_t>(o)], exact, std::fabs(exact) * 0.005 + 1e-3);
    EXPECT_TRUE(std::isnan(y[static_cast<std::size_t>(out + o)])) << "an infinite input: NaN, as in f32";
    EXPECT_TRUE(std::isnan(y[static_cast<std::size_t>(2 * out + o)])) << "a NaN input";
    EXPECT_EQ(y[static_cast<std::size_t>(3 * out + o)], y[static_cast<std::size_t>(o)]) << "rows 0 and 3 are alike";
  }
}

TEST(KernelsMatmulQ8, RowsAreBatchAndThreadInvariant) {
  // One of about 300 KB (in L2-sized blocks of 12 panels for more than 4 rows) and a small one.
  for (const auto& [in, out] : {std::pair<std::int64_t, std::int64_t>{544, 520}, {72, 45}}) {
    const Vec w = test_weights(out, in, 3);
    const PackedMatrix q = PackedMatrix::from_q8(w.data(), Element::F32, out, in);
    const std::int64_t rows = 17;
    const Vec x = random_vec(static_cast<std::size_t>(rows * in), 21);
    Vec all(static_cast<std::size_t>(rows * out));
    with_threads(1, [&] { matmul(x.data(), rows, q, all.data()); });
    for (int threads : {1, 2, 3}) {
      with_threads(threads, [&] {
        Vec many(all.size());
        matmul(x.data(), rows, q, many.data());
        EXPECT_TRUE(same_bits(many, all)) << threads << " threads";
        for (std::int64_t r = 0; r < rows; ++r) {
          Vec one(static_cast<std::size_t>(out));
          matmul(x.data() + r * in, 1, q, one.data());
          EXPECT_TRUE(same_bits(one.data(), all.data() + r * out, one.size())) << "row " << r;
        }
        for (std::int64_t n : {2, 3, 6, 7, 8}) {  // every group size, from row 4 on
          Vec part(static_cast<std::size_t>(n * out));
          matmul(x.data() + 4 * in, n, q, part.data());
          EXPECT_TRUE(same_bits(part.data(), all.data() + 4 * out, part.size())) << n << " rows";
        }
      });
    }
  }
}

}  // namespace
}  // namespace rwd::runtime::kernels
