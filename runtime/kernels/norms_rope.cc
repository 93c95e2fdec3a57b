// The normalisations (RMS norm, its gated form, l2 normalisation) and RoPE:
// the angle tables (RopeTable, RopeCache) and the rotation.
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

// 1 / sqrt(mean(x^2) + eps) of one row, in f32 like transformers.
float rms_inverse(const float* x, int64_t dim, double eps) {
  const float mean = dot_inline(x, x, dim) / static_cast<float>(dim);
  return 1.0f / std::sqrt(mean + static_cast<float>(eps));
}

// One row of gated_rms_norm, given the row's 1 / rms.
REWIND_INLINE void gated_norm_row_body(const float* x, const float* z, const float* weight, float inv, int64_t dim,
                                       float* y) {
  int64_t i = 0;
  for (; i + kLanes <= dim; i += kLanes) {
    const Lanes v = (load_lanes(weight + i) * (load_lanes(x + i) * broadcast<Lanes>(inv))) *
                    silu_lanes(load_lanes(z + i));
    __builtin_memcpy(y + i, &v, sizeof v);
  }
  for (; i < dim; ++i) y[i] = (weight[i] * (x[i] * inv)) * silu(z[i]);
}

REWIND_KERNEL_CLONES
void gated_norm_row(const float* x, const float* z, const float* weight, float inv, int64_t dim, float* y) {
  gated_norm_row_body(x, z, weight, inv, dim, y);
}

}  // namespace

void rms_norm(const float* x, const float* weight, int64_t rows, int64_t dim, double eps, float* y) {
  parallel_for(rows, rows * dim >= kParallelWork, [&](int64_t r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    const float inv = rms_inverse(xr, dim, eps);
    for (int64_t i = 0; i < dim; ++i) yr[i] = weight[i] * (xr[i] * inv);
  });
}

void gated_rms_norm(const float* x, const float* z, const float* weight, int64_t rows, int64_t dim, double eps,
                    float* y) {
  parallel_for(rows, rows * dim >= kParallelWork, [&](int64_t r) {
    const float* xr = x + r * dim;
    const float* zr = z + r * dim;
    float* yr = y + r * dim;
    gated_norm_row(xr, zr, weight, rms_inverse(xr, dim, eps), dim, yr);
  });
}

void l2_normalize(float* x, int64_t rows, int64_t dim, float eps) {
  parallel_for(rows, rows * dim >= kParallelWork, [&](int64_t r) {
    float* xr = x + r * dim;
    const float inv = 1.0f / std::sqrt(dot_inline(xr, xr, dim) + eps);
    for (int64_t i = 0; i < dim; ++i) xr[i] *= inv;
  });
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
    for (int64_t h = 0; h < heads; ++h) {
      float* xh = x + (r * heads + h) * head_dim;
      for (int64_t j = 0; j < half; ++j) {
        const float x1 = xh[j];
        const float x2 = xh[j + half];
        xh[j] = x1 * cos_t[j] - x2 * sin_t[j];
        xh[j + half] = x2 * cos_t[j] + x1 * sin_t[j];
      }
    }
  });
}

void rope_inplace(float* x, int64_t rows, int64_t heads, int64_t head_dim, const int64_t* positions, double theta,
                  int64_t rotary_dim) {
  if (rotary_dim == 0) rotary_dim = head_dim;
  assert(rotary_dim % 2 == 0 && rotary_dim <= head_dim);
  rope_inplace(x, rows, heads, head_dim, RopeTable(positions, rows, theta, rotary_dim));
}

}  // namespace rwd::runtime::kernels
