// Hostile model directories through the CLI: every one gives exit status 2
// and a single "rewind: error:" line naming the file and the problem, never
// a crash or a huge allocation (the library-level tables are in
// safetensors_test.cc and model_config_test.cc).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "runtime/weights_io.h"
#include "test_configs.h"

#ifdef REWIND_CLI_PATH
namespace rwd::runtime {
namespace {

using namespace cli_test;

std::string u64le(std::uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// Two layers, the second a conv layer (the config edits below rename it).
ModelConfig tiny() { return testing_configs::hybrid({"full_attention", "conv"}, 16); }

struct Hostile {
  std::string name;
  std::string file;    // which file the message must name
  std::string phrase;  // what it must say
  // Edits a copy of a valid model directory.
  void (*corrupt)(const fs::path& dir);
};

TEST(CliHostileModels, ExitTwoWithOneLineNamingFileAndProblem) {
  const fs::path base = scratch_dir() / "hostile";
  fs::remove_all(base);
  const fs::path valid = base / "valid";
  write_random_model(tiny(), valid.string(), 3, DType::F16);

  const std::vector<Hostile> table = {
      {"truncated", "model.safetensors", "",
       [](const fs::path& d) {
         const std::string s = read_file(d / "model.safetensors");
         write_file(d / "model.safetensors", s.substr(0, s.size() / 2));
       }},
      {"header_length_beyond_file", "model.safetensors", "header",
       [](const fs::path& d) {
         const std::string s = read_file(d / "model.safetensors");
         write_file(d / "model.safetensors", u64le(s.size() + 1000) + s.substr(8));
       }},
      {"absurd_header_length", "model.safetensors", "header",
       [](const fs::path& d) {
         const std::string s = read_file(d / "model.safetensors");
         write_file(d / "model.safetensors", u64le(std::uint64_t{1} << 62) + s.substr(8));
       }},
      {"empty_file", "model.safetensors", "", [](const fs::path& d) { write_file(d / "model.safetensors", ""); }},
      {"overflowing_shape", "model.safetensors", "",
       [](const fs::path& d) {
         const std::string h =
             R"({"model.embed_tokens.weight":{"dtype":"F16","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}})";
         write_file(d / "model.safetensors", u64le(h.size()) + h + std::string(8, '\0'));
       }},
      {"unknown_dtype", "model.safetensors", "dtype",
       [](const fs::path& d) {
         const std::string h = R"({"model.norm.weight":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})";
         write_file(d / "model.safetensors", u64le(h.size()) + h + std::string(8, '\0'));
       }},
      {"duplicate_names", "model.safetensors", "duplicate",
       [](const fs::path& d) {
         const std::string h =
             R"({"model.norm.weight":{"dtype":"F16","shape":[1],"data_offsets":[0,2]},"model.norm.weight":{"dtype":"F16","shape":[1],"data_offsets":[2,4]}})";
         write_file(d / "model.safetensors", u64le(h.size()) + h + std::string(4, '\0'));
       }},
      {"negative_size", "config.json", "hidden_size",
       [](const fs::path& d) {
         std::string c = read_file(d / "config.json");
         const auto at = c.find("\"hidden_size\"");
         const auto colon = c.find(':', at);
         const auto end = c.find_first_of(",}", colon);
         write_file(d / "config.json", c.substr(0, colon + 1) + " -16" + c.substr(end));
       }},
      {"layer_types_wrong_length", "config.json", "layer_types",
       [](const fs::path& d) {
         std::string c = read_file(d / "config.json");
         const auto at = c.find("\"conv\"");
         write_file(d / "config.json", c.substr(0, at) + "\"conv\", \"conv\"" + c.substr(at + 6));
       }},
      {"unknown_layer_type", "config.json", "mamba",
       [](const fs::path& d) {
         std::string c = read_file(d / "config.json");
         const auto at = c.find("\"conv\"");
         write_file(d / "config.json", c.substr(0, at) + "\"mamba\"" + c.substr(at + 6));
       }},
      {"not_json", "config.json", "",
       [](const fs::path& d) { write_file(d / "config.json", "{\"hidden_size\": 16,"); }},
      {"missing_safetensors", "model.safetensors", "", [](const fs::path& d) { fs::remove(d / "model.safetensors"); }},
  };
  for (const Hostile& h : table) {
    const fs::path dir = base / h.name;
    fs::create_directories(dir);
    fs::copy(valid, dir, fs::copy_options::overwrite_existing | fs::copy_options::recursive);
    h.corrupt(dir);
    const CliResult r = run_cli("inspect --model " + quote(dir.string()));
    ASSERT_NE(r.status, -1) << h.name << ": the CLI died instead of exiting";
    EXPECT_EQ(r.status, 2) << h.name;
    EXPECT_EQ(r.out, "") << h.name;
    const std::string& text = r.err;
    EXPECT_EQ(text.rfind("rewind: error: ", 0), 0u) << h.name << ": " << text;
    EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 1) << h.name << ": not one line: " << text;
    EXPECT_NE(text.find(h.file), std::string::npos) << h.name << ": " << text;
    EXPECT_NE(text.find(h.phrase), std::string::npos) << h.name << ": " << text;
  }
  fs::remove_all(scratch_dir());
}

}  // namespace
}  // namespace rwd::runtime
#endif
