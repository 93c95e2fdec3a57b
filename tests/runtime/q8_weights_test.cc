// A model loaded with Q8 weights (LoadOptions::weights = kQ8,
// docs/quantization.md): what it holds, that its forward stays batch
// invariant, and that speculative decoding of it is exact against its own
// greedy decoding (named Q8Lossless so that `make test` also runs it on
// the other matmul copies).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "rewind/error.h"
#include "runtime/generate.h"
#include "runtime/model.h"
#include "test_configs.h"

namespace rwd::runtime {
namespace {

using testing_configs::hybrid;
using testing_configs::kEveryKind;

Model q8_model(const ModelConfig& c, std::uint64_t seed, DType dtype = DType::F32) {
  return Model(ModelWeights::random(c, seed, dtype), LoadOptions{WeightFormat::kQ8});
}

GenerationOptions greedy_options(std::int64_t n) {
  GenerationOptions o;
  o.max_new_tokens = n;
  o.stop_at_eos = false;
  return o;
}

TEST(Q8Weights, HoldsQuantizedMatricesUnderItsOwnFingerprint) {
  for (DType dtype : {DType::F32, DType::BF16}) {
    const Model stored(ModelWeights::random(hybrid(kEveryKind), 5, dtype));
    const Model q8 = q8_model(hybrid(kEveryKind), 5, dtype);
    EXPECT_EQ(stored.weight_format(), WeightFormat::kAsStored);
    EXPECT_EQ(q8.weight_format(), WeightFormat::kQ8);
    EXPECT_NE(q8.fingerprint(), stored.fingerprint()) << "a Q8 model's cache entries must not serve the original";
    EXPECT_EQ(q8.fingerprint(), q8_model(hybrid(kEveryKind), 5, dtype).fingerprint());
    EXPECT_LT(q8.weight_bytes(), stored.weight_bytes());
    EXPECT_EQ(q8.parameter_count(), stored.parameter_count());
    // Close to the original's logits (within a few quantization steps of
    // the largest), not equal to them.
    const std::vector<std::int32_t> tokens = encode_prompt("In the beginning", stored.config());
    Cache a = stored.make_cache(), b = q8.make_cache();
    std::vector<float> la, lb;
    stored.forward(tokens, a, la, false);
    q8.forward(tokens, b, lb, false);
    ASSERT_EQ(la.size(), lb.size());
    float largest = 0.0f, worst = 0.0f;
    for (std::size_t v = 0; v < la.size(); ++v) {
      largest = std::max(largest, std::fabs(la[v]));
      worst = std::max(worst, std::fabs(la[v] - lb[v]));
    }
    EXPECT_GT(worst, 0.0f);
    EXPECT_LT(worst, 0.1f * largest);
  }
}

TEST(Q8Weights, RefusesANonFiniteLinearWeightNamingIt) {
  const ModelWeights random = ModelWeights::random(hybrid(kEveryKind), 4);
  const std::string bad = weight_name(random.config(), 2, WeightRole::MlpUp);
  const auto copy = [&] {
    std::map<std::string, Tensor, std::less<>> out;
    for (const auto& name : random.names()) {
      const Tensor& t = random.get(name);
      Tensor f(DType::F32, t.view().shape.data(), t.view().rank);
      std::memcpy(f.data<float>(), t.data<float>(), t.bytes());
      out.emplace(name, std::move(f));
    }
    out.at(bad).data<float>()[5] = std::numeric_limits<float>::quiet_NaN();
    return ModelWeights::from_tensors(random.config(), std::move(out));
  };
  try {
    const Model m(copy(), LoadOptions{WeightFormat::kQ8});
    ADD_FAILURE() << "a NaN weight was quantized";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(Model{copy()}) << "as stored, the weight is the checkpoint's business";
}

TEST(Q8Weights, ForwardIsBatchInvariant) {
  const Model m = q8_model(hybrid(kEveryKind), 2);
  const std::vector<std::int32_t> tokens = encode_prompt("And God said, Let there be light", m.config());
  const auto V = static_cast<std::size_t>(m.vocab_size());
  Cache all = m.make_cache();
  std::vector<float> batched;
  m.forward(tokens, all, batched, true);
  Cache one = m.make_cache();
  std::vector<float> single;
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    m.forward(std::span<const std::int32_t>(&tokens[t], 1), one, single, true);
    ASSERT_EQ(0, std::memcmp(single.data(), batched.data() + t * V, V * sizeof(float))) << "token " << t;
  }
}

TEST(Q8Lossless, SpeculativeDecodingOfAQ8ModelEqualsItsGreedyDecoding) {
  for (DType dtype : {DType::F32, DType::BF16}) {
    const Model target = q8_model(hybrid(kEveryKind), 9, dtype);
    // Drafts in either format: the draft only proposes.
    const Model small_q8 = q8_model(hybrid({"conv", "sliding_attention"}, 16, 4), 109, dtype);
    const Model small(ModelWeights::random(hybrid({"conv", "sliding_attention"}, 16, 4), 109, dtype));
    const std::vector<std::int32_t> prompt = encode_prompt("the lord is my shepherd; the lord is my", target.config());
    const GenerationOptions options = greedy_options(48);
    const std::vector<std::int32_t> greedy = generate(target, prompt, options);
    ASSERT_EQ(greedy.size(), 48u);
    for (std::int64_t K : {1, 3, 6}) {
      ModelDraft perfect(target, {}, K);
      ModelDraft draft_q8(small_q8, {}, K);
      ModelDraft draft(small, {}, K);
      RandomDraft adversarial(target.vocab_size(), static_cast<std::uint64_t>(K) + 7);
      LookupDraft lookup(3);
      for (DraftSource* s : {static_cast<DraftSource*>(&perfect), static_cast<DraftSource*>(&draft_q8),
                             static_cast<DraftSource*>(&draft), static_cast<DraftSource*>(&adversarial),
                             static_cast<DraftSource*>(&lookup)}) {
        GenerationStats stats;
        GenerationOptions chain = options;
        chain.speculation = {K, false};
        EXPECT_EQ(speculative_generate(target, *s, prompt, chain, &stats), greedy) << "K=" << K;
        if (s == &perfect) {
          EXPECT_EQ(stats.accepted, stats.drafted);
        }
      }
    }
    LookupTreeDraft tree(3);
    GenerationOptions shaped = options;
    shaped.tree = {2, 8, 3};
    EXPECT_EQ(tree_speculative_generate(target, tree, prompt, shaped), greedy);
  }
}

}  // namespace
}  // namespace rwd::runtime
