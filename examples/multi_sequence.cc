// Many sequences in one cache (docs/sequences.md), compiled and run by the
// test suite: two users of different lengths share one SequenceCache; one
// user forks to draft two continuations, keeps one (rolled back by a token)
// and drops the other. Exits non-zero when a result differs from what the
// comments say.
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "rewind/error.h"
#include "rewind/sequences.h"

using namespace rwd;

namespace {

int failures = 0;
void expect(bool ok, const char* what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what);
  if (!ok) ++failures;
}

// A stand-in for a model's forward: every layer of the batch gets its
// tokens (here, key = token id, value = -token id, conv input = token id,
// new recurrent state = previous + token id).
void forward(SequenceCache& cache, std::vector<BatchEntry> entries, const std::vector<float>& tokens) {
  SequenceBatch batch = cache.begin_batch(entries);  // reserves everything first
  const std::int64_t T = batch.num_tokens();
  Tensor keys(DType::F32, {1, 2, T, 4}), values(DType::F32, {1, 2, T, 4}), conv(DType::F32, {1, 6, T});
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t h = 0; h < 2; ++h)
      for (std::int64_t d = 0; d < 4; ++d) {
        keys.view().set(tokens[static_cast<std::size_t>(t)], 0, h, t, d);
        values.view().set(-tokens[static_cast<std::size_t>(t)], 0, h, t, d);
      }
    for (std::int64_t c = 0; c < 6; ++c) conv.view().set(tokens[static_cast<std::size_t>(t)], 0, c, t);
  }
  // Layer 0: linear attention (conv + recurrent), layers 1 and 2: attention.
  cache.update_conv_state(conv, 0);  // per entry, its conv window
  BatchRecurrentUpdate step = cache.begin_recurrent_update(0);
  for (std::size_t e = 0; e < step.num_entries(); ++e) {
    float state = step.previous(e).get(0, 0, 0, 0);
    for (std::int64_t t = 1; t <= step.num_tokens(e); ++t) {
      state += tokens[static_cast<std::size_t>(batch.offset(e) + t - 1)];
      step.next(e, t).set(state, 0, 0, 0, 0);  // S(L+t), written in place
    }
  }
  step.commit();
  for (int layer = 1; layer <= 2; ++layer) {
    // What each sequence's new queries attend to, as block spans an
    // attention kernel reads in place.
    std::span<const PagedKeyValues> kv = cache.update(keys, values, layer);
    for (std::size_t e = 0; e < kv.size(); ++e) {
      const MaskSizes mask{kv[e].kv_length, kv[e].kv_offset};
      (void)mask;
    }
  }
  batch.commit();
}

std::vector<float> keys_of(const SequenceCache& cache, SeqId id, int layer) {
  Tensor k = cache.keys(id, layer);
  std::vector<float> out;
  for (std::int64_t t = 0; t < k.view().size(2); ++t) out.push_back(k.view().get(0, 0, t, 0));
  return out;
}

}  // namespace

int main() {
  LayerOptions options;
  options.num_kv_heads = 2;
  options.key_dim = 4;
  options.sliding_window = 4;
  options.conv_kernel_size = 4;
  options.conv_channels = {6};
  options.recurrent_shapes = {{2, 4, 4}};
  SequenceCache cache({"linear_attention", "full_attention", "sliding_attention"}, options, {/*block_size=*/4});

  // Two users, prompts of 5 and 9 tokens, prefilled in one ragged batch.
  const SeqId alice = cache.add_sequence();
  const SeqId bob = cache.add_sequence();
  cache.activate_past_recording(alice, 3);  // alice will speculate up to 3 drafts
  forward(cache, {{alice, 5}, {bob, 9}}, {1, 2, 3, 4, 5, 11, 12, 13, 14, 15, 16, 17, 18, 19});
  std::printf("alice L = %lld, bob L = %lld\n", static_cast<long long>(cache.seq_length(alice)),
              static_cast<long long>(cache.seq_length(bob)));
  expect(cache.seq_length(alice) == 5 && cache.seq_length(bob) == 9, "two users, two lengths, one cache");
  expect(cache.get_recurrent_state(alice, 0).get(0, 0, 0, 0) == 15, "alice's state: 1+2+3+4+5");
  expect(cache.get_recurrent_state(bob, 0).get(0, 0, 0, 0) == 135, "bob's state: 11+...+19");

  // alice drafts two continuations: fork shares her 5 tokens (no copy of
  // history), then each branch appends 3 drafts; bob decodes one token in
  // the same batch.
  const SequenceMemory before = cache.memory();
  const SeqId draft = cache.fork(alice);
  forward(cache, {{alice, 3}, {draft, 3}, {bob, 1}}, {6, 7, 8, 60, 70, 80, 20});
  std::printf("blocks before the fork: %lld, after both branches appended: %lld\n",
              static_cast<long long>(before.blocks_in_use), static_cast<long long>(cache.memory().blocks_in_use));
  expect(keys_of(cache, alice, 1) == std::vector<float>{1, 2, 3, 4, 5, 6, 7, 8}, "branch 1 keys");
  expect(keys_of(cache, draft, 1) == std::vector<float>{1, 2, 3, 4, 5, 60, 70, 80}, "branch 2 keys");

  // The verifier accepts 2 of branch 1's drafts: roll it back by one token,
  // exactly, in every layer (recurrent state included); branch 2 is dropped.
  cache.crop(alice, -1);
  expect(cache.seq_rm(draft), "branch 2 removed");
  expect(!cache.seq_rm(draft), "removing it again changes nothing");
  expect(keys_of(cache, alice, 1) == std::vector<float>{1, 2, 3, 4, 5, 6, 7}, "kept branch, rolled back by 1");
  expect(cache.get_recurrent_state(alice, 0).get(0, 0, 0, 0) == 28, "alice's state: 1+...+7 (no draft left in it)");
  expect(keys_of(cache, alice, 2) == std::vector<float>{3, 4, 5, 6, 7}, "sliding layer: W-1+R = 6 kept, 5 remain");
  expect(cache.seq_length(bob) == 10 && cache.get_recurrent_state(bob, 0).get(0, 0, 0, 0) == 155,
         "bob untouched by alice's rollback");

  try {
    cache.crop(draft, -1);
  } catch (const IndexError& e) {
    std::printf("refused: %s\n", e.what());
  }
  return failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
