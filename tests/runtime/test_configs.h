// Small model configurations shared by the runtime tests.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "runtime/model_config.h"

namespace rwd::runtime::testing_configs {

inline const std::vector<std::string> kEveryKind = {"linear_attention", "sliding_attention", "conv", "full_attention"};

// A hybrid of `types` with hidden size `hidden` (4 heads, 2 kv heads),
// Gated DeltaNet 2 key / 4 value heads of 8, conv kernels 4 and 3, and a
// sliding window far below the lengths the tests generate.
inline ModelConfig hybrid(std::vector<std::string> types = kEveryKind, std::int64_t hidden = 32,
                          std::int64_t window = 5) {
  ModelConfig c;
  c.hidden_size = hidden;
  c.num_hidden_layers = static_cast<std::int64_t>(types.size());
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = hidden / 4;
  c.intermediate_size = 2 * hidden;
  c.vocab_size = 258;
  for (const auto& t : types) c.layer_types.push_back(parse_layer_kind(t));
  c.sliding_window = window;
  c.linear_conv_kernel_dim = 4;
  c.linear_num_key_heads = 2;
  c.linear_num_value_heads = 4;
  c.linear_key_head_dim = 8;
  c.linear_value_head_dim = 8;
  c.conv_L_cache = 3;
  return c;
}

}  // namespace rwd::runtime::testing_configs
