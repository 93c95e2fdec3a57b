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

// The checkpoint layouts the runtime reads, chosen once from config.json's
// model_type; every difference between them is a field of ModelConfig below
// (the model code reads those, never the family's name).
enum class ModelFamily {
  RewindHybrid,  // rewind's own layout (any model_type not listed below)
  Lfm2,          // "lfm2": LiquidAI LFM2, dense
  Qwen3_5,       // "qwen3_5" (nested text_config) or "qwen3_5_text": Qwen3.5, dense
  Qwen3Next,     // "qwen3_next" without mixture-of-experts layers
  Qwen3,         // "qwen3": Qwen3 dense (Qwen3ForCausalLM)
  Llama,         // "llama": Llama 2 / 3.x (LlamaForCausalLM)
};

// "rewind_hybrid", "lfm2", "qwen3_5", "qwen3_next", "qwen3", "llama" (for
// messages and inspect).
const char* model_family_name(ModelFamily family);

struct ModelConfig {
  std::string model_type = "rewind_hybrid";
  ModelFamily family = ModelFamily::RewindHybrid;
  std::int64_t hidden_size = 0;  // d
  std::int64_t num_hidden_layers = 0;
  std::int64_t num_attention_heads = 0;  // nh
  std::int64_t num_key_value_heads = 0;  // nkv, divides nh
  std::int64_t head_dim = 0;             // hd, default d / nh
  std::int64_t intermediate_size = 0;    // ff
  std::int64_t vocab_size = 0;
  // The most positions the model was built for (config.json's
  // max_position_embeddings, in [1, 2^40]); 0 when the config names none.
  // Nothing in the runtime depends on it: the CLI refuses a run whose
  // prompt and new tokens would go past it.
  std::int64_t max_position_embeddings = 0;
  // One per layer, parsed once from config.json's strings (layer_kind_name
  // gives them back); only supported_layer_kinds() occur.
  std::vector<LayerKind> layer_types;

  std::int64_t sliding_window = 0;  // > 0 when a sliding_attention layer exists
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;

  // Gated DeltaNet (linear_attention layers); 0 when the model has none.
  std::int64_t linear_conv_kernel_dim = 0;  // K of the q/k/v causal conv
  std::int64_t linear_num_key_heads = 0;    // lnk
  std::int64_t linear_num_value_heads = 0;  // lnv, multiple of lnk
  std::int64_t linear_key_head_dim = 0;     // lkd
  std::int64_t linear_value_head_dim = 0;   // lvd

  // LFM2 short convolution (conv layers); 0 when the model has none.
  std::int64_t conv_L_cache = 0;  // kernel size

  // Special tokens. bos_token_id is -1 when the config names none; add_bos
  // says whether a prompt starts with it (LFM2 and rewind's layout do, the
  // Qwen families do not). Generation stops at any of eos_token_ids (empty
  // when the config names none); eos_token_id is its first entry (-1 when
  // empty), kept for code that needs one id.
  std::int64_t bos_token_id = 256;
  std::int64_t eos_token_id = 257;
  std::vector<std::int64_t> eos_token_ids = {257};
  bool add_bos = true;
  DType torch_dtype = DType::F32;  // dtype of the stored weights

  // Architecture variants, parsed once from the family and its keys.
  // Where tensor names start: "model." or "model.language_model." (Qwen3.5
  // with a nested text_config); lm_head.weight is always top-level.
  std::string weight_prefix = "model.";
  // RMSNorms multiply by (1 + w) (Qwen3.5, Qwen3-Next; the Gated DeltaNet
  // output norm excepted), folded into the weight at load time.
  bool norm_plus_one = false;
  // Per-head RMSNorm of queries and keys before RoPE (LFM2, Qwen).
  bool qk_norm = false;
  // q_proj has 2 * nh * hd rows, per head hd query rows then hd gate rows;
  // the attention output is multiplied by sigmoid(gate) before o_proj.
  bool attn_output_gate = false;
  // RoPE rotates the first rotary_dim elements of each head (partial RoPE:
  // int(head_dim * partial_rotary_factor)); the rest pass through. 0 means
  // all of head_dim (rewind's layout and LFM2).
  std::int64_t rotary_dim = 0;
  // Qwen3-Next: Gated DeltaNet projections fused as in_proj_qkvz / in_proj_ba,
  // grouped per key head (the loader unfuses them by rows).
  bool fused_gdn_projections = false;
  // Llama 3.x RoPE frequency scaling (rope_scaling with rope_type "llama3"):
  // rope_inv_freq() applies it. factor 0 means plain RoPE; otherwise factor
  // >= 1, 0 < low_freq_factor < high_freq_factor and original_max_positions
  // >= 1.
  struct Llama3Rope {
    double factor = 0.0;
    double low_freq_factor = 0.0;
    double high_freq_factor = 0.0;
    std::int64_t original_max_positions = 0;
    bool operator==(const Llama3Rope&) const = default;
  };
  Llama3Rope llama3_rope;

  bool operator==(const ModelConfig&) const = default;

  // True when some layer is of kind `kind`.
  bool has_layer_type(LayerKind kind) const;
  // True when generation stops after `token` (one of eos_token_ids).
  bool is_eos(std::int64_t token) const;
  // Elements of a head that RoPE rotates: rotary_dim, or head_dim when 0.
  std::int64_t rope_dim() const { return rotary_dim > 0 ? rotary_dim : head_dim; }
  // Channels of the Gated DeltaNet causal conv: 2 * lnk * lkd + lnv * lvd.
  std::int64_t linear_conv_dim() const;
};

// The inverse frequency of each rotated pair j < rope_dim() / 2:
// rope_theta^(-2j / rope_dim()), rescaled per pair as transformers' "llama3"
// rope_type does when config.llama3_rope.factor > 0 (pairs whose wavelength
// exceeds original_max_positions / low_freq_factor divided by factor, those
// below original_max_positions / high_freq_factor kept, the ones between
// interpolated smoothly). REQUIRES: a validated config.
std::vector<double> rope_inv_freq(const ModelConfig& config);

// Layer kinds the runtime implements, in the order messages list them:
// full_attention, sliding_attention, linear_attention (Gated DeltaNet), conv.
const std::vector<LayerKind>& supported_layer_kinds();

// The kinds of supported_layer_kinds(), for the switches that build,
// shape or describe a layer: each names every one, so that the compiler
// points at each switch a newly implemented kind needs, and none lists the
// library's kinds that the runtime refuses.
enum class RuntimeLayerKind : std::uint8_t { FullAttention, SlidingAttention, LinearAttention, Conv };

// `kind`, of layer `layer`, as a RuntimeLayerKind. Throws FormatError
// ("config.json: layer type '...' of layer N is not implemented by the
// runtime") for a kind outside supported_layer_kinds(), which a parsed
// ModelConfig never holds.
RuntimeLayerKind runtime_layer_kind(LayerKind kind, std::int64_t layer);

// Parses and validates config.json text. The family comes from model_type
// (docs/model-format.md lists the keys each reads); a config of another
// architecture (a model_type or a transformers class in "architectures"
// that is none of the families, e.g. MistralForCausalLM) is refused first,
// naming it and the supported ones; mixture-of-experts
// variants, vision-only configs and unsupported options (biases, RoPE
// scaling other than Llama 3's, other activations) are refused with a
// message naming them. `source_name` (usually the path)
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
// parse_model_config turns back into an equal ModelConfig. For the
// families it is in their own layout (LFM2 keys, Qwen3.5's nested
// text_config), so write_random_model writes a checkpoint transformers reads.
std::string to_json(const ModelConfig& config);

// Applies DIR/generation_config.json text: its eos_token_id (an id or a
// list) replaces the config's EOS list and its bos_token_id fills in a BOS
// the config lacks, as transformers' generate() uses them. Throws
// FormatError naming `source_name` and the key for a malformed value or an
// id outside the vocabulary (config unchanged then).
void apply_generation_config(ModelConfig& config, const std::string& json_text, const std::string& source_name);

// Tensors a checkpoint of this family may hold besides expected_weights()
// that the runtime ignores (name prefixes: Qwen3.5's vision tower
// "model.visual.", the multi-token-prediction head "mtp.").
std::vector<std::string> ignored_weight_prefixes(const ModelConfig& config);

// One weight tensor the architecture needs.
struct WeightSpec {
  std::string name;
  std::vector<std::int64_t> shape;
  // An [out, in] matrix that kernels::matmul multiplies with (projections,
  // MLP, the output head, a tied embedding): what a Q8 model holds
  // quantized (docs/quantization.md).
  bool matmul = false;
};

// What a tensor is for; weight_name() gives its name in a family's
// checkpoint (docs/model-format.md has the table).
enum class WeightRole {
  Embed,
  FinalNorm,
  LmHead,  // global
  InputNorm,
  PostNorm,
  MlpGate,
  MlpUp,
  MlpDown,  // every layer
  AttnQ,
  AttnK,
  AttnV,
  AttnO,
  AttnQNorm,
  AttnKNorm,  // attention
  GdnQkv,
  GdnZ,
  GdnB,
  GdnA,
  GdnQkvz,
  GdnBa,
  GdnConv,
  GdnDtBias,
  GdnALog,
  GdnNorm,
  GdnOut,  // Gated DeltaNet
  ConvIn,
  ConvConv,
  ConvOut,  // short conv
};

// The checkpoint name of `role` in layer `layer` (ignored for the global
// roles), e.g. "model.layers.3.feed_forward.w1.weight" for LFM2's MlpGate.
// REQUIRES: a validated config; 0 <= layer < num_hidden_layers for layer roles.
std::string weight_name(const ModelConfig& config, std::int64_t layer, WeightRole role);

// Every tensor the model of `config` reads, exactly (names and shapes are in
// docs/model-format.md): global tensors first, then layer by layer.
// REQUIRES: a validated config (from parse_model_config / load_model_config).
std::vector<WeightSpec> expected_weights(const ModelConfig& config);

}  // namespace rwd::runtime
