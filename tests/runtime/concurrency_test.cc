// Thread-safety contract (docs/reliability.md): one cache per sequence
// owner; separate caches may be used from separate threads, over one shared,
// read-only Model. Run under ThreadSanitizer by `make test` (build-tsan).
#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <vector>

#include "generation_options.h"
#include "runtime/generate.h"
#include "runtime/kernels.h"
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
      spec[i] = speculative_generate(model, draft, tokens, with_chain(options, {3, false}));
    });
  }
  for (auto& t : threads) t.join();
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(plain[i], expected[i]) << "thread " << i;
    EXPECT_EQ(spec[i], expected[i]) << "thread " << i;
  }
}

// A model's RoPE angles (kernels::RopeCache) are filled on first use by
// whichever thread asks first: threads asking for positions across the same
// and different blocks at once all get the formula's values, bit for bit.
TEST(Concurrency, ThreadsFillingOneRopeCacheGetTheFormulasAngles) {
  const double theta = 10000.0;
  const std::int64_t rotary_dim = 48, half = rotary_dim / 2;
  const kernels::RopeCache cache(theta, rotary_dim);
  constexpr int kThreads = 4;
  std::vector<int> mismatches(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::int64_t> positions;
      for (std::int64_t i = 0; i < 400; ++i) positions.push_back((t % 2 == 0 ? i : 399 - i) * 7 + t);
      positions.push_back(70000);  // outside the cached range
      const auto n = static_cast<std::int64_t>(positions.size());
      const kernels::RopeTable cached(positions.data(), n, cache);
      const kernels::RopeTable direct(positions.data(), n, theta, rotary_dim);
      for (std::int64_t r = 0; r < n; ++r) {
        if (std::memcmp(cached.cos(r), direct.cos(r), static_cast<std::size_t>(half) * sizeof(float)) != 0 ||
            std::memcmp(cached.sin(r), direct.sin(r), static_cast<std::size_t>(half) * sizeof(float)) != 0) {
          ++mismatches[static_cast<std::size_t>(t)];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(mismatches[static_cast<std::size_t>(t)], 0) << "thread " << t;
  // Positions up to 399 * 7 + 3 = 2,796: blocks 0 to 10 of 256 positions.
  EXPECT_EQ(cache.bytes(), 11u * kernels::RopeCache::kBlockPositions * rotary_dim * sizeof(float));
}

}  // namespace
}  // namespace rwd::runtime
