// Implementation notes. Batch invariance (see kernels.h) rests on three
// rules followed everywhere below:
//  - a reduction is written once per kind (dot_inline, matmul_micro's
//    in-order sum, in-order loops) and its order depends only on the
//    reduced length;
//  - code specialised for a number of rows (matmul's row groups of 1 to 6)
//    or for a vector width (the 8-lane loops and their scalar tails) does
//    the same IEEE operations per element as every other path;
//  - work is split across threads by independent outputs (output panels,
//    (row, head) pairs, heads), never inside a sum.
// Why matmul is shaped as it is: a one-token forward of the shipped
// 2.6M-parameter target streams its weights from L3 (5.3 MB as f16 panels,
// 10.6 MB when they were held as f32; measured when f32), while
// a forward of K + 1 tokens must cost far less than K + 1 of those for
// speculative decoding to pay. Packed panels let one load of 8 weights
// serve up to 6 rows (8 outputs x 6 rows of accumulators in registers),
// which takes the multi-row case from memory-bound to close to the FP
// peak of separate multiplies and adds (measured 79-85 GFLOPS of ~91 with
// 5-6 rows on this 2.85 GHz Zen 4 core; one row: ~31 GFLOPS, L3-bound).
#include "runtime/kernels.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <type_traits>
#include <utility>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>
#include <omp.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <string_view>
#include <vector>

// Hot loops other than matmul are also compiled for AVX2 (some for AVX-512)
// and picked at load time (GCC / Clang function multiversioning). The
// clones only widen the vectors; every lane still does one rounded multiply
// and one rounded add in the same order (no FMA outside matmul, whose every
// copy fuses the same way), so each clone gives the same bits as the
// baseline.
// Sanitizer builds that instrument the ifunc resolvers themselves (TSan runs
// them before its runtime is up, and crashes) define REWIND_NO_KERNEL_CLONES.
#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(REWIND_NO_KERNEL_CLONES)
#define REWIND_KERNEL_CLONES __attribute__((target_clones("avx2", "default")))
// Kernels whose vectors are 16 floats wide (attention's weighted sum of
// values) also get an AVX-512 clone, with the same arithmetic per lane.
#define REWIND_WIDE_KERNEL_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define REWIND_KERNEL_CLONES
#define REWIND_WIDE_KERNEL_CLONES
#endif
#if defined(__GNUC__)
#define REWIND_INLINE __attribute__((always_inline)) inline
#else
#define REWIND_INLINE inline
#endif

// matmul is compiled once per instruction set it can use, each copy in a
// namespace of its own under `#pragma GCC target` (GCC on x86-64: AVX-512F,
// AVX2 + FMA + F16C, and the baseline), and one is picked per process
// (matmul_isa). Not target_clones: a clone must inline its whole call tree,
// and one function holding every row-group kernel made GCC spill the
// accumulators of some of them (two rows ran at 74 GFLOPS instead of 117).
// Elsewhere (clang: its `#pragma clang attribute` did not reach the
// templates' instantiations) only the baseline copy exists, whose fused
// multiply-adds go through fmaf: exact, about 100 times slower. Build the
// runtime with GCC.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define REWIND_MATMUL_ISA_KERNELS 1
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace rwd::runtime::kernels {
namespace {

using std::int64_t;

// Partial sums per reduction: enough independent chains to hide add latency
// and to fill two SSE or one AVX register; fixed so results do not depend
// on the ISA.
constexpr int kLanes = 8;

// Multiply-adds below which a kernel stays on the calling thread (waking the
// team costs a few microseconds).
constexpr int64_t kParallelWork = int64_t{1} << 16;

// Runs body(i) for i in [0, n), split statically across the OpenMP team when
// `worth_it` and more than one thread is allowed; otherwise on the calling
// thread without entering a parallel region at all (libgomp makes a futex
// system call per region even for a team of one, a few microseconds each,
// and a forward runs dozens of kernels). Which thread runs which i never
// changes a result: bodies write disjoint outputs.
template <class F>
void parallel_for(int64_t n, bool worth_it, F&& body) {
  if (worth_it && n > 1 && omp_get_max_threads() > 1) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) body(i);
  } else {
    for (int64_t i = 0; i < n; ++i) body(i);
  }
}

REWIND_INLINE float combine(const float (&a)[kLanes]) {
  return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7]));
}

// Always inlined so that each cloned caller gets a copy for its own ISA.
REWIND_INLINE float dot_inline(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  }
  float s = combine(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// GCC notes that passing a 32-byte vector by value changes the ABI when AVX
// is off (the SSE2 clone); these helpers are always inlined, so no call
// ever passes one.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

// kLanes floats as one GCC vector: ymm in the AVX2 clone, two xmm in the
// SSE2 baseline. Lane l of an accumulator holds partial sum l of dot_inline,
// and a * b + c on vectors is one rounded multiply and one rounded add per
// lane (the runtime is built with -ffp-contract=off), so the vector code
// does exactly dot_inline's arithmetic.
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

REWIND_INLINE Lanes load_lanes(const float* p) {
  Lanes v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// exp_of / silu_of (kernels.h) on kLanes values at once.
typedef std::uint32_t ULanes __attribute__((vector_size(kLanes * sizeof(float))));

REWIND_INLINE Lanes exp_lanes(Lanes x) { return exp_of<Lanes, ULanes>(x); }
REWIND_INLINE Lanes silu_lanes(Lanes x) { return silu_of<Lanes, ULanes>(x); }

// Calls f(j) for j in [0, n) with the main part in fixed chunks of kLanes:
// GCC's -O2 cost model vectorises only loops without a scalar epilogue, so
// element-wise loops of unknown length are written this way. For element-
// wise work the chunking changes nothing in the arithmetic.
template <class F>
REWIND_INLINE void for_each_lane_chunked(int64_t n, F&& f) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) f(j + l);
  }
  for (; j < n; ++j) f(j);
}

// 1 / sqrt(mean(x^2) + eps) of one row, in f32 like transformers.
float rms_inverse(const float* x, int64_t dim, double eps) {
  const float mean = dot_inline(x, x, dim) / static_cast<float>(dim);
  return 1.0f / std::sqrt(mean + static_cast<float>(eps));
}

// Rows of x that share one pass over the weights, and the panels each
// micro-kernel keeps in flight for that many rows: a panel row is 16 floats
// (one AVX-512 vector, two AVX2 ones), and rows * panels accumulators +
// panels weight rows + one broadcast fit the 16 registers of AVX2. One row
// alone still has 4 independent accumulator chains (2 panels x 2 halves)
// to hide the latency of the adds.
constexpr int kMaxGroupRows = 6;
constexpr int panels_for_rows(int rows) { return rows <= 2 ? 2 : 1; }
// With AVX-512's 32 registers, up to 6 rows keep four panels in flight (24
// accumulators + 4 weight rows + one broadcast) and 7 or 8 rows three (24
// accumulators + 3 + 1; with two, 8 broadcasts and 2 weight loads served
// 16 multiply-adds: 16 tokens of the 26M f32 model 11.0-11.5 -> 10.6-10.9
// ms, 8 tokens 2 % to 4 % faster, alternating runs). Four panels give
// enough independent sums to hide the latency of the fused multiply-adds
// and widen each f16 panel row for more outputs: on a Zen 4 core (one
// 512-bit FMA per cycle, vcvtph2ps beside it) the shipped target's 5-token forward went from 340 to 303 us with
// four panels at 5 rows instead of two, 6 rows 400 -> 356 us, while 8x2
// ran no faster per row than two groups of 4x4. So a matrix that is
// resident in L3 (not prefetched: the shipped models) goes through groups
// of at most 6 rows (7 rows: 4 + 3; 16 rows: 6 + 5 + 5), over L2 blocks of
// a multiple of 4 panels, and so does a streamed f16 / bf16 one (a 26M-
// parameter f16 model's 16-token forward: 9.5 -> 8.8 ms). A streamed f32
// matrix keeps groups of 8 rows over blocks of about 64 KiB (a multiple of
// 3 panels, the 8-row kernel's width): there every group
// after the first reads its block from L2 again, and one pass of 8 rows
// was faster (that model in f32, 8 tokens: 5.6 ms against 6.9 ms in groups
// of 4 + 4). Earlier, on a Zen 5 core (two 512-bit FMAs per cycle), 8 rows
// x 2 panels had gone from 188 to 231 GFLOPS against groups of at most 6
// with one panel each, and 4 panels for up to 4 rows took the 3-token
// forward from 128 to 111 us.
constexpr int kMaxWideGroupRows = 8;
constexpr int kMaxWideResidentGroupRows = 6;
constexpr int wide_panels_for_rows(int rows) { return rows <= 6 ? 4 : 3; }
// Rows per group with AVX-512: 8 for an f32 matrix streamed from memory
// (prefetched, ahead != 0), else 6.
inline int64_t wide_group_rows(PackedMatrix::Element element, int64_t ahead) {
  return ahead != 0 && element == PackedMatrix::Element::F32 ? kMaxWideGroupRows : kMaxWideResidentGroupRows;
}

// The instruction set matmul runs in this process (chosen once): AVX-512F
// where the CPU has it, else AVX2 + FMA + F16C, else the baseline.
// REWIND_MATMUL_NARROW=1 in the environment skips AVX-512, and
// REWIND_MATMUL_BASELINE=1 takes the baseline copy (make test runs the
// kernel and batch tests each way, whatever the machine has).
enum class MatmulIsa { Avx512, Avx2, Baseline };

bool environment_flag(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && std::string_view(value) == "1";
}

MatmulIsa matmul_isa() {
#if defined(REWIND_MATMUL_ISA_KERNELS)
  static const MatmulIsa isa = [] {
    if (environment_flag("REWIND_MATMUL_BASELINE")) return MatmulIsa::Baseline;
    const bool skip_avx512 = environment_flag("REWIND_MATMUL_NARROW");
    if (__builtin_cpu_supports("avx512f") && !skip_avx512) return MatmulIsa::Avx512;
    // F16C from CPUID leaf 1 (clang's __builtin_cpu_supports has no "f16c").
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c) return MatmulIsa::Avx2;
    return MatmulIsa::Baseline;
  }();
  return isa;
#else
  return MatmulIsa::Baseline;
#endif
}

// REWIND_MATMUL_F16_SOFTWARE=1 in the environment widens f16 panels with the
// software conversion whatever the CPU has (make test runs the kernel and
// batch tests that way too).
bool f16_software_forced() {
  static const bool forced = environment_flag("REWIND_MATMUL_F16_SOFTWARE");
  return forced;
}

constexpr int64_t kPanel = PackedMatrix::kPanelWidth;
typedef float PanelRow __attribute__((vector_size(kPanel * sizeof(float))));
typedef std::uint16_t PanelRow16 __attribute__((vector_size(kPanel * sizeof(std::uint16_t))));
typedef std::uint32_t PanelRowBits __attribute__((vector_size(kPanel * sizeof(std::uint32_t))));

REWIND_INLINE PanelRow bits_as_floats(PanelRowBits bits) {
  PanelRow v;
  __builtin_memcpy(&v, &bits, sizeof v);
  return v;
}

REWIND_INLINE PanelRowBits floats_as_bits(PanelRow v) {
  PanelRowBits bits;
  __builtin_memcpy(&bits, &v, sizeof bits);
  return bits;
}

// How matmul_micro loads one panel row of each stored element type: the 16
// weights of one input, widened to f32 exactly.
struct F32Panels {
  using Stored = float;
  REWIND_INLINE static PanelRow load(const float* p) {
    PanelRow v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
  }
};

// bf16 bits are the high half of the f32 bits.
struct Bf16Panels {
  using Stored = std::uint16_t;
  REWIND_INLINE static PanelRow load(const std::uint16_t* p) {
    PanelRow16 h;
    __builtin_memcpy(&h, p, sizeof h);
    return bits_as_floats(__builtin_convertvector(h, PanelRowBits) << 16);
  }
};

// IEEE binary16 to f32 without F16C, exactly (the values vcvtph2ps gives):
// a normal f16 is its exponent rebiased by 127 - 15 = 112 and its mantissa
// shifted up 13 bits; a subnormal one, m * 2^-24, is (1 + m / 1024) * 2^-14
// minus 2^-14, a subtraction of two normal floats that is exact (Sterbenz),
// so no f32 subnormal is involved (flush-to-zero modes change nothing);
// infinities and NaNs keep their payload under an all-ones exponent.
struct F16SoftwarePanels {
  using Stored = std::uint16_t;
  REWIND_INLINE static PanelRow load(const std::uint16_t* p) {
    PanelRow16 h;
    __builtin_memcpy(&h, p, sizeof h);
    const PanelRowBits u = __builtin_convertvector(h, PanelRowBits);
    const PanelRowBits magnitude = (u & 0x7FFFu) << 13;
    const PanelRowBits exponent = u & 0x7C00u;
    const PanelRowBits normal = magnitude + (112u << 23);
    const PanelRowBits subnormal =
        floats_as_bits(bits_as_floats(magnitude | (113u << 23)) - bits_as_floats(PanelRowBits{} + (113u << 23)));
    const PanelRowBits special = magnitude | 0x7F800000u;
    const PanelRowBits bits = exponent == 0 ? subnormal : (exponent == 0x7C00u ? special : normal);
    return bits_as_floats(bits | ((u & 0x8000u) << 16));
  }
};

// Output panels per block of matmul: the block's weights (about 64 KiB)
// stay in L2 while every group of rows passes over them, so each weight
// comes from memory once per call.
int64_t matmul_block_panels(int64_t in) {
  // Sized for f32 panels; f16 / bf16 ones take half of it (still L2-resident).
  const int64_t panel_bytes = std::max<int64_t>(in, 1) * kPanel * int64_t{sizeof(float)};
  return std::clamp<int64_t>(int64_t{64} * 1024 / panel_bytes, 1, 16);
}

// y[0, n) = s[0, n) + bias[0, n) where bias is not null: the short last
// panel of an output. Not inlined: in the AVX2 copy, inlined, it made GCC
// keep the accumulators of the multiply-add loop in memory.
__attribute__((noinline)) void write_partial_panel(const float* s, const float* bias, float* y, int64_t n) {
  for (int64_t l = 0; l < n; ++l) y[l] = bias != nullptr ? s[l] + bias[l] : s[l];
}

// y[0, n) = lanes [0, n) of a panel row held as one PanelRow, + bias[0, n)
// where bias is not null (n <= 16).
REWIND_INLINE void write_panel(const PanelRow* a, const float* bias, float* y, int64_t n) {
  if (n == kPanel) {
    PanelRow b = {};
    if (bias != nullptr) __builtin_memcpy(&b, bias, sizeof b);
    const PanelRow sum = bias != nullptr ? a[0] + b : a[0];
    __builtin_memcpy(y, &sum, sizeof sum);
  } else {
    float s[kPanel];
    __builtin_memcpy(s, a, sizeof s);
    write_partial_panel(s, bias, y, n);
  }
}

// The three copies of matmul's kernels (see REWIND_MATMUL_ISA_KERNELS).
// Each namespace gives matmul_micro.inc its F16Panels (how f16 panel rows
// are widened), multiply_add (its fused multiply-add), kWide (whether it
// has AVX-512's 32 registers), and Reg, kRegs, load_regs and write_panel
// (how a panel row is held in its registers).
namespace baseline {
using Reg = PanelRow;
constexpr int kRegs = 1;
template <class E>
REWIND_INLINE void load_regs(const typename E::Stored* p, Reg* out) {
  out[0] = E::load(p);
}
using F16Panels = F16SoftwarePanels;
// fmaf per lane: one rounding, as the FMA instructions of the other copies
// (a library call where the CPU has no FMA: exact, and slow).
REWIND_INLINE PanelRow multiply_add(float x, PanelRow w, PanelRow acc) {
  PanelRow out;
  for (int l = 0; l < kPanel; ++l) out[l] = __builtin_fmaf(x, w[l], acc[l]);
  return out;
}
constexpr bool kWide = false;
#include "matmul_micro.inc"
}  // namespace baseline

#if defined(REWIND_MATMUL_ISA_KERNELS)
namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f")
// A panel row is one 512-bit register here. load_regs is defined inside the
// target region, as every function that inlines this copy's loads must be.
using Reg = PanelRow;
constexpr int kRegs = 1;
template <class E>
REWIND_INLINE void load_regs(const typename E::Stored* p, Reg* out) {
  out[0] = E::load(p);
}
struct F16Panels {
  using Stored = std::uint16_t;
  REWIND_INLINE static PanelRow load(const std::uint16_t* p) {
    // The masked form with every lane set: _mm512_cvtph_ps starts from an
    // undefined vector that GCC 12 reports as maybe-uninitialized.
    const __m512 f =
        _mm512_maskz_cvtph_ps(0xFFFF, _mm256_loadu_si256(static_cast<const __m256i*>(static_cast<const void*>(p))));
    PanelRow v;
    __builtin_memcpy(&v, &f, sizeof v);
    return v;
  }
};
REWIND_INLINE PanelRow multiply_add(float x, PanelRow w, PanelRow acc) {
  __m512 wv, av;
  __builtin_memcpy(&wv, &w, sizeof wv);
  __builtin_memcpy(&av, &acc, sizeof av);
  const __m512 r = _mm512_fmadd_ps(_mm512_set1_ps(x), wv, av);
  PanelRow out;
  __builtin_memcpy(&out, &r, sizeof out);
  return out;
}
constexpr bool kWide = true;
#include "matmul_micro.inc"
#pragma GCC pop_options
}  // namespace avx512

namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
// A panel row as two 256-bit registers. GCC lowers a 16-float generic
// vector in AVX2 code through the stack (halves stored, the whole reloaded:
// store-forwarding stalls on every multiply-add): the shipped target's
// one-token forward took 1.6 ms on an AVX2-only CPU, and 1,043 us against
// 119 us now on a Zen 4 core told to skip AVX-512 (REWIND_MATMUL_NARROW=1;
// its 5-token forward 2,623 -> 295 us).
struct Acc {
  __m256 lo, hi;
};
using Reg = __m256;
constexpr int kRegs = 2;
template <class E>
REWIND_INLINE void load_regs(const typename E::Stored* p, Reg* out) {
  const Acc a = E::load(p);
  out[0] = a.lo;
  out[1] = a.hi;
}
// y[0, n) = lanes [0, n) of the two registers, + bias[0, n) where bias is
// not null. Neither half goes through a 64-byte generic vector, and a short
// last panel goes through write_partial_panel's call: both, inlined, made
// GCC keep the accumulators of the multiply-add loop in memory (loaded and
// stored around every multiply-add: with the 2 x 32-byte registers alone,
// the shipped target's one-token forward took 336 us, its 3-token one 667
// us; now 119 and 221).
REWIND_INLINE void write_panel(const Reg* a, const float* bias, float* y, int64_t n) {
  if (n == kPanel) {
    __m256 lo = a[0], hi = a[1];
    if (bias != nullptr) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
    }
    _mm256_storeu_ps(y, lo);
    _mm256_storeu_ps(y + 8, hi);
  } else {
    float s[kPanel];
    _mm256_storeu_ps(s, a[0]);
    _mm256_storeu_ps(s + 8, a[1]);
    write_partial_panel(s, bias, y, n);
  }
}
struct F32Panels {
  using Stored = float;
  REWIND_INLINE static Acc load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
};
struct Bf16Panels {
  using Stored = std::uint16_t;
  REWIND_INLINE static __m256 widen(const std::uint16_t* p) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(static_cast<const void*>(p))));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  }
  REWIND_INLINE static Acc load(const std::uint16_t* p) { return {widen(p), widen(p + 8)}; }
};
struct F16Panels {
  using Stored = std::uint16_t;
  REWIND_INLINE static __m256 widen(const std::uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(static_cast<const void*>(p))));
  }
  REWIND_INLINE static Acc load(const std::uint16_t* p) { return {widen(p), widen(p + 8)}; }
};
// The software widening (the tests' path), split into the two registers.
struct F16SoftwarePanels {
  using Stored = std::uint16_t;
  REWIND_INLINE static Acc load(const std::uint16_t* p) {
    const PanelRow v = kernels::F16SoftwarePanels::load(p);
    Acc a;
    __builtin_memcpy(&a.lo, &v, sizeof a.lo);
    __builtin_memcpy(&a.hi, reinterpret_cast<const char*>(&v) + sizeof a.lo, sizeof a.hi);
    return a;
  }
};
REWIND_INLINE Reg multiply_add(float x, Reg w, Reg acc) { return _mm256_fmadd_ps(_mm256_set1_ps(x), w, acc); }
constexpr bool kWide = false;
#include "matmul_micro.inc"
#pragma GCC pop_options
}  // namespace avx2
#endif

// Panels [p_begin, p_end) of every row, in the copy matmul_isa() picked.
void matmul_block(const float* x, int64_t rows, const PackedMatrix& w, float* y, const float* bias,
                  int64_t p_begin, int64_t p_end, int64_t ahead) {
  const bool f16_software = f16_software_forced();
  switch (matmul_isa()) {
#if defined(REWIND_MATMUL_ISA_KERNELS)
    case MatmulIsa::Avx512: avx512::matmul_block(x, rows, w, y, bias, p_begin, p_end, ahead, f16_software); return;
    case MatmulIsa::Avx2: avx2::matmul_block(x, rows, w, y, bias, p_begin, p_end, ahead, f16_software); return;
#else
    case MatmulIsa::Avx512:
    case MatmulIsa::Avx2:
#endif
    case MatmulIsa::Baseline: break;
  }
  baseline::matmul_block(x, rows, w, y, bias, p_begin, p_end, ahead, f16_software);
}

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
REWIND_INLINE void dot4x2_strided(const float* xa, const float* xb, const float* k, int64_t stride, int64_t n,
                                  Quad& sa, Quad& sb) {
  const float* k0 = k;
  const float* k1 = k + stride;
  const float* k2 = k + 2 * stride;
  const float* k3 = k + 3 * stride;
  PanelRow a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const PanelRow xv = __builtin_shufflevector(load_lanes(xa + i), load_lanes(xb + i), 0, 1, 2, 3, 4, 5, 6, 7, 8,
                                                9, 10, 11, 12, 13, 14, 15);
    const Lanes l0 = load_lanes(k0 + i), l1 = load_lanes(k1 + i), l2 = load_lanes(k2 + i), l3 = load_lanes(k3 + i);
    a0 += xv * __builtin_shufflevector(l0, l0, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    a1 += xv * __builtin_shufflevector(l1, l1, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    a2 += xv * __builtin_shufflevector(l2, l2, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    a3 += xv * __builtin_shufflevector(l3, l3, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
  }
  sa = combine4(__builtin_shufflevector(a0, a0, 0, 1, 2, 3, 4, 5, 6, 7),
                __builtin_shufflevector(a1, a1, 0, 1, 2, 3, 4, 5, 6, 7),
                __builtin_shufflevector(a2, a2, 0, 1, 2, 3, 4, 5, 6, 7),
                __builtin_shufflevector(a3, a3, 0, 1, 2, 3, 4, 5, 6, 7));
  sb = combine4(__builtin_shufflevector(a0, a0, 8, 9, 10, 11, 12, 13, 14, 15),
                __builtin_shufflevector(a1, a1, 8, 9, 10, 11, 12, 13, 14, 15),
                __builtin_shufflevector(a2, a2, 8, 9, 10, 11, 12, 13, 14, 15),
                __builtin_shufflevector(a3, a3, 8, 9, 10, 11, 12, 13, 14, 15));
  add_tails4(sa, xa, k, stride, i, n);
  add_tails4(sb, xb, k, stride, i, n);
}

// For each of G queries g: out[g][0, B * 8) = sum_j e[g][j] * rows[j *
// stride + (0 .. B * 8)], in order of j from 0, with the sums held in
// registers (16 floats a vector: one AVX-512 register, two AVX2 ones; each
// lane's arithmetic is the same) and each row of values loaded once for all
// G queries.
// `resume`: the sums continue from out (a previous call over the positions
// before these) instead of starting at 0; storing and reloading a sum keeps
// its bits, so splitting the positions changes nothing.
// `e_sum`, when not null: also e_sum[g] += e[g][j] in order of j, a chain of
// adds that runs alongside the products instead of in a loop of its own.
template <int B, int G>
REWIND_INLINE void weighted_sum_of_rows(const float* const* e, const float* rows, int64_t stride, int64_t n,
                                        float* const* out, bool resume, float* e_sum) {
  constexpr int kWide = B / 2, kNarrow = B % 2;  // 16-float vectors, then one of 8
  PanelRow acc[G][kWide > 0 ? kWide : 1] = {};
  Lanes tail[G] = {};
  float sum[G] = {};
#pragma GCC unroll 2
  for (int g = 0; g < G; ++g) {
    if (resume) {
      if constexpr (kWide > 0) {
#pragma GCC unroll 8
        for (int b = 0; b < kWide; ++b) acc[g][b] = F32Panels::load(out[g] + b * kPanel);
      }
      if constexpr (kNarrow) __builtin_memcpy(&tail[g], out[g] + kWide * kPanel, sizeof(Lanes));
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
    if constexpr (kNarrow) {
      const Lanes v = load_lanes(row + kWide * kPanel);
#pragma GCC unroll 2
      for (int g = 0; g < G; ++g) tail[g] += e[g][j] * v;
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
    if constexpr (kNarrow) __builtin_memcpy(out[g] + kWide * kPanel, &tail[g], sizeof(Lanes));
    if (e_sum != nullptr) e_sum[g] = sum[g];
  }
}

// out[i] = silu(gate[i]) * up[i] for i < n, or silu(gate[i]) when up is
// null. The out-of-line, cloned home of the element-wise SiLU loops, so
// that exp_of runs 16 lanes wide (one AVX-512 vector, two AVX2 ones), then
// 8, then one at a time: the same arithmetic in every lane.
// Clang checks the vector ABI of every call made directly from a cloned
// function's baseline (SSE2) version, even to always-inlined helpers, and
// rejects passing Lanes by value there; calls made from inside an inlined
// helper pass. So each cloned function below only calls a helper that
// holds its body.
REWIND_INLINE void swiglu_span_body(const float* gate, const float* up, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + kPanel <= n; i += kPanel) {
    PanelRow v = silu_of<PanelRow, PanelRowBits>(F32Panels::load(gate + i));
    if (up != nullptr) v *= F32Panels::load(up + i);
    __builtin_memcpy(out + i, &v, sizeof v);
  }
  for (; i + kLanes <= n; i += kLanes) {
    Lanes v = silu_lanes(load_lanes(gate + i));
    if (up != nullptr) v *= load_lanes(up + i);
    __builtin_memcpy(out + i, &v, sizeof v);
  }
  for (; i < n; ++i) out[i] = up != nullptr ? silu(gate[i]) * up[i] : silu(gate[i]);
}

// out[c] = sums[c] + bias[c] (bias may be null), then silu when `fuse_silu`:
// the end of causal_conv1d, element-wise.
REWIND_INLINE void add_bias_silu_body(const float* sums, const float* bias, int64_t n, bool fuse_silu, float* out) {
  int64_t c = 0;
  for (; c + kPanel <= n; c += kPanel) {
    PanelRow v = F32Panels::load(sums + c);
    if (bias != nullptr) v += F32Panels::load(bias + c);
    if (fuse_silu) v = silu_of<PanelRow, PanelRowBits>(v);
    __builtin_memcpy(out + c, &v, sizeof v);
  }
  for (; c < n; ++c) {
    float v = sums[c];
    if (bias != nullptr) v += bias[c];
    out[c] = fuse_silu ? silu(v) : v;
  }
}

REWIND_WIDE_KERNEL_CLONES
void add_bias_silu(const float* sums, const float* bias, int64_t n, bool fuse_silu, float* out) {
  add_bias_silu_body(sums, bias, n, fuse_silu, out);
}

REWIND_WIDE_KERNEL_CLONES
void swiglu_span(const float* gate, const float* up, int64_t n, float* out) { swiglu_span_body(gate, up, n, out); }

// One row of gated_rms_norm, given the row's 1 / rms.
REWIND_INLINE void gated_norm_row_body(const float* x, const float* z, const float* weight, float inv,
                                       int64_t dim, float* y) {
  int64_t i = 0;
  for (; i + kLanes <= dim; i += kLanes) {
    const Lanes v = (load_lanes(weight + i) * (load_lanes(x + i) * broadcast<Lanes>(inv))) * silu_lanes(load_lanes(z + i));
    __builtin_memcpy(y + i, &v, sizeof v);
  }
  for (; i < dim; ++i) y[i] = (weight[i] * (x[i] * inv)) * silu(z[i]);
}

REWIND_KERNEL_CLONES
void gated_norm_row(const float* x, const float* z, const float* weight, float inv, int64_t dim,
                    float* y) {
  gated_norm_row_body(x, z, weight, inv, dim, y);
}

// w[j] = exp_f32(w[j] - shift) for j < n, 16 lanes at a time, then 8, then
// one: the same arithmetic per lane.
REWIND_INLINE void exp_shifted_inplace(float* w, int64_t n, float shift) {
  int64_t j = 0;
  for (; j + kPanel <= n; j += kPanel) {
    const PanelRow e = exp_of<PanelRow, PanelRowBits>(F32Panels::load(w + j) - shift);
    __builtin_memcpy(w + j, &e, sizeof e);
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
// time (16 prompts of the shipped target while this machine's share of L3
// was a few MB: docs/performance.md section 16). Prefetching changes no
// result.
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
// floats apart) requested ahead of the scoring.
template <int G>
REWIND_INLINE void score_keys(const float* const* qh, const KVSegment* segments, int64_t num_segments,
                              int64_t k_pos_stride, int64_t v_pos_stride, int64_t head_dim, float scale,
                              int64_t begin, int64_t end, float* const* w, Quad* max4, float* max_score,
                              bool prefetch) {
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
        dot4x2_strided(qh[0], qh[1], kh + key * k_pos_stride, k_pos_stride, head_dim, sc[0], sc[1]);
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
// Up to 64 elements of o stay in registers for a whole pass over a
// segment's keys (storing o after every key would chain each step to the
// previous store); the rest goes element by element. Every path does the
// same operations per element, and storing and reloading a sum keeps its
// bits, so splitting the keys into calls or pieces changes nothing.
template <int G>
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
      const int64_t vectors = std::min<int64_t>(8, (head_dim - d0) / kLanes);
      const float* vd = vh + d0;
      float* od[G];
      for (int g = 0; g < G; ++g) od[g] = o[g] + d0;
      switch (vectors) {
        case 1: weighted_sum_of_rows<1, G>(ea, vd, v_pos_stride, count, od, resume, sum); break;
        case 2: weighted_sum_of_rows<2, G>(ea, vd, v_pos_stride, count, od, resume, sum); break;
        case 3: weighted_sum_of_rows<3, G>(ea, vd, v_pos_stride, count, od, resume, sum); break;
        case 4: weighted_sum_of_rows<4, G>(ea, vd, v_pos_stride, count, od, resume, sum); break;
        case 5: weighted_sum_of_rows<5, G>(ea, vd, v_pos_stride, count, od, resume, sum); break;
        case 6: weighted_sum_of_rows<6, G>(ea, vd, v_pos_stride, count, od, resume, sum); break;
        case 7: weighted_sum_of_rows<7, G>(ea, vd, v_pos_stride, count, od, resume, sum); break;
        default: weighted_sum_of_rows<8, G>(ea, vd, v_pos_stride, count, od, resume, sum); break;
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
REWIND_INLINE void attend_units_body(QueryUnit* units, int64_t num_units, const KVSegment* segments,
                                     int64_t num_segments, int64_t k_pos_stride, int64_t v_pos_stride,
                                     int64_t head_dim, float scale, int64_t key_block) {
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
      score_keys<2>(q.qh, segments, num_segments, k_pos_stride, v_pos_stride, head_dim, scale, a, b, q.w, max4[u],
                    max_score[u], prefetch);
    } else {
      score_keys<1>(q.qh, segments, num_segments, k_pos_stride, v_pos_stride, head_dim, scale, a, b, q.w, max4[u],
                    max_score[u], prefetch);
    }
  });
  for (int64_t u = 0; u < num_units; ++u) {
    const QueryUnit& q = units[u];
    for (int g = 0; g < q.G; ++g) {
      for (int l = 0; l < 4; ++l) max_score[u][g] = std::max(max_score[u][g], max4[u][g][l]);
      // The exponentials first (a loop the compiler vectorises); their sum,
      // in order of position, is taken in the first pass over the values.
      exp_shifted_inplace(q.w[g] + q.begin, q.end - q.begin, max_score[u][g]);
    }
  }
  for_each_block([&](int64_t u, int64_t a, int64_t b) __attribute__((always_inline)) {
    QueryUnit& q = units[u];
    if (q.G == 2) {
      weighted_values<2>(q.w, segments, num_segments, v_pos_stride, head_dim, a, b, a > q.begin, sum[u], q.o);
    } else {
      weighted_values<1>(q.w, segments, num_segments, v_pos_stride, head_dim, a, b, a > q.begin, sum[u], q.o);
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

REWIND_WIDE_KERNEL_CLONES
void attend_units(QueryUnit* units, int64_t num_units, const KVSegment* segments, int64_t num_segments,
                  int64_t k_pos_stride, int64_t v_pos_stride, int64_t head_dim, float scale, int64_t key_block) {
  attend_units_body(units, num_units, segments, num_segments, k_pos_stride, v_pos_stride, head_dim, scale, key_block);
}

// Columns [j0, j0 + W) of one gated delta step, W a vector width (V: W
// floats). Column j of the new state, kv[j], delta[j] and o[j] depend only
// on column j of the old one, so the step goes column block by column block
// with kv and o in registers, the block (k_dim x W floats) staying in L1
// between its two passes. Per element exactly the arithmetic of the
// definition: S[i][j] * decay; kv[j] summed over i in order from 0; (v[j] -
// kv[j]) * beta; S[i][j] + k[i] * delta[j]; o[j] summed over i in order.
template <class V>
REWIND_INLINE void delta_step_columns(const float* q, const float* k, const float* v, float decay, float beta,
                                      int64_t k_dim, int64_t v_dim, int64_t j0, const float* s_in, float* s_out,
                                      float* o) {
  V kv = {};
  for (int64_t i = 0; i < k_dim; ++i) {
    V row;
    __builtin_memcpy(&row, s_in + i * v_dim + j0, sizeof row);
    const V decayed = row * decay;
    __builtin_memcpy(s_out + i * v_dim + j0, &decayed, sizeof decayed);
    kv += decayed * k[i];
  }
  V vv;
  __builtin_memcpy(&vv, v + j0, sizeof vv);
  const V delta = (vv - kv) * beta;
  V out = {};
  for (int64_t i = 0; i < k_dim; ++i) {
    V row;
    __builtin_memcpy(&row, s_out + i * v_dim + j0, sizeof row);
    const V updated = row + k[i] * delta;
    __builtin_memcpy(s_out + i * v_dim + j0, &updated, sizeof updated);
    out += updated * q[i];
  }
  __builtin_memcpy(o + j0, &out, sizeof out);
}

typedef float Single __attribute__((vector_size(sizeof(float))));

// One gated delta step (kernels.h: gated_delta_rule_step) reading the old
// state from s_in and writing the new one to s_out, which may be s_in
// itself: each element is read before it is written, and no copy of the
// state is made first.
REWIND_WIDE_KERNEL_CLONES
void delta_step(const float* __restrict q, const float* __restrict k, const float* __restrict v, float decay,
                float beta, int64_t k_dim, int64_t v_dim, const float* s_in, float* s_out, float* __restrict o) {
  int64_t j0 = 0;
  for (; j0 + kPanel <= v_dim; j0 += kPanel) delta_step_columns<PanelRow>(q, k, v, decay, beta, k_dim, v_dim, j0, s_in, s_out, o);
  for (; j0 + kLanes <= v_dim; j0 += kLanes) delta_step_columns<Lanes>(q, k, v, decay, beta, k_dim, v_dim, j0, s_in, s_out, o);
  for (; j0 < v_dim; ++j0) delta_step_columns<Single>(q, k, v, decay, beta, k_dim, v_dim, j0, s_in, s_out, o);
}

}  // namespace

float dot(const float* a, const float* b, int64_t n) { return dot_inline(a, b, n); }

void PackedMatrix::AlignedFree::operator()(std::byte* p) const {
  ::operator delete[](p, std::align_val_t{alignment});
}

namespace {

// w: [out, in] of T into panels of T at dst (zeros past out).
template <class T>
void pack_panels(const T* w, int64_t out, int64_t in, int64_t panels, T* dst_all) {
  for (int64_t p = 0; p < panels; ++p) {
    T* dst = dst_all + p * in * kPanel;
    for (int64_t i = 0; i < in; ++i) {
      for (int64_t l = 0; l < kPanel; ++l) {
        const int64_t o = p * kPanel + l;
        dst[i * kPanel + l] = o < out ? w[o * in + i] : T{0};
      }
    }
  }
}

}  // namespace

// Storage for `bytes` of panels, 64-byte aligned. A matrix of at least a
// huge page (2 MiB) gets whole huge pages where the kernel grants them
// (transparent huge pages, asked for with madvise, as Debian's default
// "madvise" setting requires): matmul streams such a matrix from memory,
// and with 4 KiB pages every 4 KiB of it took a TLB miss. The one-token
// forward of a 26M-parameter f32 model (104 MB of weights), six
// alternating runs: median about 5.9 ms before, 5.3 after
// (docs/performance.md section 16). The advice is a hint: refused, the
// memory is the same, in small pages. Only the whole huge pages are
// advised: rounding the block up instead would have reserved up to 2 MiB
// more per matrix (a third more for a 3 MiB one); the tail stays in small
// pages.
std::unique_ptr<std::byte[], PackedMatrix::AlignedFree> PackedMatrix::allocate_panels(std::size_t bytes) {
  constexpr std::size_t kHugePage = std::size_t{2} << 20;
  const std::size_t alignment = bytes < kHugePage ? 64 : kHugePage;
  std::unique_ptr<std::byte[], AlignedFree> p(
      static_cast<std::byte*>(::operator new[](bytes, std::align_val_t{alignment})), AlignedFree{alignment});
#if defined(MADV_HUGEPAGE)
  if (alignment == kHugePage) (void)madvise(p.get(), bytes / kHugePage * kHugePage, MADV_HUGEPAGE);
#endif
  return p;
}

template <class T>
PackedMatrix PackedMatrix::packed_from(const T* w, int64_t out, int64_t in, Element element) {
  assert(out >= 0 && in >= 0);
  PackedMatrix m;
  m.out_ = out;
  m.in_ = in;
  m.element_ = element;
  const auto n = static_cast<std::size_t>(m.panels() * in * kPanel);
  if (n == 0) return m;
  m.data_ = allocate_panels(n * sizeof(T));
  pack_panels(w, out, in, m.panels(), static_cast<T*>(static_cast<void*>(m.data_.get())));
  return m;
}

PackedMatrix::PackedMatrix(const float* w, int64_t out, int64_t in)
    : PackedMatrix(packed_from(w, out, in, Element::F32)) {}

PackedMatrix PackedMatrix::from_bf16(const std::uint16_t* w, int64_t out, int64_t in) {
  return packed_from(w, out, in, Element::BF16);
}

PackedMatrix PackedMatrix::from_f16(const std::uint16_t* w, int64_t out, int64_t in) {
  return packed_from(w, out, in, Element::F16);
}

namespace {

// How far ahead matmul prefetches in each panel stream (0: not at all). A
// matrix larger than an L2 cache most likely streams from L3 or memory;
// there, without software prefetch, a forward of several rows stalled on
// its loads instead of overlapping them with the arithmetic (a 5-token
// forward of a 26M-parameter model held as f32 cost 2.27x a one-token one
// before, 1.31x now, docs/performance.md section 12). A model that fits in
// L3 gains nothing from it and lost about 2 % to the extra instructions,
// hence the size test.
constexpr std::size_t kPrefetchMatrixBytes = 256 * 1024;
constexpr int64_t kPrefetchAheadBytes = 4096;

int64_t matmul_prefetch_bytes(const PackedMatrix& w) {
  return w.bytes() >= kPrefetchMatrixBytes ? kPrefetchAheadBytes : 0;
}

}  // namespace

void matmul(const float* x, int64_t rows, const PackedMatrix& w, float* y, const float* bias) {
  if (rows <= 0 || w.out() <= 0) return;
  const bool worth_threads = rows * w.in() * w.out() >= kParallelWork && omp_get_max_threads() > 1;
  const int64_t ahead = matmul_prefetch_bytes(w);
  int64_t block = matmul_block_panels(w.in());
  const bool wide = matmul_isa() == MatmulIsa::Avx512;
  const int64_t max_group = wide ? wide_group_rows(w.element(), ahead) : kMaxGroupRows;
  const bool streamed_f32_rows = rows <= 2 && ahead != 0 && w.element() == PackedMatrix::Element::F32;
  if (rows <= max_group && !streamed_f32_rows) {
    // One group of rows passes over the weights once, so L2-sized blocks
    // buy nothing; small ones cost: a block of 2 or 5 panels left the 4-
    // panel micro-kernel of one row unused, or used it once and then ran a
    // 1-panel tail, one accumulator waiting on its own adds. Blocks here are
    // the panels split across the threads, in multiples of 4 (the shipped
    // target's one-token forward: 90 -> 79 us). Except for one or two rows
    // of an f32 matrix streamed from memory (prefetched): there its L2
    // blocks (2 panels of 512 inputs) run two panels at a time, and that
    // was faster than four streams at once (a 26M-parameter f32 model's
    // two-token forward: 2.67 ms against 2.79). f16 / bf16 panels, half the
    // bytes per weight, go the other way since matmul fuses its multiply-
    // adds: four streams at once took that model's f16 one-token forward
    // from 1.88 to 1.50 ms.
    const int64_t threads = worth_threads ? omp_get_max_threads() : 1;
    block = ((w.panels() + threads - 1) / threads + 3) / 4 * 4;
  } else if (wide && rows > max_group) {
    // Several groups over L2 blocks: a whole number of the widest micro-
    // kernel's panels (4 for groups of 6 rows, 3 for 8), so that no group
    // runs a narrower tail on every block (the shipped target's 192 inputs
    // gave blocks of 5 panels: its 12-token forward took 733 us against 705).
    const int64_t step = wide_panels_for_rows(static_cast<int>(max_group));
    block = std::max<int64_t>(step, block / step * step);
  }
  const int64_t num_blocks = (w.panels() + block - 1) / block;
  const bool parallel = num_blocks > 1 && worth_threads;
  parallel_for(num_blocks, parallel, [&](int64_t b) {
    matmul_block(x, rows, w, y, bias, b * block, std::min(w.panels(), (b + 1) * block), ahead);
  });
}

void rms_norm(const float* x, const float* weight, int64_t rows, int64_t dim, double eps,
              float* y) {
  parallel_for(rows, rows * dim >= kParallelWork, [&](int64_t r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    const float inv = rms_inverse(xr, dim, eps);
    for (int64_t i = 0; i < dim; ++i) yr[i] = weight[i] * (xr[i] * inv);
  });
}

void gated_rms_norm(const float* x, const float* z, const float* weight, int64_t rows, int64_t dim,
                    double eps, float* y) {
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
  for (int64_t r = 0; r < rows; ++r) rope_angles(positions[r], inv_freq, cos_.data() + r * half_, sin_.data() + r * half_);
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

void rope_inplace(float* x, int64_t rows, int64_t heads, int64_t head_dim, const int64_t* positions,
                  double theta, int64_t rotary_dim) {
  if (rotary_dim == 0) rotary_dim = head_dim;
  assert(rotary_dim % 2 == 0 && rotary_dim <= head_dim);
  rope_inplace(x, rows, heads, head_dim, RopeTable(positions, rows, theta, rotary_dim));
}

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
    // [lo, hi] is each query's own key range, whatever range was passed in:
    // this is what makes the result batch invariant. `first` / `last`:
    // the rows' union.
    const auto key_range = [&](int64_t row) {
      const int64_t p = pos0 + row;
      int64_t lo = kv_offset;
      if (mask.window > 0) lo = std::max(lo, p - mask.window + 1);
      if (mask.chunk > 0) lo = std::max(lo, p - p % mask.chunk);
      return std::pair<int64_t, int64_t>{lo, std::min(p, kv_last)};
    };
    int64_t first = std::numeric_limits<int64_t>::max(), last = -1;
    for (int64_t row = row_begin; row < row_end; ++row) {
      const auto [lo, hi] = key_range(row);
      if (hi < lo) continue;
      first = std::min(first, lo);
      last = std::max(last, hi);
    }
    const int64_t n = last >= first ? last - first + 1 : 0;
    QueryUnit units[kMaxUnits];
    int64_t num_units = 0;
    weights.resize(static_cast<std::size_t>(2 * (row_end - row_begin) * (pair_end - pair_begin) * n));
    for (int64_t row = row_begin; row < row_end; ++row) {
      const auto [lo, hi] = key_range(row);
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
    // The runs' parts that cover [first, last], in order.
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
    // One row alone needs no blocks (each block's pass would store and
    // reload its sums for nothing).
    const int64_t key_block = row_end - row_begin > 1 ? kKeyBlock : n;
    attend_units(units, num_units, segments.data(), static_cast<int64_t>(segments.size()), ks.pos_stride,
                 vs.pos_stride, head_dim, scale, key_block);
  });
}

void attention(const float* q, int64_t q_len, int64_t pos0, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, const StridedKV& k, const StridedKV& v, int64_t kv_offset,
               int64_t kv_len, AttentionMask mask, float* out) {
  const KVRun run{k.data, v.data, kv_len};
  attention_paged(q, q_len, pos0, num_heads, num_kv_heads, head_dim, std::span<const KVRun>(&run, 1), k, v, kv_offset,
                  kv_len, mask, out);
}

void causal_conv1d(const float* window, int64_t channels, int64_t kernel_size, int64_t q,
                   int64_t channel_stride, int64_t time_stride, const float* weight,
                   const float* bias, bool fuse_silu, float* out) {
  // Channels go in blocks so that the inner loop runs across channels while
  // each out[t, c] still sums over i in order.
  constexpr int64_t kBlock = 256;
  const int64_t blocks = (channels + kBlock - 1) / kBlock;
  const int64_t tasks = q * blocks;
  parallel_for(tasks, q * channels * kernel_size >= kParallelWork, [&](int64_t task) {
    const int64_t t = task / blocks;
    const int64_t c0 = (task % blocks) * kBlock;
    const int64_t nc = std::min(kBlock, channels - c0);
    float acc[kBlock] = {};
    for (int64_t i = 0; i < kernel_size; ++i) {
      const float* xs = window + c0 * channel_stride + (t + i) * time_stride;
      const float* wi = weight + c0 * kernel_size + i;
      for (int64_t c = 0; c < nc; ++c) acc[c] += wi[c * kernel_size] * xs[c * channel_stride];
    }
    add_bias_silu(acc, bias != nullptr ? bias + c0 : nullptr, nc, fuse_silu, out + t * channels + c0);
  });
}

void gated_delta_rule_step(const float* q, const float* k, const float* v, float g, float beta,
                           int64_t k_dim, int64_t v_dim, const float* state_in, float* state_out,
                           float* o) {
  delta_step(q, k, v, std::exp(g), beta, k_dim, v_dim, state_in, state_out, o);
}

void gated_delta_rule(const float* q, const float* k, const float* v, const float* g,
                      const float* beta, int64_t tokens, int64_t num_v_heads, int64_t num_k_heads,
                      int64_t k_dim, int64_t v_dim, const float* state_in, float* const* state_out,
                      float* out) {
  assert(num_k_heads > 0 && num_v_heads % num_k_heads == 0);
  const int64_t ratio = num_v_heads / num_k_heads;
  const int64_t head_state = k_dim * v_dim;
  parallel_for(num_v_heads, tokens * num_v_heads * head_state >= kParallelWork, [&](int64_t h) {
    const int64_t kh = h / ratio;
    for (int64_t t = 0; t < tokens; ++t) {
      const float* prev = (t == 0 ? state_in : state_out[t - 1]) + h * head_state;
      const int64_t qk = (t * num_k_heads + kh) * k_dim;
      const int64_t vo = t * num_v_heads + h;
      gated_delta_rule_step(q + qk, k + qk, v + vo * v_dim, g[vo], beta[vo], k_dim, v_dim, prev,
                            state_out[t] + h * head_state, out + vo * v_dim);
    }
  });
}

void silu_inplace(float* x, int64_t n) { swiglu_span(x, nullptr, n, x); }

void swiglu(const float* gate, const float* up, int64_t n, float* out) {
  constexpr int64_t kChunk = 4096;
  parallel_for((n + kChunk - 1) / kChunk, n >= kParallelWork, [&](int64_t c) {
    const int64_t begin = c * kChunk;
    swiglu_span(gate + begin, up + begin, std::min(n, begin + kChunk) - begin, out + begin);
  });
}

void add_inplace(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void scale_inplace(float* x, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

int64_t argmax(const float* x, int64_t n) {
  int64_t best = 0;
  bool found = false;
  for (int64_t i = 0; i < n; ++i) {
    // NaN fails both comparisons; strict > keeps the first of equal maxima.
    if (!found ? x[i] == x[i] : x[i] > x[best]) {
      best = i;
      found = true;
    }
  }
  return best;
}

void softmax(const float* x, int64_t n, float* y) {
  float max_value = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) max_value = std::max(max_value, x[i]);
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const float e = std::exp(x[i] - max_value);
    y[i] = e;
    sum += e;
  }
  const double inv = 1.0 / sum;
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(y[i] * inv);
}

}  // namespace rwd::runtime::kernels
