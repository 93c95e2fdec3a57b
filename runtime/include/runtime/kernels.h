// runtime/kernels.h: the f32 compute kernels of the reference runtime.
//
// Contract: every kernel is batch invariant. The bits of one output row (one
// token) depend only on that row's inputs and on the sizes that define the
// operation (in, dim, head_dim, ...), never on how many rows are processed
// in the same call, on their order, or on the number of threads.
// Speculative decoding relies on this: verifying K + 1 draft tokens in one
// forward must give exactly the logits of K + 1 single-token forwards, so
// speculative and greedy decoding emit the same tokens bit for bit.
//
// How it is kept: every reduction has one fixed order (8 partial sums over
// the reduced index, combined in a fixed tree, then the remainder in order,
// or a plain in-order sum), chosen by the sizes that define the operation
// only; code paths specialised for a number of rows (matmul's row groups)
// do exactly the same IEEE operations in the same order; and threads only
// split independent outputs, never a reduction. Do not build this file with
// -ffast-math (it lets the compiler reassociate sums differently per path)
// nor with floating-point contraction: the runtime's CMake passes
// -ffp-contract=off so that a * b + c is never fused in one path and not in
// another. Where a fused multiply-add is wanted (matmul), it is written as
// one, in every path. Hot loops also exist as AVX2 / AVX-512 copies chosen
// once per process; they do the same operations in the same order, so
// their results equal the baseline's bit for bit.
//
// Conventions: f32, row-major, contiguous unless strides are given; sizes
// and strides count elements. Arguments are not validated (hot path); the
// REQUIRES lines are the caller's obligations (checked by assert in debug
// builds where cheap). Outputs must not alias inputs unless stated.
// Depends on the C++ standard library, OpenMP (its thread-count setting
// only: the threads are the kernels' own pool) and rewind/dtype.h only.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "rewind/dtype.h"

#if defined(__GNUC__)
#define REWIND_ALWAYS_INLINE __attribute__((always_inline)) inline
#else
#define REWIND_ALWAYS_INLINE inline
#endif

namespace rwd::runtime::kernels {

// ---- scalar activations ---------------------------------------------------

// 1 / (1 + exp(-x)) without overflow for large |x|.
inline float sigmoid(float x) {
  if (x >= 0.0f) return 1.0f / (1.0f + std::exp(-x));
  const float e = std::exp(x);
  return e / (1.0f + e);
}

// v in every lane of F (float or a GCC vector of floats; v itself for float).
template <class F>
REWIND_ALWAYS_INLINE F broadcast(float v) {
  return F{} + v;
}

// e^x in f32 without a libm call, as branch-free code the compiler
// vectorises (attention's softmax and every SiLU need thousands per token):
// x = k ln2 + r with k = round(x / ln2) (ln2 split in two parts so that r is
// exact), e^r by its degree-7 Taylor polynomial, 2^k set in the exponent
// bits. Within 1.3 ulp of e^x for x in [-87, 88] (checked for every f32
// there); 0 below -87 (results under about 1.6e-38 are flushed) and +inf
// above 88; NaN stays NaN. Deterministic: the same bits on every path.
// F is float or a GCC vector of floats (the kernels' 8-lane loops) and U
// the unsigned integer type of the same shape: one definition, so every
// lane computes exactly what the scalar version computes. Always inlined,
// like everything it calls: an out-of-line copy would be compiled for the
// baseline ISA and receive the AVX2 clones' vectors with the wrong calling
// convention (unoptimised builds do not inline otherwise).
template <class F, class U>
REWIND_ALWAYS_INLINE F exp_of(F x) {
  F xc = x > broadcast<F>(88.0f) ? broadcast<F>(88.0f) : x;
  xc = xc < broadcast<F>(-87.0f) ? broadcast<F>(-87.0f) : xc;
  // Adding 1.5 * 2^23 rounds to an integer held in the low mantissa bits.
  const F t = xc * broadcast<F>(1.44269504088896341f) + broadcast<F>(12582912.0f);
  const F kf = t - broadcast<F>(12582912.0f);
  const F r = (xc - kf * broadcast<F>(0.693145751953125f)) - kf * broadcast<F>(1.42860682030941723e-6f);
  F p = broadcast<F>(1.0f / 5040.0f);
  p = p * r + broadcast<F>(1.0f / 720.0f);
  p = p * r + broadcast<F>(1.0f / 120.0f);
  p = p * r + broadcast<F>(1.0f / 24.0f);
  p = p * r + broadcast<F>(1.0f / 6.0f);
  p = p * r + broadcast<F>(0.5f);
  p = p * r + broadcast<F>(1.0f);
  p = p * r + broadcast<F>(1.0f);
  U bits;
  std::memcpy(&bits, &t, sizeof bits);
  const U scale_bits = (bits - 0x4B400000u + 127u) << 23;  // k + 127 in the exponent
  F scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  F e = p * scale;
  e = x > broadcast<F>(88.0f) ? broadcast<F>(std::numeric_limits<float>::infinity()) : e;
  e = x < broadcast<F>(-87.0f) ? broadcast<F>(0.0f) : e;
  return e;
}

inline float exp_f32(float x) { return exp_of<float, std::uint32_t>(x); }

// x * sigmoid(x), written as PyTorch's x / (1 + exp(-x)) with exp_of;
// exp overflowing to inf for very negative x gives the correct limit -0.
// F, U as for exp_of.
template <class F, class U>
REWIND_ALWAYS_INLINE F silu_of(F x) {
  return x / (broadcast<F>(1.0f) + exp_of<F, U>(-x));
}

inline float silu(float x) { return silu_of<float, std::uint32_t>(x); }

// log(1 + exp(x)) with PyTorch's threshold (beta 1, threshold 20): returns x
// above 20, where exp would dominate and could overflow.
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// ---- dense linear algebra ---------------------------------------------------

// A weight matrix w: [out, in] (nn.Linear layout) repacked for matmul.
// Output features are grouped in panels of kPanelWidth = 16; panel p stores
// w[p * 16 + l, i] at element i * 16 + l (zeros past `out`), so the kernel
// streams each panel front to back and one load of it (one AVX-512 vector,
// two AVX2 ones) serves sixteen outputs and several input rows. The elements
// keep the checkpoint's dtype: f32, bf16 or f16. Half-precision panels take
// half the bytes, and matmul widens each weight to f32 as it loads it (bf16:
// a shift; f16: the CPU's F16C conversion, or the same exact conversion in
// integer and f32 operations where it has none). Widening is exact, so the
// products and sums, and the results, are bit for bit those of the f32
// matrix of the same values. Or the elements are Q8 (from_q8): int8 in
// blocks of kQ8Block = 32 consecutive inputs of one output, each block with
// one bf16 scale s, the weight standing for q * s (docs/quantization.md).
// Panel p then holds, per block b of inputs: the 16 lanes' scales (bf16,
// 32 bytes), then 512 bytes of values: w[p * 16 + l, b * 32 + k] at
// q8_value_offset(l, k), as the byte q + 128 (groups of 4 consecutive inputs
// of one output in 4 bytes, 16 outputs per 64 bytes: the operand layout of
// an int8 dot-product instruction; 128, q = 0, past `out` and past `in`).
// matmul multiplies such a matrix with activations quantized the same way
// (docs/quantization.md, "Kernels"): per row and block, int8 values and an
// f32 scale, the block's products summed exactly in int32, then scaled and
// accumulated in f32; identical bits in every instruction-set copy, and
// each row's results independent of the other rows. Holds 64-byte aligned
// storage of its own (the source can be freed after packing); movable, not
// copyable.
class PackedMatrix {
 public:
  static constexpr std::int64_t kPanelWidth = 16;
  // Inputs per Q8 block, and the bytes of one block of a Q8 panel (16 bf16
  // scales, then 32 x 16 int8).
  static constexpr std::int64_t kQ8Block = 32;
  static constexpr std::int64_t kQ8BlockBytes = kPanelWidth * 2 + kQ8Block * kPanelWidth;
  // Where, in one block of a Q8 panel, the value of lane l (output) and input
  // k of the block lies. REQUIRES: 0 <= l < 16, 0 <= k < 32.
  static constexpr std::int64_t q8_value_offset(std::int64_t l, std::int64_t k) {
    return kPanelWidth * 2 + k / 4 * (4 * kPanelWidth) + l * 4 + k % 4;
  }
  // The value q a stored Q8 byte (q + 128) stands for.
  static constexpr std::int8_t q8_value(std::byte stored) {
    return static_cast<std::int8_t>(static_cast<int>(stored) - 128);
  }
  // How the elements are stored.
  enum class Element : std::uint8_t { F32, BF16, F16, Q8 };

  // An empty 0 x 0 matrix.
  PackedMatrix() = default;
  // Copies w: [out, in] into f32 panels. REQUIRES: out, in >= 0; w points to
  // out * in floats (may be null when that is 0). Throws std::bad_alloc.
  PackedMatrix(const float* w, std::int64_t out, std::int64_t in);
  // Copies w: [out, in] of bfloat16 bit patterns into bf16 panels. REQUIRES
  // as above (out * in uint16 values). Throws std::bad_alloc.
  static PackedMatrix from_bf16(const std::uint16_t* w, std::int64_t out, std::int64_t in);
  // Copies w: [out, in] of IEEE binary16 bit patterns into f16 panels.
  // REQUIRES as above (out * in uint16 values). Throws std::bad_alloc.
  static PackedMatrix from_f16(const std::uint16_t* w, std::int64_t out, std::int64_t in);
  // Quantizes w: [out, in] of `source` (F32: floats; BF16 / F16: uint16 bit
  // patterns, widened exactly) into Q8 panels: per block of 32 inputs of one
  // output, s = the smallest bf16 >= max|w| / 127 (0 for an all-zero
  // block) and q = the integer in [-127, 127] nearest to w / s, so that
  // |w - q * s| <= s / 2 for every weight. A non-finite weight has no Q8
  // value: the pass that quantizes also looks for one, and on meeting it
  // stores its index o * in + i in *non_finite and returns the empty matrix
  // (*non_finite is -1 otherwise), or throws InvalidArgument naming [o, i]
  // when non_finite is null. REQUIRES: source is not Q8; out, in and w as
  // for the other constructors. Throws std::bad_alloc.
  static PackedMatrix from_q8(const void* w, Element source, std::int64_t out, std::int64_t in,
                              std::int64_t* non_finite = nullptr);
  // Q8 panels from blocks already quantized (a Q8 checkpoint): q: [out, in]
  // int8 values, row-major; scales: [out, ceil(in / 32)] bf16 bit patterns,
  // row-major, as little-endian bytes (possibly unaligned). Copies them
  // into the layout from_q8 makes, so from_q8_blocks of q8_row()'s output
  // is the matrix itself, byte for byte. REQUIRES: out, in >= 0. Throws
  // std::bad_alloc.
  static PackedMatrix from_q8_blocks(const std::int8_t* q, const std::byte* scales, std::int64_t out, std::int64_t in);
  // The out x in matrix of `element` whose panels are the bytes at `data`
  // (bytes() of them, as storage() gives them), used in place: nothing is
  // copied, and `owner` (a mapped pack file, runtime/pack_file.h) keeps
  // them valid for as long as the matrix or a matrix moved from it lives.
  // REQUIRES: out, in >= 0; data is 64-byte aligned (or null when bytes()
  // is 0) and stays unchanged.
  static PackedMatrix view_of(std::shared_ptr<const void> owner, const std::byte* data, Element element,
                              std::int64_t out, std::int64_t in);
  // A moved-from matrix is the empty 0 x 0 one.
  PackedMatrix(PackedMatrix&& other) noexcept
      : owned_(std::move(other.owned_)), owner_(std::move(other.owner_)), data_(std::exchange(other.data_, nullptr)),
        out_(std::exchange(other.out_, 0)), in_(std::exchange(other.in_, 0)),
        element_(std::exchange(other.element_, Element::F32)) {}
  PackedMatrix& operator=(PackedMatrix&& other) noexcept {
    owned_ = std::move(other.owned_);
    owner_ = std::move(other.owner_);
    data_ = std::exchange(other.data_, nullptr);
    out_ = std::exchange(other.out_, 0);
    in_ = std::exchange(other.in_, 0);
    element_ = std::exchange(other.element_, Element::F32);
    return *this;
  }
  PackedMatrix(const PackedMatrix&) = delete;
  PackedMatrix& operator=(const PackedMatrix&) = delete;

  std::int64_t out() const { return out_; }
  std::int64_t in() const { return in_; }
  std::int64_t panels() const { return (out_ + kPanelWidth - 1) / kPanelWidth; }
  Element element() const { return element_; }
  // Bytes of one panel: in() * 16 elements of element(), or for Q8
  // ceil(in() / 32) blocks of kQ8BlockBytes.
  std::size_t panel_bytes() const {
    if (element_ == Element::Q8) return static_cast<std::size_t>((in_ + kQ8Block - 1) / kQ8Block * kQ8BlockBytes);
    const std::size_t element = element_ == Element::F32 ? sizeof(float) : sizeof(std::uint16_t);
    return static_cast<std::size_t>(in_ * kPanelWidth) * element;
  }
  // Panel p: [in][kPanelWidth] elements of element(): floats, or uint16 bit
  // patterns; for Q8 its blocks as described above. REQUIRES: 0 <= p <
  // panels().
  const void* panel_data(std::int64_t p) const { return data_ + static_cast<std::size_t>(p) * panel_bytes(); }
  // Panel p as floats. REQUIRES: 0 <= p < panels() and element() == F32.
  const float* panel(std::int64_t p) const { return static_cast<const float*>(panel_data(p)); }
  // w[o, i] as packed (as f32; for Q8 q * s, exact). REQUIRES: 0 <= o <
  // out(), 0 <= i < in().
  float at(std::int64_t o, std::int64_t i) const {
    const std::int64_t l = o % kPanelWidth;
    if (element_ == Element::Q8) {
      const auto* block = static_cast<const std::byte*>(panel_data(o / kPanelWidth)) + i / kQ8Block * kQ8BlockBytes;
      std::uint16_t scale;
      std::memcpy(&scale, block + l * 2, sizeof scale);
      return static_cast<float>(q8_value(block[q8_value_offset(l, i % kQ8Block)])) * bf16_to_f32(scale);
    }
    const std::int64_t k = i * kPanelWidth + l;
    if (element_ == Element::F32) return panel(o / kPanelWidth)[k];
    const std::uint16_t h = static_cast<const std::uint16_t*>(panel_data(o / kPanelWidth))[k];
    return element_ == Element::BF16 ? bf16_to_f32(h) : f16_to_f32(h);
  }
  // Row o of w as f32 into dst[0, in()) (the embedding lookup of a tied
  // output matrix). REQUIRES: 0 <= o < out().
  void row(std::int64_t o, float* dst) const {
    for (std::int64_t i = 0; i < in_; ++i) dst[i] = at(o, i);
  }
  // Row o of a Q8 matrix as stored: its in() int8 values into q and its
  // ceil(in() / 32) bf16 scales into scales (from_q8_blocks' layout).
  // REQUIRES: element() == Q8; 0 <= o < out().
  void q8_row(std::int64_t o, std::int8_t* q, std::uint16_t* scales) const;
  // Bytes of the packed storage (padding included).
  std::size_t bytes() const { return static_cast<std::size_t>(panels()) * panel_bytes(); }
  // bytes() of an out x in matrix of `element`. REQUIRES: out, in >= 0.
  static std::size_t storage_bytes(Element element, std::int64_t out, std::int64_t in) {
    PackedMatrix shape;
    shape.element_ = element;
    shape.out_ = out;
    shape.in_ = in;
    return shape.bytes();
  }
  // The packed storage: every panel in order, bytes() bytes (what view_of
  // takes back).
  std::span<const std::byte> storage() const { return {data_, bytes()}; }

 private:
  struct AlignedFree {
    std::size_t alignment;  // what the block was allocated with
    void operator()(std::byte* p) const;
  };
  template <class T>
  static PackedMatrix packed_from(const T* w, std::int64_t out, std::int64_t in, Element element);
  // Allocates `bytes` of panels as this matrix's own storage (owned_ and
  // data_) and returns them for filling.
  std::byte* allocate_panels(std::size_t bytes);
  // Panels this matrix allocated, or null for a view_of.
  std::unique_ptr<std::byte[], AlignedFree> owned_;
  std::shared_ptr<const void> owner_;  // what holds a view_of's panels
  const std::byte* data_ = nullptr;    // owned_ or the viewed bytes
  std::int64_t out_ = 0;
  std::int64_t in_ = 0;
  Element element_ = Element::F32;
};

// y[r, o] = sum_i x[r, i] * w[o, i] (+ bias[o]), each sum taken in order of
// i in f32 from 0 as a chain of fused multiply-adds (s = fma(x, w, s): one
// rounding per term), the bias added last: an output's bits depend on its
// own row and weights only, on every CPU (the FMA instruction where it
// exists, fmaf elsewhere). x: [rows, w.in()], bias: [w.out()] or nullptr,
// y: [rows, w.out()]. Up to 8 rows (6 without AVX-512) share each load of a
// weight panel, and panels are visited in blocks that stay in L2 while all
// rows pass over them, so one call with K + 1 rows costs far less than K + 1
// one-row calls (the point of verifying draft tokens in one forward).
// Multithreaded over blocks of output panels. For a Q8 w the sums are
// instead int8 dot products over each row quantized per block of 32 inputs,
// scaled per block (see PackedMatrix): still each output's bits from its
// own row and weights only, on every CPU. REQUIRES: rows >= 0; y does not
// alias x.
void matmul(const float* x, std::int64_t rows, const PackedMatrix& w, float* y, const float* bias = nullptr);

// The fixed-order dot product of the norms and attention scores (matmul
// sums in order instead, see above): 8 partial sums over i, combined
// pairwise in a fixed tree, then the n % 8 remainder in order. a, b: [n].
float dot(const float* a, const float* b, std::int64_t n);

// ---- normalisation ----------------------------------------------------------

// Per row: y = weight * (x * (1 / sqrt(mean(x^2) + eps))), in f32 as
// transformers' LlamaRMSNorm computes it. Models whose norm multiplies by
// (1 + weight) (Gemma, Qwen3-Next) fold the 1 into the weight at load time:
// 1 + w in f32 is the same single rounding either way.
// x, y: [rows, dim]; weight: [dim]. y may equal x (in place).
void rms_norm(const float* x, const float* weight, std::int64_t rows, std::int64_t dim, double eps, float* y);

// Per row: y = (weight * rmsnorm(x)) * silu(z), the gated norm at the output
// of a Gated DeltaNet block (Qwen3NextRMSNormGated).
// x, z, y: [rows, dim]; weight: [dim]. y may equal x or z.
void gated_rms_norm(const float* x, const float* z, const float* weight, std::int64_t rows, std::int64_t dim,
                    double eps, float* y);

// Per row, in place: x = x * (1 / sqrt(sum(x^2) + eps)), the l2norm that
// Qwen3-Next applies to gated-delta queries and keys (eps 1e-6 inside the
// square root of the sum of squares). x: [rows, dim].
void l2_normalize(float* x, std::int64_t rows, std::int64_t dim, float eps);

// ---- position encoding ------------------------------------------------------

// The cos / sin of RoPE angles (RopeTable's formula) for positions below
// kMaxPositions, each computed once, on first use, in blocks of
// kBlockPositions positions, and kept: a model holds one, so a forward
// copies its rows instead of calling pow, sin and cos again (on the shipped
// draft, 5 % of a one-token forward). Holds at most kMaxPositions *
// rotary_dim * 4 bytes (12 MiB at the shipped models' rotary_dim 48; 192
// KiB once their first 1,024 positions have been used); what it holds is
// `bytes()`. Thread-safe; not copyable. REQUIRES: rotary_dim even, >= 0.
class RopeCache {
 public:
  static constexpr std::int64_t kBlockPositions = 256;
  static constexpr std::int64_t kMaxPositions = std::int64_t{1} << 16;

  RopeCache(double theta, std::int64_t rotary_dim);
  // The same for frequencies given per pair (scaled RoPE such as Llama 3's):
  // the angle of pair j at position p is p * inv_freq[j]. theta() is 0.
  explicit RopeCache(std::vector<double> inv_freq);
  ~RopeCache();
  RopeCache(const RopeCache&) = delete;
  RopeCache& operator=(const RopeCache&) = delete;

  // The base the frequencies came from; 0 when they were given.
  double theta() const { return theta_; }
  std::int64_t half() const { return static_cast<std::int64_t>(inv_freq_.size()); }
  // theta^(-2j / rotary_dim) (or the given frequencies) for j < half(), in double.
  const double* inv_freq() const { return inv_freq_.data(); }
  // Writes the half() cos and sin values of `position` (any int64; rows
  // outside [0, kMaxPositions) are computed, not kept).
  void angles(std::int64_t position, float* cos_out, float* sin_out) const;
  // Bytes of angle rows held now.
  std::size_t bytes() const;

 private:
  struct Blocks;
  double theta_;
  std::vector<double> inv_freq_;
  std::unique_ptr<Blocks> blocks_;
};

// The cos / sin of the RoPE angles of `rows` positions: for row r and pair
// j < rotary_dim / 2 the angle is positions[r] * theta^(-2j / rotary_dim),
// computed in double from the position alone and rounded to f32. A forward
// builds one table for its positions and rotates the queries and keys of
// every attention layer with it (the angles would otherwise be recomputed
// per layer and per tensor). REQUIRES: rows >= 0, rotary_dim even and >= 0.
class RopeTable {
 public:
  RopeTable(const std::int64_t* positions, std::int64_t rows, double theta, std::int64_t rotary_dim);
  // The same values, copied from `cache` (or computed by it).
  RopeTable(const std::int64_t* positions, std::int64_t rows, const RopeCache& cache);
  std::int64_t rows() const { return rows_; }
  std::int64_t half() const { return half_; }
  // [half] values of row r. REQUIRES: 0 <= r < rows().
  const float* cos(std::int64_t r) const { return cos_.data() + r * half_; }
  const float* sin(std::int64_t r) const { return sin_.data() + r * half_; }

 private:
  std::int64_t rows_;
  std::int64_t half_;
  std::vector<float> cos_;
  std::vector<float> sin_;
};

// Rotate-half RoPE in place (Llama / transformers convention) with the
// angles of `table`: in each head the first 2 * table.half() elements form
// pairs (j, j + half) rotated by row r's angle j; the elements after them
// pass through (partial rotary, e.g. Qwen3-Next's factor 0.25). A row's
// result depends only on its own values and position.
// x: [rows, heads, head_dim]. REQUIRES: rows <= table.rows(),
// 2 * table.half() <= head_dim.
void rope_inplace(float* x, std::int64_t rows, std::int64_t heads, std::int64_t head_dim, const RopeTable& table);

// The same with a table built for this call: positions: [rows];
// rotary_dim 0 means head_dim. REQUIRES: rotary_dim even and <= head_dim.
void rope_inplace(float* x, std::int64_t rows, std::int64_t heads, std::int64_t head_dim, const std::int64_t* positions,
                  double theta, std::int64_t rotary_dim = 0);

// ---- attention --------------------------------------------------------------

// Keys or values of consecutive positions, read in place from a strided
// buffer (such as the cache's token-major views): the head_dim contiguous
// elements of kv head h at the j-th position start at
// data + h * head_stride + j * pos_stride. For the cache's [B=1, H, n, D]
// view with strides (H*D, D, B*H*D, 1): head_stride = D, pos_stride = B*H*D.
struct StridedKV {
  const float* data = nullptr;
  std::int64_t head_stride = 0;
  std::int64_t pos_stride = 0;
};

// Which keys a query at absolute position p attends to, besides p itself and
// the positions before it: window W > 0 keeps only [p - W + 1, p] (sliding
// attention); chunk C > 0 keeps only [floor(p / C) * C, p] (chunked-local
// attention). Both 0: full causal attention.
struct AttentionMask {
  std::int64_t window = 0;
  std::int64_t chunk = 0;
};

// Grouped-query causal attention of q_len query rows at absolute positions
// pos0 .. pos0 + q_len - 1 over the keys / values of positions
// kv_offset .. kv_offset + kv_len - 1. Query head h uses kv head
// h / (num_heads / num_kv_heads); scores are scaled by 1 / sqrt(head_dim).
// The query at p attends to the positions in [lo, min(p, kv_offset+kv_len-1)]
// where lo = max(kv_offset, the mask's lower bound for p); the softmax (max
// subtracted, exponentials summed in position order) and the weighted sum of
// values run over exactly those keys, so a query's output is bitwise the same
// whether the range passed in is wider (a multi-token forward) or exactly its
// own (a single-token forward). A query with no key in range gets zeros.
// q: [q_len, num_heads, head_dim]; out: [q_len, num_heads, head_dim].
// REQUIRES: num_heads % num_kv_heads == 0; the caller passes every key its
// queries need (kv_offset <= the mask's lower bound), else they see fewer.
void attention(const float* q, std::int64_t q_len, std::int64_t pos0, std::int64_t num_heads, std::int64_t num_kv_heads,
               std::int64_t head_dim, const StridedKV& k, const StridedKV& v, std::int64_t kv_offset,
               std::int64_t kv_len, AttentionMask mask, float* out);

// Consecutive positions of keys and values held in several places (a paged
// cache's blocks): `count` positions whose kv head 0 rows start at k / v
// (their head and position strides are the attention_paged call's).
struct KVRun {
  const float* k = nullptr;
  const float* v = nullptr;
  std::int64_t count = 0;
};

// attention() over keys / values given as runs that cover positions
// kv_offset .. kv_offset + kv_len - 1 in order (the sum of the counts is
// kv_len). Bitwise the same as attention() over the same values laid out in
// one strided buffer (one code path serves both).
// k_strides / v_strides give the head and position strides (their data is
// unused).
void attention_paged(const float* q, std::int64_t q_len, std::int64_t pos0, std::int64_t num_heads,
                     std::int64_t num_kv_heads, std::int64_t head_dim, std::span<const KVRun> runs,
                     const StridedKV& k_strides, const StridedKV& v_strides, std::int64_t kv_offset,
                     std::int64_t kv_len, AttentionMask mask, float* out);

// ---- linear attention -------------------------------------------------------

// Depthwise causal convolution over a window of inputs, the form the cache's
// conv state returns: element (c, s) of the window, s in [0, K - 1 + q), is
// at window[c * channel_stride + s * time_stride] (the cache's [B=1, C, K-1+q]
// view has channel_stride 1, time_stride B * channels).
// out[t, c] = sum_{i < K} weight[c, i] * window(c, t + i) (+ bias[c]), summed
// in order of i, then silu applied when fuse_silu.
// weight: [channels, K]; bias: [channels] or nullptr; out: [q, channels].
void causal_conv1d(const float* window, std::int64_t channels, std::int64_t kernel_size, std::int64_t q,
                   std::int64_t channel_stride, std::int64_t time_stride, const float* weight, const float* bias,
                   bool fuse_silu, float* out);

// causal_conv1d with the weights tap-major, taps[i * channels + c] =
// weight[c, i] (the layout a model keeps from load on): the same bits as
// causal_conv1d on the transposed weights, and a tap is one vector load for
// a run of channels, also for the one to three rows of a decoding step.
void causal_conv1d_taps(const float* window, std::int64_t channels, std::int64_t kernel_size, std::int64_t q,
                        std::int64_t channel_stride, std::int64_t time_stride, const float* taps, const float* bias,
                        bool fuse_silu, float* out);

// One token of the Gated DeltaNet recurrence (Qwen3-Next) for one value head:
//   S = S * exp(g); kv[j] = sum_i S[i][j] k[i]; delta[j] = (v[j] - kv[j]) beta;
//   S[i][j] += k[i] delta[j]; o[j] = sum_i S[i][j] q[i].
// The caller passes q and k already L2-normalised and q already multiplied by
// 1 / sqrt(k_dim), as transformers does before its recurrent kernel.
// q, k: [k_dim]; v, o: [v_dim]; g (log decay, <= 0) and beta are scalars;
// state_in, state_out: [k_dim, v_dim]. Reads S from state_in and writes the
// new S to state_out; state_out == state_in (in place) gives the same bits.
// Sums over i run in order of i. REQUIRES: state_out either equals state_in
// or does not overlap it.
void gated_delta_rule_step(const float* q, const float* k, const float* v, float g, float beta, std::int64_t k_dim,
                           std::int64_t v_dim, const float* state_in, float* state_out, float* o);

// The recurrence over `tokens` tokens for all value heads, writing every
// intermediate state (so a rollback can restore any of them):
// state_out[t] receives S(L + t + 1), the state after token t, and token t
// reads S(L + t) from state_out[t - 1] (state_in for t = 0). Value head h
// uses key head h / (num_v_heads / num_k_heads) (repeat_interleave). Parallel
// over heads; each state column gets, token by token in order, exactly the
// operations gated_delta_rule_step does (a head's columns go through all its
// tokens a block at a time, kept in L1), so processing q tokens in one call
// or in q calls gives the same bits.
// q, k: [tokens, num_k_heads, k_dim] (normalised, q scaled, as above);
// v: [tokens, num_v_heads, v_dim]; g, beta: [tokens, num_v_heads];
// state_in and each state_out[t]: [num_v_heads, k_dim, v_dim];
// out: [tokens, num_v_heads, v_dim].
// REQUIRES: num_v_heads % num_k_heads == 0; any two of state_in and the
// state_out[t] are either the same pointer (in place, as the cache hands out
// without recording) or do not overlap.
void gated_delta_rule(const float* q, const float* k, const float* v, const float* g, const float* beta,
                      std::int64_t tokens, std::int64_t num_v_heads, std::int64_t num_k_heads, std::int64_t k_dim,
                      std::int64_t v_dim, const float* state_in, float* const* state_out, float* out);

// ---- element-wise and sampling helpers ----------------------------------------

// x[i] = silu(x[i]) for i < n.
void silu_inplace(float* x, std::int64_t n);

// out[i] = silu(gate[i]) * up[i] for i < n (the SwiGLU MLP activation).
// out may equal gate or up.
void swiglu(const float* gate, const float* up, std::int64_t n, float* out);

// y[i] += x[i] for i < n (residual connections).
void add_inplace(float* y, const float* x, std::int64_t n);

// x[i] *= s for i < n.
void scale_inplace(float* x, std::int64_t n, float s);

// Index of the largest of x[0..n), the first one on ties (greedy decoding).
// NaNs never win; returns 0 when n <= 0 or every element is NaN.
std::int64_t argmax(const float* x, std::int64_t n);

// y = softmax(x) over n elements for sampling: max subtracted, exponentials
// summed in index order in double. y may equal x.
// REQUIRES: n >= 1 and at least one finite element.
void softmax(const float* x, std::int64_t n, float* y);

}  // namespace rwd::runtime::kernels
