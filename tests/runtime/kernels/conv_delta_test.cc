// Tests of the causal convolution and the Gated DeltaNet recurrence (runtime/kernels.h; the kernels in
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

// ---- causal conv ------------------------------------------------------------------

TEST(KernelsConv, MatchesNaiveAndTokenAlone) {
  // Window as the cache returns it: [B=2, C, K-1+q] token-major, so element
  // (c, s) of sequence 1 is at s * B * C + C + c.
  const std::int64_t batch = 2, channels = 300, kernel = 4, q = 5, span = kernel - 1 + q;
  const Vec storage = random_vec(static_cast<std::size_t>(span * batch * channels), 60, -2.0f, 2.0f);
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
            const double term = static_cast<double>(weight[static_cast<std::size_t>(c * kernel + i)]) *
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
        causal_conv1d(window + t * ts, channels, kernel, 1, 1, ts, weight.data(), b, fuse, one.data());
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
  causal_conv1d(window.data(), channels, kernel, q, span, 1, weight.data(), nullptr, false, out.data());
  for (std::int64_t t = 0; t < q; ++t) {
    for (std::int64_t c = 0; c < channels; ++c) {
      const float ref = 0.0f +
                        weight[static_cast<std::size_t>(c * kernel)] * window[static_cast<std::size_t>(c * span + t)] +
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
  DeltaInputs(std::int64_t t, std::int64_t v_heads, std::int64_t k_heads, std::int64_t k_dim, std::int64_t v_dim,
              std::uint32_t seed)
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
void run_delta(const DeltaInputs& in, std::int64_t t0, std::int64_t n, const float* state, std::vector<Vec>& states,
               Vec& out) {
  std::vector<Vec> fresh(static_cast<std::size_t>(n), Vec(in.state_size()));
  std::vector<float*> ptrs;
  for (Vec& s : fresh) ptrs.push_back(s.data());
  Vec o(static_cast<std::size_t>(n * in.nv * in.vd));
  gated_delta_rule(in.q.data() + t0 * in.nk * in.kd, in.k.data() + t0 * in.nk * in.kd, in.v.data() + t0 * in.nv * in.vd,
                   in.g.data() + t0 * in.nv, in.beta.data() + t0 * in.nv, n, in.nv, in.nk, in.kd, in.vd, state,
                   ptrs.data(), o.data());
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
      const double decay = std::exp(static_cast<double>(in.g[static_cast<std::size_t>(t * in.nv + h)]));
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
      ASSERT_NEAR(states[static_cast<std::size_t>(t)][i], s[i], 1e-5) << "state " << t << " at " << i;
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
  gated_delta_rule(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), in.tokens, in.nv, in.nk, in.kd,
                   in.vd, slot.data(), ptrs.data(), out_in_place.data());
  EXPECT_TRUE(same_bits(out, out_in_place));
  EXPECT_TRUE(same_bits(states.back(), slot));

  // The single-head step, in place and out of place.
  Vec s_in(in.state0.begin(), in.state0.begin() + in.kd * in.vd), s_out(s_in.size());
  Vec o1(static_cast<std::size_t>(in.vd)), o2(o1.size());
  gated_delta_rule_step(in.q.data(), in.k.data(), in.v.data(), in.g[0], in.beta[0], in.kd, in.vd, s_in.data(),
                        s_out.data(), o1.data());
  gated_delta_rule_step(in.q.data(), in.k.data(), in.v.data(), in.g[0], in.beta[0], in.kd, in.vd, s_in.data(),
                        s_in.data(), o2.data());
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

// ---- instruction-set copies ---------------------------------------------------------

// The AVX2 copy goes over a head's value columns in blocks of 32, 16 and 8
// (four, two and one 8-float vectors), then single columns; the baseline
// and AVX-512 copies in blocks of 16 and 8, then single columns. Every v_dim
// here mixes them (128: 32s or 16s; 75 = 2 x 32 + 8 + 3; 56 = 32 + 16 + 8;
// 27 = 16 + 8 + 3), and every copy must give the baseline's bits for the
// outputs and every state, out of place and in place.
TEST(KernelsGatedDelta, EveryIsaCopyGivesTheBaselineBits) {
  if (wider_kernel_isas().empty()) GTEST_SKIP() << "this CPU runs the baseline copy only";
  for (const std::int64_t vd : {128, 75, 56, 40, 27, 8, 5, 1}) {
    const DeltaInputs in(3, 2, 1, 19, vd, 200 + static_cast<std::uint32_t>(vd));
    EXPECT_TRUE(same_bits_as_baseline_on_every_isa([&] {
      std::vector<Vec> states;
      Vec out;
      run_delta(in, 0, in.tokens, in.state0.data(), states, out);
      for (const Vec& state : states) out.insert(out.end(), state.begin(), state.end());
      return out;
    })) << "v_dim "
        << vd;
    EXPECT_TRUE(same_bits_as_baseline_on_every_isa([&] {
      Vec slot = in.state0;
      const std::vector<float*> ptrs(static_cast<std::size_t>(in.tokens), slot.data());
      Vec out(static_cast<std::size_t>(in.tokens * in.nv * in.vd));
      gated_delta_rule(in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(), in.tokens, in.nv, in.nk,
                       in.kd, in.vd, slot.data(), ptrs.data(), out.data());
      out.insert(out.end(), slot.begin(), slot.end());
      return out;
    })) << "in place, v_dim "
        << vd;
  }
}

// The end of the convolution (bias, then SiLU) runs 8 lanes wide in the
// AVX2 copy and 16 wide in the others: channel counts with every kind of
// tail, and sums large enough for exp to saturate.
TEST(KernelsConv, EveryIsaCopyGivesTheBaselineBits) {
  if (wider_kernel_isas().empty()) GTEST_SKIP() << "this CPU runs the baseline copy only";
  for (const std::int64_t channels : {300, 261, 40, 24, 7}) {
    const std::int64_t kernel = 4, q = 3, span = kernel - 1 + q;
    const Vec window = random_vec(static_cast<std::size_t>(span * channels), 65, -40.0f, 40.0f);
    const Vec weight = random_vec(static_cast<std::size_t>(channels * kernel), 66);
    const Vec bias = random_vec(static_cast<std::size_t>(channels), 67);
    for (const bool fuse : {false, true}) {
      for (const float* b : {static_cast<const float*>(nullptr), bias.data()}) {
        EXPECT_TRUE(same_bits_as_baseline_on_every_isa([&] {
          Vec out(static_cast<std::size_t>(q * channels));
          causal_conv1d(window.data(), channels, kernel, q, 1, channels, weight.data(), b, fuse, out.data());
          return out;
        })) << "channels "
            << channels << " fuse " << fuse << " bias " << (b != nullptr);
      }
    }
  }
}

// causal_conv1d, and causal_conv1d_taps on the same weights tap-major, on
// each instruction-set copy (kernel_isa.h) equal the scalar formula bit for
// bit: channel counts with every tail (16-, 8-float vectors, scalars, and
// blocks of 256), kernel sizes 1, 3 and 4, row counts of a decoding step (1
// to 3, where causal_conv1d does not transpose and causal_conv1d_taps runs
// in registers), 4 and across the 64-row tasks, the cache's layout (channel stride 1, a padded time stride) and the
// channel-major one, with and without bias and SiLU (sums large enough for
// exp to saturate).
TEST(KernelsConv, EveryIsaCopyEqualsScalarFormulaBitwise) {
#if defined(__FMA__)
  GTEST_SKIP() << "FMA contraction enabled in this build";
#endif
  std::vector<detail::KernelIsa> isas = {detail::KernelIsa::Baseline};
  for (const detail::KernelIsa isa : wider_kernel_isas()) isas.push_back(isa);
  for (const std::int64_t channels : {1, 7, 8, 15, 16, 17, 24, 40, 255, 256, 257, 530}) {
    for (const std::int64_t kernel : {1, 3, 4}) {
      for (const std::int64_t q : {1, 2, 3, 4, 65, 130}) {
        if (channels * q > 20000 && kernel != 4) continue;  // the large ones once
        const std::int64_t span = kernel - 1 + q;
        const Vec storage = random_vec(static_cast<std::size_t>(span * (channels + 3)),
                                       static_cast<std::uint32_t>(channels * 31 + kernel * 7 + q), -40.0f, 40.0f);
        const Vec weight = random_vec(static_cast<std::size_t>(channels * kernel),
                                      static_cast<std::uint32_t>(channels));
        const Vec bias = random_vec(static_cast<std::size_t>(channels), static_cast<std::uint32_t>(channels + 1));
        Vec taps(weight.size());
        for (std::int64_t c = 0; c < channels; ++c) {
          for (std::int64_t i = 0; i < kernel; ++i)
            taps[static_cast<std::size_t>(i * channels + c)] = weight[static_cast<std::size_t>(c * kernel + i)];
        }
        // (channel stride, time stride): token-major with padding, channel-major.
        const std::int64_t layouts[2][2] = {{1, channels + 3}, {span, 1}};
        for (const auto& layout : layouts) {
          const auto at = [&](std::int64_t c, std::int64_t s) {
            return storage[static_cast<std::size_t>(c * layout[0] + s * layout[1])];
          };
          for (const bool fuse : {false, true}) {
            for (const float* b : {static_cast<const float*>(nullptr), bias.data()}) {
              Vec want(static_cast<std::size_t>(q * channels));
              for (std::int64_t t = 0; t < q; ++t) {
                for (std::int64_t c = 0; c < channels; ++c) {
                  float acc = 0.0f;
                  for (std::int64_t i = 0; i < kernel; ++i) {
                    const float product = weight[static_cast<std::size_t>(c * kernel + i)] * at(c, t + i);
                    acc = acc + product;
                  }
                  if (b != nullptr) acc = acc + b[c];
                  want[static_cast<std::size_t>(t * channels + c)] = fuse ? kernels::silu(acc) : acc;
                }
              }
              for (const detail::KernelIsa isa : isas) {
                for (const bool tap_major : {false, true}) {
                  Vec out(want.size());
                  with_kernel_isa(isa, [&] {
                    if (tap_major) {
                      causal_conv1d_taps(storage.data(), channels, kernel, q, layout[0], layout[1], taps.data(), b,
                                         fuse, out.data());
                    } else {
                      causal_conv1d(storage.data(), channels, kernel, q, layout[0], layout[1], weight.data(), b, fuse,
                                    out.data());
                    }
                  });
                  EXPECT_TRUE(same_bits(out, want))
                      << "channels " << channels << " kernel " << kernel << " q " << q << " channel stride "
                      << layout[0] << " fuse " << fuse << " bias " << (b != nullptr) << " tap-major " << tap_major
                      << ", " << isa_name(isa);
                }
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace rwd::runtime::kernels
