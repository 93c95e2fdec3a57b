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
  KeyReader(const json& doc, const std::string& source) : doc_(doc), source_(source) {}

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
      fail("missing required key '" + std::string(key) + "'" + (why.empty() ? "" : " " + why));
    }
    return *v;
  }

  std::int64_t integer(const char* key, const json& v, std::int64_t lo, std::int64_t hi) const {
    if (!v.is_number_integer()) {
      fail(std::string("'") + key + "' must be an integer, got " + json_type(v));
    }
    if (v.is_number_unsigned() &&
        v.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      fail(std::string("'") + key + "' must be in [" + std::to_string(lo) + ", " +
           std::to_string(hi) + "], got " + v.dump());
    }
    const auto i = v.get<std::int64_t>();
    if (i < lo || i > hi) {
      fail(std::string("'") + key + "' must be in [" + std::to_string(lo) + ", " +
           std::to_string(hi) + "], got " + std::to_string(i));
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
    if (!v.is_number()) fail(std::string("'") + key + "' must be a number, got " + json_type(v));
    const double d = v.get<double>();
    if (!(d > 0.0) || !std::isfinite(d)) {
      fail(std::string("'") + key + "' must be a positive finite number, got " + v.dump());
    }
    return d;
  }

  // A token id, or (transformers allows several eos ids) a non-empty list
  // of them, of which the first is used.
  std::int64_t token_id(const char* key, std::int64_t fallback, std::int64_t vocab) const {
    const json* v = find(key);
    if (v == nullptr) {
      // The default is checked too: the model looks every id up in the
      // embedding table.
      if (fallback >= vocab) {
        fail(std::string("'") + key + "' is absent and its default " + std::to_string(fallback) +
             " is outside the vocabulary ('vocab_size' " + std::to_string(vocab) + ")");
      }
      return fallback;
    }
    const json* id = v;
    if (v->is_array()) {
      if (v->empty()) fail(std::string("'") + key + "' is an empty list");
      id = &v->front();
    }
    return integer(key, *id, 0, vocab - 1);
  }

 private:
  const json& doc_;
  const std::string& source_;
};

DType parse_torch_dtype(const KeyReader& r, const char* key, const json& v) {
  if (v.is_string()) {
    const auto& s = v.get_ref<const std::string&>();
    if (s == "float32") return DType::F32;
    if (s == "float16") return DType::F16;
    if (s == "bfloat16") return DType::BF16;
  }
  r.fail(std::string("'") + key + "' must be one of \"float32\", \"float16\", \"bfloat16\", got " +
         v.dump());
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

ModelConfig parse_model_config(const std::string& json_text, const std::string& source_name) {
  json doc;
  try {
    doc = json::parse(json_text);
  } catch (const json::exception& e) {
    throw FormatError(source_name + ": not valid JSON: " + e.what());
  }
  KeyReader r(doc, source_name);
  if (!doc.is_object()) r.fail("config is not a JSON object");

  ModelConfig c;
  if (const json* v = r.find("model_type")) {
    if (!v->is_string()) r.fail(std::string("'model_type' must be a string, got ") + json_type(*v));
    c.model_type = v->get<std::string>();
  }
  c.hidden_size = r.required_size("hidden_size");
  c.num_hidden_layers = r.required_size("num_hidden_layers");
  c.num_attention_heads = r.required_size("num_attention_heads");
  c.num_key_value_heads = r.required_size("num_key_value_heads");
  c.intermediate_size = r.required_size("intermediate_size");
  c.vocab_size = r.required_size("vocab_size");
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    r.fail("'num_attention_heads' (" + std::to_string(c.num_attention_heads) +
           ") is not a multiple of 'num_key_value_heads' (" +
           std::to_string(c.num_key_value_heads) + ")");
  }
  if (const json* v = r.find("head_dim")) {
    c.head_dim = r.integer("head_dim", *v, 1, kMaxSize);
  } else {
    if (c.hidden_size % c.num_attention_heads != 0) {
      r.fail("'head_dim' is absent and 'hidden_size' (" + std::to_string(c.hidden_size) +
             ") is not a multiple of 'num_attention_heads' (" +
             std::to_string(c.num_attention_heads) + ")");
    }
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }

  const json& types = r.require("layer_types");
  if (!types.is_array()) r.fail(std::string("'layer_types' must be a list, got ") + json_type(types));
  if (static_cast<std::int64_t>(types.size()) != c.num_hidden_layers) {
    r.fail("'layer_types' has " + std::to_string(types.size()) +
           " entries, but 'num_hidden_layers' is " + std::to_string(c.num_hidden_layers));
  }
  const auto& supported = supported_layer_kinds();
  std::string supported_names;
  for (LayerKind k : supported) supported_names += (supported_names.empty() ? "" : ", ") + std::string(layer_kind_name(k));
  for (std::size_t i = 0; i < types.size(); ++i) {
    const std::string where = "layer_types[" + std::to_string(i) + "]";
    if (!types[i].is_string()) r.fail(where + " must be a string, got " + json_type(types[i]));
    const auto& t = types[i].get_ref<const std::string&>();
    auto unsupported = [&] {
      r.fail(where + " is '" + t + "', which the runtime does not support (supported: " + supported_names + ")");
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
  } else {
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
    *linear_fields[i] = has_linear ? r.required_size(linear_keys[i], because(LayerKind::LinearAttention))
                                   : r.optional_size(linear_keys[i]);
  }
  if (c.linear_num_key_heads > 0 && c.linear_num_value_heads % c.linear_num_key_heads != 0) {
    r.fail("'linear_num_value_heads' (" + std::to_string(c.linear_num_value_heads) +
           ") is not a multiple of 'linear_num_key_heads' (" +
           std::to_string(c.linear_num_key_heads) + ")");
  }
  if (c.has_layer_type(LayerKind::Conv)) {
    c.conv_L_cache = r.required_size("conv_L_cache", because(LayerKind::Conv));
  } else {
    c.conv_L_cache = r.optional_size("conv_L_cache");
  }

  // transformers >= 4.56 moved rope_theta into rope_parameters.
  if (const json* v = r.find("rope_theta")) {
    c.rope_theta = r.positive_number("rope_theta", *v);
  } else if (const json* p = r.find("rope_parameters");
             p != nullptr && p->is_object() && p->contains("rope_theta")) {
    c.rope_theta = r.positive_number("rope_parameters.rope_theta", (*p)["rope_theta"]);
  }
  if (const json* v = r.find("rms_norm_eps")) c.rms_norm_eps = r.positive_number("rms_norm_eps", *v);
  if (const json* v = r.find("tie_word_embeddings")) {
    if (!v->is_boolean()) {
      r.fail(std::string("'tie_word_embeddings' must be a boolean, got ") + json_type(*v));
    }
    c.tie_word_embeddings = v->get<bool>();
  }
  c.bos_token_id = r.token_id("bos_token_id", 256, c.vocab_size);
  c.eos_token_id = r.token_id("eos_token_id", 257, c.vocab_size);
  // transformers >= 4.56 writes "dtype"; older versions "torch_dtype".
  if (const json* v = r.find("torch_dtype")) {
    c.torch_dtype = parse_torch_dtype(r, "torch_dtype", *v);
  } else if (const json* d = r.find("dtype")) {
    c.torch_dtype = parse_torch_dtype(r, "dtype", *d);
  }
  return c;
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
  j["model_type"] = c.model_type;
  j["hidden_size"] = c.hidden_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["intermediate_size"] = c.intermediate_size;
  j["vocab_size"] = c.vocab_size;
  json types = json::array();
  for (LayerKind k : c.layer_types) types.push_back(std::string(layer_kind_name(k)));
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
  j["eos_token_id"] = c.eos_token_id;
  j["torch_dtype"] = torch_dtype_name(c.torch_dtype);
  return j.dump(2) + "\n";
}

std::vector<WeightSpec> expected_weights(const ModelConfig& c) {
  const std::int64_t d = c.hidden_size;
  const std::int64_t ff = c.intermediate_size;
  std::vector<WeightSpec> w;
  w.push_back({"model.embed_tokens.weight", {c.vocab_size, d}});
  w.push_back({"model.norm.weight", {d}});
  if (!c.tie_word_embeddings) w.push_back({"lm_head.weight", {c.vocab_size, d}});

  for (std::size_t i = 0; i < c.layer_types.size(); ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    w.push_back({p + "input_layernorm.weight", {d}});
    switch (c.layer_types[i]) {
      case LayerKind::FullAttention:
      case LayerKind::SlidingAttention: {
        const std::int64_t q = c.num_attention_heads * c.head_dim;
        const std::int64_t kv = c.num_key_value_heads * c.head_dim;
        w.push_back({p + "self_attn.q_proj.weight", {q, d}});
        w.push_back({p + "self_attn.k_proj.weight", {kv, d}});
        w.push_back({p + "self_attn.v_proj.weight", {kv, d}});
        w.push_back({p + "self_attn.o_proj.weight", {d, q}});
        break;
      }
      case LayerKind::LinearAttention: {
        const std::int64_t lnv = c.linear_num_value_heads;
        const std::int64_t value = lnv * c.linear_value_head_dim;
        const std::int64_t conv_dim = c.linear_conv_dim();
        w.push_back({p + "linear_attn.in_proj_qkv.weight", {conv_dim, d}});
        w.push_back({p + "linear_attn.in_proj_z.weight", {value, d}});
        w.push_back({p + "linear_attn.in_proj_b.weight", {lnv, d}});
        w.push_back({p + "linear_attn.in_proj_a.weight", {lnv, d}});
        w.push_back({p + "linear_attn.conv1d.weight", {conv_dim, 1, c.linear_conv_kernel_dim}});
        w.push_back({p + "linear_attn.dt_bias", {lnv}});
        w.push_back({p + "linear_attn.A_log", {lnv}});
        w.push_back({p + "linear_attn.norm.weight", {c.linear_value_head_dim}});
        w.push_back({p + "linear_attn.out_proj.weight", {d, value}});
        break;
      }
      case LayerKind::Conv:
        w.push_back({p + "conv.in_proj.weight", {3 * d, d}});
        w.push_back({p + "conv.conv.weight", {d, 1, c.conv_L_cache}});
        w.push_back({p + "conv.out_proj.weight", {d, d}});
        break;
      case LayerKind::ChunkedAttention:
      case LayerKind::Hybrid:
      case LayerKind::HybridSliding:
      case LayerKind::SparseAttention:
      case LayerKind::Moe:
      case LayerKind::Mlp: break;  // refused by parse_model_config
    }
    w.push_back({p + "post_attention_layernorm.weight", {d}});
    w.push_back({p + "mlp.gate_proj.weight", {ff, d}});
    w.push_back({p + "mlp.up_proj.weight", {ff, d}});
    w.push_back({p + "mlp.down_proj.weight", {d, ff}});
  }
  return w;
}

}  // namespace rwd::runtime
