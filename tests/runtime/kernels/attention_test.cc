// Tests of attention, dense and paged (runtime/kernels.h; the kernels in runtime/kernels/).
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

// ---- attention --------------------------------------------------------------------

// Keys / values stored the way the cache returns them: token-major rows of
// [B, H, D], here with B = 2 and sequence b = 1 used, so that the position
// stride (B * H * D) differs from H * D.
struct KVStore {
  std::int64_t batch = 2, heads, dim, len;
  Vec keys, values;
  KVStore(std::int64_t h, std::int64_t d, std::int64_t n, std::uint32_t seed)
      : heads(h), dim(d), len(n), keys(random_vec(static_cast<std::size_t>(2 * h * d * n), seed)),
        values(random_vec(static_cast<std::size_t>(2 * h * d * n), seed + 1)) {}
  // Element (position p, head h, d) of sequence 1.
  std::size_t at(std::int64_t p, std::int64_t h, std::int64_t d) const {
    return static_cast<std::size_t>(p * batch * heads * dim + heads * dim + h * dim + d);
  }
  // Strided view of positions [first, ...).
  StridedKV k(std::int64_t first) const { return {keys.data() + at(first, 0, 0), dim, batch * heads * dim}; }
  StridedKV v(std::int64_t first) const { return {values.data() + at(first, 0, 0), dim, batch * heads * dim}; }
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
Vec ref_attention(const Vec& q, std::int64_t q_len, std::int64_t pos0, std::int64_t num_heads, const KVStore& kv,
                  std::int64_t kv_offset, std::int64_t kv_len, AttentionMask mask) {
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
        out[static_cast<std::size_t>((t * num_heads + h) * d_dim + d)] = static_cast<float>(s.empty() ? 0.0
                                                                                                      : acc / sum);
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
    attention(q.data(), q_len, pos0, c.num_heads, c.num_kv_heads, c.head_dim, kv.k(kv_offset), kv.v(kv_offset),
              kv_offset, kv_len, c.mask, out.data());
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
Vec in_order_attention(const Vec& q, std::int64_t q_len, std::int64_t pos0, std::int64_t num_heads, const KVStore& kv,
                       std::int64_t kv_offset, std::int64_t kv_len, AttentionMask mask) {
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
      {"d48_gqa", 4, 2, 48, {}},
      {"d13_mha", 2, 2, 13, {}},
      {"d24_sliding", 3, 1, 24, {7, 0}},
      {"d5_chunked", 2, 1, 5, {0, 6}},
      {"d64_gqa", 4, 1, 64, {}},
      {"d136", 1, 1, 136, {}},
      {"d16_sliding100", 6, 2, 16, {100, 0}},
      {"d8_chunked70", 5, 1, 8, {0, 70}},
      {"d8_g40", 40, 1, 8, {}},
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
          attention(q.data(), q_len, pos0, c.num_heads, c.num_kv_heads, c.head_dim, kv.k(kv_offset), kv.v(kv_offset),
                    kv_offset, kv_len, c.mask, out.data());
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
    attention(q.data(), q_len, pos0, c.num_heads, c.num_kv_heads, c.head_dim, kv.k(0), kv.v(0), 0, total, c.mask,
              many.data());
    for (std::int64_t t = 0; t < q_len; ++t) {
      const std::int64_t p = pos0 + t;
      std::int64_t lo = 0;
      if (c.mask.window > 0) lo = std::max<std::int64_t>(0, p - c.mask.window + 1);
      if (c.mask.chunk > 0) lo = p / c.mask.chunk * c.mask.chunk;
      Vec one(row);
      attention(q.data() + static_cast<std::size_t>(t) * row, 1, p, c.num_heads, c.num_kv_heads, c.head_dim, kv.k(lo),
                kv.v(lo), lo, p - lo + 1, c.mask, one.data());
      EXPECT_TRUE(same_bits(one.data(), many.data() + static_cast<std::size_t>(t) * row, row))
          << c.name << " query " << t;
      // The same single query with every key up to p passed in.
      Vec wide(row);
      attention(q.data() + static_cast<std::size_t>(t) * row, 1, p, c.num_heads, c.num_kv_heads, c.head_dim, kv.k(0),
                kv.v(0), 0, total, c.mask, wide.data());
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
    attention(q.data(), q_len, total - q_len, heads, kv_heads, dim, kv.k(0), kv.v(0), 0, total, {}, one.data());
  });
  with_threads(2, [&] {
    attention(q.data(), q_len, total - q_len, heads, kv_heads, dim, kv.k(0), kv.v(0), 0, total, {}, two.data());
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

// ---- instruction-set copies ---------------------------------------------------------

// The AVX2 copy scores a pair of queries with 8-float vectors where the
// others share 16-float ones, keeps 32 floats of a pair's output in
// registers per pass over the values instead of 64, and takes the
// exponentials 8 wide: every copy must give the baseline's bits. Head dims
// with every kind of tail (fewer than 8 floats, a lone 8-float vector,
// several passes), pairs and lone queries (3 heads per KV head), one row
// and several rows over more than one 64-key block, full and sliding.
TEST(KernelsAttention, EveryIsaCopyGivesTheBaselineBits) {
  if (wider_kernel_isas().empty()) GTEST_SKIP() << "this CPU runs the baseline copy only";
  const std::int64_t total = 150;
  for (const std::int64_t dim : {48, 128, 256, 200, 20, 7}) {
    for (const auto& [heads, kv_heads] : {std::pair<std::int64_t, std::int64_t>{4, 2}, {3, 1}, {8, 2}}) {
      const KVStore kv(kv_heads, dim, total, 60 + static_cast<std::uint32_t>(dim));
      for (const std::int64_t q_len : {1, 9}) {
        for (const AttentionMask mask : {AttentionMask{}, AttentionMask{70, 0}}) {
          const Vec q = random_vec(static_cast<std::size_t>(q_len * heads * dim), 62, -3.0f, 3.0f);
          EXPECT_TRUE(same_bits_as_baseline_on_every_isa([&] {
            Vec out(q.size());
            attention(q.data(), q_len, total - q_len, heads, kv_heads, dim, kv.k(0), kv.v(0), 0, total, mask,
                      out.data());
            return out;
          })) << "head_dim "
              << dim << " heads " << heads << "/" << kv_heads << " rows " << q_len << " window " << mask.window;
        }
      }
    }
  }
}

}  // namespace
}  // namespace rwd::runtime::kernels
