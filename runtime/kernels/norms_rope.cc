// The normalisations (RMS norm, its gated form, l2 normalisation) and RoPE:
// the angle tables (RopeTable, RopeCache) and the rotation. The rows of both
// run in a copy per instruction set (kernel_isa.h).
#include <algorithm>
#include <atomic>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "internal.h"

namespace rwd::runtime::kernels {

using namespace detail;

namespace {

// dot_inline(x, x, n) on vectors: lane l of the one Lanes accumulator is
// dot_inline's partial sum l (a rounded multiply, then a rounded add, in
// order of i), then the same combine and the same in-order tail. Eight
// partial sums in every copy: the AVX-512 one gains nothing here, because a
// wider accumulator would change the order of the sum.
REWIND_INLINE float sum_squares_lanes(const float* x, int64_t n) {
  Lanes acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Lanes v = load_lanes(x + i);
    acc += v * v;
  }
  float partial[kLanes];
  __builtin_memcpy(partial, &acc, sizeof acc);
  float s = combine(partial);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// Which normalisation a row gets (kernels.h): rms_norm, gated_rms_norm or
// l2_normalize.
enum class NormKind { Rms, Gated, L2 };

// One row: x, z (Gated only), weight (not L2), y (x itself for L2); or,
// passed to norm_rows, the first of `rows` rows dim floats apart.
struct NormRow {
  NormKind kind;
  const float* x;
  const float* z;
  const float* weight;
  int64_t dim;
  float eps;
  float* y;
  int64_t rows;
};

// y[i] for the row, V floats at a time (V: PanelRow, Lanes or a float):
// x * inv (L2), weight * (x * inv) (Rms), times silu(z) (Gated). Element-
// wise, so the width changes no bits; the kind is a template argument so
// that each loop holds only its own operands (the SiLU's constants stay in
// registers).
template <NormKind kKind, class V, class Bits>
REWIND_INLINE int64_t norm_apply(const NormRow& r, float inv, int64_t i) {
  constexpr int64_t kWidth = sizeof(V) / sizeof(float);
  for (; i + kWidth <= r.dim; i += kWidth) {
    V x;
    __builtin_memcpy(&x, r.x + i, sizeof x);
    V v;
    if constexpr (kKind == NormKind::L2) {
      v = x * inv;
    } else {
      V w;
      __builtin_memcpy(&w, r.weight + i, sizeof w);
      v = w * (x * inv);
      if constexpr (kKind == NormKind::Gated) {
        V z;
        __builtin_memcpy(&z, r.z + i, sizeof z);
        v = v * silu_of<V, Bits>(z);
      }
    }
    __builtin_memcpy(r.y + i, &v, sizeof v);
  }
  return i;
}

// The element-wise part 16 floats at a time when `kWide` (one AVX-512
// vector), then 8 (one AVX2 vector), then one by one.
template <NormKind kKind, bool kWide>
REWIND_INLINE void norm_apply_all(const NormRow& r, float inv) {
  int64_t i = 0;
  if constexpr (kWide) i = norm_apply<kKind, PanelRow, PanelRowBits>(r, inv, i);
  i = norm_apply<kKind, Lanes, ULanes>(r, inv, i);
  norm_apply<kKind, float, std::uint32_t>(r, inv, i);
}

// The row: 1 / sqrt(mean(x^2) + eps) in f32 like transformers (Rms, Gated)
// or 1 / sqrt(sum(x^2) + eps) (L2), then the element-wise part.
template <bool kWide>
REWIND_INLINE void norm_row_body(const NormRow& r) {
  const float sum = sum_squares_lanes(r.x, r.dim);
  // Only the gated form's SiLU runs 16 floats wide in the AVX-512 copy: the
  // plain products are a small part of a row next to its sum of squares.
  if (r.kind == NormKind::L2) {
    norm_apply_all<NormKind::L2, false>(r, 1.0f / std::sqrt(sum + r.eps));
    return;
  }
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(r.dim) + r.eps);
  if (r.kind == NormKind::Gated) {
    norm_apply_all<NormKind::Gated, kWide>(r, inv);
  } else {
    norm_apply_all<NormKind::Rms, false>(r, inv);
  }
}

// RoPE on one row's heads (kernels.h: rope_inplace), pairs (j, j + half)
// V floats at a time: per element x1 * cos - x2 * sin and x2 * cos + x1 *
// sin, each product rounded, then the add. A vector never reaches past
// `half`, so its loads of x1 and x2 never overlap its stores.
template <class V>
REWIND_INLINE int64_t rope_apply(float* xh, const float* cos_t, const float* sin_t, int64_t half, int64_t j) {
  constexpr int64_t kWidth = sizeof(V) / sizeof(float);
  for (; j + kWidth <= half; j += kWidth) {
    V x1, x2, c, s;
    __builtin_memcpy(&x1, xh + j, sizeof x1);
    __builtin_memcpy(&x2, xh + j + half, sizeof x2);
    __builtin_memcpy(&c, cos_t + j, sizeof c);
    __builtin_memcpy(&s, sin_t + j, sizeof s);
    const V y1 = x1 * c - x2 * s;
    const V y2 = x2 * c + x1 * s;
    __builtin_memcpy(xh + j, &y1, sizeof y1);
    __builtin_memcpy(xh + j + half, &y2, sizeof y2);
  }
  return j;
}

template <bool kWide>
REWIND_INLINE void rope_row_body(float* x, int64_t heads, int64_t head_dim, const float* cos_t, const float* sin_t,
                                 int64_t half) {
  for (int64_t h = 0; h < heads; ++h) {
    float* xh = x + h * head_dim;
    int64_t j = 0;
    if constexpr (kWide) j = rope_apply<PanelRow>(xh, cos_t, sin_t, half, j);
    j = rope_apply<Lanes>(xh, cos_t, sin_t, half, j);
    rope_apply<float>(xh, cos_t, sin_t, half, j);
  }
}

// Row after row (one call per group of rows, not per row: a row of 128
// costs only a few dozen cycles).
template <bool kWide>
REWIND_INLINE void norm_rows_body(const NormRow& first) {
  NormRow r = first;
  for (int64_t k = 0; k < first.rows; ++k) {
    norm_row_body<kWide>(r);
    r.x += r.dim;
    if (r.z != nullptr) r.z += r.dim;
    r.y += r.dim;
  }
}

// The copies per instruction set (kernel_isa.h), each only calling its body
// (Clang checks the vector ABI of calls made directly from a function whose
// target differs from its callee's). The baseline keeps to 8-float vectors
// (two SSE registers each).
void norm_rows_baseline(const NormRow& r) { norm_rows_body<false>(r); }
void rope_row_baseline(float* x, int64_t heads, int64_t head_dim, const float* cos_t, const float* sin_t,
                       int64_t half) {
  rope_row_body<false>(x, heads, head_dim, cos_t, sin_t, half);
}
#if defined(REWIND_KERNEL_ISA_COPIES)
REWIND_TARGET_AVX2
void norm_rows_avx2(const NormRow& r) { norm_rows_body<false>(r); }
REWIND_TARGET_AVX2
void rope_row_avx2(float* x, int64_t heads, int64_t head_dim, const float* cos_t, const float* sin_t, int64_t half) {
  rope_row_body<false>(x, heads, head_dim, cos_t, sin_t, half);
}
REWIND_TARGET_AVX512
void norm_rows_avx512(const NormRow& r) { norm_rows_body<true>(r); }
REWIND_TARGET_AVX512
void rope_row_avx512(float* x, int64_t heads, int64_t head_dim, const float* cos_t, const float* sin_t, int64_t half) {
  rope_row_body<true>(x, heads, head_dim, cos_t, sin_t, half);
}
#endif

void norm_rows(const NormRow& r) {
  switch (kernel_isa()) {
#if defined(REWIND_KERNEL_ISA_COPIES)
    case KernelIsa::Avx512: norm_rows_avx512(r); return;
    case KernelIsa::Avx2: norm_rows_avx2(r); return;
#endif
    default: norm_rows_baseline(r); return;
  }
}

// All of `all`'s rows, in groups of kGroup rows per task (a row's result
// does not depend on its group).
void norm_all(const NormRow& all) {
  constexpr int64_t kGroup = 8;
  parallel_for((all.rows + kGroup - 1) / kGroup, all.rows * all.dim >= kParallelWork, [&](int64_t g) {
    const int64_t first = g * kGroup;
    NormRow r = all;
    r.x += first * all.dim;
    if (r.z != nullptr) r.z += first * all.dim;
    r.y += first * all.dim;
    r.rows = std::min(kGroup, all.rows - first);
    norm_rows(r);
  });
}

void rope_row(float* x, int64_t heads, int64_t head_dim, const float* cos_t, const float* sin_t, int64_t half) {
  switch (kernel_isa()) {
#if defined(REWIND_KERNEL_ISA_COPIES)
    case KernelIsa::Avx512: rope_row_avx512(x, heads, head_dim, cos_t, sin_t, half); return;
    case KernelIsa::Avx2: rope_row_avx2(x, heads, head_dim, cos_t, sin_t, half); return;
#endif
    default: rope_row_baseline(x, heads, head_dim, cos_t, sin_t, half); return;
  }
}

}  // namespace

void rms_norm(const float* x, const float* weight, int64_t rows, int64_t dim, double eps, float* y) {
  norm_all({NormKind::Rms, x, nullptr, weight, dim, static_cast<float>(eps), y, rows});
}

void gated_rms_norm(const float* x, const float* z, const float* weight, int64_t rows, int64_t dim, double eps,
                    float* y) {
  norm_all({NormKind::Gated, x, z, weight, dim, static_cast<float>(eps), y, rows});
}

void l2_normalize(float* x, int64_t rows, int64_t dim, float eps) {
  norm_all({NormKind::L2, x, nullptr, nullptr, dim, eps, x, rows});
}

namespace {

// theta^(-2j / rotary_dim) for j < rotary_dim / 2.
std::vector<double> rope_inv_freq(double theta, int64_t rotary_dim) {
  std::vector<double> inv_freq(static_cast<std::size_t>(rotary_dim / 2));
  for (std::size_t j = 0; j < inv_freq.size(); ++j) {
    inv_freq[j] = std::pow(theta, -2.0 * static_cast<double>(j) / static_cast<double>(rotary_dim));
  }
  return inv_freq;
}

// The angles of one position: a function of the position alone, so a row
// at position p is rotated by the same f32 values whatever else is in the
// call, and whether or not they came from a RopeCache.
void rope_angles(int64_t position, const std::vector<double>& inv_freq, float* cos_out, float* sin_out) {
  const double pos = static_cast<double>(position);
  for (std::size_t j = 0; j < inv_freq.size(); ++j) {
    const double angle = pos * inv_freq[j];
    cos_out[j] = static_cast<float>(std::cos(angle));
    sin_out[j] = static_cast<float>(std::sin(angle));
  }
}

}  // namespace

// Block b holds positions [b * kBlockPositions, (b + 1) * kBlockPositions),
// each as half cos values then half sin values. A block is written once,
// under the mutex, before its pointer is published; readers take the
// pointer with acquire and never wait once it is there.
struct RopeCache::Blocks {
  static constexpr int64_t kCount = kMaxPositions / kBlockPositions;
  std::mutex mutex;
  std::atomic<const float*> ready[kCount] = {};
  std::vector<std::unique_ptr<float[]>> owned;
};

RopeCache::RopeCache(double theta, int64_t rotary_dim)
    : theta_(theta), inv_freq_(rope_inv_freq(theta, rotary_dim)), blocks_(std::make_unique<Blocks>()) {
  assert(rotary_dim % 2 == 0 && rotary_dim >= 0);
}

RopeCache::RopeCache(std::vector<double> inv_freq)
    : theta_(0.0), inv_freq_(std::move(inv_freq)), blocks_(std::make_unique<Blocks>()) {}

RopeCache::~RopeCache() = default;

void RopeCache::angles(int64_t position, float* cos_out, float* sin_out) const {
  const int64_t h = half();
  if (position < 0 || position >= kMaxPositions) {
    rope_angles(position, inv_freq_, cos_out, sin_out);
    return;
  }
  const int64_t b = position / kBlockPositions;
  const float* block = blocks_->ready[b].load(std::memory_order_acquire);
  if (block == nullptr) {
    std::lock_guard<std::mutex> lock(blocks_->mutex);
    block = blocks_->ready[b].load(std::memory_order_relaxed);
    if (block == nullptr) {
      auto rows = std::make_unique<float[]>(static_cast<std::size_t>(kBlockPositions * 2 * h));
      for (int64_t i = 0; i < kBlockPositions; ++i) {
        rope_angles(b * kBlockPositions + i, inv_freq_, rows.get() + i * 2 * h, rows.get() + i * 2 * h + h);
      }
      block = rows.get();
      blocks_->owned.push_back(std::move(rows));
      blocks_->ready[b].store(block, std::memory_order_release);
    }
  }
  const float* row = block + (position - b * kBlockPositions) * 2 * h;
  std::memcpy(cos_out, row, static_cast<std::size_t>(h) * sizeof(float));
  std::memcpy(sin_out, row + h, static_cast<std::size_t>(h) * sizeof(float));
}

std::size_t RopeCache::bytes() const {
  std::lock_guard<std::mutex> lock(blocks_->mutex);
  return blocks_->owned.size() * static_cast<std::size_t>(kBlockPositions * 2 * half()) * sizeof(float);
}

RopeTable::RopeTable(const int64_t* positions, int64_t rows, double theta, int64_t rotary_dim)
    : rows_(rows), half_(rotary_dim / 2) {
  assert(rotary_dim % 2 == 0 && rows >= 0);
  const auto n = static_cast<std::size_t>(rows * half_);
  cos_.resize(n);
  sin_.resize(n);
  const std::vector<double> inv_freq = rope_inv_freq(theta, rotary_dim);
  for (int64_t r = 0; r < rows; ++r)
    rope_angles(positions[r], inv_freq, cos_.data() + r * half_, sin_.data() + r * half_);
}

RopeTable::RopeTable(const int64_t* positions, int64_t rows, const RopeCache& cache)
    : rows_(rows), half_(cache.half()) {
  assert(rows >= 0);
  const auto n = static_cast<std::size_t>(rows * half_);
  cos_.resize(n);
  sin_.resize(n);
  for (int64_t r = 0; r < rows; ++r) cache.angles(positions[r], cos_.data() + r * half_, sin_.data() + r * half_);
}

void rope_inplace(float* x, int64_t rows, int64_t heads, int64_t head_dim, const RopeTable& table) {
  const int64_t half = table.half();
  assert(rows <= table.rows() && 2 * half <= head_dim);
  parallel_for(rows, rows * heads * head_dim >= kParallelWork, [&](int64_t r) {
    const float* cos_t = table.cos(r);
    const float* sin_t = table.sin(r);
    rope_row(x + r * heads * head_dim, heads, head_dim, cos_t, sin_t, half);
  });
}

void rope_inplace(float* x, int64_t rows, int64_t heads, int64_t head_dim, const int64_t* positions, double theta,
                  int64_t rotary_dim) {
  if (rotary_dim == 0) rotary_dim = head_dim;
  assert(rotary_dim % 2 == 0 && rotary_dim <= head_dim);
  rope_inplace(x, rows, heads, head_dim, RopeTable(positions, rows, theta, rotary_dim));
}

}  // namespace rwd::runtime::kernels
