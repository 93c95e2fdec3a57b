// runtime/model_config.h: the model's architecture (config.json) and the
// list of weight tensors that architecture implies.
//
// A ModelConfig is a validated, Hugging Face style config.json: sizes, the
// per-layer `layer_types` (full_attention, sliding_attention,
// linear_attention for Gated DeltaNet, conv for LFM2-style short
// convolutions) and the options each layer kind needs. Every ModelConfig
// returned by parse_model_config / load_model_config is consistent: sizes
// are positive, head counts divide, the keys a layer kind needs are present,
// and expected_weights() of it cannot overflow. Unknown keys are ignored so
// real transformers configs parse; docs/model-format.md lists every key.
//
// expected_weights() is the single source of truth for tensor names and
// shapes: the loader checks files against it, write_random_model writes it,
// and the model reads its weights by these names.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "rewind/dtype.h"
#include "rewind/layer.h"

namespace rwd::runtime {

struct ModelConfig {
  std::string model_type = "rewind_hybrid";
  std::int64_t hidden_size = 0;          // d
  std::int64_t num_hidden_layers = 0;
  std::int64_t num_attention_heads = 0;  // nh
  std::int64_t num_key_value_heads = 0;  // nkv, divides nh
  std::int64_t head_dim = 0;             // hd, default d / nh
  std::int64_t intermediate_size = 0;    // ff
  std::int64_t vocab_size = 0;
  // One per layer, parsed once from config.json's strings (layer_kind_name
  // gives them back); only supported_layer_kinds() occur.
  std::vector<LayerKind> layer_types;

  std::int64_t sliding_window = 0;  // > 0 when a sliding_attention layer exists
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;

  // Gated DeltaNet (linear_attention layers); 0 when the model has none.
  std::int64_t linear_conv_kernel_dim = 0;   // K of the q/k/v causal conv
  std::int64_t linear_num_key_heads = 0;     // lnk
  std::int64_t linear_num_value_heads = 0;   // lnv, multiple of lnk
  std::int64_t linear_key_head_dim = 0;      // lkd
  std::int64_t linear_value_head_dim = 0;    // lvd

  // LFM2 short convolution (conv layers); 0 when the model has none.
  std::int64_t conv_L_cache = 0;  // kernel size

  std::int64_t bos_token_id = 256;
  std::int64_t eos_token_id = 257;
  DType torch_dtype = DType::F32;  // dtype of the stored weights

  bool operator==(const ModelConfig&) const = default;

  // True when some layer is of kind `kind`.
  bool has_layer_type(LayerKind kind) const;
  // Channels of the Gated DeltaNet causal conv: 2 * lnk * lkd + lnv * lvd.
  std::int64_t linear_conv_dim() const;
};

// Layer kinds the runtime implements, in the order messages list them:
// full_attention, sliding_attention, linear_attention (Gated DeltaNet), conv.
const std::vector<LayerKind>& supported_layer_kinds();

// Parses and validates config.json text. `source_name` (usually the path)
// starts every message. Throws FormatError naming the source and the key for
// invalid JSON, a missing required key, a wrong JSON type, a size <= 0 (or
// above 2^24), a layer_types list whose length is not num_hidden_layers, an
// unsupported layer type, head counts that do not divide, and a layer kind's
// options missing (sliding_window, linear_*, conv_L_cache).
ModelConfig parse_model_config(const std::string& json_text, const std::string& source_name);

// Reads the file and parses it with its path as the source name. Throws
// rwd::Error when the file cannot be read, FormatError as above.
ModelConfig load_model_config(const std::string& path_to_config_json);

// config.json text (pretty-printed, every field written explicitly) that
// parse_model_config turns back into an equal ModelConfig.
std::string to_json(const ModelConfig& config);

// One weight tensor the architecture needs.
struct WeightSpec {
  std::string name;
  std::vector<std::int64_t> shape;
};

// Every tensor the model of `config` reads, exactly (names and shapes are in
// docs/model-format.md): global tensors first, then layer by layer.
// REQUIRES: a validated config (from parse_model_config / load_model_config).
std::vector<WeightSpec> expected_weights(const ModelConfig& config);

}  // namespace rwd::runtime
