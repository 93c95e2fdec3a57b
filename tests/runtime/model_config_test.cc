// Tests of config.json parsing, the expected tensor list and model
// directories (runtime/model_config.h, runtime/weights_io.h).
#include "runtime/model_config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "rewind/error.h"
#include "runtime/safetensors.h"
#include "runtime/weights_io.h"

namespace rwd::runtime {
namespace {

namespace fs = std::filesystem;

// ---- config text helpers -----------------------------------------------------

// Key -> raw JSON value of a hybrid config with one layer of each kind.
std::map<std::string, std::string> hybrid_keys() {
  return {
      {"model_type", R"("rewind_hybrid")"},
      {"hidden_size", "32"},
      {"num_hidden_layers", "4"},
      {"num_attention_heads", "4"},
      {"num_key_value_heads", "2"},
      {"intermediate_size", "48"},
      {"vocab_size", "300"},
      {"layer_types", R"(["full_attention", "sliding_attention", "linear_attention", "conv"])"},
      {"sliding_window", "8"},
      {"linear_conv_kernel_dim", "4"},
      {"linear_num_key_heads", "2"},
      {"linear_num_value_heads", "4"},
      {"linear_key_head_dim", "8"},
      {"linear_value_head_dim", "6"},
      {"conv_L_cache", "3"},
  };
}

std::string to_text(const std::map<std::string, std::string>& keys) {
  std::string s = "{";
  for (const auto& [k, v] : keys) {
    if (s.size() > 1) s += ",\n";
    s += "  \"" + k + "\": " + v;
  }
  return s + "\n}";
}

// The hybrid config with `set` keys replaced / added and `drop` keys removed.
std::string hybrid_text(const std::map<std::string, std::string>& set = {}, const std::set<std::string>& drop = {}) {
  auto keys = hybrid_keys();
  for (const auto& [k, v] : set) keys[k] = v;
  for (const auto& k : drop) keys.erase(k);
  return to_text(keys);
}

ModelConfig hybrid_config() { return parse_model_config(hybrid_text(), "hybrid/config.json"); }

// A small config with only attention layers (no kind-specific keys).
ModelConfig attention_config() {
  return parse_model_config(to_text({{"hidden_size", "16"},
                                     {"num_hidden_layers", "2"},
                                     {"num_attention_heads", "2"},
                                     {"num_key_value_heads", "1"},
                                     {"intermediate_size", "24"},
                                     {"vocab_size", "260"},
                                     {"layer_types", R"(["full_attention", "full_attention"])"},
                                     {"tie_word_embeddings", "true"}}),
                            "attn/config.json");
}

// ---- ModelConfig -----------------------------------------------------------------

TEST(ModelConfig, ParsesHybridConfigWithDefaults) {
  const ModelConfig c = hybrid_config();
  EXPECT_EQ(c.model_type, "rewind_hybrid");
  EXPECT_EQ(c.hidden_size, 32);
  EXPECT_EQ(c.num_hidden_layers, 4);
  EXPECT_EQ(c.num_attention_heads, 4);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 8);  // hidden_size / num_attention_heads
  EXPECT_EQ(c.intermediate_size, 48);
  EXPECT_EQ(c.vocab_size, 300);
  EXPECT_EQ(c.layer_types, (std::vector<LayerKind>{LayerKind::FullAttention, LayerKind::SlidingAttention,
                                                   LayerKind::LinearAttention, LayerKind::Conv}));
  EXPECT_EQ(c.sliding_window, 8);
  EXPECT_EQ(c.linear_conv_kernel_dim, 4);
  EXPECT_EQ(c.linear_num_key_heads, 2);
  EXPECT_EQ(c.linear_num_value_heads, 4);
  EXPECT_EQ(c.linear_key_head_dim, 8);
  EXPECT_EQ(c.linear_value_head_dim, 6);
  EXPECT_EQ(c.linear_conv_dim(), 2 * 2 * 8 + 4 * 6);
  EXPECT_EQ(c.conv_L_cache, 3);
  EXPECT_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 256);
  EXPECT_EQ(c.eos_token_id, 257);
  EXPECT_EQ(c.torch_dtype, DType::F32);
  EXPECT_TRUE(c.has_layer_type(LayerKind::Conv));
  EXPECT_FALSE(c.has_layer_type(LayerKind::Moe));
}

TEST(ModelConfig, ParsesExplicitValues) {
  const ModelConfig c = parse_model_config(hybrid_text({{"head_dim", "16"},
                                                        {"rope_theta", "1000000"},
                                                        {"rms_norm_eps", "1e-5"},
                                                        {"tie_word_embeddings", "true"},
                                                        {"bos_token_id", "1"},
                                                        {"eos_token_id", "[2, 3]"},
                                                        {"torch_dtype", R"("bfloat16")"},
                                                        {"model_type", R"("my_hybrid")"},
                                                        {"architectures", R"(["Whatever"])"}}),
                                           "x/config.json");
  EXPECT_EQ(c.head_dim, 16);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_id, 2);  // the first of a list
  EXPECT_EQ(c.torch_dtype, DType::BF16);
  EXPECT_EQ(c.model_type, "my_hybrid");
}

TEST(ModelConfig, NewerTransformersSpellings) {
  const ModelConfig c = parse_model_config(
      hybrid_text({{"dtype", R"("float16")"}, {"rope_parameters", R"({"rope_theta": 5e5})"}}), "x/config.json");
  EXPECT_EQ(c.torch_dtype, DType::F16);
  EXPECT_EQ(c.rope_theta, 5e5);
}

TEST(ModelConfig, KindKeysAreOptionalWithoutTheirKind) {
  const ModelConfig c = parse_model_config(
      hybrid_text(
          {{"layer_types", R"(["full_attention", "full_attention", "conv", "conv"])"}, {"sliding_window", "null"}},
          {"linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
           "linear_value_head_dim"}),
      "x/config.json");
  EXPECT_EQ(c.sliding_window, 0);
  EXPECT_EQ(c.linear_num_key_heads, 0);
  EXPECT_EQ(c.conv_L_cache, 3);
  const ModelConfig a = attention_config();
  EXPECT_EQ(a.conv_L_cache, 0);
  EXPECT_EQ(a.head_dim, 8);
}

TEST(ModelConfig, ToJsonRoundTrips) {
  for (ModelConfig c : {hybrid_config(), attention_config()}) {
    c.rope_theta = 123456.789;
    c.rms_norm_eps = 1.0 / 3.0;
    c.torch_dtype = DType::BF16;
    const std::string text = to_json(c);
    EXPECT_EQ(parse_model_config(text, "rt"), c) << text;
  }
}

TEST(ModelConfig, LoadFromFile) {
  const fs::path dir = fs::temp_directory_path() / ("rewind_cfg_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string p = (dir / "config.json").string();
  {
    std::ofstream out(p);
    out << hybrid_text();
  }
  EXPECT_EQ(load_model_config(p), hybrid_config());
  fs::remove_all(dir);
  try {
    load_model_config(p);
    ADD_FAILURE() << "no error for a missing file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

struct BadConfig {
  const char* label;
  std::string text;
  const char* phrase;
};

TEST(ModelConfig, InvalidConfigsThrowFormatError) {
  const std::vector<BadConfig> cases = {
      {"not JSON", "{\"hidden_size\": ", "not valid JSON"},
      {"not an object", "[1, 2, 3]", "config is not a JSON object"},
      {"missing hidden_size", hybrid_text({}, {"hidden_size"}), "missing required key 'hidden_size'"},
      {"missing vocab_size", hybrid_text({}, {"vocab_size"}), "missing required key 'vocab_size'"},
      {"missing layer_types", hybrid_text({}, {"layer_types"}), "missing required key 'layer_types'"},
      {"missing num_key_value_heads", hybrid_text({}, {"num_key_value_heads"}),
       "missing required key 'num_key_value_heads'"},
      {"null required key", hybrid_text({{"intermediate_size", "null"}}), "missing required key 'intermediate_size'"},
      {"negative hidden_size", hybrid_text({{"hidden_size", "-32"}}),
       "'hidden_size' must be in [1, 16777216], got -32"},
      {"zero layers", hybrid_text({{"num_hidden_layers", "0"}}), "'num_hidden_layers' must be in [1, 16777216], got 0"},
      {"huge vocab", hybrid_text({{"vocab_size", "1000000000000"}}), "'vocab_size' must be in"},
      {"beyond int64", hybrid_text({{"vocab_size", "18446744073709551615"}}), "'vocab_size' must be in"},
      {"string size", hybrid_text({{"hidden_size", R"("32")"}}), "'hidden_size' must be an integer, got a string"},
      {"fractional size", hybrid_text({{"intermediate_size", "48.5"}}),
       "'intermediate_size' must be an integer, got a number"},
      {"boolean size", hybrid_text({{"num_attention_heads", "true"}}),
       "'num_attention_heads' must be an integer, got a boolean"},
      {"zero head_dim", hybrid_text({{"head_dim", "0"}}), "'head_dim' must be in [1,"},
      {"layer_types too short", hybrid_text({{"layer_types", R"(["conv", "conv", "conv"])"}}),
       "'layer_types' has 3 entries, but 'num_hidden_layers' is 4"},
      {"layer_types too long", hybrid_text({{"layer_types", R"(["conv", "conv", "conv", "conv", "conv"])"}}),
       "'layer_types' has 5 entries"},
      {"layer_types not a list", hybrid_text({{"layer_types", R"("conv")"}}),
       "'layer_types' must be a list, got a string"},
      {"layer type not a string", hybrid_text({{"layer_types", R"(["conv", 1, "conv", "conv"])"}}),
       "layer_types[1] must be a string, got an integer"},
      {"unknown layer type", hybrid_text({{"layer_types", R"(["full_attention", "conv", "conv", "moe"])"}}),
       "layer_types[3] is 'moe', which the runtime does not support (supported: full_attention, "
       "sliding_attention, linear_attention, conv)"},
      {"heads not divisible", hybrid_text({{"num_key_value_heads", "3"}}),
       "'num_attention_heads' (4) is not a multiple of 'num_key_value_heads' (3)"},
      {"hidden not divisible by heads", hybrid_text({{"hidden_size", "30"}}),
       "'head_dim' is absent and 'hidden_size' (30) is not a multiple of 'num_attention_heads' (4)"},
      {"sliding layer without sliding_window", hybrid_text({}, {"sliding_window"}),
       "missing required key 'sliding_window' (layer 1 is sliding_attention)"},
      {"sliding_window zero", hybrid_text({{"sliding_window", "0"}}),
       "'sliding_window' must be in [1, 16777216], got 0"},
      {"negative unused sliding_window",
       hybrid_text({{"layer_types", R"(["full_attention", "full_attention", "linear_attention", "conv"])"},
                    {"sliding_window", "-1"}}),
       "'sliding_window' must be in [0, 16777216], got -1"},
      {"linear layer without linear_num_key_heads", hybrid_text({}, {"linear_num_key_heads"}),
       "missing required key 'linear_num_key_heads' (layer 2 is linear_attention)"},
      {"linear layer without linear_conv_kernel_dim", hybrid_text({}, {"linear_conv_kernel_dim"}),
       "missing required key 'linear_conv_kernel_dim' (layer 2 is linear_attention)"},
      {"linear heads not divisible", hybrid_text({{"linear_num_key_heads", "4"}, {"linear_num_value_heads", "6"}}),
       "'linear_num_value_heads' (6) is not a multiple of 'linear_num_key_heads' (4)"},
      {"conv layer without conv_L_cache", hybrid_text({}, {"conv_L_cache"}),
       "missing required key 'conv_L_cache' (layer 3 is conv)"},
      {"negative conv_L_cache", hybrid_text({{"conv_L_cache", "-3"}}), "'conv_L_cache' must be in"},
      {"negative rope_theta", hybrid_text({{"rope_theta", "-1"}}), "'rope_theta' must be a positive finite number"},
      {"string rms_norm_eps", hybrid_text({{"rms_norm_eps", R"("small")"}}),
       "'rms_norm_eps' must be a number, got a string"},
      {"integer tie_word_embeddings", hybrid_text({{"tie_word_embeddings", "1"}}),
       "'tie_word_embeddings' must be a boolean, got an integer"},
      {"unknown torch_dtype", hybrid_text({{"torch_dtype", R"("int8")"}}),
       "'torch_dtype' must be one of \"float32\", \"float16\", \"bfloat16\""},
      {"bos outside the vocabulary", hybrid_text({{"bos_token_id", "300"}}),
       "'bos_token_id' must be in [0, 299], got 300"},
      {"default bos outside a small vocabulary", hybrid_text({{"vocab_size", "100"}}),
       "'bos_token_id' is absent and its default 256 is outside the vocabulary ('vocab_size' 100)"},
      {"default eos outside a small vocabulary", hybrid_text({{"vocab_size", "257"}, {"bos_token_id", "0"}}),
       "'eos_token_id' is absent and its default 257 is outside the vocabulary"},
      {"empty eos list", hybrid_text({{"eos_token_id", "[]"}}), "'eos_token_id' is an empty list"},
      {"model_type not a string", hybrid_text({{"model_type", "3"}}), "'model_type' must be a string"},
  };
  for (const BadConfig& bc : cases) {
    SCOPED_TRACE(bc.label);
    try {
      parse_model_config(bc.text, "models/tiny/config.json");
      ADD_FAILURE() << "no error, expected '" << bc.phrase << "'";
    } catch (const FormatError& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind("models/tiny/config.json: ", 0), 0u) << msg;
      EXPECT_NE(msg.find(bc.phrase), std::string::npos) << "expected '" << bc.phrase << "' in: " << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  }
}

// Hugging Face configs of families the runtime does not read (as the Hub
// ships them, trimmed): refused by name, with the supported list, before
// any "missing required key".
TEST(ModelConfig, UnsupportedArchitecturesAreNamedWithTheSupportedList) {
  const std::string mistral = R"({"architectures": ["MistralForCausalLM"], "model_type": "mistral",
      "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
      "num_key_value_heads": 8, "vocab_size": 32768, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
      "hidden_act": "silu", "sliding_window": null})";
  // transformers >= 4.55 writes layer_types into Qwen2 / Qwen3 configs: the
  // layout key alone must not make it rewind's own.
  const std::string qwen2 = R"({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
      "intermediate_size": 4864, "num_attention_heads": 14, "num_hidden_layers": 2, "num_key_value_heads": 2,
      "vocab_size": 151936, "max_position_embeddings": 32768,
      "layer_types": ["full_attention", "full_attention"], "tie_word_embeddings": true})";
  const std::string qwen3_moe = R"({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
      "hidden_size": 2048, "intermediate_size": 6144, "num_attention_heads": 32, "num_hidden_layers": 2,
      "num_key_value_heads": 4, "vocab_size": 151936, "num_experts": 128})";
  const std::string no_architectures = R"({"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 300})";
  struct Case {
    std::string text, named;
  };
  for (const Case& k : std::vector<Case>{
           {mistral,
            "config.json: architecture 'MistralForCausalLM' (model_type 'mistral') is not supported; supported: "},
           {qwen2, "config.json: architecture 'Qwen2ForCausalLM' (model_type 'qwen2') is not supported; supported: "},
           {qwen3_moe, "config.json: model_type 'qwen3_moe' is not supported (mixture-of-experts"},
           {no_architectures, "config.json: model_type 'mistral' is not supported; supported: "},
       }) {
    try {
      parse_model_config(k.text, "config.json");
      ADD_FAILURE() << "accepted: " << k.text;
    } catch (const FormatError& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind(k.named, 0), 0u) << msg;
      for (const char* family :
           {"rewind_hybrid", "lfm2", "qwen3_5", "qwen3_5_text", "qwen3_next", "qwen3 (", "llama (LlamaForCausalLM"}) {
        EXPECT_NE(msg.find(family, k.named.size()), std::string::npos) << family << " missing in: " << msg;
      }
      EXPECT_EQ(msg.find("missing required key"), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  }
  // rewind's own layout under another name still parses (ParsesExplicitValues),
  // and rewind_hybrid without layer_types still says what it lacks.
  EXPECT_EQ(parse_model_config(hybrid_text({{"model_type", R"("my_hybrid")"}}), "x").model_type, "my_hybrid");
  EXPECT_THROW(
      {
        try {
          parse_model_config(hybrid_text({}, {"layer_types"}), "x");
        } catch (const FormatError& e) {
          EXPECT_NE(std::string(e.what()).find("missing required key 'layer_types'"), std::string::npos) << e.what();
          throw;
        }
      },
      FormatError);
}

TEST(ModelConfig, MaxPositionEmbeddingsIsReadAndRoundTrips) {
  EXPECT_EQ(hybrid_config().max_position_embeddings, 0);  // absent: no limit named
  const ModelConfig c = parse_model_config(hybrid_text({{"max_position_embeddings", "4096"}}), "x");
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_EQ(parse_model_config(to_json(c), "rt"), c);
  for (const char* bad : {"0", "-1", "\"long\"", "1e3"}) {
    EXPECT_THROW(parse_model_config(hybrid_text({{"max_position_embeddings", bad}}), "x"), FormatError) << bad;
  }
}

// ---- expected_weights ------------------------------------------------------------

std::map<std::string, std::vector<std::int64_t>> spec_map(const ModelConfig& c) {
  std::map<std::string, std::vector<std::int64_t>> m;
  for (const WeightSpec& s : expected_weights(c)) {
    EXPECT_TRUE(m.emplace(s.name, s.shape).second) << "duplicate " << s.name;
  }
  return m;
}

TEST(ExpectedWeights, HybridNamesAndShapes) {
  ModelConfig c = hybrid_config();
  c.head_dim = 10;  // differs from d / nh, so q/o shapes use it
  const auto m = spec_map(c);
  const std::int64_t d = 32, ff = 48, V = 300, conv_dim = 2 * 2 * 8 + 4 * 6;
  const std::map<std::string, std::vector<std::int64_t>> want = {
      {"model.embed_tokens.weight", {V, d}},
      {"model.norm.weight", {d}},
      {"lm_head.weight", {V, d}},
      {"model.layers.0.self_attn.q_proj.weight", {4 * 10, d}},
      {"model.layers.0.self_attn.k_proj.weight", {2 * 10, d}},
      {"model.layers.0.self_attn.v_proj.weight", {2 * 10, d}},
      {"model.layers.0.self_attn.o_proj.weight", {d, 4 * 10}},
      {"model.layers.1.self_attn.q_proj.weight", {4 * 10, d}},
      {"model.layers.1.self_attn.k_proj.weight", {2 * 10, d}},
      {"model.layers.1.self_attn.v_proj.weight", {2 * 10, d}},
      {"model.layers.1.self_attn.o_proj.weight", {d, 4 * 10}},
      {"model.layers.2.linear_attn.in_proj_qkv.weight", {conv_dim, d}},
      {"model.layers.2.linear_attn.in_proj_z.weight", {4 * 6, d}},
      {"model.layers.2.linear_attn.in_proj_b.weight", {4, d}},
      {"model.layers.2.linear_attn.in_proj_a.weight", {4, d}},
      {"model.layers.2.linear_attn.conv1d.weight", {conv_dim, 1, 4}},
      {"model.layers.2.linear_attn.dt_bias", {4}},
      {"model.layers.2.linear_attn.A_log", {4}},
      {"model.layers.2.linear_attn.norm.weight", {6}},
      {"model.layers.2.linear_attn.out_proj.weight", {d, 4 * 6}},
      {"model.layers.3.conv.in_proj.weight", {3 * d, d}},
      {"model.layers.3.conv.conv.weight", {d, 1, 3}},
      {"model.layers.3.conv.out_proj.weight", {d, d}},
  };
  auto expected = want;
  for (int i = 0; i < 4; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    expected[p + "input_layernorm.weight"] = {d};
    expected[p + "post_attention_layernorm.weight"] = {d};
    expected[p + "mlp.gate_proj.weight"] = {ff, d};
    expected[p + "mlp.up_proj.weight"] = {ff, d};
    expected[p + "mlp.down_proj.weight"] = {d, ff};
  }
  EXPECT_EQ(m, expected);
  EXPECT_EQ(expected_weights(c).front().name, "model.embed_tokens.weight");
}

TEST(ExpectedWeights, TiedEmbeddingsHaveNoLmHead) {
  const ModelConfig c = attention_config();
  const auto m = spec_map(c);
  EXPECT_EQ(m.count("lm_head.weight"), 0u);
  EXPECT_EQ(m.count("model.embed_tokens.weight"), 1u);
  EXPECT_EQ(m.size(), 2u + 2u * 9u);
}

// ---- model directories -------------------------------------------------------------

class ModelWeightsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static std::atomic<int> counter{0};
    root_ = fs::temp_directory_path() /
            ("rewind_weights_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(root_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  std::string dir(const std::string& name) const { return (root_ / name).string(); }

  static std::string read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  // Rewrites DIR/model.safetensors from the f32 values of `w`, after `edit`
  // changes the list of (name, shape, values).
  struct Owned {
    std::string name;
    std::vector<std::int64_t> shape;
    std::vector<float> values;
  };
  static void rewrite(const std::string& model_dir, const ModelWeights& w,
                      const std::function<void(std::vector<Owned>&)>& edit) {
    std::vector<Owned> owned;
    for (const std::string& name : w.names()) {
      const Tensor& t = w.get(name);
      Owned o{name, {}, std::vector<float>(static_cast<std::size_t>(t.numel()))};
      for (int i = 0; i < t.view().rank; ++i) o.shape.push_back(t.view().size(i));
      std::memcpy(o.values.data(), t.data<float>(), t.bytes());
      owned.push_back(std::move(o));
    }
    edit(owned);
    std::vector<TensorToWrite> out;
    for (const Owned& o : owned) {
      out.push_back({o.name, DType::F32, o.shape, std::as_bytes(std::span<const float>(o.values))});
    }
    write_safetensors((fs::path(model_dir) / "model.safetensors").string(), out);
  }

  fs::path root_;
};

void expect_load_error(const std::string& dir, const std::string& file, const std::vector<std::string>& phrases) {
  try {
    load_weights(dir);
    ADD_FAILURE() << "no error, expected '" << phrases.front() << "'";
  } catch (const FormatError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find((fs::path(dir) / file).string()), std::string::npos) << msg;
    for (const std::string& p : phrases) {
      EXPECT_NE(msg.find(p), std::string::npos) << "expected '" << p << "' in: " << msg;
    }
  }
}

bool same_values(const ModelWeights& a, const ModelWeights& b) {
  if (a.names() != b.names()) return false;
  for (const std::string& n : a.names()) {
    if (!bitwise_equal(a.get(n), b.get(n))) return false;
  }
  return true;
}

TEST_F(ModelWeightsTest, RandomModelRoundTripsInEveryDtype) {
  const ModelConfig c = hybrid_config();
  for (DType dt : {DType::F32, DType::F16, DType::BF16}) {
    SCOPED_TRACE(std::string(safetensors_dtype_name(dt)));
    const std::string d = dir(std::string("m_") + std::string(safetensors_dtype_name(dt)));
    write_random_model(c, d, 42, dt);
    const ModelWeights w = load_weights(d);

    ModelConfig want = c;
    want.torch_dtype = dt;
    EXPECT_EQ(w.config(), want);
    const SafetensorsFile f = SafetensorsFile::open(d + "/model.safetensors");
    EXPECT_EQ(f.metadata().at("format"), "pt");

    const auto specs = expected_weights(c);
    ASSERT_EQ(w.size(), specs.size());
    std::size_t total = 0;
    for (const WeightSpec& s : specs) {
      const Tensor* t = w.find(s.name);
      ASSERT_NE(t, nullptr) << s.name;
      // Every dtype stays as stored (the kernels widen half precision).
      EXPECT_EQ(t->view().dtype, dt);
      ASSERT_EQ(static_cast<std::size_t>(t->view().rank), s.shape.size()) << s.name;
      for (std::size_t i = 0; i < s.shape.size(); ++i) {
        EXPECT_EQ(t->view().size(static_cast<int>(i)), s.shape[i]) << s.name;
      }
      EXPECT_EQ(f.get(s.name).dtype, dt) << s.name;
      total += t->bytes();
    }
    EXPECT_EQ(w.bytes(), total);
    // The in-memory generator gives what the files hold, value for value.
    EXPECT_TRUE(same_values(w, ModelWeights::random(c, 42, dt)));
    EXPECT_EQ(ModelWeights::random(c, 42, dt).config(), want);
  }
}

TEST_F(ModelWeightsTest, SameSeedSameBytesDifferentSeedDifferent) {
  const ModelConfig c = hybrid_config();
  write_random_model(c, dir("a"), 7, DType::BF16);
  write_random_model(c, dir("b"), 7, DType::BF16);
  write_random_model(c, dir("c"), 8, DType::BF16);
  const std::string a = read(dir("a") + "/model.safetensors");
  EXPECT_GT(a.size(), 1000u);
  EXPECT_EQ(a, read(dir("b") + "/model.safetensors"));
  EXPECT_EQ(read(dir("a") + "/config.json"), read(dir("b") + "/config.json"));
  EXPECT_NE(a, read(dir("c") + "/model.safetensors"));

  const ModelWeights wa = load_weights(dir("a"));
  const ModelWeights wc = load_weights(dir("c"));
  for (const std::string& n : wa.names()) {
    EXPECT_FALSE(bitwise_equal(wa.get(n), wc.get(n))) << n << " does not depend on the seed";
  }
  // Tensors differ from each other too (each has its own stream).
  EXPECT_FALSE(
      bitwise_equal(wa.get("model.layers.0.mlp.gate_proj.weight"), wa.get("model.layers.0.mlp.up_proj.weight")));
}

// Mean and standard deviation of a tensor's values.
std::pair<double, double> moments(const Tensor& t) {
  const float* p = t.data<float>();
  const auto n = static_cast<std::size_t>(t.numel());
  double sum = 0, sq = 0;
  for (std::size_t i = 0; i < n; ++i) sum += p[i];
  const double mean = sum / static_cast<double>(n);
  for (std::size_t i = 0; i < n; ++i) sq += (p[i] - mean) * (p[i] - mean);
  return {mean, std::sqrt(sq / static_cast<double>(n))};
}

TEST_F(ModelWeightsTest, RandomInitScales) {
  ModelConfig c = hybrid_config();
  c.hidden_size = 128;
  c.intermediate_size = 256;
  c.num_attention_heads = 4;
  c.head_dim = 32;
  const ModelWeights w = ModelWeights::random(c, 1);
  auto [emb_mean, emb_std] = moments(w.get("model.embed_tokens.weight"));
  EXPECT_NEAR(emb_mean, 0.0, 0.02);
  EXPECT_NEAR(emb_std, 1.0, 0.02);
  auto [q_mean, q_std] = moments(w.get("model.layers.0.self_attn.q_proj.weight"));
  EXPECT_NEAR(q_mean, 0.0, 0.01);
  EXPECT_NEAR(q_std, 1.0 / std::sqrt(128.0), 0.01);
  auto [down_mean, down_std] = moments(w.get("model.layers.0.mlp.down_proj.weight"));
  EXPECT_NEAR(down_std, 1.0 / std::sqrt(256.0), 0.005);
  (void)down_mean;
  auto [conv_mean, conv_std] = moments(w.get("model.layers.3.conv.conv.weight"));
  EXPECT_NEAR(conv_std, 1.0 / std::sqrt(3.0), 0.1);
  (void)conv_mean;
  auto [norm_mean, norm_std] = moments(w.get("model.layers.1.input_layernorm.weight"));
  EXPECT_NEAR(norm_mean, 1.0, 0.05);
  EXPECT_GT(norm_std, 0.0);
  EXPECT_LT(norm_std, 0.2);
  const Tensor& a_log = w.get("model.layers.2.linear_attn.A_log");
  for (std::int64_t i = 0; i < a_log.numel(); ++i) {
    EXPECT_GE(a_log.data<float>()[i], 0.0f);
    EXPECT_LE(a_log.data<float>()[i], std::log(16.0f));
  }
  const Tensor& dt_bias = w.get("model.layers.2.linear_attn.dt_bias");
  for (std::int64_t i = 0; i < dt_bias.numel(); ++i) {
    EXPECT_LT(std::fabs(dt_bias.data<float>()[i]), 1.0f);
  }
}

TEST_F(ModelWeightsTest, KeepsHalfAndBfloatAsStoredWideningToExactValues) {
  const ModelConfig c = attention_config();  // d = 16
  const std::string d = dir("mixed");
  write_random_model(c, d, 3, DType::F32);
  const ModelWeights w = load_weights(d);
  // model.norm.weight stored as F16 and one layernorm as BF16, known bits.
  std::vector<std::uint16_t> half(16, 0x3C00);   // 1.0
  half[1] = 0xC000;                              // -2.0
  half[2] = 0x3555;                              // 0.333251953125
  half[3] = 0x0001;                              // smallest subnormal, 2^-24
  half[4] = 0xFC00;                              // -inf
  std::vector<std::uint16_t> brain(16, 0x3F80);  // 1.0
  brain[1] = 0xC040;                             // -3.0
  brain[2] = 0x3EAB;                             // 0.333984375
  std::vector<TensorToWrite> out;
  std::vector<std::vector<float>> keep;
  for (const std::string& n : w.names()) {
    const Tensor& t = w.get(n);
    std::vector<std::int64_t> shape;
    for (int i = 0; i < t.view().rank; ++i) shape.push_back(t.view().size(i));
    if (n == "model.norm.weight") {
      out.push_back({n, DType::F16, shape, std::as_bytes(std::span<const std::uint16_t>(half))});
    } else if (n == "model.layers.1.input_layernorm.weight") {
      out.push_back({n, DType::BF16, shape, std::as_bytes(std::span<const std::uint16_t>(brain))});
    } else {
      keep.emplace_back(t.data<float>(), t.data<float>() + t.numel());
    }
  }
  std::size_t k = 0;
  for (const std::string& n : w.names()) {
    if (n == "model.norm.weight" || n == "model.layers.1.input_layernorm.weight") continue;
    const Tensor& t = w.get(n);
    std::vector<std::int64_t> shape;
    for (int i = 0; i < t.view().rank; ++i) shape.push_back(t.view().size(i));
    out.push_back({n, DType::F32, shape, std::as_bytes(std::span<const float>(keep[k++]))});
  }
  write_safetensors(d + "/model.safetensors", out);

  const ModelWeights m = load_weights(d);
  // F16 and BF16 are kept as stored, bit for bit; widened they give the
  // exact values.
  const Tensor& ht = m.get("model.norm.weight");
  ASSERT_EQ(ht.view().dtype, DType::F16);
  const std::uint16_t* h = ht.data<std::uint16_t>();
  EXPECT_TRUE(std::equal(half.begin(), half.end(), h));
  EXPECT_EQ(f16_to_f32(h[0]), 1.0f);
  EXPECT_EQ(f16_to_f32(h[1]), -2.0f);
  EXPECT_EQ(f16_to_f32(h[2]), 0.333251953125f);
  EXPECT_EQ(f16_to_f32(h[3]), std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_f32(h[4]), -std::numeric_limits<float>::infinity());
  const Tensor& bt = m.get("model.layers.1.input_layernorm.weight");
  ASSERT_EQ(bt.view().dtype, DType::BF16);
  const std::uint16_t* b = bt.data<std::uint16_t>();
  EXPECT_TRUE(std::equal(brain.begin(), brain.end(), b));
  EXPECT_EQ(bf16_to_f32(b[0]), 1.0f);
  EXPECT_EQ(bf16_to_f32(b[1]), -3.0f);
  EXPECT_EQ(bf16_to_f32(b[2]), 0.333984375f);
  // Untouched f32 tensors are copied exactly.
  EXPECT_TRUE(bitwise_equal(m.get("model.embed_tokens.weight"), w.get("model.embed_tokens.weight")));
}

TEST_F(ModelWeightsTest, MissingTensor) {
  const std::string d = dir("missing");
  write_random_model(hybrid_config(), d, 1, DType::F32);
  rewrite(d, load_weights(d), [](std::vector<Owned>& t) {
    std::erase_if(t, [](const Owned& o) { return o.name == "model.layers.2.linear_attn.A_log"; });
  });
  expect_load_error(d, "model.safetensors",
                    {"missing tensor 'model.layers.2.linear_attn.A_log'", "config.json requires"});
}

TEST_F(ModelWeightsTest, ShapeMismatch) {
  const std::string d = dir("shape");
  write_random_model(hybrid_config(), d, 1, DType::F32);
  rewrite(d, load_weights(d), [](std::vector<Owned>& t) {
    for (Owned& o : t) {
      if (o.name == "model.layers.3.conv.conv.weight") {
        o.shape = {32, 3};  // same element count, wrong rank
      }
    }
  });
  expect_load_error(d, "model.safetensors",
                    {"model.safetensors: tensor 'model.layers.3.conv.conv.weight' has shape [32, 3], ",
                     "config.json implies [32, 1, 3]"});
}

TEST_F(ModelWeightsTest, ShapeMismatchAfterConfigChange) {
  const std::string d = dir("cfg_changed");
  const ModelConfig c = hybrid_config();
  write_random_model(c, d, 1, DType::F16);
  ModelConfig bigger = c;
  bigger.intermediate_size = 64;
  std::ofstream(d + "/config.json") << to_json(bigger);
  expect_load_error(
      d, "model.safetensors",
      {"tensor 'model.layers.0.mlp.gate_proj.weight' has shape [48, 32]", "config.json implies [64, 32]"});
}

TEST_F(ModelWeightsTest, ExtraTensor) {
  const std::string d = dir("extra");
  write_random_model(hybrid_config(), d, 1, DType::F32);
  rewrite(d, load_weights(d), [](std::vector<Owned>& t) {
    t.push_back({"model.layers.0.self_attn.q_norm.weight", {8}, std::vector<float>(8, 1.0f)});
  });
  expect_load_error(d, "model.safetensors", {"unexpected tensor 'model.layers.0.self_attn.q_norm.weight'"});
}

TEST_F(ModelWeightsTest, TiedConfigRejectsLmHead) {
  const std::string d = dir("tied");
  ModelConfig c = hybrid_config();
  write_random_model(c, d, 1, DType::F32);  // untied: has lm_head.weight
  c.tie_word_embeddings = true;
  std::ofstream(d + "/config.json") << to_json(c);
  expect_load_error(d, "model.safetensors", {"unexpected tensor 'lm_head.weight'"});
}

TEST_F(ModelWeightsTest, BadConfigOrMissingFiles) {
  const std::string d = dir("badcfg");
  write_random_model(hybrid_config(), d, 1, DType::F32);
  std::ofstream(d + "/config.json") << hybrid_text({{"layer_types", R"(["conv"])"}});
  expect_load_error(d, "config.json", {"'layer_types' has 1 entries"});

  const std::string e = dir("nofile");
  write_random_model(hybrid_config(), e, 1, DType::F32);
  fs::remove(e + "/model.safetensors");
  EXPECT_THROW(load_weights(e), Error);
  EXPECT_THROW(load_weights(dir("does_not_exist")), Error);

  const std::string t = dir("truncated");
  write_random_model(hybrid_config(), t, 1, DType::F32);
  fs::resize_file(t + "/model.safetensors", 100);
  expect_load_error(t, "model.safetensors", {"past the end of the file"});
}

TEST_F(ModelWeightsTest, GetUnknownNameThrows) {
  const ModelWeights w = ModelWeights::random(attention_config(), 5);
  EXPECT_EQ(w.find("nope"), nullptr);
  EXPECT_THROW(w.get("nope"), InvalidArgument);
  EXPECT_NO_THROW(w.get("model.norm.weight"));
}

TEST_F(ModelWeightsTest, ReleaseFreesOneTensorAndRefusesUnknownNames) {
  ModelWeights w = ModelWeights::random(attention_config(), 5);
  const std::vector<std::string> names = w.names();
  const std::size_t bytes = w.bytes();
  const std::string victim = "model.layers.0.mlp.up_proj.weight";
  const std::size_t victim_bytes = w.get(victim).bytes();
  ASSERT_GT(victim_bytes, 0u);
  w.release(victim);
  EXPECT_EQ(w.find(victim), nullptr);
  EXPECT_EQ(w.bytes(), bytes - victim_bytes);
  std::vector<std::string> expected = names;
  expected.erase(std::find(expected.begin(), expected.end(), victim));
  EXPECT_EQ(w.names(), expected);
  // Unknown or already released: InvalidArgument naming it, nothing changes.
  for (const std::string& name : {std::string("nope"), victim}) {
    try {
      w.release(name);
      ADD_FAILURE() << "released " << name;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("'" + name + "'"), std::string::npos) << e.what();
    }
    EXPECT_EQ(w.names(), expected);
    EXPECT_EQ(w.bytes(), bytes - victim_bytes);
  }
}

}  // namespace
}  // namespace rwd::runtime
