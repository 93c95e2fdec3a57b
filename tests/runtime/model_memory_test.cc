// The runtime's memory figures (what `rewind inspect` prints) come from the
// library's retention rules; checked here against what a real cache holds
// after real forwards, and the runtime's forwards are all-or-nothing.
#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <vector>

#include "rewind/cache.h"
#include "rewind/error.h"
#include "runtime/model.h"
#include "runtime/weights_io.h"
#include "test_configs.h"

namespace rwd::runtime {
namespace {

std::vector<std::int32_t> tokens(std::int64_t n, std::int32_t first) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    t[static_cast<std::size_t>(i)] = (first + static_cast<std::int32_t>(i) * 7) % 256;
  return t;
}

TEST(ModelMemory, RetentionFiguresMatchWhatTheCacheHolds) {
  const Model model(ModelWeights::random(testing_configs::hybrid(), 21));
  const std::int64_t R = 4;
  Cache cache = model.make_cache();
  cache.activate_past_recording(R);
  std::vector<float> logits;
  model.forward(tokens(40, 3), cache, logits);
  model.forward(tokens(5, 9), cache, logits);  // L = 45, far past the window (5) and the kernels (4, 3)
  const std::int64_t L = cache.get_seq_length();
  // Recording R: every bounded part holds exactly its bound (sliding W-1+R,
  // conv K+R, recurrent R+1 states); full attention holds every token.
  EXPECT_EQ(cache.memory().bytes_used, model.fixed_state_bytes() + model.rollback_bytes(R) +
                                           model.kv_bytes_per_token() * static_cast<std::size_t>(L));
  // Without history (crop(0)): the fixed state alone.
  cache.crop(0);
  EXPECT_EQ(cache.memory().bytes_used,
            model.fixed_state_bytes() + model.kv_bytes_per_token() * static_cast<std::size_t>(L));
  // Hand-worked for this config: full attention 2 kv heads x 8 dims, keys +
  // values f32 = 128 bytes per token; sliding W-1 = 4 tokens x 128; conv
  // (linear) 2*8*2 + 4*8 = 64 channels x K=4, conv 32 channels x K=3;
  // recurrent 4 x 8 x 8 f32.
  EXPECT_EQ(model.kv_bytes_per_token(), 128u);
  EXPECT_EQ(model.fixed_state_bytes(), (4 * 128) + (64 * 4 * 4) + (32 * 3 * 4) + (4 * 8 * 8 * 4));
  EXPECT_EQ(model.rollback_bytes(1), 128u + 64 * 4 + 32 * 4 + 4 * 8 * 8 * 4);
  EXPECT_THROW((void)model.rollback_bytes(-1), InvalidArgument);
}

TEST(ModelMemory, AForwardRefusedByTheBudgetChangesNoLayer) {
  const Model model(ModelWeights::random(testing_configs::hybrid(), 22));
  Cache cache = model.make_cache();
  cache.activate_past_recording(3);
  std::vector<float> logits;
  model.forward(tokens(10, 1), cache, logits);
  cache.set_memory_budget(cache.memory().bytes_reserved + 1024);
  const std::int64_t before = cache.max_rollback();
  const std::size_t reserved = cache.memory().bytes_reserved;
  EXPECT_THROW(model.forward(tokens(200, 5), cache, logits), CapacityError);
  for (int i = 0; i < cache.num_layers(); ++i) EXPECT_EQ(cache.get_seq_length(i), 10) << "layer " << i;
  EXPECT_EQ(cache.max_rollback(), before);
  EXPECT_EQ(cache.memory().bytes_reserved, reserved);
  // The same tokens fit once the budget is lifted, and give the logits a
  // fresh cache gives (nothing stale was left behind).
  cache.set_memory_budget(0);
  model.forward(tokens(3, 7), cache, logits);
  Cache fresh = model.make_cache();
  std::vector<float> a, b;
  std::vector<std::int32_t> all = tokens(10, 1);
  const std::vector<std::int32_t> tail = tokens(3, 7);
  all.insert(all.end(), tail.begin(), tail.end());
  model.forward(all, fresh, b, /*all_logits=*/false);
  model.forward(tokens(1, 11), cache, a, false);
  model.forward(tokens(1, 11), fresh, b, false);
  EXPECT_EQ(a, b);
}

}  // namespace
}  // namespace rwd::runtime
