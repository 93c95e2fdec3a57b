// rewind/dtype.h: element types and conversions.
//
// The cache stores elements as raw bytes and never converts them: what goes in
// comes back bit for bit. The conversions below are for callers (kernels,
// loaders, tests) that need f16 / bf16 arithmetic in f32.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace rwd {

enum class DType : std::uint8_t { F32, F16, BF16 };

// Bytes per element: 4 for F32, 2 for F16 and BF16.
constexpr std::size_t dtype_size(DType t) { return t == DType::F32 ? 4 : 2; }

// "f32", "f16", "bf16".
std::string_view dtype_name(DType t);

// Parses "f32"/"float32"/"F32", "f16"/"float16"/"F16", "bf16"/"bfloat16"/"BF16".
// Throws InvalidArgument naming the accepted spellings otherwise.
DType parse_dtype(std::string_view name);

// IEEE binary16 <-> binary32, round to nearest even; NaN and Inf preserved.
float f16_to_f32(std::uint16_t h);
std::uint16_t f32_to_f16(float f);

// bfloat16 <-> binary32, round to nearest even; NaN stays NaN.
inline float bf16_to_f32(std::uint16_t b) {
  std::uint32_t bits = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
std::uint16_t f32_to_bf16(float f);

// Reads / writes one element of type `t` at `p` as f32.
float load_as_f32(const void* p, DType t);
void store_from_f32(void* p, DType t, float value);

}  // namespace rwd
