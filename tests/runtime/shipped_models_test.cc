// The shipped models (models/kjv-hybrid, models/kjv-draft) against logits
// computed by the PyTorch definition of the architecture
// (scripts/train/model.py, tests/fixtures/shipped_models_logits.json): the
// C++ runtime and the training code must implement the same model.
//
// Each prompt is longer than the sliding window (64) and is fed in uneven
// chunks (1, 5, 17, 64, rest), so the comparison covers sliding-window
// eviction, the conv states and the Gated DeltaNet state carried across
// forwards, not only a single prefill.
//
// Tolerance: per stored row, max |cpp - python| <= 1e-3 * max(1, max |python|).
// Both sides compute in f32 from the same f16 weights but sum in different
// orders; the observed difference is about 1e-6 of the logit scale, so 1e-3
// leaves a wide margin while any architectural mismatch (a wrong norm, gate,
// mask or head mapping) moves logits by far more.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "generation_options.h"
#include "runtime/generate.h"
#include "runtime/kernels.h"
#include "runtime/model.h"

namespace rwd::runtime {
namespace {

constexpr double kRelativeTolerance = 1e-3;

std::string source_path(const std::string& relative) { return std::string(REWIND_SOURCE_DIR) + "/" + relative; }

nlohmann::json load_fixtures() {
  std::ifstream in(source_path("tests/fixtures/shipped_models_logits.json"));
  if (!in) return nullptr;
  std::stringstream text;
  text << in.rdbuf();
  return nlohmann::json::parse(text.str());
}

// Logits of every position, the prompt fed in chunks 1, 5, 17, 64, rest.
std::vector<float> chunked_logits(const Model& m, const std::vector<std::int32_t>& tokens) {
  Cache cache = m.make_cache();
  std::vector<float> all, part;
  std::size_t at = 0;
  for (std::size_t size : {std::size_t{1}, std::size_t{5}, std::size_t{17}, std::size_t{64}, tokens.size()}) {
    const std::size_t n = std::min(size, tokens.size() - at);
    if (n == 0) break;
    m.forward(std::span<const std::int32_t>(tokens.data() + at, n), cache, part, true);
    all.insert(all.end(), part.begin(), part.end());
    at += n;
  }
  EXPECT_EQ(at, tokens.size());
  return all;
}

TEST(ShippedModels, LogitsMatchThePyTorchDefinition) {
  const nlohmann::json fixtures = load_fixtures();
  ASSERT_FALSE(fixtures.is_null()) << "missing tests/fixtures/shipped_models_logits.json";
  ASSERT_EQ(fixtures["models"].size(), 2u);
  double worst_relative = 0.0;
  for (const auto& entry : fixtures["models"]) {
    const std::string dir = entry["model"].get<std::string>();
    SCOPED_TRACE(dir);
    const Model m = Model::load(source_path(dir));
    EXPECT_EQ(m.parameter_count(), entry["parameters"].get<std::int64_t>());
    const auto V = static_cast<std::size_t>(m.vocab_size());
    for (const auto& prompt : entry["prompts"]) {
      const auto tokens = prompt["tokens"].get<std::vector<std::int32_t>>();
      ASSERT_EQ(tokens, encode_prompt(prompt["text"].get<std::string>(), m.config()));
      ASSERT_GT(tokens.size(), static_cast<std::size_t>(m.config().sliding_window));
      const std::vector<float> logits = chunked_logits(m, tokens);
      ASSERT_EQ(logits.size(), tokens.size() * V);
      const auto positions = prompt["positions"].get<std::vector<std::size_t>>();
      const auto& rows = prompt["logits"];
      ASSERT_EQ(rows.size(), positions.size());
      for (std::size_t i = 0; i < positions.size(); ++i) {
        const auto expected = rows[i].get<std::vector<float>>();
        ASSERT_EQ(expected.size(), V);
        const float* got = logits.data() + positions[i] * V;
        double scale = 1.0, worst = 0.0;
        for (std::size_t v = 0; v < V; ++v) scale = std::max(scale, std::abs(static_cast<double>(expected[v])));
        for (std::size_t v = 0; v < V; ++v) {
          worst = std::max(worst, std::abs(static_cast<double>(got[v]) - expected[v]));
        }
        worst_relative = std::max(worst_relative, worst / scale);
        EXPECT_LE(worst, kRelativeTolerance * scale)
            << "position " << positions[i] << " of a " << tokens.size() << "-token prompt";
        // Where PyTorch's top token wins clearly, the runtime picks it too.
        std::vector<float> sorted = expected;
        std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<>());
        if (sorted[0] - sorted[1] > 2 * kRelativeTolerance * scale) {
          const auto want = kernels::argmax(expected.data(), static_cast<std::int64_t>(V));
          EXPECT_EQ(kernels::argmax(got, static_cast<std::int64_t>(V)), want) << "position " << positions[i];
        }
      }
    }
  }
  std::printf("largest difference: %.3g of the logit scale (tolerance %.0e)\n", worst_relative, kRelativeTolerance);
}

TEST(ShippedModels, DraftIsCompatibleWithTheTarget) {
  const Model target = Model::load(source_path("models/kjv-hybrid"));
  const Model draft = Model::load(source_path("models/kjv-draft"));
  EXPECT_EQ(target.vocab_size(), draft.vocab_size());
  EXPECT_EQ(target.config().bos_token_id, draft.config().bos_token_id);
  EXPECT_EQ(target.config().eos_token_id, draft.config().eos_token_id);
  // The target has every layer kind the runtime implements.
  for (const LayerKind kind : supported_layer_kinds()) {
    EXPECT_TRUE(target.config().has_layer_type(kind)) << layer_kind_name(kind);
  }
  EXPECT_LT(draft.parameter_count() * 4, target.parameter_count());
}

// The draft is distilled from the target (scripts/train/README.md): greedy
// speculative decoding of the demo prompt accepts most of its drafts. The
// draft trained on the text alone accepted 0.706 of them here (K = 4, 1000
// tokens), 0.851 at the first position; the shipped distilled one 0.876 and
// 0.959 (another distillation run of the same recipe: 0.831 and 0.935). The
// thresholds sit between, so a draft that agrees no better than the one
// trained on the text fails. Deterministic: greedy decoding, fixed weights.
TEST(ShippedModels, DistilledDraftAgreesWithTheTarget) {
  const Model target = Model::load(source_path("models/kjv-hybrid"));
  const Model draft = Model::load(source_path("models/kjv-draft"));
  GenerationOptions options;
  options.max_new_tokens = 1000;
  options.stop_at_eos = false;
  ModelDraft source(draft, {}, 4);
  GenerationStats stats;
  const auto prompt = encode_prompt("And it came to pass, when the king heard", target.config());
  const auto spec = speculative_generate(target, source, prompt, with_chain(options, {4, false}), &stats);
  EXPECT_EQ(spec, generate(target, prompt, options));
  ASSERT_EQ(stats.drafted_at.size(), 4u);
  EXPECT_GT(stats.acceptance_rate(), 0.77);
  EXPECT_GT(stats.acceptance_at(0), 0.88);
}

}  // namespace
}  // namespace rwd::runtime
