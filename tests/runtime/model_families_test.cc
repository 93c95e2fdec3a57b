// Checkpoints of the transformers families the runtime reads (LFM2,
// Qwen3.5, Qwen3-Next without experts, Qwen3 dense with and without sliding
// layers, Llama with Llama 3 RoPE scaling, tied and untied, sharded) against
// the logits of transformers' own modeling classes
// (tests/fixtures/families_logits.json, written with the random-weight
// checkpoints in tests/fixtures/families/ by
// scripts/fixtures/make_family_fixtures.py), and for the dense families
// against the reference's own greedy continuation.
//
// Each prompt is fed in uneven chunks (1, 5, 17, rest) through the cache, so
// the comparison covers the attention KV, conv and recurrent states carried
// across forwards. Tolerance as for the shipped models: per stored row,
// max |cpp - python| <= 1e-3 * max(1, max |python|).
//
// Controls: each architectural difference of these families is left out in
// turn (the (1 + w) norm fold, the attention output gate, q/k norm, partial
// RoPE, Qwen3-Next's grouped projection layout, Llama 3's RoPE scaling,
// Qwen3's sliding window) by rebuilding the weights
// the way a loader that ignored it would, and the logits must then miss the
// tolerance by far: the comparison is sensitive to every one of them.
#include <gtest/gtest.h>

#include <unistd.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_test_util.h"
#include "generation_options.h"
#include "rewind/error.h"
#include "runtime/generate.h"
#include "runtime/model.h"
#include "runtime/safetensors.h"

namespace rwd::runtime {
namespace {

namespace fs = std::filesystem;
constexpr double kRelativeTolerance = 1e-3;

std::string source_path(const std::string& relative) { return std::string(REWIND_SOURCE_DIR) + "/" + relative; }
std::string family_dir(const std::string& name) { return source_path("tests/fixtures/families/" + name); }

const nlohmann::json& fixtures() {
  static const nlohmann::json doc = [] {
    std::ifstream in(source_path("tests/fixtures/families_logits.json"));
    std::stringstream text;
    text << in.rdbuf();
    return in ? nlohmann::json::parse(text.str()) : nlohmann::json();
  }();
  return doc;
}

const nlohmann::json& fixture(const std::string& name) {
  for (const auto& m : fixtures()["models"])
    if (m["model"] == "tests/fixtures/families/" + name) return m;
  throw InvalidArgument("no fixture " + name);
}

// Logits of every position, the prompt fed in chunks 1, 5, 17, rest.
std::vector<float> chunked_logits(const Model& m, const std::vector<std::int32_t>& tokens) {
  Cache cache = m.make_cache();
  std::vector<float> all, part;
  std::size_t at = 0;
  for (std::size_t size : {std::size_t{1}, std::size_t{5}, std::size_t{17}, tokens.size()}) {
    const std::size_t n = std::min(size, tokens.size() - at);
    if (n == 0) break;
    m.forward(std::span<const std::int32_t>(tokens.data() + at, n), cache, part, true);
    all.insert(all.end(), part.begin(), part.end());
    at += n;
  }
  return all;
}

// The largest per-row difference to transformers' logits, relative to the
// row's logit scale (max(1, max |logit|)), over every stored row.
double worst_relative_difference(const Model& m, const nlohmann::json& entry, double* worst_absolute = nullptr) {
  const auto V = static_cast<std::size_t>(m.vocab_size());
  double worst_relative = 0.0;
  for (const auto& prompt : entry["prompts"]) {
    const auto tokens = prompt["tokens"].get<std::vector<std::int32_t>>();
    const std::vector<float> logits = chunked_logits(m, tokens);
    const auto positions = prompt["positions"].get<std::vector<std::size_t>>();
    for (std::size_t i = 0; i < positions.size(); ++i) {
      const auto expected = prompt["logits"][i].get<std::vector<float>>();
      EXPECT_EQ(expected.size(), V);
      const float* got = logits.data() + positions[i] * V;
      double scale = 1.0, worst = 0.0;
      for (std::size_t v = 0; v < V; ++v) scale = std::max(scale, std::abs(static_cast<double>(expected[v])));
      for (std::size_t v = 0; v < V; ++v) worst = std::max(worst, std::abs(static_cast<double>(got[v]) - expected[v]));
      worst_relative = std::max(worst_relative, worst / scale);
      if (worst_absolute != nullptr) *worst_absolute = std::max(*worst_absolute, worst);
    }
  }
  return worst_relative;
}

class FamilyLogits : public ::testing::TestWithParam<const char*> {};

// A test name for fixture `p` (gtest allows no '-').
std::string fixture_test_name(const ::testing::TestParamInfo<const char*>& p) {
  std::string n = p.param;
  std::replace(n.begin(), n.end(), '-', '_');
  return n;
}

TEST_P(FamilyLogits, MatchTransformers) {
  ASSERT_FALSE(fixtures().is_null()) << "missing tests/fixtures/families_logits.json";
  const Model m = Model::load(family_dir(GetParam()));
  double absolute = 0.0;
  const double worst = worst_relative_difference(m, fixture(GetParam()), &absolute);
  std::printf("%s: largest difference %.3g of the logit scale, %.3g absolute (tolerance %.0e of the scale)\n",
              GetParam(), worst, absolute, kRelativeTolerance);
  EXPECT_LE(worst, kRelativeTolerance);
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyLogits,
                         ::testing::Values("lfm2", "qwen3_5", "qwen3_next", "qwen3", "qwen3-draft", "qwen3_sliding",
                                           "llama", "llama-draft"),
                         fixture_test_name);

// The dense families' greedy continuation equals the reference's (computed
// there by a full forward per token; the fixture records the smallest
// top-2 gap on the way, far above the logits' differences).
class FamilyGreedy : public ::testing::TestWithParam<const char*> {};

TEST_P(FamilyGreedy, MatchesTheReferenceGreedy) {
  const nlohmann::json& entry = fixture(GetParam());
  ASSERT_TRUE(entry.contains("greedy"));
  const Model m = Model::load(family_dir(GetParam()));
  GenerationOptions o;
  o.stop_at_eos = false;
  const auto expected = entry["greedy"]["tokens"].get<std::vector<std::int32_t>>();
  o.max_new_tokens = static_cast<std::int64_t>(expected.size());
  EXPECT_EQ(generate(m, entry["greedy"]["prompt"].get<std::vector<std::int32_t>>(), o), expected);
}

INSTANTIATE_TEST_SUITE_P(Families, FamilyGreedy,
                         ::testing::Values("qwen3", "qwen3-draft", "qwen3_sliding", "llama", "llama-draft"),
                         fixture_test_name);

// ---- controls ------------------------------------------------------------------

// A copy of every tensor of `w` (F32 or BF16, as loaded).
std::map<std::string, Tensor, std::less<>> copy_tensors(const ModelWeights& w) {
  std::map<std::string, Tensor, std::less<>> out;
  for (const auto& name : w.names()) {
    const TensorView v = w.get(name).view();
    Tensor t(v.dtype, v.shape.data(), v.rank);
    std::memcpy(t.data<std::byte>(), v.data, w.get(name).bytes());
    out.emplace(name, std::move(t));
  }
  return out;
}

// Rows [first + g * stride, + count) for every group g of an [out, in] tensor.
Tensor rows_of(const Tensor& t, std::int64_t groups, std::int64_t stride, std::int64_t first, std::int64_t count) {
  const std::int64_t in = t.view().shape[1];
  const auto row = static_cast<std::size_t>(in) * dtype_size(t.view().dtype);
  Tensor out(t.view().dtype, {groups * count, in});
  for (std::int64_t g = 0; g < groups; ++g) {
    std::memcpy(out.data<std::byte>() + static_cast<std::size_t>(g * count) * row,
                t.data<std::byte>() + static_cast<std::size_t>(g * stride + first) * row,
                static_cast<std::size_t>(count) * row);
  }
  return out;
}

// The family's model with one difference left out by `alter` (which edits the
// config and the tensors as a loader ignoring that difference would).
double difference_without(const char* name,
                          const std::function<void(ModelConfig&, std::map<std::string, Tensor, std::less<>>&)>& alter) {
  const ModelWeights loaded = ModelWeights::load(family_dir(name));
  ModelConfig c = loaded.config();
  auto tensors = copy_tensors(loaded);
  alter(c, tensors);
  const Model m(ModelWeights::from_tensors(c, std::move(tensors)));
  return worst_relative_difference(m, fixture(name));
}

TEST(FamilyControls, EveryDifferenceIsNeeded) {
  // Far outside the tolerance: a difference that moved the logits by a hair
  // would not show that the test can tell.
  constexpr double kMissed = 100 * kRelativeTolerance;
  for (const char* name : {"qwen3_5", "qwen3_next"}) {
    SCOPED_TRACE(name);
    const double no_fold = difference_without(name, [](ModelConfig& c, auto&) { c.norm_plus_one = false; });
    EXPECT_GT(no_fold, kMissed) << "(1 + w) fold";
    const double no_gate = difference_without(name, [](ModelConfig& c, auto& t) {
      c.attn_output_gate = false;
      for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
        if (c.layer_types[static_cast<std::size_t>(i)] != LayerKind::FullAttention) continue;
        const std::string q = weight_name(c, i, WeightRole::AttnQ);
        t[q] = rows_of(t.at(q), c.num_attention_heads, 2 * c.head_dim, 0, c.head_dim);  // the query rows alone
      }
    });
    EXPECT_GT(no_gate, kMissed) << "attention output gate";
    const double full_rope = difference_without(name, [](ModelConfig& c, auto&) { c.rotary_dim = 0; });
    EXPECT_GT(full_rope, kMissed) << "partial RoPE";
    std::printf("%s controls: no (1+w) fold %.3g, no output gate %.3g, full RoPE %.3g\n", name, no_fold, no_gate,
                full_rope);
  }
  for (const char* name : {"lfm2", "qwen3_5", "qwen3_next", "qwen3"}) {
    SCOPED_TRACE(name);
    const double no_qk_norm = difference_without(name, [](ModelConfig& c, auto& t) {
      c.qk_norm = false;
      for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
        if (c.layer_types[static_cast<std::size_t>(i)] != LayerKind::FullAttention) continue;
        t.erase(weight_name(c, i, WeightRole::AttnQNorm));
        t.erase(weight_name(c, i, WeightRole::AttnKNorm));
      }
    });
    EXPECT_GT(no_qk_norm, kMissed) << "q/k norm";
    std::printf("%s controls: no q/k norm %.3g\n", name, no_qk_norm);
  }
  // Qwen3-Next's fused projections read as if they were concatenated
  // [q; k; v; z] and [b; a] rather than grouped per key head.
  const double flat = difference_without("qwen3_next", [](ModelConfig& c, auto& t) {
    c.fused_gdn_projections = false;
    const std::int64_t conv = c.linear_conv_dim(), nv = c.linear_num_value_heads;
    const std::int64_t value = nv * c.linear_value_head_dim;
    for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
      if (c.layer_types[static_cast<std::size_t>(i)] != LayerKind::LinearAttention) continue;
      const Tensor qkvz = std::move(t.at(weight_name(c, i, WeightRole::GdnQkvz)));
      const Tensor ba = std::move(t.at(weight_name(c, i, WeightRole::GdnBa)));
      t.erase(weight_name(c, i, WeightRole::GdnQkvz));
      t.erase(weight_name(c, i, WeightRole::GdnBa));
      t.emplace(weight_name(c, i, WeightRole::GdnQkv), rows_of(qkvz, 1, 0, 0, conv));
      t.emplace(weight_name(c, i, WeightRole::GdnZ), rows_of(qkvz, 1, 0, conv, value));
      t.emplace(weight_name(c, i, WeightRole::GdnB), rows_of(ba, 1, 0, 0, nv));
      t.emplace(weight_name(c, i, WeightRole::GdnA), rows_of(ba, 1, 0, nv, nv));
    }
  });
  EXPECT_GT(flat, kMissed) << "fused projection layout";
  std::printf("qwen3_next control: fused projections read flat %.3g\n", flat);
  // Llama 3's scaled frequencies read as plain RoPE; Qwen3's sliding layers
  // read as full attention (the prompts are longer than the window).
  const double unscaled = difference_without("llama", [](ModelConfig& c, auto&) { c.llama3_rope = {}; });
  EXPECT_GT(unscaled, kMissed) << "llama3 RoPE scaling";
  const double no_window = difference_without("qwen3_sliding", [](ModelConfig& c, auto&) {
    for (LayerKind& k : c.layer_types) k = LayerKind::FullAttention;
    c.sliding_window = 0;
  });
  EXPECT_GT(no_window, kMissed) << "sliding window";
  std::printf("llama control: unscaled RoPE %.3g; qwen3_sliding control: no window %.3g\n", unscaled, no_window);
}

// ---- what the loader reads from each layout ------------------------------------------

TEST(ModelFamilies, ConfigsAsTransformersResolvesThem) {
  const ModelConfig lfm2 = Model::load(family_dir("lfm2")).config();
  EXPECT_EQ(lfm2.family, ModelFamily::Lfm2);
  EXPECT_EQ(lfm2.intermediate_size, 96);  // block_ff_dim 128: int(2 * 128 / 3) = 85, up to a multiple of 24
  EXPECT_EQ(lfm2.layer_types, (std::vector<LayerKind>{LayerKind::Conv, LayerKind::FullAttention, LayerKind::Conv,
                                                      LayerKind::Conv, LayerKind::FullAttention}));  // full_attn_idxs
  EXPECT_TRUE(lfm2.tie_word_embeddings);                                                             // tie_embedding
  EXPECT_EQ(lfm2.rope_theta, 1e6);     // the family's default
  EXPECT_EQ(lfm2.rms_norm_eps, 1e-5);  // norm_eps
  EXPECT_TRUE(lfm2.add_bos);
  EXPECT_EQ(lfm2.bos_token_id, 1);
  EXPECT_EQ(lfm2.eos_token_ids, std::vector<std::int64_t>{7});
  EXPECT_TRUE(lfm2.qk_norm);
  EXPECT_FALSE(lfm2.norm_plus_one || lfm2.attn_output_gate || lfm2.fused_gdn_projections);
  EXPECT_EQ(lfm2.rope_dim(), lfm2.head_dim);

  const ModelConfig q35 = Model::load(family_dir("qwen3_5")).config();
  EXPECT_EQ(q35.family, ModelFamily::Qwen3_5);
  EXPECT_EQ(q35.weight_prefix, "model.language_model.");
  EXPECT_EQ(q35.torch_dtype, DType::BF16);
  EXPECT_EQ(q35.rope_dim(), 4);  // partial_rotary_factor 0.25 of head_dim 16
  EXPECT_EQ(q35.rope_theta, 1e7);
  EXPECT_FALSE(q35.add_bos);
  EXPECT_EQ(q35.bos_token_id, -1);
  EXPECT_EQ(q35.eos_token_ids, (std::vector<std::int64_t>{159, 156}));  // generation_config.json's list
  EXPECT_EQ(q35.eos_token_id, 159);
  EXPECT_TRUE(q35.is_eos(156));
  EXPECT_TRUE(q35.norm_plus_one && q35.qk_norm && q35.attn_output_gate);
  EXPECT_FALSE(q35.fused_gdn_projections);

  const ModelConfig qn = Model::load(family_dir("qwen3_next")).config();
  EXPECT_EQ(qn.family, ModelFamily::Qwen3Next);
  EXPECT_EQ(qn.weight_prefix, "model.");
  EXPECT_EQ(qn.rope_dim(), 8);  // top-level partial_rotary_factor 0.5
  EXPECT_EQ(qn.layer_types, (std::vector<LayerKind>{LayerKind::LinearAttention, LayerKind::FullAttention,
                                                    LayerKind::LinearAttention, LayerKind::FullAttention}));
  EXPECT_TRUE(qn.fused_gdn_projections && qn.norm_plus_one && qn.attn_output_gate);
  EXPECT_EQ(qn.bos_token_id, 157);
  EXPECT_FALSE(qn.add_bos);
  EXPECT_EQ(qn.eos_token_ids, std::vector<std::int64_t>{158});

  // Prompts: BOS only where the family adds one.
  EXPECT_EQ(encode_prompt("A", lfm2), (std::vector<std::int32_t>{1, 65}));
  EXPECT_EQ(encode_prompt("A", q35), (std::vector<std::int32_t>{65}));
}

TEST(ModelFamilies, ToJsonRoundTripsInTheFamilyLayout) {
  for (const char* name : {"lfm2", "lfm2-draft", "qwen3_5", "qwen3_next"}) {
    SCOPED_TRACE(name);
    ModelConfig c = load_model_config(family_dir(name) + "/config.json");
    EXPECT_EQ(parse_model_config(to_json(c), "x"), c);
  }
  // Edge cases the fuzz target (fuzz_config) round-trips too.
  for (const char* text : {
           R"({"model_type": "lfm2", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 7, "conv_L_cache": 5})",
           R"({"model_type": "lfm2", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2,
               "num_attention_heads": 2, "num_key_value_heads": 1, "block_ff_dim": 30, "full_attn_idxs": [],
               "block_ffn_dim_multiplier": 1.3, "block_multiple_of": 7, "eos_token_id": [3, 4, 5]})",
           R"({"model_type": "qwen3_5", "tie_word_embeddings": true, "text_config": {"vocab_size": 10,
               "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
               "intermediate_size": 8, "head_dim": 10, "layer_types": ["full_attention"],
               "partial_rotary_factor": 0.4}})",
           R"({"model_type": "qwen3_next", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
               "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 8, "head_dim": 6,
               "num_experts": 0, "layer_types": ["full_attention"], "rope_parameters": {"rope_theta": 3.5,
               "partial_rotary_factor": 0.34}, "linear_num_key_heads": 3})"}) {
    SCOPED_TRACE(text);
    const ModelConfig c = parse_model_config(text, "x");
    EXPECT_EQ(parse_model_config(to_json(c), "x"), c);
  }
  // A random model of a family is a checkpoint of that family.
  const fs::path dir = fs::temp_directory_path() / ("rewind_family_random_" + std::to_string(::getpid()));
  ModelConfig c = load_model_config(family_dir("qwen3_next") + "/config.json");
  write_random_model(c, dir.string(), 7, DType::BF16);
  const Model m = Model::load(dir.string());
  EXPECT_EQ(m.config().family, ModelFamily::Qwen3Next);
  EXPECT_TRUE(SafetensorsFile::open((dir / "model.safetensors").string())
                  .find("model.layers.0.linear_attn.in_proj_qkvz.weight"));
  fs::remove_all(dir);
}

// ---- config keys, hand-worked -------------------------------------------------------

std::string lfm2_text(const std::string& extra) {
  return R"({"model_type": "lfm2", "vocab_size": 100, "hidden_size": 1024, "num_hidden_layers": 4,
             "num_attention_heads": 16, "num_key_value_heads": 8)" +
         extra + "}";
}

TEST(ModelFamilies, Lfm2MlpWidthRule) {
  auto width = [](const std::string& extra) { return parse_model_config(lfm2_text(extra), "c").intermediate_size; };
  // LFM2-350M: int(2 * 6656 / 3) = 4437, times 1.0, up to a multiple of 256.
  EXPECT_EQ(width(R"(, "block_ff_dim": 6656, "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0)"), 4608);
  // LFM2-1.2B: int(2 * 12288 / 3) = 8192, already a multiple of 256.
  EXPECT_EQ(width(R"(, "intermediate_size": 12288, "block_multiple_of": 256)"), 8192);
  // Without a multiplier there is no rounding; without auto adjustment the key is the width.
  EXPECT_EQ(width(R"(, "block_ff_dim": 6656, "block_ffn_dim_multiplier": null)"), 4437);
  EXPECT_EQ(width(R"(, "block_ff_dim": 6656, "block_auto_adjust_ff_dim": false)"), 6656);
  // A multiplier of 1.5 and multiple 100: int(1.5 * 4437) = 6655 -> 6700.
  EXPECT_EQ(width(R"(, "block_ff_dim": 6656, "block_ffn_dim_multiplier": 1.5, "block_multiple_of": 100)"), 6700);
  // block_ff_dim (the original key) wins over intermediate_size, as in Lfm2Config.
  EXPECT_EQ(width(R"(, "block_ff_dim": 300, "intermediate_size": 999, "block_auto_adjust_ff_dim": false)"), 300);
}

TEST(ModelFamilies, Lfm2DefaultsAndAliases) {
  const ModelConfig c = parse_model_config(lfm2_text(R"(, "intermediate_size": 96, "full_attn_idxs": [0, 3])"), "c");
  EXPECT_EQ(c.layer_types, (std::vector<LayerKind>{LayerKind::FullAttention, LayerKind::Conv, LayerKind::Conv,
                                                   LayerKind::FullAttention}));
  EXPECT_EQ(c.conv_L_cache, 3);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.bos_token_id, 1);
  EXPECT_EQ(c.eos_token_ids, std::vector<std::int64_t>{2});
  // tie_embedding overrides tie_word_embeddings; no full_attn_idxs: every layer attends.
  const ModelConfig u = parse_model_config(
      lfm2_text(R"(, "intermediate_size": 96, "tie_embedding": false, "tie_word_embeddings": true,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}, "eos_token_id": [7, 9])"),
      "c");
  EXPECT_FALSE(u.tie_word_embeddings);
  EXPECT_EQ(u.rope_theta, 5000.0);
  EXPECT_EQ(u.layer_types, std::vector<LayerKind>(4, LayerKind::FullAttention));
  EXPECT_EQ(u.eos_token_ids, (std::vector<std::int64_t>{7, 9}));
  EXPECT_EQ(u.eos_token_id, 7);
}

TEST(ModelFamilies, QwenDefaults) {
  const ModelConfig c = parse_model_config(
      R"({"model_type": "qwen3_next", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 8,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "num_experts": 0,
          "linear_conv_kernel_dim": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
          "linear_key_head_dim": 8, "linear_value_head_dim": 8})",
      "c");
  EXPECT_EQ(c.head_dim, 256);            // the config classes' default
  EXPECT_EQ(c.rope_dim(), 64);           // partial_rotary_factor 0.25
  for (std::size_t i = 0; i < 8; ++i) {  // full_attention_interval 4: layers 3 and 7
    EXPECT_EQ(c.layer_types[i], i % 4 == 3 ? LayerKind::FullAttention : LayerKind::LinearAttention) << i;
  }
  EXPECT_EQ(c.bos_token_id, -1);
  EXPECT_TRUE(c.eos_token_ids.empty());
  EXPECT_EQ(c.eos_token_id, -1);
  EXPECT_FALSE(c.is_eos(-1));
  // Every layer listed in mlp_only_layers: dense despite num_experts.
  const ModelConfig d = parse_model_config(
      R"({"model_type": "qwen3_next", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "num_experts": 64,
          "mlp_only_layers": [0, 1], "layer_types": ["full_attention", "full_attention"], "head_dim": 16})",
      "c");
  EXPECT_EQ(d.num_hidden_layers, 2);
  ModelConfig g = d;
  apply_generation_config(g, R"({"eos_token_id": [5, 6], "bos_token_id": 4})", "gen.json");
  EXPECT_EQ(g.eos_token_ids, (std::vector<std::int64_t>{5, 6}));
  EXPECT_EQ(g.bos_token_id, 4);
  ModelConfig bad = d;
  EXPECT_THROW(apply_generation_config(bad, R"({"eos_token_id": [5, 100]})", "gen.json"), FormatError);
  EXPECT_EQ(bad, d);  // unchanged
}

// A copy of fixture `name` in a fresh directory, with `edit` applied to the
// text of `file` (a config) before the load.
fs::path edited_copy(const std::string& name, const std::string& file,
                     const std::function<void(nlohmann::json&)>& edit) {
  static int counter = 0;
  const fs::path dir = fs::temp_directory_path() /
                       ("rewind_family_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
  fs::remove_all(dir);
  fs::copy(family_dir(name), dir);
  std::ifstream in(dir / file);
  nlohmann::json j = nlohmann::json::parse(in);
  in.close();
  edit(j);
  std::ofstream(dir / file) << j.dump(2);
  return dir;
}

// A copy of fixture `name` (a single model.safetensors) whose tensors
// `edit` may rename, add or drop before they are written back.
fs::path rewritten_copy(
    const std::string& name,
    const std::function<void(std::vector<TensorToWrite>&, std::vector<std::vector<std::byte>>&)>& edit) {
  const fs::path dir = edited_copy(name, "config.json", [](auto&) {});
  std::vector<std::vector<std::byte>> keep;
  std::vector<TensorToWrite> tensors;
  {
    const SafetensorsFile f = SafetensorsFile::open((dir / "model.safetensors").string());
    for (const TensorEntry& e : f.entries()) keep.emplace_back(e.data, e.data + e.nbytes);
    std::size_t i = 0;
    for (const TensorEntry& e : f.entries()) tensors.push_back({e.name, e.dtype, e.shape, keep[i++]});
  }
  edit(tensors, keep);
  write_safetensors((dir / "model.safetensors").string(), tensors);
  return dir;
}

void expect_load_error(const fs::path& dir, const std::string& needle) {
  try {
    (void)Model::load(dir.string());
    ADD_FAILURE() << "loaded " << dir << ", expected an error containing: " << needle;
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(ModelFamilies, RefusesWhatItDoesNotImplement) {
  expect_load_error(edited_copy("qwen3_next", "config.json", [](auto& j) { j["num_experts"] = 8; }),
                    "layer 0 is a mixture-of-experts layer ('num_experts' 8)");
  expect_load_error(edited_copy("qwen3_next", "config.json", [](auto& j) { j.erase("num_experts"); }),
                    "mixture-of-experts layer ('num_experts' 512 by default)");
  expect_load_error(edited_copy("qwen3_5", "config.json", [](auto& j) { j["model_type"] = "qwen3_5_moe"; }),
                    "model_type 'qwen3_5_moe' is not supported");
  expect_load_error(edited_copy("lfm2", "config.json", [](auto& j) { j["model_type"] = "lfm2_moe"; }),
                    "model_type 'lfm2_moe' is not supported");
  expect_load_error(edited_copy("lfm2", "config.json", [](auto& j) { j["conv_bias"] = true; }), "'conv_bias' is true");
  expect_load_error(
      edited_copy("qwen3_5", "config.json", [](auto& j) { j["text_config"]["rope_parameters"]["rope_type"] = "yarn"; }),
      "'text_config.rope_parameters' has rope_type \"yarn\"");
  expect_load_error(
      edited_copy("qwen3_5", "config.json", [](auto& j) { j["text_config"]["layer_types"][0] = "sliding_attention"; }),
      "text_config.layer_types[0] is 'sliding_attention', which the runtime does not support in "
      "qwen3_5 models (supported: full_attention, linear_attention)");
  expect_load_error(edited_copy("qwen3_5", "config.json", [](auto& j) { j["text_config"].erase("hidden_size"); }),
                    "missing required key 'text_config.hidden_size'");
  // The index must place every tensor in a shard that holds it.
  expect_load_error(
      edited_copy(
          "qwen3_5", "model.safetensors.index.json",
          [](auto& j) {
            j["weight_map"]["model.language_model.norm.weight"] = j["weight_map"]["model.language_model.norm.weight"] ==
                                                                          "model-00001-of-00002.safetensors"
                                                                      ? "model-00002-of-00002.safetensors"
                                                                      : "model-00001-of-00002.safetensors";
          }),
      "missing tensor 'model.language_model.norm.weight', which");
  expect_load_error(edited_copy("qwen3_5", "model.safetensors.index.json",
                                [](auto& j) { j["weight_map"]["lm_head.weight"] = "../elsewhere.safetensors"; }),
                    "not a file name in the directory");
  // Only the vision tower and the MTP head are skipped: any other stray
  // tensor means the config and the weights disagree.
  const fs::path stray = rewritten_copy(
      "lfm2", [](std::vector<TensorToWrite>& t, std::vector<std::vector<std::byte>>&) {
        t.push_back({"model.layers.0.conv.extra.weight", t.front().dtype, t.front().shape, t.front().bytes});
      });
  expect_load_error(stray, "unexpected tensor 'model.layers.0.conv.extra.weight'");
}

TEST(ModelFamilies, Qwen3_5TextConfigReadsEitherPrefix) {
  // Qwen3_5ForCausalLM's config (model_type qwen3_5_text, flat) next to the
  // multimodal checkpoint's model.language_model.* names, as transformers
  // loads it; and next to model.* names.
  const fs::path flat = edited_copy("qwen3_5", "config.json", [](auto& j) {
    nlohmann::json text = j["text_config"];
    text["tie_word_embeddings"] = false;
    j = text;
  });
  {
    const Model m = Model::load(flat.string());
    EXPECT_EQ(m.config().weight_prefix, "model.language_model.");
    EXPECT_LE(worst_relative_difference(m, fixture("qwen3_5")), kRelativeTolerance);
  }
  fs::remove_all(flat);
  const fs::path renamed = rewritten_copy("qwen3_5-draft", [](std::vector<TensorToWrite>& t, auto&) {
    for (auto& e : t) {
      if (e.name.rfind("model.language_model.", 0) == 0) e.name = "model." + e.name.substr(21);
    }
  });
  {
    nlohmann::json j;
    std::ifstream(renamed / "config.json") >> j;
    std::ofstream(renamed / "config.json") << j["text_config"].dump();
  }
  const Model a = Model::load(renamed.string());
  const Model b = Model::load(family_dir("qwen3_5-draft"));
  EXPECT_EQ(a.config().weight_prefix, "model.");
  const std::vector<std::int32_t> tokens = {5, 9, 100, 3, 77};
  std::vector<float> la, lb;
  Cache ca = a.make_cache(), cb = b.make_cache();
  a.forward(tokens, ca, la);
  b.forward(tokens, cb, lb);
  EXPECT_EQ(la, lb);
  fs::remove_all(renamed);
}

TEST(ModelFamilies, TiedEmbeddingsAsFromPretrainedTiesThem) {
  // Tied in the config, but the checkpoint holds both matrices: transformers
  // keeps them apart, and so does the loader (the logits stay transformers').
  const fs::path both = edited_copy("qwen3_next", "config.json", [](auto& j) { j["tie_word_embeddings"] = true; });
  {
    const Model m = Model::load(both.string());
    EXPECT_FALSE(m.config().tie_word_embeddings);
    EXPECT_LE(worst_relative_difference(m, fixture("qwen3_next")), kRelativeTolerance);
  }
  fs::remove_all(both);
  // Tied, with only lm_head.weight in the file: the embedding is tied to it.
  const fs::path head_only = rewritten_copy("lfm2",
                                            [](std::vector<TensorToWrite>& t, std::vector<std::vector<std::byte>>&) {
                                              for (auto& e : t)
                                                if (e.name == "model.embed_tokens.weight") e.name = "lm_head.weight";
                                            });
  {
    const Model m = Model::load(head_only.string());
    EXPECT_TRUE(m.config().tie_word_embeddings);
    EXPECT_LE(worst_relative_difference(m, fixture("lfm2")), kRelativeTolerance);
  }
  fs::remove_all(head_only);
}

// ---- the dense families: Qwen3 and Llama ------------------------------------------------

TEST(DenseFamilies, ConfigsAsTransformersResolvesThem) {
  const ModelConfig q = Model::load(family_dir("qwen3")).config();
  EXPECT_EQ(q.family, ModelFamily::Qwen3);
  EXPECT_EQ(q.head_dim, 16);  // the config's, not hidden_size / heads (8)
  EXPECT_EQ(q.num_key_value_heads, 2);
  EXPECT_EQ(q.layer_types, std::vector<LayerKind>(4, LayerKind::FullAttention));
  EXPECT_EQ(q.sliding_window, 0);  // use_sliding_window false
  EXPECT_TRUE(q.qk_norm);
  EXPECT_FALSE(q.norm_plus_one || q.attn_output_gate || q.fused_gdn_projections || q.tie_word_embeddings);
  EXPECT_EQ(q.rope_dim(), 16);
  EXPECT_EQ(q.rope_theta, 1e6);
  EXPECT_EQ(q.llama3_rope.factor, 0.0);
  EXPECT_FALSE(q.add_bos);
  EXPECT_EQ(q.bos_token_id, 157);
  EXPECT_EQ(q.eos_token_ids, std::vector<std::int64_t>{159});
  EXPECT_TRUE(Model::load(family_dir("qwen3-draft")).config().tie_word_embeddings);

  const ModelConfig s = Model::load(family_dir("qwen3_sliding")).config();
  EXPECT_EQ(s.layer_types, (std::vector<LayerKind>{LayerKind::FullAttention, LayerKind::SlidingAttention,
                                                   LayerKind::SlidingAttention}));  // from max_window_layers 1
  EXPECT_EQ(s.sliding_window, 8);
  EXPECT_EQ(s.torch_dtype, DType::F32);

  const ModelConfig l = Model::load(family_dir("llama")).config();
  EXPECT_EQ(l.family, ModelFamily::Llama);
  EXPECT_EQ(l.head_dim, 8);  // hidden_size / heads: no head_dim key
  EXPECT_EQ(l.num_attention_heads / l.num_key_value_heads, 3);
  EXPECT_FALSE(l.qk_norm || l.norm_plus_one || l.attn_output_gate || l.tie_word_embeddings);
  EXPECT_EQ(l.rms_norm_eps, 1e-5);
  EXPECT_EQ(l.llama3_rope, (ModelConfig::Llama3Rope{8.0, 1.0, 4.0, 256}));
  EXPECT_TRUE(l.add_bos);
  EXPECT_EQ(l.bos_token_id, 157);
  EXPECT_EQ(l.eos_token_ids, (std::vector<std::int64_t>{158, 155}));
  const ModelConfig ld = Model::load(family_dir("llama-draft")).config();
  EXPECT_TRUE(ld.tie_word_embeddings);
  EXPECT_EQ(ld.torch_dtype, DType::F16);
  EXPECT_EQ(ld.llama3_rope.factor, 0.0);  // rope_scaling null
  EXPECT_EQ(encode_prompt("A", l), (std::vector<std::int32_t>{157, 65}));
  EXPECT_EQ(encode_prompt("A", q), (std::vector<std::int32_t>{65}));
}

TEST(DenseFamilies, Llama3FrequenciesByBand) {
  // head_dim 8, theta 500000: inverse frequencies 1, 500000^-1/4, ^-1/2,
  // ^-3/4, wavelengths 2 pi / f = 6.28, 167, 4443, 118000 positions. With
  // an original context of 256 and factors 1 / 4, wavelengths below 64 keep
  // their frequency, those above 256 are divided by 8, and 167 is blended:
  // smooth = (256 / 167.0 - 1) / 3, f' = (1 - smooth) f / 8 + smooth f.
  const ModelConfig l = Model::load(family_dir("llama")).config();
  const std::vector<double> f = rope_inv_freq(l);
  ASSERT_EQ(f.size(), 4u);
  const double f1 = std::pow(500000.0, -0.25);
  const double smooth = (256.0 / (2 * M_PI / f1) - 1.0) / 3.0;
  EXPECT_DOUBLE_EQ(f[0], 1.0);
  EXPECT_DOUBLE_EQ(f[1], (1 - smooth) * f1 / 8 + smooth * f1);
  EXPECT_DOUBLE_EQ(f[2], std::pow(500000.0, -0.5) / 8);
  EXPECT_DOUBLE_EQ(f[3], std::pow(500000.0, -0.75) / 8);
  // Without scaling: theta^(-2j / d).
  ModelConfig plain = l;
  plain.llama3_rope = {};
  EXPECT_DOUBLE_EQ(rope_inv_freq(plain)[1], f1);
}

TEST(DenseFamilies, ToJsonRoundTripsInTheFamilyLayout) {
  for (const char* name : {"qwen3", "qwen3-draft", "qwen3_sliding", "llama", "llama-draft"}) {
    SCOPED_TRACE(name);
    const ModelConfig c = load_model_config(family_dir(name) + "/config.json");
    EXPECT_EQ(parse_model_config(to_json(c), "x"), c);
  }
  // A random model of a family is a checkpoint of that family.
  const fs::path dir = fs::temp_directory_path() / ("rewind_dense_random_" + std::to_string(::getpid()));
  write_random_model(load_model_config(family_dir("llama") + "/config.json"), dir.string(), 7, DType::BF16);
  const Model m = Model::load(dir.string());
  EXPECT_EQ(m.config().family, ModelFamily::Llama);
  EXPECT_EQ(m.config().llama3_rope.factor, 8.0);
  fs::remove_all(dir);
}

TEST(DenseFamilies, AsDownloadedConfigs) {
  // Trimmed from the Hub's Llama-3.2-1B and Qwen3-0.6B configs (transformers
  // 4.5x: rope_scaling and rope_theta at the top level; 5.x writes
  // rope_parameters and layer_types).
  const ModelConfig l = parse_model_config(
      R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
          "intermediate_size": 8192, "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
          "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0,
          "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                           "original_max_position_embeddings": 8192, "rope_type": "llama3"},
          "hidden_act": "silu", "attention_bias": false, "mlp_bias": false, "rms_norm_eps": 1e-05,
          "tie_word_embeddings": true, "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16"})",
      "llama.json");
  EXPECT_EQ(l.head_dim, 64);
  EXPECT_EQ(l.llama3_rope, (ModelConfig::Llama3Rope{32.0, 1.0, 4.0, 8192}));
  EXPECT_TRUE(l.tie_word_embeddings);
  EXPECT_EQ(l.bos_token_id, 128000);
  const ModelConfig q = parse_model_config(
      R"({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
          "intermediate_size": 3072, "num_attention_heads": 16, "num_hidden_layers": 2, "num_key_value_heads": 8,
          "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
          "layer_types": ["full_attention", "full_attention"], "max_window_layers": 28, "sliding_window": null,
          "use_sliding_window": false, "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
          "tie_word_embeddings": true})",
      "qwen3.json");
  EXPECT_EQ(q.head_dim, 128);
  EXPECT_EQ(q.rope_theta, 1e6);
  EXPECT_TRUE(q.qk_norm && q.tie_word_embeddings);
  // Qwen3Config's head_dim default (128) when the key is absent.
  EXPECT_EQ(parse_model_config(R"({"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 8,
                                    "num_attention_heads": 4, "num_hidden_layers": 1, "num_key_value_heads": 2,
                                    "vocab_size": 10})",
                               "q")
                .head_dim,
            128);
}

TEST(DenseFamilies, RefusesWhatItDoesNotImplement) {
  expect_load_error(edited_copy("llama", "config.json", [](auto& j) { j["rope_scaling"]["rope_type"] = "yarn"; }),
                    "'rope_scaling' has rope_type \"yarn\", which the runtime does not support (supported: "
                    "\"default\", \"llama3\")");
  expect_load_error(edited_copy("llama", "config.json",
                                [](auto& j) {
                                  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
                                }),
                    "'rope_scaling' has type \"linear\"");
  expect_load_error(edited_copy("qwen3", "config.json",
                                [](auto& j) {
                                  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 2.0}};
                                }),
                    "'rope_scaling' has rope_type \"llama3\", which the runtime does not support (only the default");
  expect_load_error(edited_copy("llama", "config.json", [](auto& j) { j["rope_scaling"].erase("low_freq_factor"); }),
                    "missing required key 'rope_scaling.low_freq_factor' (rope_type \"llama3\") (model_type 'llama')");
  expect_load_error(edited_copy("llama", "config.json", [](auto& j) { j["rope_scaling"]["high_freq_factor"] = 1.0; }),
                    "'rope_scaling.high_freq_factor' (1.000000) must be greater than 'rope_scaling.low_freq_factor'");
  expect_load_error(edited_copy("llama", "config.json", [](auto& j) { j["mlp_bias"] = true; }),
                    "'mlp_bias' is true: MLP biases are not supported in llama models");
  expect_load_error(edited_copy("qwen3", "config.json", [](auto& j) { j["attention_bias"] = true; }),
                    "'attention_bias' is true: attention biases are not supported in qwen3 models");
  expect_load_error(edited_copy("llama", "config.json", [](auto& j) { j["hidden_act"] = "gelu"; }),
                    "'hidden_act' is \"gelu\": only \"silu\" is supported in llama models");
  expect_load_error(
      edited_copy("qwen3", "config.json",
                  [](auto& j) {
                    j["layer_types"] = {"full_attention", "sliding_attention", "full_attention", "full_attention"};
                  }),
      "layer 1 is sliding_attention but 'use_sliding_window' is not true");
  expect_load_error(edited_copy("qwen3_sliding", "config.json",
                                [](auto& j) {
                                  j["sliding_window"] = nullptr;
                                  j["layer_types"] = {"full_attention", "sliding_attention", "sliding_attention"};
                                }),
                    "missing required key 'sliding_window' (layer 1 is sliding_attention) (model_type 'qwen3')");
  expect_load_error(edited_copy("llama", "config.json",
                                [](auto& j) {
                                  j["layer_types"] = {"full_attention", "conv", "full_attention"};
                                }),
                    "layer_types[1] is 'conv', which the runtime does not support in llama models (supported: "
                    "full_attention)");
  expect_load_error(edited_copy("qwen3", "config.json", [](auto& j) { j.erase("num_key_value_heads"); }),
                    "missing required key 'num_key_value_heads' (model_type 'qwen3')");
  expect_load_error(edited_copy("llama", "config.json", [](auto& j) { j.erase("intermediate_size"); }),
                    "missing required key 'intermediate_size' (model_type 'llama')");
  expect_load_error(edited_copy("llama", "config.json", [](auto& j) { j["num_key_value_heads"] = 4; }),
                    "'num_attention_heads' (6) is not a multiple of 'num_key_value_heads' (4)");
}

TEST(DenseFamilies, ShardedCheckpointErrors) {
  // The Llama fixture is in three shards; a shard the index names must exist.
  const fs::path dir = edited_copy("llama", "config.json", [](auto&) {});
  fs::remove(dir / "model-00002-of-00003.safetensors");
  try {
    (void)Model::load(dir.string());
    ADD_FAILURE() << "loaded without a shard";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model-00002-of-00003.safetensors"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
  // A tensor the index does not place is missing, named with the index.
  expect_load_error(edited_copy("llama", "model.safetensors.index.json",
                                [](auto& j) { j["weight_map"].erase("model.layers.1.self_attn.k_proj.weight"); }),
                    "model.safetensors.index.json: missing tensor 'model.layers.1.self_attn.k_proj.weight', which");
}

TEST(DenseFamilies, SavedRopeFrequencyBuffersAreIgnored) {
  // Some transformers versions saved RoPE's inv_freq buffer, at the top level
  // or per layer; it is derived from config.json, as transformers does.
  const Model reference = Model::load(family_dir("qwen3"));
  const std::int64_t half = reference.config().rope_dim() / 2;
  std::vector<float> inv_freq(static_cast<std::size_t>(half), 0.5f);  // not the real ones: never read
  const auto bytes = std::as_bytes(std::span<const float>(inv_freq));
  const fs::path dir = rewritten_copy("qwen3", [&](std::vector<TensorToWrite>& t, auto&) {
    t.push_back({"model.rotary_emb.inv_freq", DType::F32, {half}, bytes});
    t.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", DType::F32, {half}, bytes});
  });
  {
    const Model m = Model::load(dir.string());
    EXPECT_EQ(m.parameter_count(), reference.parameter_count());
    EXPECT_LE(worst_relative_difference(m, fixture("qwen3")), kRelativeTolerance);
  }
  fs::remove_all(dir);
  // Another stray name under rotary_emb is still refused.
  expect_load_error(rewritten_copy("qwen3",
                                   [&](std::vector<TensorToWrite>& t, auto&) {
                                     t.push_back({"model.rotary_emb.inv_freq_scaled", DType::F32, {half}, bytes});
                                   }),
                    "unexpected tensor 'model.rotary_emb.inv_freq_scaled'");
}

// ---- speculative decoding on the families ----------------------------------------------

// Speculative decoding of fixture `name` with the same-family `draft_name`,
// with prompt lookup and with itself as draft: each equal to its greedy.
void expect_speculative_is_greedy(const std::string& name, const std::string& draft_name) {
  const Model target = Model::load(family_dir(name));
  const Model draft = Model::load(family_dir(draft_name));
  EXPECT_EQ(draft.config().eos_token_ids, target.config().eos_token_ids);
  EXPECT_EQ(draft.config().bos_token_id, target.config().bos_token_id);
  GenerationOptions o;
  o.max_new_tokens = 40;
  o.stop_at_eos = false;  // random weights: decode the full budget
  const auto tokens = fixture(name)["prompts"][1]["tokens"].get<std::vector<std::int32_t>>();
  const std::vector<std::int32_t> greedy = generate(target, tokens, o);
  ASSERT_EQ(greedy.size(), 40u);
  for (std::int64_t K : {1, 3, 5}) {
    ModelDraft small(draft, {}, K);
    EXPECT_EQ(speculative_generate(target, small, tokens, with_chain(o, {K, false})), greedy) << "draft model, K " << K;
    LookupDraft lookup(3);
    EXPECT_EQ(speculative_generate(target, lookup, tokens, with_chain(o, {K, false})), greedy)
        << "prompt lookup, K " << K;
    ModelDraft perfect(target, {}, K);  // every draft accepted: multi-token verification forwards
    GenerationStats stats;
    EXPECT_EQ(speculative_generate(target, perfect, tokens, with_chain(o, {K, false}), &stats), greedy)
        << "self draft, K " << K;
  }
}

class FamilySpeculative : public ::testing::TestWithParam<const char*> {};

TEST_P(FamilySpeculative, IdenticalToGreedyWithADraftAndWithPromptLookup) {
  expect_speculative_is_greedy(GetParam(), std::string(GetParam()) + "-draft");
}

INSTANTIATE_TEST_SUITE_P(Families, FamilySpeculative,
                         ::testing::Values("lfm2", "qwen3_5", "qwen3_next", "qwen3", "llama"));

// Sliding layers roll back across their window while drafts are rejected.
TEST(FamilySpeculativeSliding, Qwen3SlidingIdenticalToGreedy) {
  expect_speculative_is_greedy("qwen3_sliding", "qwen3-draft");
}

#ifdef REWIND_CLI_PATH
// The CLI on the family checkpoints: generate, verify (IDENTICAL) with a
// same-family draft and with prompt lookup, inspect's family line, and a
// draft of another vocabulary refused by name.
TEST(ModelFamiliesCli, VerifyInspectAndGenerate) {
  using cli_test::run_cli;
  for (const std::string name : {"lfm2", "qwen3_5", "qwen3_next", "qwen3", "llama"}) {
    SCOPED_TRACE(name);
    const std::string model = "--model " + cli_test::quote(family_dir(name));
    for (const std::string& source :
         {"--draft " + cli_test::quote(family_dir(name + "-draft")), std::string("--lookup 3")}) {
      const auto r = run_cli("verify " + model + " " + source + " --prompt 'And God said' --max-new-tokens 24");
      EXPECT_EQ(r.status, 0) << r.all();
      EXPECT_NE(r.out.find("IDENTICAL"), std::string::npos) << r.all();
    }
    const auto g = run_cli("generate " + model + " --prompt 'And God said' --max-new-tokens 4");
    EXPECT_EQ(g.status, 0) << g.all();
    const auto i = run_cli("inspect " + model);
    EXPECT_EQ(i.status, 0) << i.all();
    EXPECT_NE(i.out.find("family: " + name + " (model_type "), std::string::npos) << i.out;
  }
  const auto q = run_cli("inspect --model " + cli_test::quote(family_dir("qwen3_next")));
  EXPECT_NE(q.out.find("layers: 2 full_attention, 2 linear_attention; (1 + w) RMSNorm, q/k norm, attention output "
                       "gate, partial RoPE 8/16, fused in_proj_qkvz / in_proj_ba"),
            std::string::npos)
      << q.out;
  const auto l = run_cli("inspect --model " + cli_test::quote(family_dir("llama")));
  EXPECT_NE(l.out.find("layers: 3 full_attention; llama3 RoPE scaling (factor 8, low_freq_factor 1, high_freq_factor "
                       "4, original context 256)"),
            std::string::npos)
      << l.out;
  const auto mixed = run_cli("verify --model " + cli_test::quote(family_dir("qwen3_5")) + " --draft " +
                             cli_test::quote(family_dir("qwen3_next-draft")) + " --prompt x --max-new-tokens 4");
  EXPECT_EQ(mixed.status, 2) << mixed.all();
  EXPECT_NE(mixed.err.find("is incompatible with the target: vocabulary 160 (BOS 157 not added, EOS [158]) vs 160 "
                           "(BOS -1 not added, EOS [159,156])"),
            std::string::npos)
      << mixed.all();
}
#endif

}  // namespace
}  // namespace rwd::runtime
