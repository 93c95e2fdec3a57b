// Q8 checkpoints (write_q8_checkpoint, `rewind quantize`,
// docs/quantization.md): loading one gives, bit for bit, the model that
// quantizing the original at load gives (logits compared exactly, greedy
// tokens equal), on random models of every layer kind and family and on
// the shipped models; what the file holds; and every refusal: as-stored
// weights asked of it, corrupt or truncated files (naming file and
// tensor, nothing loaded), an output directory in use, a source it cannot
// quantize (no output left behind). Also the one-pass quantization's own
// non-finite check (kernels::PackedMatrix::from_q8).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "model_test_util.h"
#include "rewind/error.h"
#include "runtime/generate.h"
#include "runtime/kernels.h"
#include "runtime/model.h"
#include "runtime/safetensors.h"
#include "runtime/weights_io.h"
#include "test_configs.h"

namespace rwd::runtime {
namespace {

namespace fs = std::filesystem;
using kernels::PackedMatrix;
using testing_configs::hybrid;
using testing_configs::kEveryKind;

std::string source_path(const std::string& relative) { return std::string(REWIND_SOURCE_DIR) + "/" + relative; }

class Q8Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("rewind_q8ck_" + std::to_string(::getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string path(const std::string& name) const { return (root_ / name).string(); }

  fs::path root_;
};

// Loading `quantized` equals loading `original` with kQ8: the same logits
// bit for bit, the same greedy tokens, memory and parameter count.
void expect_same_model(const std::string& original, const std::string& quantized, const std::string& what) {
  SCOPED_TRACE(what);
  const Model at_load = Model::load(original, LoadOptions{WeightFormat::kQ8});
  const Model stored = Model::load(quantized);
  EXPECT_EQ(stored.weight_format(), WeightFormat::kQ8);
  EXPECT_EQ(Model::load(quantized, LoadOptions{WeightFormat::kQ8}).weight_bytes(), stored.weight_bytes());
  EXPECT_EQ(stored.weight_bytes(), at_load.weight_bytes());
  EXPECT_EQ(stored.parameter_count(), at_load.parameter_count());
  EXPECT_EQ(stored.config().tie_word_embeddings, at_load.config().tie_word_embeddings);
  const std::string prompt = "And God said, Let there be light: and there was light.";
  const std::vector<float> a = logits_of(at_load, prompt), b = logits_of(stored, prompt);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "logits differ";
  const std::vector<std::int32_t> tokens = encode_prompt("In the beginning", stored.config());
  EXPECT_EQ(generate(stored, tokens, greedy(24)), generate(at_load, tokens, greedy(24)));
}

TEST_F(Q8Checkpoint, LoadsBitIdenticalToQuantizingAtLoadForEveryLayerKindAndDtype) {
  // hidden 40: inputs of 40, 80 and 32, so short last blocks too.
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    for (std::int64_t hidden : {32, 40}) {
      const std::string name = std::string(dtype_name(dtype)) + "_" + std::to_string(hidden);
      write_random_model(hybrid(kEveryKind, hidden), path(name), 3, dtype);
      const QuantizeResult r = write_q8_checkpoint(path(name), path(name + "_q8"));
      EXPECT_GT(r.quantized, 0);
      EXPECT_EQ(r.file_bytes, fs::file_size(path(name + "_q8") + "/model.safetensors"));
      expect_same_model(path(name), path(name + "_q8"), name);
    }
  }
}

// The families' variants: fused projections split at load (Qwen3-Next's
// qkvz / ba, Qwen3.5's query + gate rows), tied and untied heads, LFM2's
// conv layers, Qwen3.5's prefix.
TEST_F(Q8Checkpoint, LoadsBitIdenticalToQuantizingAtLoadForEveryFamily) {
  for (const auto& entry : fs::directory_iterator(source_path("tests/fixtures/families"))) {
    const std::string name = entry.path().filename().string();
    write_q8_checkpoint(entry.path().string(), path(name));
    expect_same_model(entry.path().string(), path(name), name);
  }
}

TEST_F(Q8Checkpoint, ShippedModelsLoadBitIdenticalAndTheFileHoldsTheLayout) {
  for (const std::string name : {"kjv-hybrid", "kjv-draft"}) {
    const std::string original = source_path("models/" + name);
    write_q8_checkpoint(original, path(name));
    expect_same_model(original, path(name), name);
    // Every file but the weights copied unchanged.
    for (const char* file : {"config.json", "README.md", "training.json"}) {
      std::ifstream a(original + "/" + file), b(path(name) + "/" + file);
      const std::string ta((std::istreambuf_iterator<char>(a)), {}), tb((std::istreambuf_iterator<char>(b)), {});
      EXPECT_EQ(ta, tb) << file;
    }
    // The layout of docs/quantization.md: W.q8 I8 [out, in], W.q8_scale
    // BF16 [out, ceil(in / 32)] with the values of PackedMatrix::from_q8.
    const SafetensorsFile f = SafetensorsFile::open(path(name) + "/model.safetensors");
    EXPECT_EQ(f.metadata().at(kQ8FormatKey), "q8");
    EXPECT_EQ(f.metadata().at(kQ8VersionKey), "1");
    EXPECT_EQ(f.metadata().at(kQ8BlockKey), "32");
    const ModelWeights w = ModelWeights::load(original);
    for (const WeightSpec& spec : expected_weights(w.config())) {
      if (!spec.matmul) {
        const TensorEntry& e = f.get(spec.name);
        EXPECT_EQ(0, std::memcmp(e.data, w.get(spec.name).data<std::byte>(), e.nbytes)) << spec.name;
        continue;
      }
      const TensorEntry& q = f.get(spec.name + ".q8");
      const TensorEntry& s = f.get(spec.name + ".q8_scale");
      const std::int64_t out = spec.shape[0], in = spec.shape[1], blocks = (in + 31) / 32;
      ASSERT_TRUE(q.i8);
      EXPECT_EQ(q.shape, spec.shape);
      EXPECT_EQ(s.dtype, DType::BF16);
      EXPECT_EQ(s.shape, (std::vector<std::int64_t>{out, blocks}));
      EXPECT_EQ(f.find(spec.name), nullptr);
      const Tensor& t = w.get(spec.name);
      const PackedMatrix::Element element = t.view().dtype == DType::F16    ? PackedMatrix::Element::F16
                                            : t.view().dtype == DType::BF16 ? PackedMatrix::Element::BF16
                                                                            : PackedMatrix::Element::F32;
      const PackedMatrix m = PackedMatrix::from_q8(t.data<std::byte>(), element, out, in);
      for (std::int64_t o = 0; o < out; o += 7) {
        for (std::int64_t i = 0; i < in; i += 5) {
          std::uint16_t bits;
          std::memcpy(&bits, s.data + 2 * (o * blocks + i / 32), 2);
          const auto value = static_cast<std::int8_t>(q.data[o * in + i]);
          ASSERT_EQ(static_cast<float>(value) * bf16_to_f32(bits), m.at(o, i))
              << spec.name << " [" << o << ", " << i << "]";
        }
      }
    }
  }
}

TEST_F(Q8Checkpoint, RefusesAsStoredWeightsNamingWhatIsAllowed) {
  write_random_model(hybrid(kEveryKind), path("m"), 4, DType::BF16);
  write_q8_checkpoint(path("m"), path("q"));
  try {
    Model::load(path("q"), LoadOptions{WeightFormat::kAsStored});
    ADD_FAILURE() << "as-stored weights of a Q8 checkpoint were loaded";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("already quantized"), std::string::npos) << what;
    EXPECT_NE(what.find("q8"), std::string::npos) << what;
  }
  // Anything else loads it as Q8; an original stays as stored by default.
  EXPECT_EQ(Model::load(path("q")).weight_format(), WeightFormat::kQ8);
  EXPECT_EQ(Model::load(path("m")).weight_format(), WeightFormat::kAsStored);
  EXPECT_TRUE(ModelWeights::load(path("q")).q8());
  EXPECT_FALSE(ModelWeights::load(path("m")).q8());
  // A Q8 checkpoint is not quantized again.
  EXPECT_THROW(write_q8_checkpoint(path("q"), path("qq")), InvalidArgument);
  EXPECT_FALSE(fs::exists(path("qq")));
}

// A copy of `dir`'s model.safetensors with its tensors and metadata
// changed by `edit`, written to `out` with `dir`'s config.json.
template <class Edit>
void rewrite(const std::string& dir, const std::string& out, Edit edit) {
  const SafetensorsFile f = SafetensorsFile::open(dir + "/model.safetensors");
  std::map<std::string, std::vector<std::byte>> bytes;
  std::vector<TensorToWrite> tensors;
  for (const TensorEntry& e : f.entries()) {
    bytes[e.name].assign(e.data, e.data + e.nbytes);
    tensors.push_back({e.name, e.dtype, e.shape, {}, e.i8});
  }
  std::map<std::string, std::string> metadata = f.metadata();
  edit(tensors, bytes, metadata);
  for (TensorToWrite& t : tensors) t.bytes = bytes[t.name];
  fs::create_directories(out);
  fs::copy_file(dir + "/config.json", out + "/config.json", fs::copy_options::overwrite_existing);
  write_safetensors(out + "/model.safetensors", tensors, metadata);
}

// What loading `dir` throws (FormatError), or "" when it loads.
std::string load_error(const std::string& dir) {
  try {
    Model::load(dir);
  } catch (const FormatError& e) {
    return e.what();
  }
  return "";
}

TEST_F(Q8Checkpoint, RefusesCorruptFilesNamingFileAndTensor) {
  write_random_model(hybrid(kEveryKind), path("m"), 5, DType::BF16);
  write_q8_checkpoint(path("m"), path("q"));
  const ModelConfig c = ModelWeights::load(path("m")).config();
  const std::string up = weight_name(c, 1, WeightRole::MlpUp);
  const std::string file = path("bad") + "/model.safetensors";
  auto expect_refused = [&](const std::string& must_name) {
    const std::string error = load_error(path("bad"));
    EXPECT_NE(error.find(file), std::string::npos) << error;
    EXPECT_NE(error.find(must_name), std::string::npos) << error;
  };
  // A scale that is not finite, or negative.
  for (std::uint16_t bits : {std::uint16_t{0x7FC0}, std::uint16_t{0x7F80}, std::uint16_t{0xBF80}}) {
    rewrite(path("q"), path("bad"),
            [&](auto&, auto& bytes, auto&) { std::memcpy(bytes[up + ".q8_scale"].data() + 2 * 3, &bits, 2); });
    expect_refused("'" + up + ".q8_scale' holds an invalid scale at [3, 0]");  // one block per row of 32
  }
  // Values missing, or stored in another dtype or shape.
  rewrite(path("q"), path("bad"), [&](auto& tensors, auto&, auto&) {
    std::erase_if(tensors, [&](const TensorToWrite& t) { return t.name == up + ".q8"; });
  });
  expect_refused("missing tensor '" + up + ".q8'");
  rewrite(path("q"), path("bad"), [&](auto& tensors, auto& bytes, auto&) {
    for (TensorToWrite& t : tensors) {
      if (t.name == up + ".q8_scale") {
        t.shape[1] += 1;
        bytes[t.name].resize(bytes[t.name].size() + 2 * static_cast<std::size_t>(t.shape[0]));
      }
    }
  });
  expect_refused("'" + up + ".q8_scale' is BF16");
  rewrite(path("q"), path("bad"), [&](auto& tensors, auto&, auto&) {
    for (TensorToWrite& t : tensors)
      if (t.name == up + ".q8_scale") t.dtype = DType::F16;
  });
  expect_refused("'" + up + ".q8_scale' is F16");
  // A format version or block size this build does not read.
  rewrite(path("q"), path("bad"), [&](auto&, auto&, auto& metadata) { metadata[kQ8VersionKey] = "2"; });
  expect_refused("version '2'");
  rewrite(path("q"), path("bad"), [&](auto&, auto&, auto& metadata) { metadata[kQ8BlockKey] = "64"; });
  expect_refused("block size '64'");
  // Without the format named, the file lacks the float weights.
  rewrite(path("q"), path("bad"), [&](auto&, auto&, auto& metadata) { metadata.erase(kQ8FormatKey); });
  expect_refused("missing tensor");
  // An int8 tensor where a float one belongs.
  rewrite(path("m"), path("bad"), [&](auto& tensors, auto& bytes, auto&) {
    for (TensorToWrite& t : tensors) {
      if (t.name == up) {
        t.i8 = true;
        bytes[t.name].resize(bytes[t.name].size() / 2);
      }
    }
  });
  expect_refused("'" + up + "' is I8");
  // Truncated: the header promises bytes the file no longer has.
  fs::remove_all(path("bad"));
  fs::create_directories(path("bad"));
  fs::copy_file(path("q") + "/config.json", path("bad") + "/config.json");
  fs::copy_file(path("q") + "/model.safetensors", file);
  fs::resize_file(file, fs::file_size(file) - 100);
  const std::string error = load_error(path("bad"));
  EXPECT_NE(error.find(file), std::string::npos) << error;
  EXPECT_NE(error.find("tensor '"), std::string::npos) << error;
}

TEST_F(Q8Checkpoint, WritesAtomicallyAndRefusesAnOutputInUse) {
  write_random_model(hybrid({"conv", "full_attention"}), path("m"), 6, DType::F32);
  // An existing non-empty directory (or a file) is left as it was.
  fs::create_directories(path("full"));
  std::ofstream(path("full") + "/keep.txt") << "mine";
  EXPECT_THROW(write_q8_checkpoint(path("m"), path("full")), InvalidArgument);
  EXPECT_TRUE(fs::exists(path("full") + "/keep.txt"));
  EXPECT_FALSE(fs::exists(path("full") + "/model.safetensors"));
  std::ofstream(path("file")) << "x";
  EXPECT_THROW(write_q8_checkpoint(path("m"), path("file")), InvalidArgument);
  // An empty directory is filled.
  fs::create_directories(path("empty"));
  write_q8_checkpoint(path("m"), path("empty"));
  EXPECT_TRUE(ModelWeights::load(path("empty")).q8());
  write_q8_checkpoint(path("m"), path("slash") + "/");  // the directory named, not one inside it
  EXPECT_TRUE(ModelWeights::load(path("slash")).q8());
  // A failure part way (a NaN in the last layer's MLP) leaves nothing:
  // neither the output nor the temporary directory beside it.
  const ModelConfig c = ModelWeights::load(path("m")).config();
  const std::string down = weight_name(c, 1, WeightRole::MlpDown);
  rewrite(path("m"), path("nan"), [&](auto&, auto& bytes, auto& metadata) {
    metadata.clear();
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::memcpy(bytes[down].data() + 4 * 70, &nan, 4);  // [1, 6]: 64 inputs per row
  });
  const auto entries_before = std::distance(fs::directory_iterator(root_), fs::directory_iterator());
  try {
    write_q8_checkpoint(path("nan"), path("out"));
    ADD_FAILURE() << "a NaN weight was quantized";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("'" + down + "' holds a non-finite value at [1, 6]"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(fs::exists(path("out")));
  EXPECT_EQ(std::distance(fs::directory_iterator(root_), fs::directory_iterator()), entries_before);
  // Loading it with Q8 at load names the same weight and position.
  try {
    Model::load(path("nan"), LoadOptions{WeightFormat::kQ8});
    ADD_FAILURE() << "a NaN weight was quantized at load";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("tensor '" + down + "' holds a non-finite value at [1, 6]"), std::string::npos)
        << e.what();
  }
  // Progress: one call per group (the global tensors, then each layer).
  std::vector<std::string> groups;
  write_q8_checkpoint(path("m"), path("progress"), [&](std::int64_t done, std::int64_t total, const std::string& g) {
    EXPECT_EQ(done, static_cast<std::int64_t>(groups.size()) + 1);
    EXPECT_EQ(total, 3);
    groups.push_back(g);
  });
  EXPECT_EQ(groups, (std::vector<std::string>{"global tensors", "layer 0", "layer 1"}));
}

// from_q8 checks finiteness in its quantizing pass: it names the first
// non-finite weight (row-major) and packs nothing, or throws without a
// place to put it; and q8_row / from_q8_blocks give back the same panels.
TEST(KernelsQ8Blocks, FromQ8FindsTheFirstNonFiniteWeightAndBlocksRoundTrip) {
  const std::int64_t out = 19, in = 70;
  std::vector<float> w(static_cast<std::size_t>(out * in));
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = std::sin(static_cast<float>(i) * 0.37f) * 0.02f;
  w[3 * in + 40] = 0.0f;  // an all-zero block needs none of the scale
  for (std::int64_t i = 32; i < 64; ++i) w[static_cast<std::size_t>(5 * in + i)] = 0.0f;
  const PackedMatrix m = PackedMatrix::from_q8(w.data(), PackedMatrix::Element::F32, out, in);
  std::vector<std::int8_t> q(static_cast<std::size_t>(out * in));
  std::vector<std::uint16_t> scales(static_cast<std::size_t>(out * 3));
  for (std::int64_t o = 0; o < out; ++o) m.q8_row(o, q.data() + o * in, scales.data() + o * 3);
  const PackedMatrix back = PackedMatrix::from_q8_blocks(
      q.data(), static_cast<const std::byte*>(static_cast<const void*>(scales.data())), out, in);
  ASSERT_EQ(back.bytes(), m.bytes());
  for (std::int64_t p = 0; p < m.panels(); ++p) {
    EXPECT_EQ(0, std::memcmp(back.panel_data(p), m.panel_data(p), m.panel_bytes())) << "panel " << p;
  }
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    std::vector<float> v = w;
    v[static_cast<std::size_t>(11 * in + 66)] = bad;  // in the short last block
    v[static_cast<std::size_t>(12 * in + 1)] = bad;   // a later one
    std::int64_t where = 0;
    const PackedMatrix none = PackedMatrix::from_q8(v.data(), PackedMatrix::Element::F32, out, in, &where);
    EXPECT_EQ(where, 11 * in + 66);
    EXPECT_EQ(none.out(), 0);
    EXPECT_THROW(PackedMatrix::from_q8(v.data(), PackedMatrix::Element::F32, out, in), InvalidArgument);
  }
  std::int64_t where = 0;
  (void)PackedMatrix::from_q8(w.data(), PackedMatrix::Element::F32, out, in, &where);
  EXPECT_EQ(where, -1);
}

}  // namespace
}  // namespace rwd::runtime
