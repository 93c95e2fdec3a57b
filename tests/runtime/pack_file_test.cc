// Pack files (runtime/pack_file.h, write_pack_file, `rewind pack`): a model
// loaded from its pack is, bit for bit, the model packed at load (logits,
// greedy tokens, fingerprint, parameter count, weight bytes) for every layer
// kind, dtype, family and weight format; its matrices come from the pack,
// not the checkpoint (the checkpoint's matrix bytes are overwritten in place
// and the model does not change); a pack is used only while the files it was
// made from are unchanged, and says why not otherwise; malformed packs are
// refused naming the file and the problem; the mapping outlives the file.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model_test_util.h"
#include "rewind/error.h"
#include "runtime/generate.h"
#include "runtime/model.h"
#include "runtime/pack_file.h"
#include "runtime/weights_io.h"
#include "test_configs.h"

namespace rwd::runtime {
namespace {

namespace fs = std::filesystem;
using testing_configs::hybrid;
using testing_configs::kEveryKind;

std::string source_path(const std::string& relative) { return std::string(REWIND_SOURCE_DIR) + "/" + relative; }

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

class PackFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("rewind_pack_" + std::to_string(::getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  std::string path(const std::string& name) const { return (root_ / name).string(); }
  // A copy of directory `from` at path(name).
  std::string copy_of(const std::string& from, const std::string& name) const {
    fs::copy(from, path(name), fs::copy_options::recursive);
    return path(name);
  }

  fs::path root_;
};

LoadOptions no_pack(std::optional<WeightFormat> weights = std::nullopt) {
  LoadOptions o;
  o.weights = weights;
  o.pack = LoadOptions::Pack::kNever;
  return o;
}

const std::string kPrompt = "And God said, Let there be light: and there was light.";

// `mapped` (from a pack) is `packed` (packed at load), bit for bit.
void expect_same_model(const Model& mapped, const Model& packed) {
  EXPECT_FALSE(mapped.pack_path().empty());
  EXPECT_TRUE(packed.pack_path().empty());
  EXPECT_EQ(mapped.weight_format(), packed.weight_format());
  EXPECT_EQ(mapped.fingerprint(), packed.fingerprint());
  EXPECT_EQ(mapped.parameter_count(), packed.parameter_count());
  EXPECT_EQ(mapped.weight_bytes(), packed.weight_bytes());
  const std::vector<float> a = logits_of(mapped, kPrompt), b = logits_of(packed, kPrompt);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << "logits differ";
  const std::vector<std::int32_t> tokens = encode_prompt("In the beginning", mapped.config());
  EXPECT_EQ(generate(mapped, tokens, greedy(16)), generate(packed, tokens, greedy(16)));
}

// Packs `dir` for `weights` (unset: as the checkpoint holds them) and
// checks the pack loads as the model packed at load.
void expect_pack_round_trip(const std::string& dir, std::optional<WeightFormat> weights, const std::string& what) {
  SCOPED_TRACE(what);
  LoadOptions asked;
  asked.weights = weights;
  const PackResult r = write_pack_file(dir, asked);
  EXPECT_GT(r.matrices, 0);
  EXPECT_EQ(r.file_bytes, fs::file_size(r.path));
  EXPECT_EQ(fs::path(r.path).filename().string(), pack_file_name(r.weights));
  const Model mapped = Model::load(dir, asked);
  EXPECT_EQ(mapped.pack_path(), r.path);
  EXPECT_EQ(mapped.pack_note(), "");
  expect_same_model(mapped, Model::load(dir, no_pack(weights)));
}

TEST_F(PackFileTest, LoadsBitIdenticalForEveryLayerKindDtypeAndFormat) {
  for (DType dtype : {DType::F32, DType::BF16, DType::F16}) {
    const std::string name(dtype_name(dtype));
    write_random_model(hybrid(kEveryKind, 40), path(name), 3, dtype);
    expect_pack_round_trip(path(name), std::nullopt, name + " as stored");
    expect_pack_round_trip(path(name), WeightFormat::kQ8, name + " q8");
    // Both packs side by side: each load maps the one of its format.
    EXPECT_EQ(Model::load(path(name)).weight_format(), WeightFormat::kAsStored);
    EXPECT_EQ(Model::load(path(name), LoadOptions{WeightFormat::kQ8}).weight_format(), WeightFormat::kQ8);
  }
}

// Fused projections split at load (Qwen3-Next's qkvz / ba, Qwen3.5's query
// + gate rows), tied and untied heads, and a Q8 checkpoint (its pack is
// the q8 one, mapped without a weights option).
TEST_F(PackFileTest, LoadsBitIdenticalForEveryFamilyAndAQ8Checkpoint) {
  for (const auto& entry : fs::directory_iterator(source_path("tests/fixtures/families"))) {
    const std::string name = entry.path().filename().string();
    expect_pack_round_trip(copy_of(entry.path().string(), name), std::nullopt, name);
  }
  write_random_model(hybrid(kEveryKind, 40), path("m"), 3, DType::BF16);
  write_q8_checkpoint(path("m"), path("q"));
  expect_pack_round_trip(path("q"), std::nullopt, "Q8 checkpoint");
  EXPECT_TRUE(fs::exists(path("q") + "/" + pack_file_name("q8")));
}

// The matrices are views of the pack: the checkpoint's matrix bytes are
// not read. Overwritten in place (size and time kept, so the pack is still
// current), they change the model loaded without the pack only.
TEST_F(PackFileTest, MatricesComeFromThePackNotTheCheckpoint) {
  write_random_model(hybrid(kEveryKind, 40), path("m"), 3, DType::F32);
  write_pack_file(path("m"));
  const std::vector<float> before = logits_of(Model::load(path("m"), no_pack()), kPrompt);
  const fs::path file = path("m") + "/model.safetensors";
  const fs::file_time_type time = fs::last_write_time(file);
  std::string bytes = read_bytes(file);
  std::uint64_t header = 0;
  std::memcpy(&header, bytes.data(), 8);
  const nlohmann::json index = nlohmann::json::parse(bytes.substr(8, header));
  int overwritten = 0;
  for (const WeightSpec& spec : expected_weights(load_weights(path("m")).config())) {
    if (!spec.matmul) continue;
    const auto offsets = index.at(spec.name).at("data_offsets");
    for (std::size_t i = offsets[0].get<std::size_t>(); i < offsets[1].get<std::size_t>(); i += 4) {
      const float v = 1e3f;
      std::memcpy(bytes.data() + 8 + header + i, &v, 4);
    }
    ++overwritten;
  }
  ASSERT_GT(overwritten, 5);
  write_bytes(file, bytes);
  fs::last_write_time(file, time);
  const Model mapped = Model::load(path("m"));
  ASSERT_FALSE(mapped.pack_path().empty()) << mapped.pack_note();
  const std::vector<float> after = logits_of(mapped, kPrompt);
  EXPECT_EQ(0, std::memcmp(before.data(), after.data(), before.size() * sizeof(float)));
  const std::vector<float> changed = logits_of(Model::load(path("m"), no_pack()), kPrompt);
  EXPECT_NE(0, std::memcmp(before.data(), changed.data(), before.size() * sizeof(float)));
}

// The views hold the mapping: the pack file can go, the model stays.
TEST_F(PackFileTest, TheModelOutlivesItsPackFile) {
  write_random_model(hybrid(kEveryKind, 40), path("m"), 3, DType::BF16);
  const PackResult r = write_pack_file(path("m"));
  Model mapped = Model::load(path("m"));
  fs::remove(r.path);
  const Model moved = std::move(mapped);
  expect_same_model(moved, Model::load(path("m")));
}

// A pack stands for the files it was made from: changed, added or removed
// files, another format, or none asked for, and it is not used (the model
// loads from the checkpoint and pack_note says why).
TEST_F(PackFileTest, APackIsUsedOnlyWhileItsFilesAreUnchanged) {
  write_random_model(hybrid(kEveryKind, 40), path("m"), 3, DType::BF16);
  const std::string dir = path("m"), file = dir + "/model.safetensors";
  const std::string pack = write_pack_file(dir).path;
  const fs::file_time_type time = fs::last_write_time(file);
  fs::last_write_time(file, time + std::chrono::seconds(1));
  {
    const Model m = Model::load(dir);
    EXPECT_EQ(m.pack_path(), "");
    EXPECT_NE(m.pack_note().find("model.safetensors changed since it was written"), std::string::npos) << m.pack_note();
    const std::vector<float> a = logits_of(m, kPrompt), b = logits_of(Model::load(dir, no_pack()), kPrompt);
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float)));
  }
  fs::last_write_time(file, time);
  EXPECT_EQ(Model::load(dir).pack_path(), pack);
  write_bytes(dir + "/generation_config.json", "{}");
  EXPECT_NE(Model::load(dir).pack_note().find("generation_config.json was added"), std::string::npos);
  fs::remove(dir + "/generation_config.json");
  EXPECT_EQ(Model::load(dir).pack_path(), pack);
  EXPECT_EQ(Model::load(dir, no_pack()).pack_note(), "");
  // A q8 pack of a float checkpoint serves --weights q8 only.
  fs::rename(pack, dir + "/" + pack_file_name("q8"));
  EXPECT_EQ(Model::load(dir, LoadOptions{WeightFormat::kQ8}).pack_path(), "");
  EXPECT_NE(Model::load(dir, LoadOptions{WeightFormat::kQ8}).pack_note().find("holds as-stored weights, not q8"),
            std::string::npos);
  write_pack_file(dir, LoadOptions{WeightFormat::kQ8});
  const Model q8 = Model::load(dir);
  EXPECT_EQ(q8.weight_format(), WeightFormat::kAsStored);
  EXPECT_NE(q8.pack_note().find("only --weights q8 asks for"), std::string::npos) << q8.pack_note();
  EXPECT_FALSE(Model::load(dir, LoadOptions{WeightFormat::kQ8}).pack_path().empty());
}

// `pack` with its index text edited: `from` replaced by `to` (the same
// length, so the trailer still frames it).
void edit_index(const std::string& pack, const std::string& from, const std::string& to) {
  ASSERT_EQ(from.size(), to.size());
  std::string bytes = read_bytes(pack);
  const std::size_t at = bytes.rfind(from);
  ASSERT_NE(at, std::string::npos) << from;
  bytes.replace(at, from.size(), to);
  write_bytes(pack, bytes);
}

TEST_F(PackFileTest, MalformedPacksAreRefusedNamingTheFileAndTheProblem) {
  write_random_model(hybrid(kEveryKind, 40), path("m"), 3, DType::BF16);
  const std::string pack = write_pack_file(path("m")).path;
  const std::string good = read_bytes(pack);
  const auto expect_refused = [&](const std::string& what) {
    try {
      (void)PackFile::open(pack);
      ADD_FAILURE() << "opened: " << what;
    } catch (const FormatError& e) {
      EXPECT_NE(std::string(e.what()).find(pack + ": "), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
    // Model::load does not use it and says why; the model is the checkpoint's.
    const Model m = Model::load(path("m"));
    EXPECT_EQ(m.pack_path(), "");
    EXPECT_NE(m.pack_note().find(what), std::string::npos) << m.pack_note();
    write_bytes(pack, good);
  };
  write_bytes(pack, good.substr(0, good.size() - 1));
  expect_refused("no end magic");
  write_bytes(pack, good.substr(0, 100));
  expect_refused("too short for a pack file");
  write_bytes(pack, "XWDPACK1" + good.substr(8));
  expect_refused("no RWDPACK1 magic");
  edit_index(pack, "\"version\":2", "\"version\":1");
  expect_refused("pack version 1; this build reads version 2 only");
  edit_index(pack, "\"panel_width\":16", "\"panel_width\":32");
  expect_refused("panels of another layout");
  edit_index(pack, "\"offset\":4096", "\"offset\":4097");
  expect_refused("are not aligned to 4096");
  edit_index(pack, "\"element\":\"bf16\"", "\"element\":\"bf17\"");
  expect_refused("is not one of f32, bf16, f16, q8");
  edit_index(pack, "\"out\":", "\"ouT\":");  // one matrix loses its out
  expect_refused("has no 'out'");
  edit_index(pack, "\"format\":\"rewind.pack\"", "\"format\":\"rewind.pac_\"");
  expect_refused("the index is not a pack's");
  // Bytes of the JSON broken: not JSON.
  edit_index(pack, "{\"fingerprint\"", "[\"fingerprint\"");
  expect_refused("the index is not JSON");
  // The file still opens whole afterwards.
  EXPECT_EQ(PackFile::open(pack).size(), static_cast<std::size_t>(write_pack_file(path("m")).matrices));
}

// A pack that matches the files but not the model (one written by a build
// that packs in another order) is refused when its matrices are taken.
TEST_F(PackFileTest, APackOfAnotherLayoutIsRefusedAtLoad) {
  write_random_model(hybrid(kEveryKind, 40), path("m"), 3, DType::F32);
  const PackFile pack = PackFile::open(write_pack_file(path("m")).path);
  EXPECT_THROW((void)pack.take(0, "no such matrix", 1, 1), FormatError);
  EXPECT_THROW((void)pack.take(pack.size(), "past the end", 1, 1), FormatError);
  // The first matrix renamed: the pack is current, but the model needs
  // another matrix first.
  std::string bytes = read_bytes(pack.path());
  const std::size_t at = bytes.find("\"key\":\"", bytes.rfind("{\"fingerprint\"")) + 7;
  const std::size_t end = bytes.find('"', at);
  ASSERT_GT(end, at);
  bytes.replace(at, end - at, std::string(end - at, 'x'));  // the first matrix renamed, sizes kept
  write_bytes(pack.path(), bytes);
  try {
    (void)Model::load(path("m"));
    ADD_FAILURE() << "loaded";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("rewrite it with rewind pack"), std::string::npos) << e.what();
  }
}

TEST_F(PackFileTest, WritePackRefusesBadRecordsAndWritesNothing) {
  const kernels::PackedMatrix m = kernels::PackedMatrix::from_bf16(std::vector<std::uint16_t>(40 * 8).data(), 40, 8);
  const PackedMatrixRecord good{"a", m.element(), m.out(), m.in(), m.storage()};
  PackedMatrixRecord short_panels = good;
  short_panels.key = "b";
  short_panels.panels = m.storage().first(10);
  for (const auto& records : {std::vector{good, good}, std::vector{good, short_panels}}) {
    EXPECT_THROW(write_pack(path("p"), records, {}), InvalidArgument);
    EXPECT_FALSE(fs::exists(path("p")));
  }
  const std::uint64_t written = write_pack(path("p"), {good}, {});
  EXPECT_EQ(written, fs::file_size(path("p")));
  EXPECT_EQ(PackFile::open(path("p")).take(0, "a", 40, 8).storage().size(), m.bytes());
  EXPECT_EQ(0,
            std::memcmp(PackFile::open(path("p")).take(0, "a", 40, 8).storage().data(), m.storage().data(), m.bytes()));
}

// The fuzzer's seed (fuzz/corpus/pack/valid, written by hand from
// docs/model-format.md) opens: it stays a valid pack of this version.
TEST(PackFileSeed, TheFuzzSeedIsAValidPack) {
  const PackFile pack = PackFile::open(std::string(REWIND_SOURCE_DIR) + "/fuzz/corpus/pack/valid");
  ASSERT_EQ(pack.size(), 3u);
  EXPECT_EQ(pack.matrix(0).key, "model.layers.0.mlp.up_proj.weight");
  EXPECT_EQ(pack.matrix(1).element, kernels::PackedMatrix::Element::Q8);
  EXPECT_EQ(pack.matrix(1).offset, 2 * kPackAlignment);
  const kernels::PackedMatrix up = pack.take(0, "model.layers.0.mlp.up_proj.weight", 2, 3);
  EXPECT_EQ(up.at(1, 2), 1.0f);  // bf16 0x3F80 in lanes 0 and 1
  const kernels::PackedMatrix down = pack.take(1, "model.layers.0.mlp.down_proj.weight", 3, 40);
  // Lane l, input k of block 0: the byte (k / 4 * 7 + l) % 255, minus 128, times the scale 0x3C00 (2^-7).
  EXPECT_EQ(down.at(2, 9), static_cast<float>((9 / 4 * 7 + 2) % 255 - 128) * 0.0078125f);
  EXPECT_EQ(pack.take(2, "model.norm_like", 0, 5).bytes(), 0u);
}

}  // namespace
}  // namespace rwd::runtime
