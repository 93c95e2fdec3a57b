// Weights in their checkpoint dtype: a bf16 or f16 checkpoint stays so in
// memory (the matmul widens each weight exactly as it loads it), loading
// holds the file's bytes about once, and the logits are bit for bit those of
// the same values in f32, alone or in any batch or chunk. make test runs
// these with each of the f16 widening paths (AVX-512F, AVX2 + F16C,
// software: REWIND_MATMUL_NARROW, REWIND_MATMUL_F16_SOFTWARE).
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "runtime/kernels.h"
#include "runtime/model.h"
#include "runtime/weights_io.h"
#include "test_configs.h"

namespace rwd::runtime {
namespace {

namespace fs = std::filesystem;

// Element i of `t` as f32: the library's scalar conversions (rewind/dtype.h),
// independent of the kernels' vector widening.
float as_f32(const Tensor& t, std::int64_t i) {
  switch (t.view().dtype) {
    case DType::BF16: return bf16_to_f32(t.data<std::uint16_t>()[i]);
    case DType::F16: return f16_to_f32(t.data<std::uint16_t>()[i]);
    default: return t.data<float>()[i];
  }
}

// The weights of `w` widened to f32 (the values a half-precision model
// computes with).
ModelWeights widened(const ModelWeights& w) {
  std::map<std::string, Tensor, std::less<>> out;
  for (const auto& name : w.names()) {
    const Tensor& t = w.get(name);
    Tensor f(DType::F32, t.view().shape.data(), t.view().rank);
    for (std::int64_t i = 0; i < t.numel(); ++i) f.data<float>()[i] = as_f32(t, i);
    out.emplace(name, std::move(f));
  }
  return ModelWeights::from_tensors(w.config(), std::move(out));
}

TEST(WeightsMemory, HalfPrecisionKernelsGiveTheF32BitsAloneAndBatched) {
  for (const DType dtype : {DType::BF16, DType::F16}) {
    for (const bool tied : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (tied ? " tied" : " untied"));
      ModelConfig c = testing_configs::hybrid();
      c.tie_word_embeddings = tied;
      const ModelWeights w = ModelWeights::random(c, 5, dtype);
      ASSERT_EQ(w.get("model.layers.0.mlp.up_proj.weight").view().dtype, dtype);
      const Model f32(widened(w));
      const Model half(ModelWeights::random(c, 5, dtype));
      std::vector<std::int32_t> tokens;
      for (int i = 0; i < 40; ++i) tokens.push_back((i * 37 + 11) % 258);
      std::vector<float> a, b, part;
      Cache ca = f32.make_cache(), cb = half.make_cache();
      f32.forward(tokens, ca, a, true);
      // The half-precision model in chunks: one forward per token, then the
      // rest at once.
      std::size_t at = 0;
      for (std::size_t n : {std::size_t{1}, std::size_t{1}, std::size_t{3}, tokens.size()}) {
        n = std::min(n, tokens.size() - at);
        half.forward(std::span<const std::int32_t>(tokens.data() + at, n), cb, part, true);
        b.insert(b.end(), part.begin(), part.end());
        at += n;
      }
      ASSERT_EQ(a.size(), b.size());
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
    }
  }
}

// A 20 x 7 matrix of half-precision bit patterns w packed as `element`:
// two panels of 16 outputs x 7 inputs at 2 bytes each, holding exactly the
// values `widen` (the library's scalar conversion) gives, and matmul of one
// row computing matmul's in-order chains of fused multiply-adds of those
// values.
void expect_packed_half_matrix(const std::vector<std::uint16_t>& w, kernels::PackedMatrix::Element element,
                               float (*widen)(std::uint16_t)) {
  const auto m = element == kernels::PackedMatrix::Element::BF16 ? kernels::PackedMatrix::from_bf16(w.data(), 20, 7)
                                                                 : kernels::PackedMatrix::from_f16(w.data(), 20, 7);
  EXPECT_EQ(m.element(), element);
  EXPECT_EQ(m.bytes(), 2u * 16 * 7 * 2);
  auto value = [&](std::int64_t o, std::int64_t i) { return widen(w[static_cast<std::size_t>(o * 7 + i)]); };
  for (std::int64_t o = 0; o < 20; ++o)
    for (std::int64_t i = 0; i < 7; ++i) EXPECT_EQ(m.at(o, i), value(o, i));
  std::vector<float> x(7), y(20);
  for (std::size_t i = 0; i < 7; ++i) x[i] = 0.5f + static_cast<float>(i);
  kernels::matmul(x.data(), 1, m, y.data());
  for (std::int64_t o = 0; o < 20; ++o) {
    float s = 0.0f;
    for (std::int64_t i = 0; i < 7; ++i) s = std::fma(x[static_cast<std::size_t>(i)], value(o, i), s);
    EXPECT_EQ(y[static_cast<std::size_t>(o)], s) << o;
  }
}

TEST(WeightsMemory, PackedBf16MatrixHoldsTwoBytesPerWeightAndTheExactValues) {
  std::vector<std::uint16_t> w(20 * 7);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<std::uint16_t>(0x3F80 + 37 * i);
  expect_packed_half_matrix(w, kernels::PackedMatrix::Element::BF16, bf16_to_f32);
}

TEST(WeightsMemory, PackedF16MatrixHoldsTwoBytesPerWeightAndTheExactValues) {
  // Normals of both signs, subnormals, zeros of both signs, the largest
  // finite value: every class a trained checkpoint holds.
  const std::uint16_t classes[] = {0x3C00, 0xC000, 0x3555, 0x0001, 0x03FF, 0x8001, 0x0000,
                                   0x8000, 0x7BFF, 0xFBFF, 0x0400, 0x2E66, 0xB2CD, 0x1234};
  std::vector<std::uint16_t> w(20 * 7);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = classes[(i * 5) % std::size(classes)];
  expect_packed_half_matrix(w, kernels::PackedMatrix::Element::F16, f16_to_f32);
}

// Each of the 65,536 f16 bit patterns through matmul (one input, x = 1: the
// output is 0 + w exactly) against the scalar conversion of rewind/dtype.h:
// the widening path this process runs (vcvtph2ps or the software one) gives
// the same value for every one, infinities included; NaNs stay NaN.
TEST(WeightsMemory, MatmulWidensEveryF16PatternExactly) {
  std::vector<std::uint16_t> w(65536);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<std::uint16_t>(i);
  const auto m = kernels::PackedMatrix::from_f16(w.data(), 65536, 1);
  for (const std::int64_t rows : {1, 3, 6, 8}) {  // other row groups, other register shapes
    std::vector<float> x(static_cast<std::size_t>(rows), 1.0f), y(static_cast<std::size_t>(rows) * 65536);
    kernels::matmul(x.data(), rows, m, y.data());
    int mismatches = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::size_t i = 0; i < w.size(); ++i) {
        const float got = y[static_cast<std::size_t>(r) * 65536 + i];
        const float want = 0.0f + f16_to_f32(w[i]);
        const bool same = std::isnan(want) ? std::isnan(got) : std::memcmp(&got, &want, sizeof got) == 0;
        if (!same && ++mismatches <= 5) ADD_FAILURE() << "f16 0x" << std::hex << i << ": " << got << ", want " << want;
      }
    }
    EXPECT_EQ(mismatches, 0) << rows << " rows";
  }
}

// A half-precision matrix large enough to be streamed (prefetched, as a big
// model's are: 262 x 515 in f16 is 270 KB) through every row-group shape
// (1 to 8 rows alone; 13 and 16 in groups; 5 and 6 rows keep four panels
// in flight there): every output is the in-order chain of fused
// multiply-adds of the widened weights, computed here with std::fma.
TEST(WeightsMemory, StreamedF16MatrixGivesTheInOrderFmaChainForEveryRowCount) {
  const std::int64_t out = 262, in = 515;
  std::vector<std::uint16_t> w(static_cast<std::size_t>(out * in));
  for (std::size_t i = 0; i < w.size(); ++i) {
    // Normal f16 values of both signs, from 2^-3 to 2^3.
    const auto magnitude = static_cast<std::uint16_t>(0x3000 + (i * 2654435761u >> 7) % 0x1800);
    w[i] = static_cast<std::uint16_t>(magnitude | (i % 3 == 0 ? 0x8000 : 0));
  }
  const auto m = kernels::PackedMatrix::from_f16(w.data(), out, in);
  ASSERT_GE(m.bytes(), 256u * 1024) << "the test wants a streamed matrix";
  for (const std::int64_t rows : {1, 2, 3, 4, 5, 6, 7, 8, 13, 16}) {
    std::vector<float> x(static_cast<std::size_t>(rows * in)), y(static_cast<std::size_t>(rows * out));
    for (std::size_t i = 0; i < x.size(); ++i) {
      x[i] = static_cast<float>(static_cast<int>(i * 40503u % 2001) - 1000) / 997.0f;
    }
    kernels::matmul(x.data(), rows, m, y.data());
    int mismatches = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t o = 0; o < out; ++o) {
        float s = 0.0f;
        for (std::int64_t i = 0; i < in; ++i) {
          s = std::fma(x[static_cast<std::size_t>(r * in + i)], f16_to_f32(w[static_cast<std::size_t>(o * in + i)]), s);
        }
        const float got = y[static_cast<std::size_t>(r * out + o)];
        if (std::memcmp(&got, &s, sizeof s) != 0 && ++mismatches <= 3) {
          ADD_FAILURE() << rows << " rows: row " << r << " output " << o << ": " << got << ", want " << s;
        }
      }
    }
    EXPECT_EQ(mismatches, 0) << rows << " rows";
  }
}

#ifdef REWIND_CLI_PATH
// The peak resident memory `rewind inspect --model dir` reports for itself
// (VmHWM, KiB): the CLI plus loading the model.
long inspect_peak_kib(const std::string& dir) {
  const std::string out = (fs::temp_directory_path() / ("rewind_inspect_" + std::to_string(getpid()))).string();
  const std::string cmd = std::string("'") + REWIND_CLI_PATH + "' inspect --model '" + dir + "' > '" + out + "'";
  if (std::system(cmd.c_str()) != 0) return -1;
  std::ifstream in(out);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  fs::remove(out);
  const std::string key = "peak resident memory of this process: ";
  const auto at = text.find(key);
  return at == std::string::npos ? -1 : std::stol(text.substr(at + key.size()));
}

TEST(WeightsMemory, LoadingAHalfPrecisionCheckpointPeaksNearItsSize) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "sanitizers keep freed memory (quarantine) and add shadow memory: resident sizes mean nothing";
#endif
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
  GTEST_SKIP() << "sanitizers keep freed memory (quarantine) and add shadow memory: resident sizes mean nothing";
#endif
#endif
  // About 30 MB of half-precision weights: large against the allocator's
  // and the test's own noise.
  ModelConfig c = testing_configs::hybrid({"full_attention", "linear_attention", "conv", "sliding_attention"}, 384);
  c.intermediate_size = 1536;
  c.vocab_size = 8192;
  c.linear_num_key_heads = 4;
  c.linear_num_value_heads = 8;
  c.linear_key_head_dim = 48;
  c.linear_value_head_dim = 48;
  for (const DType dtype : {DType::BF16, DType::F16}) {
    const std::string name(dtype_name(dtype));
    SCOPED_TRACE(name);
    const fs::path dir = fs::temp_directory_path() / ("rewind_weights_memory_" + std::to_string(getpid()));
    write_random_model(c, dir.string(), 1, dtype);
    // The same process with a tiny model: the CLI's own footprint.
    const fs::path tiny = fs::temp_directory_path() / ("rewind_weights_memory_tiny_" + std::to_string(getpid()));
    write_random_model(testing_configs::hybrid(), tiny.string(), 1, dtype);
    const auto file_kib = static_cast<long>(fs::file_size(dir / "model.safetensors") / 1024);
    const long base = inspect_peak_kib(tiny.string());
    const long total = inspect_peak_kib(dir.string());
    fs::remove_all(dir);
    fs::remove_all(tiny);
    ASSERT_GT(base, 0);
    ASSERT_GT(total, 0);
    const long peak = total - base;
    std::printf(
        "%s checkpoint %ld KiB: peak resident memory of loading it %ld KiB (%.2fx; process %ld KiB, of "
        "which %ld KiB for the CLI with a tiny model)\n",
        name.c_str(), file_kib, peak, static_cast<double>(peak) / static_cast<double>(file_kib), total, base);
    // Converting to f32 and packing a copy (what the runtime did before)
    // peaks near 4x the file. Now: the file's bytes once, plus, while one
    // matrix is packed, that matrix twice (here the 6 MiB output matrix,
    // 0.2x).
    EXPECT_LT(peak, file_kib * 14 / 10);
    EXPECT_GT(peak, file_kib * 9 / 10);  // the weights are all there
  }
}
#endif

}  // namespace
}  // namespace rwd::runtime
