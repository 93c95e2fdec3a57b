#include "runtime/model_config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "rewind/error.h"

namespace rwd::runtime {
namespace {

using nlohmann::json;

// Sizes are capped so that every product expected_weights() forms (at most
// three factors, e.g. 2 * lnk * lkd) stays far inside int64.
constexpr std::int64_t kMaxSize = std::int64_t{1} << 24;
// max_position_embeddings is no size of a tensor: only a limit the CLI checks.
constexpr std::int64_t kMaxPositions = std::int64_t{1} << 40;

const char* json_type(const json& v) {
  if (v.is_boolean()) return "a boolean";
  if (v.is_number_integer()) return "an integer";
  if (v.is_number()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_array()) return "a list";
  if (v.is_object()) return "an object";
  if (v.is_null()) return "null";
  return "something else";
}

// Reads typed keys out of one config object; every failure names the source
// and the key.
class KeyReader {
 public:
  KeyReader(const json& doc, const std::string& source, std::string key_prefix = "")
      : doc_(doc), source_(source), key_prefix_(std::move(key_prefix)) {}

  // 'key' as messages quote it ('text_config.key' inside a nested config).
  std::string q(const char* key) const { return "'" + key_prefix_ + key + "'"; }

  [[noreturn]] void fail(const std::string& problem) const {
    throw FormatError(source_ + ": " + problem);
  }

  // The value of `key`, or nullptr when absent or null (transformers writes
  // null for "not set").
  const json* find(const char* key) const {
    auto it = doc_.find(key);
    if (it == doc_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  const json& require(const char* key, const std::string& why = "") const {
    const json* v = find(key);
    if (v == nullptr) {
      fail("missing required key " + q(key) + (why.empty() ? "" : " " + why));
    }
    return *v;
  }

  std::int64_t integer(const char* key, const json& v, std::int64_t lo, std::int64_t hi) const {
    if (!v.is_number_integer()) {
      fail(q(key) + " must be an integer, got " + json_type(v));
    }
    if (v.is_number_unsigned() &&
        v.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      fail(q(key) + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + v.dump());
    }
    const auto i = v.get<std::int64_t>();
    if (i < lo || i > hi) {
      fail(q(key) + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
           std::to_string(i));
    }
    return i;
  }

  std::int64_t required_size(const char* key, const std::string& why = "") const {
    return integer(key, require(key, why), 1, kMaxSize);
  }

  // A size only some layer kinds need: absent reads as 0, a present value
  // may be 0 (to_json's "unused") or a valid size.
  std::int64_t optional_size(const char* key) const {
    const json* v = find(key);
    return v == nullptr ? 0 : integer(key, *v, 0, kMaxSize);
  }

  double positive_number(const char* key, const json& v) const {
    if (!v.is_number()) fail(q(key) + " must be a number, got " + json_type(v));
    const double d = v.get<double>();
    if (!(d > 0.0) || !std::isfinite(d)) fail(q(key) + " must be a positive finite number, got " + v.dump());
    return d;
  }

  bool boolean(const char* key, bool fallback) const {
    const json* v = find(key);
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) fail(q(key) + " must be a boolean, got " + json_type(*v));
    return v->get<bool>();
  }

  // Every id of a token-id key (an id or a non-empty list), each in [0, vocab).
  std::vector<std::int64_t> token_ids(const char* key, std::int64_t vocab) const {
    const json* v = find(key);
    if (v == nullptr) return {};
    if (!v->is_array()) return {integer(key, *v, 0, vocab - 1)};
    if (v->empty()) fail(q(key) + " is an empty list");
    std::vector<std::int64_t> ids;
    for (const json& id : *v) ids.push_back(integer(key, id, 0, vocab - 1));
    return ids;
  }

  const json& doc() const { return doc_; }

  // A token id, or (transformers allows several eos ids) a non-empty list
  // of them, of which the first is used.
  std::int64_t token_id(const char* key, std::int64_t fallback, std::int64_t vocab) const {
    const json* v = find(key);
    if (v == nullptr) {
      // The default is checked too: the model looks every id up in the
      // embedding table.
      if (fallback >= vocab) {
        fail(q(key) + " is absent and its default " + std::to_string(fallback) +
             " is outside the vocabulary ('vocab_size' " + std::to_string(vocab) + ")");
      }
      return fallback;
    }
    return token_ids(key, vocab).front();
  }

 private:
  const json& doc_;
  const std::string& source_;
  std::string key_prefix_;
};

DType parse_torch_dtype(const KeyReader& r, const char* key, const json& v) {
  if (v.is_string()) {
    const auto& s = v.get_ref<const std::string&>();
    if (s == "float32") return DType::F32;
    if (s == "float16") return DType::F16;
    if (s == "bfloat16") return DType::BF16;
  }
  r.fail(r.q(key) + " must be one of \"float32\", \"float16\", \"bfloat16\", got " + v.dump());
}

const char* torch_dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::F16: return "float16";
    case DType::BF16: return "bfloat16";
  }
  return "float32";
}

// Index of the first layer of `kind`, or -1.
int first_layer_of(const ModelConfig& c, LayerKind kind) {
  for (std::size_t i = 0; i < c.layer_types.size(); ++i) {
    if (c.layer_types[i] == kind) return static_cast<int>(i);
  }
  return -1;
}

}  // namespace

bool ModelConfig::is_eos(std::int64_t token) const {
  return std::find(eos_token_ids.begin(), eos_token_ids.end(), token) != eos_token_ids.end();
}

bool ModelConfig::has_layer_type(LayerKind kind) const { return first_layer_of(*this, kind) >= 0; }

std::int64_t ModelConfig::linear_conv_dim() const {
  return 2 * linear_num_key_heads * linear_key_head_dim +
         linear_num_value_heads * linear_value_head_dim;
}

const std::vector<LayerKind>& supported_layer_kinds() {
  static const std::vector<LayerKind> kKinds = {LayerKind::FullAttention, LayerKind::SlidingAttention,
                                                LayerKind::LinearAttention, LayerKind::Conv};
  return kKinds;
}

const char* model_family_name(ModelFamily family) {
  switch (family) {
    case ModelFamily::RewindHybrid: return "rewind_hybrid";
    case ModelFamily::Lfm2: return "lfm2";
    case ModelFamily::Qwen3_5: return "qwen3_5";
    case ModelFamily::Qwen3Next: return "qwen3_next";
  }
  return "rewind_hybrid";
}

namespace {

// Variants of the supported families that the runtime refuses by name
// rather than misload (their tensors would not match, or worse, would).
// What the runtime reads, as messages about other architectures list it.
constexpr const char* kSupportedArchitectures =
    "rewind_hybrid (rewind's own layout, with 'layer_types'), lfm2 (Lfm2ForCausalLM, dense), qwen3_5 and "
    "qwen3_5_text (Qwen3_5ForConditionalGeneration / Qwen3_5ForCausalLM, dense), qwen3_next (Qwen3NextForCausalLM "
    "without experts)";

constexpr const char* kRefusedModelTypes[] = {"qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next_moe",
                                              "lfm2_moe", "lfm2_vl", "qwen3_vl_moe"};

// LFM2's MLP width rule (transformers' Lfm2MLP): with block_auto_adjust_ff_dim
// the width is int(2 * I / 3), then, when block_ffn_dim_multiplier is set,
// int(multiplier * width) rounded up to a multiple of block_multiple_of.
std::int64_t lfm2_mlp_width(const KeyReader& r, std::int64_t base) {
  if (!r.boolean("block_auto_adjust_ff_dim", true)) return base;
  auto width = static_cast<std::int64_t>(2.0 * static_cast<double>(base) / 3.0);
  const json* m = r.find("block_ffn_dim_multiplier");
  if (m != nullptr) {
    const double multiplier = r.positive_number("block_ffn_dim_multiplier", *m);
    const std::int64_t multiple =
        r.find("block_multiple_of") ? r.integer("block_multiple_of", *r.find("block_multiple_of"), 1, kMaxSize) : 256;
    const double scaled = multiplier * static_cast<double>(width);
    // Checked before the conversion: a huge multiplier must not overflow it.
    if (!(scaled < static_cast<double>(kMaxSize))) {
      r.fail(r.q("block_ffn_dim_multiplier") + " (" + std::to_string(multiplier) + ") makes the MLP width exceed " +
             std::to_string(kMaxSize));
    }
    width = static_cast<std::int64_t>(scaled);
    width = multiple * ((width + multiple - 1) / multiple);
  }
  if (width < 1 || width > kMaxSize) {
    r.fail("the LFM2 MLP width derived from 'intermediate_size' (" + std::to_string(base) + ") is " +
           std::to_string(width) + ", outside [1, " + std::to_string(kMaxSize) + "]");
  }
  return width;
}

// The layer kinds a family's checkpoints have.
std::vector<LayerKind> family_layer_kinds(ModelFamily f) {
  switch (f) {
    case ModelFamily::RewindHybrid: return supported_layer_kinds();
    case ModelFamily::Lfm2: return {LayerKind::FullAttention, LayerKind::Conv};
    case ModelFamily::Qwen3_5:
    case ModelFamily::Qwen3Next: return {LayerKind::FullAttention, LayerKind::LinearAttention};
  }
  return {};
}

// layer_types when the config has none: LFM2 lists its attention layers in
// full_attn_idxs (all layers when absent), the Qwen families place one full
// attention layer every full_attention_interval (4) layers.
json default_layer_types(const KeyReader& r, ModelFamily f, std::int64_t layers) {
  json types = json::array();
  if (f == ModelFamily::Lfm2) {
    std::vector<bool> attention(static_cast<std::size_t>(layers), r.find("full_attn_idxs") == nullptr);
    if (const json* idx = r.find("full_attn_idxs")) {
      if (!idx->is_array()) r.fail(r.q("full_attn_idxs") + " must be a list, got " + json_type(*idx));
      for (const json& i : *idx) attention[static_cast<std::size_t>(r.integer("full_attn_idxs", i, 0, layers - 1))] = true;
    }
    for (bool a : attention) types.push_back(a ? "full_attention" : "conv");
  } else {
    const json* iv = r.find("full_attention_interval");
    const std::int64_t interval = iv ? r.integer("full_attention_interval", *iv, 1, kMaxSize) : 4;
    for (std::int64_t i = 0; i < layers; ++i) types.push_back((i + 1) % interval ? "linear_attention" : "full_attention");
  }
  return types;
}

}  // namespace

ModelConfig parse_model_config(const std::string& json_text, const std::string& source_name) {
  json doc;
  try {
    doc = json::parse(json_text);
  } catch (const json::exception& e) {
    throw FormatError(source_name + ": not valid JSON: " + e.what());
  }
  KeyReader top(doc, source_name);
  if (!doc.is_object()) top.fail("config is not a JSON object");

  ModelConfig c;
  if (const json* v = top.find("model_type")) {
    if (!v->is_string()) top.fail(std::string("'model_type' must be a string, got ") + json_type(*v));
    c.model_type = v->get<std::string>();
  }
  for (const char* refused : kRefusedModelTypes) {
    if (c.model_type == refused) {
      top.fail("model_type '" + c.model_type +
               "' is not supported (mixture-of-experts and vision-language variants are not implemented; "
               "supported: rewind_hybrid, lfm2, qwen3_5, qwen3_5_text, qwen3_next without experts)");
    }
  }
  // A Hugging Face config of another family (Llama, Qwen3, Mistral, ...)
  // would otherwise be read as rewind's own layout and fail on some key it
  // lacks ('layer_types'), which says nothing of the real problem. rewind's
  // layout is model_type rewind_hybrid, or another name with 'layer_types'
  // and no transformers class in 'architectures'.
  {
    const bool named = top.find("model_type") != nullptr;
    const bool known = c.model_type == "rewind_hybrid" || c.model_type == "lfm2" || c.model_type == "qwen3_5" ||
                       c.model_type == "qwen3_5_text" || c.model_type == "qwen3_next";
    std::string hf_class;
    if (const json* a = top.find("architectures"); a != nullptr && a->is_array()) {
      for (const json& name : *a) {
        if (!name.is_string()) continue;
        const std::string& s = name.get_ref<const std::string&>();
        for (const std::string_view suffix : {"ForCausalLM", "ForConditionalGeneration", "LMHeadModel"}) {
          if (s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0) hf_class = s;
        }
        if (!hf_class.empty()) break;
      }
    }
    if (!known && (!hf_class.empty() || (named && !doc.contains("layer_types")))) {
      top.fail((hf_class.empty() ? std::string() : "architecture '" + hf_class + "' ") +
               (named ? (hf_class.empty() ? "model_type '" + c.model_type + "'" : "(model_type '" + c.model_type + "')")
                      : std::string("(no model_type)")) +
               " is not supported; supported: " + kSupportedArchitectures);
    }
  }
  // The one place the family's name is compared: everything below and in the
  // model reads the fields it sets.
  const json* text_doc = &doc;
  std::string key_prefix;
  if (c.model_type == "lfm2") {
    c.family = ModelFamily::Lfm2;
  } else if (c.model_type == "qwen3_5") {
    c.family = ModelFamily::Qwen3_5;
    text_doc = top.find("text_config");
    if (text_doc == nullptr || !text_doc->is_object()) {
      top.fail("model_type 'qwen3_5' needs the object 'text_config' (the language model's config)");
    }
    c.weight_prefix = "model.language_model.";
    key_prefix = "text_config.";
  } else if (c.model_type == "qwen3_5_text") {
    c.family = ModelFamily::Qwen3_5;
  } else if (c.model_type == "qwen3_next") {
    c.family = ModelFamily::Qwen3Next;
  }
  const bool lfm2 = c.family == ModelFamily::Lfm2;
  const bool qwen = c.family == ModelFamily::Qwen3_5 || c.family == ModelFamily::Qwen3Next;
  KeyReader r(*text_doc, source_name, key_prefix);

  c.hidden_size = r.required_size("hidden_size");
  c.num_hidden_layers = r.required_size("num_hidden_layers");
  c.num_attention_heads = r.required_size("num_attention_heads");
  c.num_key_value_heads = r.required_size("num_key_value_heads");
  if (lfm2) {
    // transformers' Lfm2Config reads the original key block_ff_dim first.
    const char* key = r.find("block_ff_dim") ? "block_ff_dim" : "intermediate_size";
    c.intermediate_size = lfm2_mlp_width(r, r.required_size(key));
  } else {
    c.intermediate_size = r.required_size("intermediate_size");
  }
  c.vocab_size = r.required_size("vocab_size");
  if (const json* v = r.find("max_position_embeddings")) {
    c.max_position_embeddings = r.integer("max_position_embeddings", *v, 1, kMaxPositions);
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    r.fail(r.q("num_attention_heads") + " (" + std::to_string(c.num_attention_heads) + ") is not a multiple of " +
           r.q("num_key_value_heads") + " (" + std::to_string(c.num_key_value_heads) + ")");
  }
  if (const json* v = r.find("head_dim")) {
    c.head_dim = r.integer("head_dim", *v, 1, kMaxSize);
  } else if (qwen) {
    c.head_dim = 256;  // Qwen3NextConfig / Qwen3_5TextConfig's default
  } else {
    if (c.hidden_size % c.num_attention_heads != 0) {
      r.fail(r.q("head_dim") + " is absent and " + r.q("hidden_size") + " (" + std::to_string(c.hidden_size) +
             ") is not a multiple of " + r.q("num_attention_heads") + " (" + std::to_string(c.num_attention_heads) +
             ")");
    }
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }

  json implied_types;
  const json* types_ptr = r.find("layer_types");
  if (types_ptr == nullptr && c.family != ModelFamily::RewindHybrid) {
    implied_types = default_layer_types(r, c.family, c.num_hidden_layers);
    types_ptr = &implied_types;
  }
  const json& types = types_ptr ? *types_ptr : r.require("layer_types");
  if (!types.is_array()) r.fail(r.q("layer_types") + " must be a list, got " + json_type(types));
  if (static_cast<std::int64_t>(types.size()) != c.num_hidden_layers) {
    r.fail(r.q("layer_types") + " has " + std::to_string(types.size()) + " entries, but " +
           r.q("num_hidden_layers") + " is " + std::to_string(c.num_hidden_layers));
  }
  const std::vector<LayerKind> supported = family_layer_kinds(c.family);
  std::string supported_names;
  for (LayerKind k : supported) supported_names += (supported_names.empty() ? "" : ", ") + std::string(layer_kind_name(k));
  for (std::size_t i = 0; i < types.size(); ++i) {
    const std::string where = key_prefix + "layer_types[" + std::to_string(i) + "]";
    if (!types[i].is_string()) r.fail(where + " must be a string, got " + json_type(types[i]));
    const auto& t = types[i].get_ref<const std::string&>();
    auto unsupported = [&] {
      r.fail(where + " is '" + t + "', which the runtime does not support" +
             (c.family == ModelFamily::RewindHybrid ? std::string()
                                                    : std::string(" in ") + model_family_name(c.family) + " models") +
             " (supported: " + supported_names + ")");
    };
    LayerKind kind;
    try {
      kind = parse_layer_kind(t);
    } catch (const InvalidArgument&) {
      unsupported();
    }
    if (std::find(supported.begin(), supported.end(), kind) == supported.end()) unsupported();
    c.layer_types.push_back(kind);
  }

  // Keys a layer kind needs are required exactly when that kind is present;
  // otherwise they are optional (real configs often carry unused ones).
  auto because = [&c](LayerKind kind) {
    return "(layer " + std::to_string(first_layer_of(c, kind)) + " is " + std::string(layer_kind_name(kind)) + ")";
  };
  if (c.has_layer_type(LayerKind::SlidingAttention)) {
    c.sliding_window = r.required_size("sliding_window", because(LayerKind::SlidingAttention));
  } else if (c.family == ModelFamily::RewindHybrid) {
    c.sliding_window = r.optional_size("sliding_window");
  }
  const char* linear_keys[] = {"linear_conv_kernel_dim", "linear_num_key_heads",
                               "linear_num_value_heads", "linear_key_head_dim",
                               "linear_value_head_dim"};
  std::int64_t* linear_fields[] = {&c.linear_conv_kernel_dim, &c.linear_num_key_heads,
                                   &c.linear_num_value_heads, &c.linear_key_head_dim,
                                   &c.linear_value_head_dim};
  const bool has_linear = c.has_layer_type(LayerKind::LinearAttention);
  for (std::size_t i = 0; i < 5; ++i) {
    if (has_linear) {
      *linear_fields[i] = r.required_size(linear_keys[i], because(LayerKind::LinearAttention));
    } else if (!lfm2) {
      *linear_fields[i] = r.optional_size(linear_keys[i]);
    }
  }
  if (c.linear_num_key_heads > 0 && c.linear_num_value_heads % c.linear_num_key_heads != 0) {
    r.fail(r.q("linear_num_value_heads") + " (" + std::to_string(c.linear_num_value_heads) +
           ") is not a multiple of " + r.q("linear_num_key_heads") + " (" + std::to_string(c.linear_num_key_heads) +
           ")");
  }
  if (c.has_layer_type(LayerKind::Conv)) {
    if (lfm2 && r.find("conv_L_cache") == nullptr) {
      c.conv_L_cache = 3;  // Lfm2Config's default
    } else {
      c.conv_L_cache = r.required_size("conv_L_cache", because(LayerKind::Conv));
    }
  } else if (!qwen) {
    c.conv_L_cache = r.optional_size("conv_L_cache");
  }

  // RoPE: theta at the top level or (transformers >= 4.56) in
  // rope_parameters; only the default (unscaled) RoPE is implemented.
  if (lfm2) c.rope_theta = 1000000.0;  // Lfm2Config.default_theta
  const json* rope_params = r.find("rope_parameters");
  if (rope_params != nullptr && !rope_params->is_object()) {
    r.fail(r.q("rope_parameters") + " must be an object, got " + json_type(*rope_params));
  }
  if (const json* v = r.find("rope_theta")) {
    c.rope_theta = r.positive_number("rope_theta", *v);
  } else if (rope_params != nullptr && rope_params->contains("rope_theta")) {
    c.rope_theta = r.positive_number("rope_parameters.rope_theta", (*rope_params)["rope_theta"]);
  }
  if (c.family != ModelFamily::RewindHybrid) {
    for (const char* key : {"rope_parameters", "rope_scaling"}) {
      const json* p = r.find(key);
      if (p == nullptr || !p->is_object()) continue;
      const char* type_key = p->contains("rope_type") ? "rope_type" : "type";
      if (p->contains(type_key) && !(*p)[type_key].is_null() && (*p)[type_key] != "default") {
        r.fail(r.q(key) + " has " + type_key + " " + (*p)[type_key].dump() +
               ", which the runtime does not support (only the default RoPE is implemented)");
      }
    }
  }
  if (qwen) {
    double factor = 0.25;  // the Qwen3-Next / Qwen3.5 configs' default
    if (rope_params != nullptr && rope_params->contains("partial_rotary_factor")) {
      factor = r.positive_number("rope_parameters.partial_rotary_factor", (*rope_params)["partial_rotary_factor"]);
    } else if (const json* f = r.find("partial_rotary_factor")) {
      factor = r.positive_number("partial_rotary_factor", *f);
    }
    if (factor > 1.0) r.fail("partial_rotary_factor " + std::to_string(factor) + " is above 1");
    // transformers: dim = int(head_dim * partial_rotary_factor).
    c.rotary_dim = static_cast<std::int64_t>(static_cast<double>(c.head_dim) * factor);
    if (c.rotary_dim < 2 || c.rotary_dim > c.head_dim || c.rotary_dim % 2 != 0) {
      r.fail("partial_rotary_factor " + std::to_string(factor) + " gives " + std::to_string(c.rotary_dim) +
             " rotary dimensions of 'head_dim' " + std::to_string(c.head_dim) + " (must be even, in [2, head_dim])");
    }
  }

  if (lfm2) {
    c.rms_norm_eps = 1e-5;
    if (const json* v = r.find("norm_eps")) c.rms_norm_eps = r.positive_number("norm_eps", *v);
  } else if (const json* v = r.find("rms_norm_eps")) {
    c.rms_norm_eps = r.positive_number("rms_norm_eps", *v);
  }
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", lfm2);
  // Lfm2Config: kwargs.get("tie_embedding", tie_word_embeddings).
  if (lfm2) c.tie_word_embeddings = r.boolean("tie_embedding", c.tie_word_embeddings);
  // Qwen3.5's outer config (Qwen3_5Config, default false) decides the tying
  // of the whole model; text_config's own key is not what transformers reads.
  if (text_doc != &doc) c.tie_word_embeddings = top.boolean("tie_word_embeddings", false);

  // Options the runtime does not implement are refused, never ignored.
  if (lfm2 && r.boolean("conv_bias", false)) r.fail(r.q("conv_bias") + " is true: biased LFM2 convolutions are not supported");
  if (qwen && r.boolean("attention_bias", false)) {
    r.fail(r.q("attention_bias") + " is true: attention biases are not supported");
  }
  if (qwen) {
    if (const json* act = r.find("hidden_act"); act != nullptr && *act != "silu") {
      r.fail(r.q("hidden_act") + " is " + act->dump() + ": only \"silu\" is supported");
    }
  }
  if (c.family == ModelFamily::Qwen3Next) {
    // Qwen3NextDecoderLayer: a layer is a sparse MoE block unless it is in
    // mlp_only_layers, when num_experts > 0 and (i + 1) % decoder_sparse_step == 0.
    const json* ne = r.find("num_experts");
    const std::int64_t experts = ne ? r.integer("num_experts", *ne, 0, kMaxSize) : 512;
    const json* st = r.find("decoder_sparse_step");
    const std::int64_t step = st ? r.integer("decoder_sparse_step", *st, 1, kMaxSize) : 1;
    std::vector<bool> dense(static_cast<std::size_t>(c.num_hidden_layers), false);
    if (const json* only = r.find("mlp_only_layers")) {
      if (!only->is_array()) r.fail(r.q("mlp_only_layers") + " must be a list, got " + json_type(*only));
      for (const json& i : *only) {
        dense[static_cast<std::size_t>(r.integer("mlp_only_layers", i, 0, c.num_hidden_layers - 1))] = true;
      }
    }
    for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
      if (!dense[static_cast<std::size_t>(i)] && experts > 0 && (i + 1) % step == 0) {
        r.fail("layer " + std::to_string(i) + " is a mixture-of-experts layer ('num_experts' " +
               std::to_string(experts) + (ne ? "" : " by default") +
               "), which the runtime does not support: only dense Qwen3-Next (num_experts 0, or every layer in "
               "mlp_only_layers) loads");
      }
    }
  }

  // Special tokens. rewind's layout defaults to its byte vocabulary's BOS
  // 256 / EOS 257, LFM2 to its config class's 1 / 2; the Qwen families add
  // no BOS and name their EOS in the config or generation_config.json.
  if (c.family == ModelFamily::RewindHybrid) {
    c.bos_token_id = r.token_id("bos_token_id", 256, c.vocab_size);
    c.eos_token_id = r.token_id("eos_token_id", 257, c.vocab_size);
    c.eos_token_ids = r.find("eos_token_id") ? r.token_ids("eos_token_id", c.vocab_size)
                                             : std::vector<std::int64_t>{c.eos_token_id};
  } else {
    auto ids = [&](const char* key) {
      std::vector<std::int64_t> v = r.token_ids(key, c.vocab_size);
      if (v.empty() && text_doc != &doc) v = top.token_ids(key, c.vocab_size);
      return v;
    };
    const std::vector<std::int64_t> bos = ids("bos_token_id");
    c.eos_token_ids = ids("eos_token_id");
    c.bos_token_id = bos.empty() ? -1 : bos.front();
    if (lfm2) {
      if (bos.empty()) c.bos_token_id = r.token_id("bos_token_id", 1, c.vocab_size);
      if (c.eos_token_ids.empty()) c.eos_token_ids = {r.token_id("eos_token_id", 2, c.vocab_size)};
    }
    c.eos_token_id = c.eos_token_ids.empty() ? -1 : c.eos_token_ids.front();
    c.add_bos = lfm2;
  }
  // transformers >= 4.56 writes "dtype"; older versions "torch_dtype".
  for (const KeyReader* reader : {&r, &top}) {
    if (const json* v = reader->find("torch_dtype")) {
      c.torch_dtype = parse_torch_dtype(*reader, "torch_dtype", *v);
      break;
    }
    if (const json* d = reader->find("dtype")) {
      c.torch_dtype = parse_torch_dtype(*reader, "dtype", *d);
      break;
    }
    if (text_doc == &doc) break;
  }

  c.norm_plus_one = qwen;
  c.qk_norm = lfm2 || qwen;
  c.attn_output_gate = qwen;
  c.fused_gdn_projections = c.family == ModelFamily::Qwen3Next;
  return c;
}

void apply_generation_config(ModelConfig& config, const std::string& json_text, const std::string& source_name) {
  json doc;
  try {
    doc = json::parse(json_text);
  } catch (const json::exception& e) {
    throw FormatError(source_name + ": not valid JSON: " + e.what());
  }
  KeyReader r(doc, source_name);
  if (!doc.is_object()) r.fail("generation config is not a JSON object");
  const std::vector<std::int64_t> eos = r.token_ids("eos_token_id", config.vocab_size);
  const std::vector<std::int64_t> bos = r.token_ids("bos_token_id", config.vocab_size);
  if (!eos.empty()) {
    config.eos_token_ids = eos;
    config.eos_token_id = eos.front();
  }
  if (config.bos_token_id < 0 && !bos.empty()) config.bos_token_id = bos.front();
}

std::vector<std::string> ignored_weight_prefixes(const ModelConfig& config) {
  switch (config.family) {
    case ModelFamily::RewindHybrid:
    case ModelFamily::Lfm2: return {};
    case ModelFamily::Qwen3_5: return {"model.visual.", "mtp."};
    case ModelFamily::Qwen3Next: return {"mtp."};
  }
  return {};
}

ModelConfig load_model_config(const std::string& path_to_config_json) {
  std::ifstream in(path_to_config_json, std::ios::binary);
  if (!in) throw Error(path_to_config_json + ": cannot open: " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw Error(path_to_config_json + ": cannot read");
  return parse_model_config(text.str(), path_to_config_json);
}

std::string to_json(const ModelConfig& c) {
  // nlohmann's ordered_json keeps the insertion order, so the file reads in
  // the same order as the struct.
  nlohmann::ordered_json j;
  json types = json::array();
  for (LayerKind k : c.layer_types) types.push_back(std::string(layer_kind_name(k)));
  auto eos_value = [&c]() -> json {
    if (c.eos_token_ids.size() == 1) return c.eos_token_ids.front();
    return c.eos_token_ids;
  };
  if (c.family != ModelFamily::RewindHybrid) {
    // The family's own layout: what transformers writes for such a model.
    nlohmann::ordered_json t;
    t["model_type"] = c.model_type;
    t["hidden_size"] = c.hidden_size;
    t["num_hidden_layers"] = c.num_hidden_layers;
    t["num_attention_heads"] = c.num_attention_heads;
    t["num_key_value_heads"] = c.num_key_value_heads;
    t["head_dim"] = c.head_dim;
    t["intermediate_size"] = c.intermediate_size;
    t["vocab_size"] = c.vocab_size;
    if (c.max_position_embeddings > 0) t["max_position_embeddings"] = c.max_position_embeddings;
    t["layer_types"] = types;
    nlohmann::ordered_json rope;
    rope["rope_type"] = "default";
    rope["rope_theta"] = c.rope_theta;
    if (c.family == ModelFamily::Lfm2) {
      t["block_auto_adjust_ff_dim"] = false;  // intermediate_size is the MLP width itself
      t["norm_eps"] = c.rms_norm_eps;
      t["conv_L_cache"] = c.conv_L_cache;
      t["conv_bias"] = false;
    } else {
      // The smallest factor whose int(head_dim * factor) is rotary_dim.
      double factor = static_cast<double>(c.rope_dim()) / static_cast<double>(c.head_dim);
      while (static_cast<std::int64_t>(static_cast<double>(c.head_dim) * factor) < c.rope_dim()) {
        factor = std::nextafter(factor, 2.0);
      }
      rope["partial_rotary_factor"] = factor;
      t["rms_norm_eps"] = c.rms_norm_eps;
      t["hidden_act"] = "silu";
      t["attention_bias"] = false;
      t["linear_conv_kernel_dim"] = c.linear_conv_kernel_dim;
      t["linear_num_key_heads"] = c.linear_num_key_heads;
      t["linear_num_value_heads"] = c.linear_num_value_heads;
      t["linear_key_head_dim"] = c.linear_key_head_dim;
      t["linear_value_head_dim"] = c.linear_value_head_dim;
      if (c.family == ModelFamily::Qwen3Next) t["num_experts"] = 0;
    }
    t["rope_parameters"] = rope;
    t["tie_word_embeddings"] = c.tie_word_embeddings;
    if (c.bos_token_id >= 0) t["bos_token_id"] = c.bos_token_id;
    if (!c.eos_token_ids.empty()) t["eos_token_id"] = eos_value();
    t["torch_dtype"] = torch_dtype_name(c.torch_dtype);
    if (c.weight_prefix == "model.language_model.") {
      t["model_type"] = "qwen3_5_text";
      j["model_type"] = "qwen3_5";
      j["text_config"] = t;
      j["tie_word_embeddings"] = c.tie_word_embeddings;
      return j.dump(2) + "\n";
    }
    return t.dump(2) + "\n";
  }
  j["model_type"] = c.model_type;
  j["hidden_size"] = c.hidden_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["intermediate_size"] = c.intermediate_size;
  j["vocab_size"] = c.vocab_size;
  if (c.max_position_embeddings > 0) j["max_position_embeddings"] = c.max_position_embeddings;
  j["layer_types"] = types;
  // Kind-specific sizes are written when set; 0 means "unused" and reads
  // back as absent.
  auto optional = [&j](const char* key, std::int64_t v) {
    if (v != 0) j[key] = v;
  };
  optional("sliding_window", c.sliding_window);
  j["rope_theta"] = c.rope_theta;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  optional("linear_conv_kernel_dim", c.linear_conv_kernel_dim);
  optional("linear_num_key_heads", c.linear_num_key_heads);
  optional("linear_num_value_heads", c.linear_num_value_heads);
  optional("linear_key_head_dim", c.linear_key_head_dim);
  optional("linear_value_head_dim", c.linear_value_head_dim);
  optional("conv_L_cache", c.conv_L_cache);
  j["bos_token_id"] = c.bos_token_id;
  j["eos_token_id"] = eos_value();
  j["torch_dtype"] = torch_dtype_name(c.torch_dtype);
  return j.dump(2) + "\n";
}

std::string weight_name(const ModelConfig& c, std::int64_t layer, WeightRole role) {
  const bool lfm2 = c.family == ModelFamily::Lfm2;
  const char* suffix = "";
  switch (role) {
    case WeightRole::Embed: return c.weight_prefix + "embed_tokens.weight";
    // LFM2 calls its final norm embedding_norm (applied after the last layer).
    case WeightRole::FinalNorm: return c.weight_prefix + (lfm2 ? "embedding_norm.weight" : "norm.weight");
    case WeightRole::LmHead: return "lm_head.weight";
    case WeightRole::InputNorm: suffix = lfm2 ? "operator_norm.weight" : "input_layernorm.weight"; break;
    case WeightRole::PostNorm: suffix = lfm2 ? "ffn_norm.weight" : "post_attention_layernorm.weight"; break;
    case WeightRole::MlpGate: suffix = lfm2 ? "feed_forward.w1.weight" : "mlp.gate_proj.weight"; break;
    case WeightRole::MlpUp: suffix = lfm2 ? "feed_forward.w3.weight" : "mlp.up_proj.weight"; break;
    case WeightRole::MlpDown: suffix = lfm2 ? "feed_forward.w2.weight" : "mlp.down_proj.weight"; break;
    case WeightRole::AttnQ: suffix = "self_attn.q_proj.weight"; break;
    case WeightRole::AttnK: suffix = "self_attn.k_proj.weight"; break;
    case WeightRole::AttnV: suffix = "self_attn.v_proj.weight"; break;
    case WeightRole::AttnO: suffix = lfm2 ? "self_attn.out_proj.weight" : "self_attn.o_proj.weight"; break;
    case WeightRole::AttnQNorm: suffix = lfm2 ? "self_attn.q_layernorm.weight" : "self_attn.q_norm.weight"; break;
    case WeightRole::AttnKNorm: suffix = lfm2 ? "self_attn.k_layernorm.weight" : "self_attn.k_norm.weight"; break;
    case WeightRole::GdnQkv: suffix = "linear_attn.in_proj_qkv.weight"; break;
    case WeightRole::GdnZ: suffix = "linear_attn.in_proj_z.weight"; break;
    case WeightRole::GdnB: suffix = "linear_attn.in_proj_b.weight"; break;
    case WeightRole::GdnA: suffix = "linear_attn.in_proj_a.weight"; break;
    case WeightRole::GdnQkvz: suffix = "linear_attn.in_proj_qkvz.weight"; break;
    case WeightRole::GdnBa: suffix = "linear_attn.in_proj_ba.weight"; break;
    case WeightRole::GdnConv: suffix = "linear_attn.conv1d.weight"; break;
    case WeightRole::GdnDtBias: suffix = "linear_attn.dt_bias"; break;
    case WeightRole::GdnALog: suffix = "linear_attn.A_log"; break;
    case WeightRole::GdnNorm: suffix = "linear_attn.norm.weight"; break;
    case WeightRole::GdnOut: suffix = "linear_attn.out_proj.weight"; break;
    case WeightRole::ConvIn: suffix = "conv.in_proj.weight"; break;
    case WeightRole::ConvConv: suffix = "conv.conv.weight"; break;
    case WeightRole::ConvOut: suffix = "conv.out_proj.weight"; break;
  }
  return c.weight_prefix + "layers." + std::to_string(layer) + "." + suffix;
}

std::vector<WeightSpec> expected_weights(const ModelConfig& c) {
  const std::int64_t d = c.hidden_size;
  const std::int64_t ff = c.intermediate_size;
  std::vector<WeightSpec> w;
  w.push_back({weight_name(c, 0, WeightRole::Embed), {c.vocab_size, d}});
  w.push_back({weight_name(c, 0, WeightRole::FinalNorm), {d}});
  if (!c.tie_word_embeddings) w.push_back({weight_name(c, 0, WeightRole::LmHead), {c.vocab_size, d}});

  for (std::size_t li = 0; li < c.layer_types.size(); ++li) {
    const auto i = static_cast<std::int64_t>(li);
    auto add = [&](WeightRole role, std::vector<std::int64_t> shape) { w.push_back({weight_name(c, i, role), std::move(shape)}); };
    add(WeightRole::InputNorm, {d});
    switch (c.layer_types[li]) {
      case LayerKind::FullAttention:
      case LayerKind::SlidingAttention: {
        const std::int64_t q = c.num_attention_heads * c.head_dim;
        const std::int64_t kv = c.num_key_value_heads * c.head_dim;
        add(WeightRole::AttnQ, {c.attn_output_gate ? 2 * q : q, d});
        add(WeightRole::AttnK, {kv, d});
        add(WeightRole::AttnV, {kv, d});
        add(WeightRole::AttnO, {d, q});
        if (c.qk_norm) {
          add(WeightRole::AttnQNorm, {c.head_dim});
          add(WeightRole::AttnKNorm, {c.head_dim});
        }
        break;
      }
      case LayerKind::LinearAttention: {
        const std::int64_t lnv = c.linear_num_value_heads;
        const std::int64_t value = lnv * c.linear_value_head_dim;
        const std::int64_t conv_dim = c.linear_conv_dim();
        if (c.fused_gdn_projections) {
          add(WeightRole::GdnQkvz, {conv_dim + value, d});
          add(WeightRole::GdnBa, {2 * lnv, d});
        } else {
          add(WeightRole::GdnQkv, {conv_dim, d});
          add(WeightRole::GdnZ, {value, d});
          add(WeightRole::GdnB, {lnv, d});
          add(WeightRole::GdnA, {lnv, d});
        }
        add(WeightRole::GdnConv, {conv_dim, 1, c.linear_conv_kernel_dim});
        add(WeightRole::GdnDtBias, {lnv});
        add(WeightRole::GdnALog, {lnv});
        add(WeightRole::GdnNorm, {c.linear_value_head_dim});
        add(WeightRole::GdnOut, {d, value});
        break;
      }
      case LayerKind::Conv:
        add(WeightRole::ConvIn, {3 * d, d});
        add(WeightRole::ConvConv, {d, 1, c.conv_L_cache});
        add(WeightRole::ConvOut, {d, d});
        break;
      case LayerKind::ChunkedAttention:
      case LayerKind::Hybrid:
      case LayerKind::HybridSliding:
      case LayerKind::SparseAttention:
      case LayerKind::Moe:
      case LayerKind::Mlp: break;  // refused by parse_model_config
    }
    add(WeightRole::PostNorm, {d});
    add(WeightRole::MlpGate, {ff, d});
    add(WeightRole::MlpUp, {ff, d});
    add(WeightRole::MlpDown, {d, ff});
  }
  return w;
}

}  // namespace rwd::runtime
