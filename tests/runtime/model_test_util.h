// tests/runtime/model_test_util.h: what the tests that compare two loads of
// one model (Q8 checkpoints, pack files) run on each.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "runtime/generate.h"
#include "runtime/model.h"

namespace rwd::runtime {

// Every logit of `prompt` (all rows) under `m`, from an empty cache.
inline std::vector<float> logits_of(const Model& m, const std::string& prompt) {
  const std::vector<std::int32_t> tokens = encode_prompt(prompt, m.config());
  Cache cache = m.make_cache();
  std::vector<float> logits;
  m.forward(tokens, cache, logits, true);
  return logits;
}

// Greedy decoding of n tokens, past any EOS.
inline GenerationOptions greedy(std::int64_t n) {
  GenerationOptions o;
  o.max_new_tokens = n;
  o.stop_at_eos = false;
  return o;
}

}  // namespace rwd::runtime
