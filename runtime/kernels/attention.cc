// Grouped-query causal attention, over one strided buffer (attention) or
// paged runs of keys and values (attention_paged): one code path serves
// both. Queries of one row that share a KV head go in pairs, rows of one KV
// head go through the keys block by block, and the softmax's exponentials
// and sums run in position order, so a query's bits depend only on its own
// keys (kernels.h).
#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "internal.h"

namespace rwd::runtime::kernels {

using namespace detail;

namespace {

typedef float Quad __attribute__((vector_size(4 * sizeof(float))));

// s[u] += x[i] * k[u * stride + i] for i from i0 to n - 1, in order: dot_inline's
// tail, for four keys at once.
REWIND_INLINE void add_tails4(Quad& s, const float* x, const float* k, int64_t stride, int64_t i0, int64_t n) {
  for (int64_t i = i0; i < n; ++i) {
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u) s[u] += x[i] * k[u * stride + i];
  }
}

// The horizontal sums of a0..a3 in one pass of shuffles: lane u ends as
// ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])) of a_u,
// the very adds of dot_inline's combine (a + b and b + a are the same
// float), with the four keys' sums sharing the vectors.
REWIND_INLINE Quad combine4(Lanes a0, Lanes a1, Lanes a2, Lanes a3) {
  // h01 lane 4u + i (u < 2) = a_u[i] + a_u[i + 4]; h23 the same for a2, a3.
  const Lanes h01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11) +
                    __builtin_shufflevector(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15);
  const Lanes h23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11) +
                    __builtin_shufflevector(a2, a3, 4, 5, 6, 7, 12, 13, 14, 15);
  // pairs lane u = h_u[0] + h_u[1], lane 4 + u = h_u[2] + h_u[3].
  const Lanes pairs = __builtin_shufflevector(h01, h23, 0, 4, 8, 12, 2, 6, 10, 14) +
                      __builtin_shufflevector(h01, h23, 1, 5, 9, 13, 3, 7, 11, 15);
  return __builtin_shufflevector(pairs, pairs, 0, 1, 2, 3) + __builtin_shufflevector(pairs, pairs, 4, 5, 6, 7);
}

// {dot_inline(x, k + u * stride, n) for u < 4}, sharing the loads of x: per
// product exactly dot_inline's arithmetic (same lanes, same tree, same tail).
REWIND_INLINE Quad dot4_strided(const float* x, const float* k, int64_t stride, int64_t n) {
  const float* k0 = k;
  const float* k1 = k + stride;
  const float* k2 = k + 2 * stride;
  const float* k3 = k + 3 * stride;
  Lanes a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Lanes xv = load_lanes(x + i);
    a0 += xv * load_lanes(k0 + i);
    a1 += xv * load_lanes(k1 + i);
    a2 += xv * load_lanes(k2 + i);
    a3 += xv * load_lanes(k3 + i);
  }
  Quad s = combine4(a0, a1, a2, a3);
  add_tails4(s, x, k, stride, i, n);
  return s;
}

// dot4_strided for two queries xa, xb at once (sa: xa's four sums, sb:
// xb's), each key chunk loaded once: a 16-float vector holds xa's 8 partial
// sums in its low half and xb's in its high half, so each half does exactly
// dot_inline's arithmetic (same lanes, same tree, same tail), and one
// AVX-512 multiply and add serve both queries.
REWIND_INLINE void dot4x2_strided(const float* xa, const float* xb, const float* k, int64_t stride, int64_t n, Quad& sa,
                                  Quad& sb) {
  const float* k0 = k;
  const float* k1 = k + stride;
  const float* k2 = k + 2 * stride;
  const float* k3 = k + 3 * stride;
  PanelRow a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const PanelRow xv = __builtin_shufflevector(load_lanes(xa + i), load_lanes(xb + i), 0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                                10, 11, 12, 13, 14, 15);
    const Lanes l0 = load_lanes(k0 + i), l1 = load_lanes(k1 + i), l2 = load_lanes(k2 + i), l3 = load_lanes(k3 + i);
    a0 += xv * __builtin_shufflevector(l0, l0, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    a1 += xv * __builtin_shufflevector(l1, l1, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    a2 += xv * __builtin_shufflevector(l2, l2, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    a3 += xv * __builtin_shufflevector(l3, l3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
  }
  sa = combine4(
      __builtin_shufflevector(a0, a0, 0, 1, 2, 3, 4, 5, 6, 7), __builtin_shufflevector(a1, a1, 0, 1, 2, 3, 4, 5, 6, 7),
      __builtin_shufflevector(a2, a2, 0, 1, 2, 3, 4, 5, 6, 7), __builtin_shufflevector(a3, a3, 0, 1, 2, 3, 4, 5, 6, 7));
  sb = combine4(__builtin_shufflevector(a0, a0, 8, 9, 10, 11, 12, 13, 14, 15),
                __builtin_shufflevector(a1, a1, 8, 9, 10, 11, 12, 13, 14, 15),
                __builtin_shufflevector(a2, a2, 8, 9, 10, 11, 12, 13, 14, 15),
                __builtin_shufflevector(a3, a3, 8, 9, 10, 11, 12, 13, 14, 15));
  add_tails4(sa, xa, k, stride, i, n);
  add_tails4(sb, xb, k, stride, i, n);
}

// dot4x2_strided with 8-float vectors only (the AVX2 copy, where a 16-float
// one goes through the stack): xa's partial sums in a0..a3, xb's in
// b0..b3, each key chunk loaded once for both. Lane for lane the
// arithmetic of dot4x2_strided's halves.
REWIND_INLINE void dot4x2_strided_narrow(const float* xa, const float* xb, const float* k, int64_t stride, int64_t n,
                                         Quad& sa, Quad& sb) {
  const float* k0 = k;
  const float* k1 = k + stride;
  const float* k2 = k + 2 * stride;
  const float* k3 = k + 3 * stride;
  Lanes a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Lanes xav = load_lanes(xa + i), xbv = load_lanes(xb + i);
    const Lanes l0 = load_lanes(k0 + i), l1 = load_lanes(k1 + i), l2 = load_lanes(k2 + i), l3 = load_lanes(k3 + i);
    a0 += xav * l0;
    b0 += xbv * l0;
    a1 += xav * l1;
    b1 += xbv * l1;
    a2 += xav * l2;
    b2 += xbv * l2;
    a3 += xav * l3;
    b3 += xbv * l3;
  }
  sa = combine4(a0, a1, a2, a3);
  sb = combine4(b0, b1, b2, b3);
  add_tails4(sa, xa, k, stride, i, n);
  add_tails4(sb, xb, k, stride, i, n);
}

// For each of G queries g: out[g][0, B * 8) = sum_j e[g][j] * rows[j *
// stride + (0 .. B * 8)], in order of j from 0, with the sums held in
// registers and each row of values loaded once for all G queries. `kWide`:
// 16 floats a vector (one AVX-512 register), then one of 8; otherwise 8
// floats a vector (one AVX2 register); each lane's arithmetic is the same.
// `resume`: the sums continue from out (a previous call over the positions
// before these) instead of starting at 0; storing and reloading a sum keeps
// its bits, so splitting the positions changes nothing.
// `e_sum`, when not null: also e_sum[g] += e[g][j] in order of j, a chain of
// adds that runs alongside the products instead of in a loop of its own.
template <int B, int G, bool kWideRows>
REWIND_INLINE void weighted_sum_of_rows(const float* const* e, const float* rows, int64_t stride, int64_t n,
                                        float* const* out, bool resume, float* e_sum) {
  // 16-float vectors, then 8-float ones (one at most when kWideRows).
  constexpr int kWide = kWideRows ? B / 2 : 0, kNarrow = kWideRows ? B % 2 : B;
  PanelRow acc[G][kWide > 0 ? kWide : 1] = {};
  Lanes tail[G][kNarrow > 0 ? kNarrow : 1] = {};
  float sum[G] = {};
#pragma GCC unroll 2
  for (int g = 0; g < G; ++g) {
    if (resume) {
      if constexpr (kWide > 0) {
#pragma GCC unroll 8
        for (int b = 0; b < kWide; ++b) acc[g][b] = F32Panels::load(out[g] + b * kPanel);
      }
      if constexpr (kNarrow > 0) {
#pragma GCC unroll 8
        for (int b = 0; b < kNarrow; ++b) tail[g][b] = load_lanes(out[g] + kWide * kPanel + b * kLanes);
      }
    }
    if (e_sum != nullptr) sum[g] = e_sum[g];
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* row = rows + j * stride;
    if constexpr (kWide > 0) {
#pragma GCC unroll 8
      for (int b = 0; b < kWide; ++b) {
        const PanelRow v = F32Panels::load(row + b * kPanel);
#pragma GCC unroll 2
        for (int g = 0; g < G; ++g) acc[g][b] += e[g][j] * v;
      }
    }
    if constexpr (kNarrow > 0) {
#pragma GCC unroll 8
      for (int b = 0; b < kNarrow; ++b) {
        const Lanes v = load_lanes(row + kWide * kPanel + b * kLanes);
#pragma GCC unroll 2
        for (int g = 0; g < G; ++g) tail[g][b] += e[g][j] * v;
      }
    }
    if (e_sum != nullptr) {
#pragma GCC unroll 2
      for (int g = 0; g < G; ++g) sum[g] += e[g][j];
    }
  }
#pragma GCC unroll 2
  for (int g = 0; g < G; ++g) {
    if constexpr (kWide > 0) {
#pragma GCC unroll 8
      for (int b = 0; b < kWide; ++b) __builtin_memcpy(out[g] + b * kPanel, &acc[g][b], sizeof(PanelRow));
    }
    if constexpr (kNarrow > 0) {
#pragma GCC unroll 8
      for (int b = 0; b < kNarrow; ++b)
        __builtin_memcpy(out[g] + kWide * kPanel + b * kLanes, &tail[g][b], sizeof(Lanes));
    }
    if (e_sum != nullptr) e_sum[g] = sum[g];
  }
}

// w[j] = exp_f32(w[j] - shift) for j < n, 16 lanes at a time (when
// `kWide`), then 8, then one: the same arithmetic per lane.
template <bool kWide>
REWIND_INLINE void exp_shifted_inplace(float* w, int64_t n, float shift) {
  int64_t j = 0;
  if constexpr (kWide) {
    for (; j + kPanel <= n; j += kPanel) {
      const PanelRow e = exp_of<PanelRow, PanelRowBits>(F32Panels::load(w + j) - shift);
      __builtin_memcpy(w + j, &e, sizeof e);
    }
  }
  for (; j + kLanes <= n; j += kLanes) {
    const Lanes e = exp_lanes(load_lanes(w + j) - broadcast<Lanes>(shift));
    __builtin_memcpy(w + j, &e, sizeof e);
  }
  for (; j < n; ++j) w[j] = exp_f32(w[j] - shift);
}

// A run of consecutive key / value positions of one KV head: n rows, each
// k_pos_stride / v_pos_stride floats after the previous (see attend_group).
struct KVSegment {
  const float* k;
  const float* v;
  int64_t n;
};

// Walks the key / value rows of the segments from a key index on, issuing
// software prefetches (to L2) for the keys and values of each row it passes.
// A batch of sequences reads each sequence's keys and values once a round,
// block after block at scattered addresses: the hardware prefetchers lose
// the stream at every block, and attention waited on memory for most of its
// time (16 prompts of the shipped target while the machine's share of L3
// was a few MB). Prefetching changes no result.
struct RowPrefetcher {
  const KVSegment* segment;
  const KVSegment* segments_end;
  int64_t row;  // in *segment
  int64_t k_pos_stride, v_pos_stride, row_bytes;

  RowPrefetcher(const KVSegment* segments, int64_t num_segments, int64_t key, int64_t k_stride, int64_t v_stride,
                int64_t head_dim)
      : segment(segments), segments_end(segments + num_segments), row(key), k_pos_stride(k_stride),
        v_pos_stride(v_stride), row_bytes(head_dim * static_cast<int64_t>(sizeof(float))) {
    while (segment != segments_end && row >= segment->n) row -= (segment++)->n;
  }
  // Prefetches the next `rows` rows (fewer at the end of the segments).
  REWIND_INLINE void advance(int64_t rows) {
    for (int64_t i = 0; i < rows && segment != segments_end; ++i) {
      const char* k = reinterpret_cast<const char*>(segment->k + row * k_pos_stride);
      const char* v = reinterpret_cast<const char*>(segment->v + row * v_pos_stride);
      for (int64_t b = 0; b < row_bytes; b += 64) {
        __builtin_prefetch(k + b, 0, 2);
        __builtin_prefetch(v + b, 0, 2);
      }
      if (++row == segment->n) {
        ++segment;
        row = 0;
      }
    }
  }
};

// Rows ahead of the scoring that RowPrefetcher keeps: about one memory
// latency of scoring work (a row's scores take some 25 cycles).
constexpr int64_t kPrefetchRows = 16;

// Scores of G queries (1 or 2: heads of one row that share a KV head, hence
// the same keys) against the keys j in [begin, end) of the segments (key 0:
// the first segment's first row, rows k_pos_stride floats apart): query g's
// score of key j, times `scale`, goes to w[g][j], and its maximum into
// max4[g] (per lane of four keys) or max_score[g]. Four keys at a time
// (independent chains that overlap), each with dot_inline's arithmetic,
// then the rest one by one: a key's score does not depend on how keys are
// grouped, and a maximum does not depend on the order it is taken in
// (signed zeros aside, and exp(w - max) is the same for max = +0 and -0).
// `prefetch`: keep kPrefetchRows rows of keys and values (v_pos_stride
// floats apart) requested ahead of the scoring. `kWide`: pairs of queries
// share 16-float vectors (dot4x2_strided); otherwise 8-float ones.
template <int G, bool kWide>
REWIND_INLINE void score_keys(const float* const* qh, const KVSegment* segments, int64_t num_segments,
                              int64_t k_pos_stride, int64_t v_pos_stride, int64_t head_dim, float scale, int64_t begin,
                              int64_t end, float* const* w, Quad* max4, float* max_score, bool prefetch) {
  const Quad scale4 = Quad{} + scale;
  RowPrefetcher ahead(segments, prefetch ? num_segments : 0, begin, k_pos_stride, v_pos_stride, head_dim);
  if (prefetch) ahead.advance(kPrefetchRows);
  int64_t at = 0;  // key index of the current segment's first row
  for (int64_t s = 0; s < num_segments && at < end; at += segments[s].n, ++s) {
    const int64_t a = std::max(begin, at), b = std::min(end, at + segments[s].n);
    if (a >= b) continue;
    const float* kh = segments[s].k + (a - at) * k_pos_stride;
    const int64_t count = b - a;
    int64_t key = 0;
    for (; key + 4 <= count; key += 4) {
      ahead.advance(4);
      Quad sc[G];
      if constexpr (G == 2) {
        if constexpr (kWide) {
          dot4x2_strided(qh[0], qh[1], kh + key * k_pos_stride, k_pos_stride, head_dim, sc[0], sc[1]);
        } else {
          dot4x2_strided_narrow(qh[0], qh[1], kh + key * k_pos_stride, k_pos_stride, head_dim, sc[0], sc[1]);
        }
      } else {
        sc[0] = dot4_strided(qh[0], kh + key * k_pos_stride, k_pos_stride, head_dim);
      }
      for (int g = 0; g < G; ++g) {
        sc[g] *= scale4;
        __builtin_memcpy(w[g] + a + key, &sc[g], sizeof sc[g]);
        max4[g] = max4[g] < sc[g] ? sc[g] : max4[g];
      }
    }
    for (; key < count; ++key) {
      ahead.advance(1);
      for (int g = 0; g < G; ++g) {
        const float sc = dot_inline(qh[g], kh + key * k_pos_stride, head_dim) * scale;
        w[g][a + key] = sc;
        max_score[g] = std::max(max_score[g], sc);
      }
    }
  }
}

// o[g][0, head_dim) = sum of e[g][j] * v_j over the keys j in [begin, end)
// of the segments (numbered as in score_keys; rows v_pos_stride floats
// apart), in order of j, for G queries at once (each value row loaded once
// for both); `resume`: continuing from o (the keys before `begin`) instead
// of from 0. e_sum[g] += e[g][j] in the same order.
// Up to 64 elements of o (16-float vectors, `kWide`: AVX-512's 32
// registers; 8-float ones for one query in AVX2) or 48 (a pair of queries
// in AVX2's 16 registers: 12 sums, a row of values and the two weights)
// stay in registers for a whole pass over a segment's keys (storing o after
// every key would chain each step to the previous store); the rest goes
// element by element. Every path does the same operations per element, and
// storing and reloading a sum keeps its bits, so splitting the keys into
// calls or pieces changes nothing.
template <int G, bool kWide>
REWIND_INLINE void weighted_values(float* const* e, const KVSegment* segments, int64_t num_segments,
                                   int64_t v_pos_stride, int64_t head_dim, int64_t begin, int64_t end, bool resume,
                                   float* e_sum, float* const* o) {
  int64_t at = 0;
  for (int64_t s = 0; s < num_segments && at < end; at += segments[s].n, ++s) {
    const int64_t a = std::max(begin, at), b = std::min(end, at + segments[s].n);
    if (a >= b) continue;
    const float* vh = segments[s].v + (a - at) * v_pos_stride;
    const int64_t count = b - a;
    const float* ea[G];
    for (int g = 0; g < G; ++g) ea[g] = e[g] + a;
    int64_t d0 = 0;
    float* sum = e_sum;  // the first pass over this piece's keys adds up e
    for (; d0 + kLanes <= head_dim;) {
      constexpr int64_t kMaxVectors = kWide || G == 1 ? 8 : 6;
      const int64_t vectors = std::min<int64_t>(kMaxVectors, (head_dim - d0) / kLanes);
      const float* vd = vh + d0;
      float* od[G];
      for (int g = 0; g < G; ++g) od[g] = o[g] + d0;
      switch (vectors) {
        case 1: weighted_sum_of_rows<1, G, kWide>(ea, vd, v_pos_stride, count, od, resume, sum); break;
        case 2: weighted_sum_of_rows<2, G, kWide>(ea, vd, v_pos_stride, count, od, resume, sum); break;
        case 3: weighted_sum_of_rows<3, G, kWide>(ea, vd, v_pos_stride, count, od, resume, sum); break;
        case 4: weighted_sum_of_rows<4, G, kWide>(ea, vd, v_pos_stride, count, od, resume, sum); break;
        case 5: weighted_sum_of_rows<5, G, kWide>(ea, vd, v_pos_stride, count, od, resume, sum); break;
        case 6: weighted_sum_of_rows<6, G, kWide>(ea, vd, v_pos_stride, count, od, resume, sum); break;
        case 7: weighted_sum_of_rows<7, G, kWide>(ea, vd, v_pos_stride, count, od, resume, sum); break;
        default:
          if constexpr (kMaxVectors >= 8)
            weighted_sum_of_rows<8, G, kWide>(ea, vd, v_pos_stride, count, od, resume, sum);
          break;
      }
      sum = nullptr;
      d0 += vectors * kLanes;
    }
    for (int g = 0; g < G; ++g) {
      if (sum != nullptr) {  // head_dim < 8: no vector pass took the sum
        for (int64_t i = 0; i < count; ++i) sum[g] += ea[g][i];
      }
      for (int64_t d = d0; d < head_dim; ++d) {
        float acc = resume ? o[g][d] : 0.0f;
        for (int64_t i = 0; i < count; ++i) acc += ea[g][i] * vh[i * v_pos_stride + d];
        o[g][d] = acc;
      }
    }
    resume = true;
  }
}

// The queries of one attention row that share a KV head, taken together
// (G of them: 1 or 2): query g reads qh[g], attends to the keys [begin,
// end) of the segments (numbered as in score_keys), writes o[g] and keeps
// its softmax weights in w[g][begin, end).
struct QueryUnit {
  int G;
  int64_t begin, end;
  const float* qh[2];
  float* o[2];
  float* w[2];
};

// Units one attend_units call takes (attention_paged's tasks are sized to
// it).
constexpr int64_t kMaxUnits = 16;

// Keys per block of attend_units: a block's keys and values of one KV head
// (64 rows of up to 2 x 128 floats of head_dim 128: 64 KB; the shipped
// models' head_dim 48: 24 KB) stay in L1/L2 while every unit passes over
// them.
constexpr int64_t kKeyBlock = 64;

// Attention for the units (rows of one KV head: several for a verification
// forward or a prompt) over the same segments, key block by key block: the
// units' scores for one block, then the next; after the softmax, the same
// for the values. A query's arithmetic is the plain definition (kernels.h)
// whatever the blocks and the other units: its scores do not depend on the
// grouping of keys, its maximum not on the order, its sums of e and of e *
// v go in order of position, resuming from their stored bits at each
// block. What the blocks change is where keys and values come from: a
// block is read from L2 (or DRAM) once and then from L1 by the other rows.
// `kWide`: with 16-float vectors (the baseline and AVX-512 copies);
// otherwise with 8-float ones only (AVX2), the same arithmetic per lane.
template <bool kWide>
REWIND_INLINE void attend_units_body(QueryUnit* units, int64_t num_units, const KVSegment* segments,
                                     int64_t num_segments, int64_t k_pos_stride, int64_t v_pos_stride, int64_t head_dim,
                                     float scale, int64_t key_block) {
  int64_t first = std::numeric_limits<int64_t>::max(), last = 0;
  for (int64_t u = 0; u < num_units; ++u) {
    first = std::min(first, units[u].begin);
    last = std::max(last, units[u].end);
  }
  Quad max4[kMaxUnits][2];
  float max_score[kMaxUnits][2], sum[kMaxUnits][2];
  for (int64_t u = 0; u < num_units; ++u) {
    for (int g = 0; g < 2; ++g) {
      max4[u][g] = Quad{} - std::numeric_limits<float>::infinity();
      max_score[u][g] = -std::numeric_limits<float>::infinity();
      sum[u][g] = 0.0f;
    }
  }
  // Calls f(unit, a, b) for each unit's keys [a, b) of each block, block by
  // block. The lambdas are always inlined: otherwise they are compiled for
  // the baseline ISA and called from every clone (attention ran 10x slower).
  const auto for_each_block = [&](auto&& f) __attribute__((always_inline)) {
    for (int64_t b0 = first; b0 < last; b0 += key_block) {
      for (int64_t u = 0; u < num_units; ++u) {
        const int64_t a = std::max(b0, units[u].begin), b = std::min(b0 + key_block, units[u].end);
        if (a < b) f(u, a, b);
      }
    }
  };
  for_each_block([&](int64_t u, int64_t a, int64_t b) __attribute__((always_inline)) {
    QueryUnit& q = units[u];
    // One block of keys for every unit (a decoding row: its keys come from
    // memory): the first unit requests them ahead of use, the others find
    // them in cache. Rows of a longer prompt or verification share each key
    // block, fetched once for all of them.
    const bool prefetch = u == 0 && last - first <= key_block;
    if (q.G == 2) {
      score_keys<2, kWide>(q.qh, segments, num_segments, k_pos_stride, v_pos_stride, head_dim, scale, a, b, q.w,
                           max4[u], max_score[u], prefetch);
    } else {
      score_keys<1, kWide>(q.qh, segments, num_segments, k_pos_stride, v_pos_stride, head_dim, scale, a, b, q.w,
                           max4[u], max_score[u], prefetch);
    }
  });
  for (int64_t u = 0; u < num_units; ++u) {
    const QueryUnit& q = units[u];
    for (int g = 0; g < q.G; ++g) {
      for (int l = 0; l < 4; ++l) max_score[u][g] = std::max(max_score[u][g], max4[u][g][l]);
      // The exponentials first (a loop the compiler vectorises); their sum,
      // in order of position, is taken in the first pass over the values.
      exp_shifted_inplace<kWide>(q.w[g] + q.begin, q.end - q.begin, max_score[u][g]);
    }
  }
  for_each_block([&](int64_t u, int64_t a, int64_t b) __attribute__((always_inline)) {
    QueryUnit& q = units[u];
    if (q.G == 2) {
      weighted_values<2, kWide>(q.w, segments, num_segments, v_pos_stride, head_dim, a, b, a > q.begin, sum[u], q.o);
    } else {
      weighted_values<1, kWide>(q.w, segments, num_segments, v_pos_stride, head_dim, a, b, a > q.begin, sum[u], q.o);
    }
  });
  for (int64_t u = 0; u < num_units; ++u) {
    const QueryUnit& q = units[u];
    for (int g = 0; g < q.G; ++g) {
      const float inv_sum = 1.0f / sum[u][g];
      float* og = q.o[g];
      for_each_lane_chunked(head_dim, [&](int64_t d) { og[d] *= inv_sum; });
    }
  }
}

// The copies per instruction set (kernel_isa.h), each calling only its body.
void attend_units_baseline(QueryUnit* units, int64_t num_units, const KVSegment* segments, int64_t num_segments,
                           int64_t k_pos_stride, int64_t v_pos_stride, int64_t head_dim, float scale,
                           int64_t key_block) {
  attend_units_body<true>(units, num_units, segments, num_segments, k_pos_stride, v_pos_stride, head_dim, scale,
                          key_block);
}
#if defined(REWIND_KERNEL_ISA_COPIES)
REWIND_TARGET_AVX2
void attend_units_avx2(QueryUnit* units, int64_t num_units, const KVSegment* segments, int64_t num_segments,
                       int64_t k_pos_stride, int64_t v_pos_stride, int64_t head_dim, float scale, int64_t key_block) {
  attend_units_body<false>(units, num_units, segments, num_segments, k_pos_stride, v_pos_stride, head_dim, scale,
                           key_block);
}
REWIND_TARGET_AVX512
void attend_units_avx512(QueryUnit* units, int64_t num_units, const KVSegment* segments, int64_t num_segments,
                         int64_t k_pos_stride, int64_t v_pos_stride, int64_t head_dim, float scale, int64_t key_block) {
  attend_units_body<true>(units, num_units, segments, num_segments, k_pos_stride, v_pos_stride, head_dim, scale,
                          key_block);
}
#endif

void attend_units(QueryUnit* units, int64_t num_units, const KVSegment* segments, int64_t num_segments,
                  int64_t k_pos_stride, int64_t v_pos_stride, int64_t head_dim, float scale, int64_t key_block) {
  switch (kernel_isa()) {
#if defined(REWIND_KERNEL_ISA_COPIES)
    case KernelIsa::Avx512:
      attend_units_avx512(units, num_units, segments, num_segments, k_pos_stride, v_pos_stride, head_dim, scale,
                          key_block);
      return;
    case KernelIsa::Avx2:
      attend_units_avx2(units, num_units, segments, num_segments, k_pos_stride, v_pos_stride, head_dim, scale,
                        key_block);
      return;
#endif
    default:
      attend_units_baseline(units, num_units, segments, num_segments, k_pos_stride, v_pos_stride, head_dim, scale,
                            key_block);
      return;
  }
}

// The query at position p's own key range [lo, hi] (empty when hi < lo),
// whatever range was passed in: this is what makes the result batch
// invariant.
inline std::pair<int64_t, int64_t> key_range(int64_t p, int64_t kv_offset, int64_t kv_last, AttentionMask mask) {
  int64_t lo = kv_offset;
  if (mask.window > 0) lo = std::max(lo, p - mask.window + 1);
  if (mask.chunk > 0) lo = std::max(lo, p - p % mask.chunk);
  return {lo, std::min(p, kv_last)};
}

// The runs' parts that cover positions [first, last] of one KV head, in
// order; the runs start at position kv_offset.
inline void gather_segments(std::span<const KVRun> runs, int64_t kv_offset, int64_t first, int64_t last,
                            int64_t kv_head, const StridedKV& ks, const StridedKV& vs,
                            std::vector<KVSegment>& segments) {
  segments.clear();
  int64_t run_first = kv_offset;  // position of the current run's first row
  for (const KVRun& run : runs) {
    const int64_t a = std::max(first, run_first), b = std::min(last + 1, run_first + run.count);
    if (a < b) {
      segments.push_back({run.k + (a - run_first) * ks.pos_stride + kv_head * ks.head_stride,
                          run.v + (a - run_first) * vs.pos_stride + kv_head * vs.head_stride, b - a});
    }
    run_first += run.count;
    if (run_first > last) break;
  }
}

}  // namespace

void attention_paged(const float* q, int64_t q_len, int64_t pos0, int64_t num_heads, int64_t num_kv_heads,
                     int64_t head_dim, std::span<const KVRun> runs, const StridedKV& ks, const StridedKV& vs,
                     int64_t kv_offset, int64_t kv_len, AttentionMask mask, float* out) {
  assert(num_kv_heads > 0 && num_heads % num_kv_heads == 0);
  const int64_t group = num_heads / num_kv_heads;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  const int64_t kv_last = kv_offset + kv_len - 1;
  // Heads of one KV group go in pairs (2m, 2m + 1), which read the same keys
  // and values over the same range (same row), so each load serves both;
  // up to kRowsTogether rows of one KV head go through attend_units
  // together, so that each block of keys and values is fetched once for
  // all of them (a verification forward's rows, a prompt's).
  constexpr int64_t kRowsTogether = 8;
  const int64_t pairs = (group + 1) / 2;
  const int64_t pairs_per_task = std::min(pairs, kMaxUnits);
  const int64_t rows_per_task = std::max<int64_t>(1, std::min(kRowsTogether, kMaxUnits / pairs_per_task));
  const int64_t row_blocks = (q_len + rows_per_task - 1) / rows_per_task;
  const int64_t pair_blocks = (pairs + pairs_per_task - 1) / pairs_per_task;
  // Tasks run kv head by kv head: the queries of all rows that read the
  // same keys and values come one after another, so those stay in L2
  // instead of being fetched again for every row.
  const int64_t tasks = num_kv_heads * row_blocks * pair_blocks;
  parallel_for(tasks, q_len * num_heads * kv_len * head_dim >= kParallelWork, [&](int64_t task) {
    // Per-thread scratch for the softmax weights and the key segments,
    // reused across calls.
    thread_local std::vector<float> weights;
    thread_local std::vector<KVSegment> segments;
    const int64_t kv_head = task / (row_blocks * pair_blocks);
    const int64_t row_begin = task / pair_blocks % row_blocks * rows_per_task;
    const int64_t row_end = std::min(q_len, row_begin + rows_per_task);
    const int64_t pair_begin = task % pair_blocks * pairs_per_task;
    const int64_t pair_end = std::min(pairs, pair_begin + pairs_per_task);
    // `first` / `last`: the union of the rows' key ranges.
    int64_t first = std::numeric_limits<int64_t>::max(), last = -1;
    for (int64_t row = row_begin; row < row_end; ++row) {
      const auto [lo, hi] = key_range(pos0 + row, kv_offset, kv_last, mask);
      if (hi < lo) continue;
      first = std::min(first, lo);
      last = std::max(last, hi);
    }
    const int64_t n = last >= first ? last - first + 1 : 0;
    QueryUnit units[kMaxUnits];
    int64_t num_units = 0;
    weights.resize(static_cast<std::size_t>(2 * (row_end - row_begin) * (pair_end - pair_begin) * n));
    for (int64_t row = row_begin; row < row_end; ++row) {
      const auto [lo, hi] = key_range(pos0 + row, kv_offset, kv_last, mask);
      for (int64_t pair = pair_begin; pair < pair_end; ++pair) {
        const int64_t head = kv_head * group + 2 * pair;
        QueryUnit& unit = units[num_units];
        unit.G = static_cast<int>(std::min<int64_t>(2, kv_head * group + group - head));
        for (int g = 0; g < unit.G; ++g) {
          unit.o[g] = out + (row * num_heads + head + g) * head_dim;
          unit.qh[g] = q + (row * num_heads + head + g) * head_dim;
        }
        if (hi < lo) {
          for (int g = 0; g < unit.G; ++g) std::fill(unit.o[g], unit.o[g] + head_dim, 0.0f);
          continue;
        }
        // Keys numbered from `first`; unit u's weights at u * 2n.
        unit.begin = lo - first;
        unit.end = hi - first + 1;
        for (int g = 0; g < 2; ++g) unit.w[g] = weights.data() + (2 * num_units + g) * n;
        ++num_units;
      }
    }
    if (num_units == 0) return;
    gather_segments(runs, kv_offset, first, last, kv_head, ks, vs, segments);
    // One row alone needs no blocks (each block's pass would store and
    // reload its sums for nothing).
    const int64_t key_block = row_end - row_begin > 1 ? kKeyBlock : n;
    attend_units(units, num_units, segments.data(), static_cast<int64_t>(segments.size()), ks.pos_stride, vs.pos_stride,
                 head_dim, scale, key_block);
  });
}

void attention(const float* q, int64_t q_len, int64_t pos0, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               const StridedKV& k, const StridedKV& v, int64_t kv_offset, int64_t kv_len, AttentionMask mask,
               float* out) {
  const KVRun run{k.data, v.data, kv_len};
  attention_paged(q, q_len, pos0, num_heads, num_kv_heads, head_dim, std::span<const KVRun>(&run, 1), k, v, kv_offset,
                  kv_len, mask, out);
}

}  // namespace rwd::runtime::kernels
