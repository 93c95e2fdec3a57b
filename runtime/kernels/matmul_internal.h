// runtime/kernels/matmul_internal.h: what matmul's translation units share.
//
// matmul is compiled once per instruction set it can use, each copy in a
// translation unit of its own (matmul_avx512.cc, matmul_avx2.cc,
// matmul_baseline.cc, each including matmul_micro.inc once), and one is
// picked per process (matmul_isa, matmul_dispatch.cc). The AVX-512 and AVX2
// units compile their kernels inside a `#pragma GCC target` region rather
// than with per-file -mavx512f / -mavx2 flags: with a per-file flag every
// inline function and template instantiated in that file (kernels.h's
// PackedMatrix accessors, the standard library's) is compiled for that ISA
// and emitted as a COMDAT copy, and the linker keeps one copy for the whole
// program, so a CPU without the ISA could end up running it. A pragma region
// applies the ISA to the functions defined inside it only.
// Not target_clones: a clone must inline its whole call tree, and one
// function holding every row-group kernel made GCC spill the accumulators of
// some of them (two rows ran at 74 GFLOPS instead of 117).
// Elsewhere (clang: its `#pragma clang attribute` did not reach the
// templates' instantiations) only the baseline copy exists, whose fused
// multiply-adds go through fmaf: exact, about 100 times slower. Build the
// runtime with GCC.
//
// Why matmul is shaped as it is: a one-token forward of the shipped
// 2.6M-parameter target streams its weights from L3, while a forward of
// K + 1 tokens must cost far less than K + 1 of those for speculative
// decoding to pay. Packed panels let one load of a panel row serve up to 6
// rows (8 with AVX-512) of accumulators held in registers, which takes the
// multi-row case from memory-bound to close to the FP peak.
#pragma once

#include <cstdint>

#include "internal.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define REWIND_MATMUL_ISA_KERNELS 1
#endif

namespace rwd::runtime::kernels::detail {

// Rows of x that share one pass over the weights, and the panels each
// micro-kernel keeps in flight for that many rows: a panel row is 16 floats
// (one AVX-512 vector, two AVX2 ones), and rows * panels accumulators +
// panels weight rows + one broadcast fit the 16 registers of AVX2. One row
// alone still has 4 independent accumulator chains (2 panels x 2 halves)
// to hide the latency of the adds.
inline constexpr int kMaxGroupRows = 6;
constexpr int panels_for_rows(int rows) { return rows <= 2 ? 2 : 1; }
// With AVX-512's 32 registers, up to 6 rows keep four panels in flight (24
// accumulators + 4 weight rows + one broadcast) and 7 or 8 rows three (24
// accumulators + 3 + 1). Four panels give enough independent sums to hide
// the latency of the fused multiply-adds and widen each f16 panel row for
// more outputs. A matrix that is resident in L3 (not prefetched: the shipped
// models) goes through groups of at most 6 rows (7 rows: 4 + 3; 16 rows: 6 +
// 5 + 5), over L2 blocks of a multiple of 4 panels, and so does a streamed
// f16 / bf16 one. A streamed f32 matrix keeps groups of 8 rows over blocks
// of about 64 KiB (a multiple of 3 panels, the 8-row kernel's width): there
// every group after the first reads its block from L2 again, and one pass of
// 8 rows was faster than groups of 4 + 4.
inline constexpr int kMaxWideGroupRows = 8;
inline constexpr int kMaxWideResidentGroupRows = 6;
constexpr int wide_panels_for_rows(int rows) { return rows <= 6 ? 4 : 3; }
// Rows per group with AVX-512: 8 for an f32 matrix streamed from memory
// (prefetched, ahead != 0), else 6.
inline int64_t wide_group_rows(PackedMatrix::Element element, int64_t ahead) {
  return ahead != 0 && element == PackedMatrix::Element::F32 ? kMaxWideGroupRows : kMaxWideResidentGroupRows;
}

// The instruction set matmul runs in this process (chosen once, on first
// use): AVX-512F where the CPU has it, else AVX2 + FMA + F16C, else the
// baseline. REWIND_MATMUL_NARROW=1 in the environment skips AVX-512, and
// REWIND_MATMUL_BASELINE=1 takes the baseline copy (make test runs the
// kernel and batch tests each way, whatever the machine has). Builds
// without REWIND_MATMUL_ISA_KERNELS always get Baseline.
enum class MatmulIsa { Avx512, Avx2, Baseline };
MatmulIsa matmul_isa();

// Whether REWIND_MATMUL_F16_SOFTWARE=1 was set: f16 panels are then widened
// with the software conversion whatever the CPU has (make test runs the
// kernel and batch tests that way too).
bool f16_software_forced();

// Panels [p_begin, p_end) of every row of x: [rows, w.in()] into y: [rows,
// w.out()] (+ bias), in the copy matmul_isa() picked; `ahead`: bytes to
// prefetch ahead in each panel stream, 0 for none.
void matmul_block(const float* x, int64_t rows, const PackedMatrix& w, float* y, const float* bias, int64_t p_begin,
                  int64_t p_end, int64_t ahead);

// The same in one instruction set's copy (matmul_<isa>.cc); f16_software
// widens f16 panels with the software conversion even where the set has
// its own. avx512 and avx2 exist only with REWIND_MATMUL_ISA_KERNELS.
namespace baseline {
void matmul_block(const float* x, int64_t rows, const PackedMatrix& w, float* y, const float* bias, int64_t p_begin,
                  int64_t p_end, int64_t ahead, bool f16_software);
}
namespace avx2 {
void matmul_block(const float* x, int64_t rows, const PackedMatrix& w, float* y, const float* bias, int64_t p_begin,
                  int64_t p_end, int64_t ahead, bool f16_software);
}
namespace avx512 {
void matmul_block(const float* x, int64_t rows, const PackedMatrix& w, float* y, const float* bias, int64_t p_begin,
                  int64_t p_end, int64_t ahead, bool f16_software);
}

// Rows of activations quantized for a Q8 matrix (matmul.cc,
// quantize_q8_rows; docs/quantization.md): per row r and block b of 32
// inputs (the last one zero-padded), values[(r * blocks + b) * 32 + k] in
// [-127, 127], the block's scale scale[r * blocks + b] (0 for an all-zero
// block, NaN where the block holds a non-finite input, whose values are
// then 0) and the sum of its values sum[r * blocks + b].
struct Q8Rows {
  const std::int8_t* values;
  const float* scale;
  const std::int32_t* sum;
  std::int64_t blocks;
};

// Panels [p_begin, p_end) of every row of x (rows quantized rows) times the
// Q8 matrix w, into y: [rows, w.out()] (+ bias), in the copy
// matmul_q8_isa() picks: AVX-512 with VNNI, else AVX2, else the baseline;
// REWIND_MATMUL_NARROW and REWIND_MATMUL_BASELINE hold as for matmul_isa().
// Every copy gives the same bits. No software prefetch (matmul.cc).
MatmulIsa matmul_q8_isa();
void matmul_q8_block(const Q8Rows& x, int64_t rows, const PackedMatrix& w, float* y, const float* bias, int64_t p_begin,
                     int64_t p_end);
namespace baseline {
void matmul_q8_block(const Q8Rows& x, int64_t rows, const PackedMatrix& w, float* y, const float* bias, int64_t p_begin,
                     int64_t p_end);
}
namespace avx2 {
void matmul_q8_block(const Q8Rows& x, int64_t rows, const PackedMatrix& w, float* y, const float* bias, int64_t p_begin,
                     int64_t p_end);
}
namespace avx512_vnni {
void matmul_q8_block(const Q8Rows& x, int64_t rows, const PackedMatrix& w, float* y, const float* bias, int64_t p_begin,
                     int64_t p_end);
}

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
    const PanelRowBits subnormal = floats_as_bits(bits_as_floats(magnitude | (113u << 23)) -
                                                  bits_as_floats(PanelRowBits{} + (113u << 23)));
    const PanelRowBits special = magnitude | 0x7F800000u;
    const PanelRowBits bits = exponent == 0 ? subnormal : (exponent == 0x7C00u ? special : normal);
    return bits_as_floats(bits | ((u & 0x8000u) << 16));
  }
};

namespace {
// y[0, n) = s[0, n) + bias[0, n) where bias is not null: the short last
// panel of an output. Not inlined: in the AVX2 copy, inlined, it made GCC
// keep the accumulators of the multiply-add loop in memory. Yet defined in
// each unit that calls it (internal linkage, `inline` only so that the
// units that do not call it raise no unused warning): a call GCC can see
// the body of clobbers only the registers that body uses (-fipa-ra), so the
// accumulators of the other panels stay in registers across it; through an
// external call every vector register is clobbered.
__attribute__((noinline)) inline void write_partial_panel(const float* s, const float* bias, float* y, int64_t n) {
  for (int64_t l = 0; l < n; ++l) y[l] = bias != nullptr ? s[l] + bias[l] : s[l];
}
}  // namespace

// y[0, n) = lanes [0, n) of a panel row held as one PanelRow, + bias[0, n)
// where bias is not null (n <= 16): the copies whose panel row is one
// register (baseline, AVX-512).
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

}  // namespace rwd::runtime::kernels::detail
