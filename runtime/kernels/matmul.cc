// matmul's packed weights (PackedMatrix) and its driver: how the output
// panels are split into blocks and across threads. The arithmetic is in the
// per-ISA copies (matmul_internal.h), picked by matmul_dispatch.cc.
#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <vector>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "matmul_internal.h"
#include "rewind/error.h"

namespace rwd::runtime::kernels {

using namespace detail;

namespace {

// Output panels per block of matmul: the block's weights (about 64 KiB)
// stay in L2 while every group of rows passes over them, so each weight
// comes from memory once per call.
int64_t matmul_block_panels(int64_t in) {
  // Sized for f32 panels; f16 / bf16 ones take half of it (still L2-resident).
  const int64_t panel_bytes = std::max<int64_t>(in, 1) * kPanel * int64_t{sizeof(float)};
  return std::clamp<int64_t>(int64_t{64} * 1024 / panel_bytes, 1, 16);
}

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

void PackedMatrix::AlignedFree::operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t{alignment}); }

// Storage for `bytes` of panels, 64-byte aligned. A matrix of at least a
// huge page (2 MiB) gets whole huge pages where the kernel grants them
// (transparent huge pages, asked for with madvise, as Debian's default
// "madvise" setting requires): matmul streams such a matrix from memory,
// and with 4 KiB pages every 4 KiB of it took a TLB miss. The one-token
// forward of a 26M-parameter f32 model (104 MB of weights), six
// alternating runs: median about 5.9 ms before, 5.3 after. The advice is
// a hint: refused, the memory is the same, in small pages. Only the whole
// huge pages are advised: rounding the block up instead would have reserved
// up to 2 MiB more per matrix (a third more for a 3 MiB one); the tail
// stays in small pages.
std::byte* PackedMatrix::allocate_panels(std::size_t bytes) {
  constexpr std::size_t kHugePage = std::size_t{2} << 20;
  const std::size_t alignment = bytes < kHugePage ? 64 : kHugePage;
  std::unique_ptr<std::byte[], AlignedFree> p(
      static_cast<std::byte*>(::operator new[](bytes, std::align_val_t{alignment})), AlignedFree{alignment});
#if defined(MADV_HUGEPAGE)
  if (alignment == kHugePage) (void)madvise(p.get(), bytes / kHugePage * kHugePage, MADV_HUGEPAGE);
#endif
  owned_ = std::move(p);
  data_ = owned_.get();
  return owned_.get();
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
  pack_panels(w, out, in, m.panels(), static_cast<T*>(static_cast<void*>(m.allocate_panels(n * sizeof(T)))));
  return m;
}

PackedMatrix::PackedMatrix(const float* w, int64_t out, int64_t in)
    : PackedMatrix(packed_from(w, out, in, Element::F32)) {}

PackedMatrix PackedMatrix::from_bf16(const std::uint16_t* w, int64_t out, int64_t in) {
  return packed_from(w, out, in, Element::BF16);
}

PackedMatrix PackedMatrix::view_of(std::shared_ptr<const void> owner, const std::byte* data, Element element,
                                   int64_t out, int64_t in) {
  assert(out >= 0 && in >= 0);
  PackedMatrix m;
  m.out_ = out;
  m.in_ = in;
  m.element_ = element;
  if (m.bytes() == 0) return m;
  assert(data != nullptr && reinterpret_cast<std::uintptr_t>(data) % 64 == 0);
  m.owner_ = std::move(owner);
  m.data_ = data;
  return m;
}

PackedMatrix PackedMatrix::from_f16(const std::uint16_t* w, int64_t out, int64_t in) {
  return packed_from(w, out, in, Element::F16);
}

namespace {

// Row o of a [out, in] source matrix of `source` as f32 into dst[0, in),
// exactly.
void source_row(const void* w, PackedMatrix::Element source, int64_t o, int64_t in, float* dst) {
  const auto first = static_cast<std::size_t>(o * in);
  const auto* half = static_cast<const std::uint16_t*>(w) + first;
  switch (source) {
    case PackedMatrix::Element::BF16:
      for (int64_t i = 0; i < in; ++i) dst[i] = bf16_to_f32(half[i]);
      return;
    case PackedMatrix::Element::F16:
      for (int64_t i = 0; i < in; ++i) dst[i] = f16_to_f32(half[i]);
      return;
    default: std::memcpy(dst, static_cast<const float*>(w) + first, static_cast<std::size_t>(in) * sizeof(float));
  }
}

// The smallest bf16 >= max_abs / 127 (max_abs finite and >= 0), as its bits:
// rounding the scale up keeps every |w| / s within 127 (a scale rounded
// down could need 128). Positive floats order as their bits, so rounding up
// to bf16 is adding one unit in the kept half where any dropped bit is set.
std::uint16_t q8_scale_bits(float max_abs) {
  const double exact = static_cast<double>(max_abs) / 127.0;
  float s = static_cast<float>(exact);
  if (static_cast<double>(s) < exact) s = std::nextafter(s, std::numeric_limits<float>::infinity());
  std::uint32_t bits;
  std::memcpy(&bits, &s, sizeof bits);
  return static_cast<std::uint16_t>((bits >> 16) + ((bits & 0xFFFFu) != 0 ? 1u : 0u));
}

// The integer in [-127, 127] nearest to v / s (s > 0, |v| <= 127 s): the
// nearest integer to the quotient in double, moved by one where the exact
// error says so (q * s has at most 16 significant bits and v 24, so
// v - q * s is exact in double), so that |v - q s| <= s / 2 holds exactly.
std::int8_t q8_nearest(float v, float s) {
  const double x = static_cast<double>(v), sd = static_cast<double>(s);
  double q = std::clamp(std::nearbyint(x / sd), -127.0, 127.0);
  const double e = x - q * sd;
  if (e > sd / 2 && q < 127.0) q += 1.0;
  if (e < -sd / 2 && q > -127.0) q -= 1.0;
  return static_cast<std::int8_t>(q);
}

// The stored byte of q: q + 128 (kernels.h).
std::byte q8_stored(std::int8_t q) { return static_cast<std::byte>(static_cast<unsigned char>(q) ^ 0x80u); }

// Q8 panels of `bytes` at p with every scale 0 and every value q = 0 (the
// byte 128), which is what padding holds.
std::byte* clear_q8_panels(std::byte* p, std::size_t bytes) {
  constexpr auto kBlockBytes = static_cast<std::size_t>(PackedMatrix::kQ8BlockBytes);
  for (std::size_t b = 0; b < bytes; b += kBlockBytes) {
    std::memset(p + b, 0, kPanel * 2);
    std::memset(p + b + kPanel * 2, 0x80, kBlockBytes - kPanel * 2);
  }
  return p;
}

}  // namespace

PackedMatrix PackedMatrix::from_q8(const void* w, Element source, int64_t out, int64_t in, int64_t* non_finite) {
  assert(out >= 0 && in >= 0 && source != Element::Q8);
  if (non_finite != nullptr) *non_finite = -1;
  PackedMatrix m;
  m.out_ = out;
  m.in_ = in;
  m.element_ = Element::Q8;
  const std::size_t total = m.bytes();
  if (total == 0) return m;
  std::byte* const panels = clear_q8_panels(m.allocate_panels(total), total);
  const int64_t blocks = (in + kQ8Block - 1) / kQ8Block;
  std::vector<float> row(static_cast<std::size_t>(in));
  for (int64_t o = 0; o < out; ++o) {
    const int64_t l = o % kPanel;
    std::byte* panel = panels + static_cast<std::size_t>(o / kPanel) * m.panel_bytes();
    source_row(w, source, o, in, row.data());
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t first = b * kQ8Block, n = std::min(kQ8Block, in - first);
      const float* v = row.data() + first;
      // |v| <= FLT_MAX is false for an infinity and a NaN alike, so one
      // comparison per weight finds both while the block's maximum is taken
      // (std::max alone would skip a NaN).
      float max_abs = 0.0f;
      bool finite = true;
      for (int64_t k = 0; k < n; ++k) {
        const float a = std::abs(v[k]);
        finite &= a <= std::numeric_limits<float>::max();  // no branch: the loop stays vectorizable
        max_abs = std::max(max_abs, a);
      }
      if (!finite) {
        int64_t k = 0;
        while (std::abs(v[k]) <= std::numeric_limits<float>::max()) ++k;
        if (non_finite == nullptr) {
          throw InvalidArgument("PackedMatrix::from_q8: weight [" + std::to_string(o) + ", " +
                                std::to_string(first + k) + "] is not finite; Q8 holds finite weights only");
        }
        *non_finite = o * in + first + k;
        return PackedMatrix();
      }
      std::byte* block = panel + b * kQ8BlockBytes;
      if (max_abs == 0.0f) continue;  // scale and values stay 0
      const std::uint16_t scale_bits = q8_scale_bits(max_abs);
      std::memcpy(block + l * 2, &scale_bits, sizeof scale_bits);
      const float s = bf16_to_f32(scale_bits);
      for (int64_t k = 0; k < n; ++k) block[q8_value_offset(l, k)] = q8_stored(q8_nearest(v[k], s));
    }
  }
  return m;
}

PackedMatrix PackedMatrix::from_q8_blocks(const std::int8_t* q, const std::byte* scales, int64_t out, int64_t in) {
  assert(out >= 0 && in >= 0);
  PackedMatrix m;
  m.out_ = out;
  m.in_ = in;
  m.element_ = Element::Q8;
  const std::size_t total = m.bytes();
  if (total == 0) return m;
  std::byte* const panels = clear_q8_panels(m.allocate_panels(total), total);
  const int64_t blocks = (in + kQ8Block - 1) / kQ8Block;
  for (int64_t o = 0; o < out; ++o) {
    const int64_t l = o % kPanel;
    std::byte* panel = panels + static_cast<std::size_t>(o / kPanel) * m.panel_bytes();
    const std::int8_t* row = q + o * in;
    const std::byte* row_scales = scales + static_cast<std::size_t>(o * blocks) * 2;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t first = b * kQ8Block, n = std::min(kQ8Block, in - first);
      std::byte* block = panel + b * kQ8BlockBytes;
      std::memcpy(block + l * 2, row_scales + b * 2, 2);
      for (int64_t k = 0; k < n; ++k) block[q8_value_offset(l, k)] = q8_stored(row[first + k]);
    }
  }
  return m;
}

void PackedMatrix::q8_row(int64_t o, std::int8_t* q, std::uint16_t* scales) const {
  assert(element_ == Element::Q8 && o >= 0 && o < out_);
  const int64_t l = o % kPanel;
  const std::byte* panel = static_cast<const std::byte*>(panel_data(o / kPanel));
  const int64_t blocks = (in_ + kQ8Block - 1) / kQ8Block;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = b * kQ8Block, n = std::min(kQ8Block, in_ - first);
    const std::byte* block = panel + b * kQ8BlockBytes;
    std::memcpy(scales + b, block + l * 2, 2);
    for (int64_t k = 0; k < n; ++k) q[first + k] = q8_value(block[q8_value_offset(l, k)]);
  }
}

namespace {

// How far ahead matmul prefetches in each panel stream (0: not at all). A
// matrix larger than an L2 cache most likely streams from L3 or memory;
// there, without software prefetch, a forward of several rows stalled on
// its loads instead of overlapping them with the arithmetic (a 5-token
// forward of a 26M-parameter model held as f32 cost 2.27x a one-token one
// before, 1.31x now, docs/performance.md section 2). A model that fits in
// L3 gains nothing from it and lost about 2 % to the extra instructions,
// hence the size test. With fewer than 4 rows the CPU's own prefetcher
// streams the panels faster: on an AMD Zen 4 the one-token forward of a
// 354M-parameter bf16 model took 29.5 ms without software prefetch and 34
// with it, two and three rows 31-33 against 35 (four rows are even, five
// and six 1.1x faster with it; docs/performance.md section 11). Q8 matmul
// never prefetches: there every row count up to 6 was faster without
// (one row 17.0 ms against 23.7, five 27.2 against 34.8).
constexpr std::size_t kPrefetchMatrixBytes = 256 * 1024;
constexpr int64_t kPrefetchAheadBytes = 4096;
constexpr int64_t kPrefetchMinRows = 4;

// Blocks per thread when one group of rows is split across threads: the
// threads take blocks as they come (parallel.cc), so a thread the OS
// deschedules holds up at most the block it has started.
constexpr int64_t kBlocksPerThread = 4;

bool streamed(const PackedMatrix& w) { return w.bytes() >= kPrefetchMatrixBytes; }

int64_t matmul_prefetch_bytes(const PackedMatrix& w, int64_t rows) {
  return streamed(w) && rows >= kPrefetchMinRows ? kPrefetchAheadBytes : 0;
}

// Whether a product of `rows` rows with w is worth splitting across threads.
bool worth_threads(int64_t rows, const PackedMatrix& w) {
  return rows * w.in() * w.out() >= kParallelWork && max_threads() > 1;
}

// Panels per block when one pass over w is split across the threads (or
// not, when it is not worth it): kBlocksPerThread blocks per thread, in
// multiples of 4 panels.
int64_t thread_split_panels(const PackedMatrix& w, bool split) {
  const int64_t parts = split ? max_threads() * kBlocksPerThread : 1;
  return ((w.panels() + parts - 1) / parts + 3) / 4 * 4;
}

// x: [rows, in] quantized for a Q8 matrix into `storage` (Q8Rows): per row
// and block of 32 inputs, a = the largest |x|; d = a / 127 and each value
// the integer nearest to x / d (ties to even; within [-127, 127] since
// |x| <= a), both divisions in f32. A block of zeros has d = 0, and one
// holding an infinity or a NaN d = NaN and values 0, so that its outputs
// are NaN as the f32 matmul's would be. Plain scalar code, the same in
// every build, since every instruction-set copy reads what it makes.
Q8Rows quantize_q8_rows(const float* x, int64_t rows, int64_t in, std::vector<std::byte>& storage) {
  const int64_t blocks = (in + PackedMatrix::kQ8Block - 1) / PackedMatrix::kQ8Block;
  const auto n = static_cast<std::size_t>(rows * blocks);
  storage.resize(n * (PackedMatrix::kQ8Block + sizeof(float) + sizeof(std::int32_t)));
  auto* values = reinterpret_cast<std::int8_t*>(storage.data());
  auto* scale = reinterpret_cast<float*>(storage.data() + n * PackedMatrix::kQ8Block);
  auto* sum = reinterpret_cast<std::int32_t*>(storage.data() + n * (PackedMatrix::kQ8Block + sizeof(float)));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * in + b * PackedMatrix::kQ8Block;
      const int64_t count = std::min(PackedMatrix::kQ8Block, in - b * PackedMatrix::kQ8Block);
      const std::size_t at = static_cast<std::size_t>(r * blocks + b);
      std::int8_t* q = values + at * PackedMatrix::kQ8Block;
      float a = 0.0f;
      bool finite = true;
      for (int64_t k = 0; k < count; ++k) {
        const float m = std::abs(xb[k]);
        finite &= m <= std::numeric_limits<float>::max();
        a = std::max(a, m);
      }
      std::int32_t total = 0;
      if (!finite || a == 0.0f) {
        std::memset(q, 0, PackedMatrix::kQ8Block);
        scale[at] = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
      } else {
        const float d = a / 127.0f;
        for (int64_t k = 0; k < PackedMatrix::kQ8Block; ++k) {
          const float v = k < count ? std::clamp(std::nearbyint(xb[k] / d), -127.0f, 127.0f) : 0.0f;
          q[k] = static_cast<std::int8_t>(v);
          total += q[k];
        }
        scale[at] = d;
      }
      sum[at] = total;
    }
  }
  return Q8Rows{values, scale, sum, blocks};
}

// Panels per block of a Q8 matmul of more rows than one group: about
// 128 KiB of blocks, which every group of rows then reads from L2.
int64_t q8_block_panels(int64_t in) {
  const auto panel_bytes = static_cast<int64_t>(PackedMatrix::storage_bytes(PackedMatrix::Element::Q8, kPanel, in));
  return std::max<int64_t>(4, int64_t{128} * 1024 / std::max<int64_t>(panel_bytes, 1) / 4 * 4);
}

// Q8: the rows quantized once, then the panels split across the threads as
// for one group of rows; with more rows than the smallest copy's group (4,
// AVX2 and baseline), in L2-sized blocks that each group reads from L2.
void matmul_q8(const float* x, int64_t rows, const PackedMatrix& w, float* y, const float* bias) {
  std::vector<std::byte> storage;
  const Q8Rows q = quantize_q8_rows(x, rows, w.in(), storage);
  const bool split = worth_threads(rows, w);
  int64_t block = thread_split_panels(w, split);
  if (rows > 4) block = std::min(block, q8_block_panels(w.in()));
  const int64_t num_blocks = (w.panels() + block - 1) / block;
  parallel_for(num_blocks, num_blocks > 1 && split, [&](int64_t b) {
    matmul_q8_block(q, rows, w, y, bias, b * block, std::min(w.panels(), (b + 1) * block));
  });
}

}  // namespace

void matmul(const float* x, int64_t rows, const PackedMatrix& w, float* y, const float* bias) {
  if (rows <= 0 || w.out() <= 0) return;
  if (w.element() == PackedMatrix::Element::Q8) {
    matmul_q8(x, rows, w, y, bias);
    return;
  }
  const bool split = worth_threads(rows, w);
  const int64_t ahead = matmul_prefetch_bytes(w, rows);
  int64_t block = matmul_block_panels(w.in());
  const bool wide = matmul_isa() == MatmulIsa::Avx512;
  const int64_t max_group = wide ? wide_group_rows(w.element(), ahead) : kMaxGroupRows;
  const bool streamed_f32_rows = rows <= 2 && streamed(w) && w.element() == PackedMatrix::Element::F32;
  if (rows <= max_group && !streamed_f32_rows) {
    // One group of rows passes over the weights once, so L2-sized blocks
    // buy nothing; small ones cost: a block of 2 or 5 panels left the 4-
    // panel micro-kernel of one row unused, or used it once and then ran a
    // 1-panel tail, one accumulator waiting on its own adds. Blocks here are
    // the panels split across the threads, in multiples of 4 (the shipped
    // target's one-token forward: 90 -> 79 us). Except for one or two rows
    // of an f32 matrix streamed from memory: there its L2
    // blocks (2 panels of 512 inputs) run two panels at a time, and that
    // was faster than four streams at once (a 26M-parameter f32 model's
    // two-token forward: 2.67 ms against 2.79). f16 / bf16 panels, half the
    // bytes per weight, go the other way since matmul fuses its multiply-
    // adds: four streams at once took that model's f16 one-token forward
    // from 1.88 to 1.50 ms.
    block = thread_split_panels(w, split);
  } else if (wide && rows > max_group) {
    // Several groups over L2 blocks: a whole number of the widest micro-
    // kernel's panels (4 for groups of 6 rows, 3 for 8), so that no group
    // runs a narrower tail on every block (the shipped target's 192 inputs
    // gave blocks of 5 panels: its 12-token forward took 733 us against 705).
    const int64_t step = wide_panels_for_rows(static_cast<int>(max_group));
    block = std::max<int64_t>(step, block / step * step);
  }
  const int64_t num_blocks = (w.panels() + block - 1) / block;
  const bool parallel = num_blocks > 1 && split;
  parallel_for(num_blocks, parallel, [&](int64_t b) {
    matmul_block(x, rows, w, y, bias, b * block, std::min(w.panels(), (b + 1) * block), ahead);
  });
}

}  // namespace rwd::runtime::kernels
