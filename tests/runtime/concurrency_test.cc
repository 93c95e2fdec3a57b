// Thread-safety contract (docs/reliability.md): one cache per sequence
// owner; separate caches may be used from separate threads, over one shared,
// read-only Model. Run under ThreadSanitizer by `make test` (build-tsan).
#include <gtest/gtest.h>

#include <thread>
#include <vector>

#include "runtime/generate.h"
#include "runtime/model.h"
#include "test_configs.h"

namespace rwd::runtime {
namespace {

ModelConfig small_hybrid() { return testing_configs::hybrid(testing_configs::kEveryKind, 32, 6); }

TEST(Concurrency, ThreadsDecodingWithTheirOwnCachesOverSharedWeights) {
  const Model model(ModelWeights::random(small_hybrid(), 77));
  const std::vector<std::string> prompts = {"first prompt", "second, longer prompt text", "third", "the fourth one"};
  GenerationOptions options;
  options.max_new_tokens = 24;
  options.stop_at_eos = false;

  // Expected outputs, computed one after the other on this thread.
  std::vector<std::vector<std::int32_t>> expected;
  for (const auto& p : prompts) expected.push_back(generate(model, encode_prompt(p, model.config()), options));

  std::vector<std::vector<std::int32_t>> plain(prompts.size()), spec(prompts.size());
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    threads.emplace_back([&, i] {
      const auto tokens = encode_prompt(prompts[i], model.config());
      plain[i] = generate(model, tokens, options);
      ModelDraft draft(model, {}, 3);  // a draft with its own cache, same shared weights
      spec[i] = speculative_generate(model, draft, tokens, options, {3, false});
    });
  }
  for (auto& t : threads) t.join();
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(plain[i], expected[i]) << "thread " << i;
    EXPECT_EQ(spec[i], expected[i]) << "thread " << i;
  }
}

}  // namespace
}  // namespace rwd::runtime
