#include "runtime/model_config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <numbers>
#include <sstream>
#include <utility>

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
  KeyReader(const json& doc, const std::string& source, std::string key_prefix = "", std::string family = "")
      : doc_(doc), source_(source), key_prefix_(std::move(key_prefix)), family_(std::move(family)) {}

  // Names the family in messages about missing keys (" (model_type
  // 'llama')"): which family's keys are required says why the key is.
  void set_family(std::string family) { family_ = std::move(family); }
  const std::string& family() const { return family_; }

  // 'key' as messages quote it ('text_config.key' inside a nested config).
  std::string q(const char* key) const { return "'" + key_prefix_ + key + "'"; }

  [[noreturn]] void fail(const std::string& problem) const { throw FormatError(source_ + ": " + problem); }

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
      fail("missing required key " + q(key) + (why.empty() ? "" : " " + why) + family_);
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
      fail(q(key) + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " + std::to_string(i));
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
  // What q() puts before a key ("text_config." inside a nested config).
  const std::string& key_prefix() const { return key_prefix_; }

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
  std::string family_;
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
  return 2 * linear_num_key_heads * linear_key_head_dim + linear_num_value_heads * linear_value_head_dim;
}

const std::vector<LayerKind>& supported_layer_kinds() {
  static const std::vector<LayerKind> kKinds = {LayerKind::FullAttention, LayerKind::SlidingAttention,
                                                LayerKind::LinearAttention, LayerKind::Conv};
  return kKinds;
}

RuntimeLayerKind runtime_layer_kind(LayerKind kind, std::int64_t layer) {
  switch (kind) {
    case LayerKind::FullAttention: return RuntimeLayerKind::FullAttention;
    case LayerKind::SlidingAttention: return RuntimeLayerKind::SlidingAttention;
    case LayerKind::LinearAttention: return RuntimeLayerKind::LinearAttention;
    case LayerKind::Conv: return RuntimeLayerKind::Conv;
    case LayerKind::ChunkedAttention:
    case LayerKind::Hybrid:
    case LayerKind::HybridSliding:
    case LayerKind::SparseAttention:
    case LayerKind::Moe:
    case LayerKind::Mlp: break;
  }
  throw FormatError("config.json: layer type '" + std::string(layer_kind_name(kind)) + "' of layer " +
                    std::to_string(layer) + " is not implemented by the runtime");
}

const char* model_family_name(ModelFamily family) {
  switch (family) {
    case ModelFamily::RewindHybrid: return "rewind_hybrid";
    case ModelFamily::Lfm2: return "lfm2";
    case ModelFamily::Qwen3_5: return "qwen3_5";
    case ModelFamily::Qwen3Next: return "qwen3_next";
    case ModelFamily::Qwen3: return "qwen3";
    case ModelFamily::Llama: return "llama";
  }
  return "rewind_hybrid";
}

std::vector<double> rope_inv_freq(const ModelConfig& c) {
  const std::int64_t dim = c.rope_dim();
  std::vector<double> inv_freq(static_cast<std::size_t>(dim / 2));
  for (std::size_t j = 0; j < inv_freq.size(); ++j) {
    inv_freq[j] = std::pow(c.rope_theta, -2.0 * static_cast<double>(j) / static_cast<double>(dim));
  }
  const ModelConfig::Llama3Rope& s = c.llama3_rope;
  if (!(s.factor > 0.0)) return inv_freq;
  // Wavelengths (positions per turn) against the pretraining context: short
  // ones keep their frequency, long ones are slowed by `factor`, and the
  // band between blends the two linearly in context / wavelength.
  const double context = static_cast<double>(s.original_max_positions);
  const double slow_above = context / s.low_freq_factor;
  const double keep_below = context / s.high_freq_factor;
  for (double& f : inv_freq) {
    const double wavelength = 2.0 * std::numbers::pi / f;
    if (wavelength < keep_below) continue;
    if (wavelength > slow_above) {
      f /= s.factor;
      continue;
    }
    const double smooth = (context / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
    f = (1.0 - smooth) * f / s.factor + smooth * f;
  }
  return inv_freq;
}

namespace {

// ---- shared readers --------------------------------------------------------
// Each reads one group of keys the same way for every family that calls it;
// the family adapters below call them in one fixed order, so a config with
// several problems is refused for the same first one whatever its family.

json parse_json(const std::string& json_text, const std::string& source_name) {
  try {
    return json::parse(json_text);
  } catch (const json::exception& e) {
    throw FormatError(source_name + ": not valid JSON: " + e.what());
  }
}

// One config.json being read: `top` reads the whole file, `text` the
// language model's keys (the same object unless the family nests them, as
// Qwen3.5 does in text_config).
struct ConfigKeys {
  const KeyReader& top;
  const KeyReader& text;
  bool nested() const { return &text.doc() != &top.doc(); }
};

// The MLP width: 'intermediate_size' itself, or a family's rule applied to it.
using MlpWidthReader = std::int64_t (*)(const KeyReader&);

std::int64_t plain_mlp_width(const KeyReader& r) { return r.required_size("intermediate_size"); }

// The sizes every family has, in this order: hidden_size,
// num_hidden_layers, the head counts, the MLP width, vocab_size,
// max_position_embeddings, then head_dim (`default_head_dim` when absent,
// or d / nh when that is 0).
void read_sizes(const KeyReader& r, ModelConfig& c, MlpWidthReader mlp_width, std::int64_t default_head_dim) {
  c.hidden_size = r.required_size("hidden_size");
  c.num_hidden_layers = r.required_size("num_hidden_layers");
  c.num_attention_heads = r.required_size("num_attention_heads");
  c.num_key_value_heads = r.required_size("num_key_value_heads");
  c.intermediate_size = mlp_width(r);
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
  } else if (default_head_dim > 0) {
    c.head_dim = default_head_dim;
  } else {
    if (c.hidden_size % c.num_attention_heads != 0) {
      r.fail(r.q("head_dim") + " is absent and " + r.q("hidden_size") + " (" + std::to_string(c.hidden_size) +
             ") is not a multiple of " + r.q("num_attention_heads") + " (" + std::to_string(c.num_attention_heads) +
             ")");
    }
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
}

// c.layer_types from `types` (config.json's layer_types, or the list a
// family implies without one), each one of `supported`.
void read_layer_types(const KeyReader& r, ModelConfig& c, const json& types, const std::vector<LayerKind>& supported) {
  if (!types.is_array()) r.fail(r.q("layer_types") + " must be a list, got " + json_type(types));
  if (static_cast<std::int64_t>(types.size()) != c.num_hidden_layers) {
    r.fail(r.q("layer_types") + " has " + std::to_string(types.size()) + " entries, but " + r.q("num_hidden_layers") +
           " is " + std::to_string(c.num_hidden_layers));
  }
  std::string supported_names;
  for (LayerKind k : supported)
    supported_names += (supported_names.empty() ? "" : ", ") + std::string(layer_kind_name(k));
  for (std::size_t i = 0; i < types.size(); ++i) {
    const std::string where = r.key_prefix() + "layer_types[" + std::to_string(i) + "]";
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
}

// A family's layer_types: config.json's, or when it has none the list
// `implied` derives from the family's own keys.
void read_layer_types_or_implied(const KeyReader& r, ModelConfig& c, const std::vector<LayerKind>& supported,
                                 json (*implied)(const KeyReader&, std::int64_t layers)) {
  if (const json* types = r.find("layer_types")) {
    read_layer_types(r, c, *types, supported);
  } else {
    read_layer_types(r, c, implied(r, c.num_hidden_layers), supported);
  }
}

// Why a layer kind's key is required: "(layer 3 is conv)".
std::string because(const ModelConfig& c, LayerKind kind) {
  return "(layer " + std::to_string(first_layer_of(c, kind)) + " is " + std::string(layer_kind_name(kind)) + ")";
}

// Keys a layer kind needs are required exactly when that kind is present;
// otherwise they are optional (real configs often carry unused ones).
void read_sliding_window(const KeyReader& r, ModelConfig& c) {
  if (c.has_layer_type(LayerKind::SlidingAttention)) {
    c.sliding_window = r.required_size("sliding_window", because(c, LayerKind::SlidingAttention));
  } else {
    c.sliding_window = r.optional_size("sliding_window");
  }
}

void read_linear_attention_sizes(const KeyReader& r, ModelConfig& c) {
  const char* keys[] = {"linear_conv_kernel_dim", "linear_num_key_heads", "linear_num_value_heads",
                        "linear_key_head_dim", "linear_value_head_dim"};
  std::int64_t* fields[] = {&c.linear_conv_kernel_dim, &c.linear_num_key_heads, &c.linear_num_value_heads,
                            &c.linear_key_head_dim, &c.linear_value_head_dim};
  const bool has_linear = c.has_layer_type(LayerKind::LinearAttention);
  for (std::size_t i = 0; i < 5; ++i) {
    *fields[i] = has_linear ? r.required_size(keys[i], because(c, LayerKind::LinearAttention))
                            : r.optional_size(keys[i]);
  }
  if (c.linear_num_key_heads > 0 && c.linear_num_value_heads % c.linear_num_key_heads != 0) {
    r.fail(r.q("linear_num_value_heads") + " (" + std::to_string(c.linear_num_value_heads) + ") is not a multiple of " +
           r.q("linear_num_key_heads") + " (" + std::to_string(c.linear_num_key_heads) + ")");
  }
}

// conv_L_cache; `default_kernel` (when > 0) stands in for an absent key.
void read_conv_kernel(const KeyReader& r, ModelConfig& c, std::int64_t default_kernel) {
  if (!c.has_layer_type(LayerKind::Conv)) {
    c.conv_L_cache = r.optional_size("conv_L_cache");
  } else if (default_kernel > 0 && r.find("conv_L_cache") == nullptr) {
    c.conv_L_cache = default_kernel;
  } else {
    c.conv_L_cache = r.required_size("conv_L_cache", because(c, LayerKind::Conv));
  }
}

// Which rope_type values of rope_parameters / rope_scaling a family accepts.
enum class RopeTypes {
  Unchecked,    // rewind's layout: the keys are not read
  DefaultOnly,  // only the default (unscaled) RoPE
  DefaultOrLlama3,
};

// Llama 3's rope_type "llama3" parameters out of the object under `key`.
void read_llama3_rope(const KeyReader& r, ModelConfig& c, const char* key, const json& p) {
  const std::string where = std::string(key) + ".";
  auto number = [&](const char* name) {
    const std::string full = where + name;
    if (!p.contains(name) || p[name].is_null()) {
      r.fail("missing required key " + r.q(full.c_str()) + " (rope_type \"llama3\")" + r.family());
    }
    return r.positive_number(full.c_str(), p[name]);
  };
  ModelConfig::Llama3Rope s;
  s.factor = number("factor");
  s.low_freq_factor = number("low_freq_factor");
  s.high_freq_factor = number("high_freq_factor");
  const std::string omp = where + "original_max_position_embeddings";
  if (!p.contains("original_max_position_embeddings") || p["original_max_position_embeddings"].is_null()) {
    r.fail("missing required key " + r.q(omp.c_str()) + " (rope_type \"llama3\")" + r.family());
  }
  s.original_max_positions = r.integer(omp.c_str(), p["original_max_position_embeddings"], 1, kMaxPositions);
  if (!(s.high_freq_factor > s.low_freq_factor)) {
    r.fail(r.q((where + "high_freq_factor").c_str()) + " (" + std::to_string(s.high_freq_factor) +
           ") must be greater than " + r.q((where + "low_freq_factor").c_str()) + " (" +
           std::to_string(s.low_freq_factor) + ")");
  }
  c.llama3_rope = s;
}

// RoPE: theta at the top level or (transformers >= 4.56) in
// rope_parameters, c.rope_theta when neither names one. Unless `types` is
// Unchecked, a rope_parameters or rope_scaling of a rope_type outside
// `types` is refused naming it; "llama3" fills c.llama3_rope.
void read_rope(const KeyReader& r, ModelConfig& c, RopeTypes types) {
  const json* rope_params = r.find("rope_parameters");
  if (rope_params != nullptr && !rope_params->is_object()) {
    r.fail(r.q("rope_parameters") + " must be an object, got " + json_type(*rope_params));
  }
  if (const json* v = r.find("rope_theta")) {
    c.rope_theta = r.positive_number("rope_theta", *v);
  } else if (rope_params != nullptr && rope_params->contains("rope_theta")) {
    c.rope_theta = r.positive_number("rope_parameters.rope_theta", (*rope_params)["rope_theta"]);
  }
  if (types == RopeTypes::Unchecked) return;
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    const json* p = r.find(key);
    if (p == nullptr) continue;
    if (!p->is_object()) r.fail(r.q(key) + " must be an object, got " + json_type(*p));
    const char* type_key = p->contains("rope_type") ? "rope_type" : "type";
    if (!p->contains(type_key) || (*p)[type_key].is_null() || (*p)[type_key] == "default") continue;
    if (types == RopeTypes::DefaultOrLlama3 && (*p)[type_key] == "llama3") {
      read_llama3_rope(r, c, key, *p);
      continue;
    }
    r.fail(r.q(key) + " has " + type_key + " " + (*p)[type_key].dump() + ", which the runtime does not support" +
           (types == RopeTypes::DefaultOrLlama3 ? " (supported: \"default\", \"llama3\")"
                                                : " (only the default RoPE is implemented)"));
  }
}

// Partial RoPE (the Qwen families): c.rotary_dim from partial_rotary_factor
// (in rope_parameters or at the top level, 0.25 when absent).
void read_partial_rotary(const KeyReader& r, ModelConfig& c) {
  const json* rope_params = r.find("rope_parameters");
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

// The RMSNorm epsilon under `key`, c.rms_norm_eps when absent.
void read_norm_eps(const KeyReader& r, ModelConfig& c, const char* key) {
  if (const json* v = r.find(key)) c.rms_norm_eps = r.positive_number(key, *v);
}

// The special tokens of a transformers config: ids in the language model's
// keys or, when those are nested, at the top level; none when absent.
void read_listed_special_tokens(const ConfigKeys& k, ModelConfig& c) {
  auto ids = [&](const char* key) {
    std::vector<std::int64_t> v = k.text.token_ids(key, c.vocab_size);
    if (v.empty() && k.nested()) v = k.top.token_ids(key, c.vocab_size);
    return v;
  };
  const std::vector<std::int64_t> bos = ids("bos_token_id");
  c.eos_token_ids = ids("eos_token_id");
  c.bos_token_id = bos.empty() ? -1 : bos.front();
  c.eos_token_id = c.eos_token_ids.empty() ? -1 : c.eos_token_ids.front();
  c.add_bos = false;
}

// The special tokens of a family that, like Lfm2Config and LlamaConfig,
// falls back on BOS 1 and EOS 2 when the config names none, and whose
// prompts start with BOS.
void read_special_tokens_bos1_eos2(const ConfigKeys& k, ModelConfig& c) {
  const KeyReader& r = k.text;
  read_listed_special_tokens(k, c);
  if (c.bos_token_id < 0) c.bos_token_id = r.token_id("bos_token_id", 1, c.vocab_size);
  if (c.eos_token_ids.empty()) c.eos_token_ids = {r.token_id("eos_token_id", 2, c.vocab_size)};
  c.eos_token_id = c.eos_token_ids.front();
  c.add_bos = true;
}

// transformers >= 4.56 writes "dtype"; older versions "torch_dtype". The
// language model's keys are read first, then a nesting config's.
void read_torch_dtype(const ConfigKeys& k, ModelConfig& c) {
  for (const KeyReader* reader : {&k.text, &k.top}) {
    if (const json* v = reader->find("torch_dtype")) {
      c.torch_dtype = parse_torch_dtype(*reader, "torch_dtype", *v);
      return;
    }
    if (const json* d = reader->find("dtype")) {
      c.torch_dtype = parse_torch_dtype(*reader, "dtype", *d);
      return;
    }
    if (!k.nested()) return;
  }
}

// ---- rewind_hybrid ---------------------------------------------------------

void read_rewind_hybrid(const ConfigKeys& k, ModelConfig& c) {
  const KeyReader& r = k.text;
  read_sizes(r, c, plain_mlp_width, 0);
  read_layer_types(r, c, r.require("layer_types"), supported_layer_kinds());
  read_sliding_window(r, c);
  read_linear_attention_sizes(r, c);
  read_conv_kernel(r, c, 0);
  read_rope(r, c, RopeTypes::Unchecked);
  read_norm_eps(r, c, "rms_norm_eps");
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  // rewind's byte vocabulary: BOS 256, EOS 257 unless the config names others.
  c.bos_token_id = r.token_id("bos_token_id", 256, c.vocab_size);
  c.eos_token_id = r.token_id("eos_token_id", 257, c.vocab_size);
  c.eos_token_ids = r.find("eos_token_id") ? r.token_ids("eos_token_id", c.vocab_size)
                                           : std::vector<std::int64_t>{c.eos_token_id};
  read_torch_dtype(k, c);
}

// ---- lfm2 ------------------------------------------------------------------

// LFM2's MLP width rule (transformers' Lfm2MLP): with block_auto_adjust_ff_dim
// the width is int(2 * I / 3), then, when block_ffn_dim_multiplier is set,
// int(multiplier * width) rounded up to a multiple of block_multiple_of.
// transformers' Lfm2Config reads the original key block_ff_dim before
// intermediate_size.
std::int64_t lfm2_mlp_width(const KeyReader& r) {
  const std::int64_t base = r.required_size(r.find("block_ff_dim") ? "block_ff_dim" : "intermediate_size");
  if (!r.boolean("block_auto_adjust_ff_dim", true)) return base;
  auto width = static_cast<std::int64_t>(2.0 * static_cast<double>(base) / 3.0);
  const json* m = r.find("block_ffn_dim_multiplier");
  if (m != nullptr) {
    const double multiplier = r.positive_number("block_ffn_dim_multiplier", *m);
    const std::int64_t multiple = r.find("block_multiple_of")
                                      ? r.integer("block_multiple_of", *r.find("block_multiple_of"), 1, kMaxSize)
                                      : 256;
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

// LFM2's layer_types when the config has none: full_attn_idxs lists the
// attention layers (all layers when absent), the others are conv.
json lfm2_default_layer_types(const KeyReader& r, std::int64_t layers) {
  std::vector<bool> attention(static_cast<std::size_t>(layers), r.find("full_attn_idxs") == nullptr);
  if (const json* idx = r.find("full_attn_idxs")) {
    if (!idx->is_array()) r.fail(r.q("full_attn_idxs") + " must be a list, got " + json_type(*idx));
    for (const json& i : *idx)
      attention[static_cast<std::size_t>(r.integer("full_attn_idxs", i, 0, layers - 1))] = true;
  }
  json types = json::array();
  for (bool a : attention) types.push_back(a ? "full_attention" : "conv");
  return types;
}

void read_lfm2(const ConfigKeys& k, ModelConfig& c) {
  const KeyReader& r = k.text;
  read_sizes(r, c, lfm2_mlp_width, 0);
  read_layer_types_or_implied(r, c, {LayerKind::FullAttention, LayerKind::Conv}, lfm2_default_layer_types);
  read_conv_kernel(r, c, 3);  // Lfm2Config's default
  c.rope_theta = 1000000.0;   // Lfm2Config.default_theta
  read_rope(r, c, RopeTypes::DefaultOnly);
  c.rms_norm_eps = 1e-5;
  read_norm_eps(r, c, "norm_eps");
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", true);
  // Lfm2Config: kwargs.get("tie_embedding", tie_word_embeddings).
  c.tie_word_embeddings = r.boolean("tie_embedding", c.tie_word_embeddings);
  // Options the runtime does not implement are refused, never ignored.
  if (r.boolean("conv_bias", false)) r.fail(r.q("conv_bias") + " is true: biased LFM2 convolutions are not supported");
  // Lfm2Config's BOS 1 and EOS 2 when the config names none; a prompt starts
  // with BOS.
  read_special_tokens_bos1_eos2(k, c);
  read_torch_dtype(k, c);
  c.qk_norm = true;
}

// ---- qwen3_5, qwen3_5_text and qwen3_next ----------------------------------

// The Qwen families' layer_types when the config has none: one full
// attention layer every full_attention_interval (4) layers, the others
// Gated DeltaNet.
json qwen_default_layer_types(const KeyReader& r, std::int64_t layers) {
  const json* iv = r.find("full_attention_interval");
  const std::int64_t interval = iv ? r.integer("full_attention_interval", *iv, 1, kMaxSize) : 4;
  json types = json::array();
  for (std::int64_t i = 0; i < layers; ++i) types.push_back((i + 1) % interval ? "linear_attention" : "full_attention");
  return types;
}

// What Qwen3.5 and Qwen3-Next's text models share: everything but the
// experts, the special tokens and the projection layout.
void read_qwen_text_model(const ConfigKeys& k, ModelConfig& c) {
  const KeyReader& r = k.text;
  read_sizes(r, c, plain_mlp_width, 256);  // Qwen3NextConfig / Qwen3_5TextConfig's head_dim
  read_layer_types_or_implied(r, c, {LayerKind::FullAttention, LayerKind::LinearAttention}, qwen_default_layer_types);
  read_linear_attention_sizes(r, c);
  read_rope(r, c, RopeTypes::DefaultOnly);
  read_partial_rotary(r, c);
  read_norm_eps(r, c, "rms_norm_eps");
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  // Qwen3.5's outer config (Qwen3_5Config, default false) decides the tying
  // of the whole model; text_config's own key is not what transformers reads.
  if (k.nested()) c.tie_word_embeddings = k.top.boolean("tie_word_embeddings", false);
  // Options the runtime does not implement are refused, never ignored.
  if (r.boolean("attention_bias", false))
    r.fail(r.q("attention_bias") + " is true: attention biases are not supported");
  if (const json* act = r.find("hidden_act"); act != nullptr && *act != "silu") {
    r.fail(r.q("hidden_act") + " is " + act->dump() + ": only \"silu\" is supported");
  }
}

// The Qwen families add no BOS and name their EOS in the config or
// generation_config.json; their RMSNorms multiply by (1 + w), queries and
// keys are normed, and the attention output is gated.
void finish_qwen(const ConfigKeys& k, ModelConfig& c) {
  read_listed_special_tokens(k, c);
  read_torch_dtype(k, c);
  c.norm_plus_one = true;
  c.qk_norm = true;
  c.attn_output_gate = true;
}

void read_qwen3_5(const ConfigKeys& k, ModelConfig& c) {
  read_qwen_text_model(k, c);
  finish_qwen(k, c);
}

// Qwen3NextDecoderLayer: a layer is a sparse MoE block unless it is in
// mlp_only_layers, when num_experts > 0 and (i + 1) % decoder_sparse_step == 0.
// Only dense checkpoints load.
void refuse_qwen3_next_experts(const KeyReader& r, const ModelConfig& c) {
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
      r.fail("layer " + std::to_string(i) + " is a mixture-of-experts layer ('num_experts' " + std::to_string(experts) +
             (ne ? "" : " by default") +
             "), which the runtime does not support: only dense Qwen3-Next (num_experts 0, or every layer in "
             "mlp_only_layers) loads");
    }
  }
}

void read_qwen3_next(const ConfigKeys& k, ModelConfig& c) {
  read_qwen_text_model(k, c);
  refuse_qwen3_next_experts(k.text, c);
  finish_qwen(k, c);
  c.fused_gdn_projections = true;  // in_proj_qkvz / in_proj_ba
}

// ---- qwen3 and llama (dense, every layer attention) ---------------------------

// Options of the dense families the runtime does not implement are refused,
// never ignored: biases and activations other than SiLU.
void refuse_dense_options(const KeyReader& r, const ModelConfig& c, bool has_mlp_bias) {
  const std::string family = model_family_name(c.family);
  if (r.boolean("attention_bias", false)) {
    r.fail(r.q("attention_bias") + " is true: attention biases are not supported in " + family + " models");
  }
  if (has_mlp_bias && r.boolean("mlp_bias", false)) {
    r.fail(r.q("mlp_bias") + " is true: MLP biases are not supported in " + family + " models");
  }
  if (const json* act = r.find("hidden_act"); act != nullptr && *act != "silu") {
    r.fail(r.q("hidden_act") + " is " + act->dump() + ": only \"silu\" is supported in " + family + " models");
  }
}

// Qwen3Config's layer_types when the config has none: with
// use_sliding_window, layers from max_window_layers (28) on attend within
// sliding_window; every other layer (all of them by default) is full.
json qwen3_default_layer_types(const KeyReader& r, std::int64_t layers) {
  const bool sliding = r.boolean("use_sliding_window", false) && r.find("sliding_window") != nullptr;
  const json* mw = r.find("max_window_layers");
  const std::int64_t first_sliding = mw ? r.integer("max_window_layers", *mw, 0, kMaxPositions) : 28;
  json types = json::array();
  for (std::int64_t i = 0; i < layers; ++i) {
    types.push_back(sliding && i >= first_sliding ? "sliding_attention" : "full_attention");
  }
  return types;
}

// Qwen3 dense (Qwen3ForCausalLM): GQA attention with per-head q/k RMSNorm
// before RoPE, plain RMSNorms, SwiGLU, optional sliding-window layers.
void read_qwen3(const ConfigKeys& k, ModelConfig& c) {
  const KeyReader& r = k.text;
  read_sizes(r, c, plain_mlp_width, 128);  // Qwen3Config's head_dim
  read_layer_types_or_implied(r, c, {LayerKind::FullAttention, LayerKind::SlidingAttention}, qwen3_default_layer_types);
  // Qwen3Config drops sliding_window unless use_sliding_window is set; a
  // sliding layer then has no window transformers would apply.
  const bool use_sliding = r.boolean("use_sliding_window", false);
  if (c.has_layer_type(LayerKind::SlidingAttention)) {
    if (!use_sliding) {
      r.fail("layer " + std::to_string(first_layer_of(c, LayerKind::SlidingAttention)) + " is sliding_attention but " +
             r.q("use_sliding_window") + " is not true (Qwen3Config then sets no window)");
    }
    read_sliding_window(r, c);
  }
  read_rope(r, c, RopeTypes::DefaultOnly);
  read_norm_eps(r, c, "rms_norm_eps");
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  refuse_dense_options(r, c, false);
  read_listed_special_tokens(k, c);
  read_torch_dtype(k, c);
  c.qk_norm = true;
}

// Llama 2 / 3.x (LlamaForCausalLM): GQA attention, plain RMSNorms, SwiGLU,
// default or Llama 3 scaled RoPE; LlamaConfig's BOS 1 and EOS 2 when the
// config names none, and prompts start with BOS.
void read_llama(const ConfigKeys& k, ModelConfig& c) {
  const KeyReader& r = k.text;
  read_sizes(r, c, plain_mlp_width, 0);  // LlamaConfig: head_dim or hidden_size / num_attention_heads
  read_layer_types_or_implied(r, c, {LayerKind::FullAttention}, [](const KeyReader&, std::int64_t layers) {
    json types = json::array();
    for (std::int64_t i = 0; i < layers; ++i) types.push_back("full_attention");
    return types;
  });
  read_rope(r, c, RopeTypes::DefaultOrLlama3);
  read_norm_eps(r, c, "rms_norm_eps");
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  refuse_dense_options(r, c, true);
  read_special_tokens_bos1_eos2(k, c);
  read_torch_dtype(k, c);
}

// ---- the family table --------------------------------------------------------

// The one place a family's name is compared: the adapters set the fields of
// ModelConfig that the model reads.
struct FamilyAdapter {
  const char* model_type;
  ModelFamily family;
  // The language model's keys are in the object 'text_config', and its
  // tensors under "model.language_model.".
  bool nested_text_config;
  void (*read)(const ConfigKeys&, ModelConfig&);
};

constexpr FamilyAdapter kFamilies[] = {
    {"rewind_hybrid", ModelFamily::RewindHybrid, false, read_rewind_hybrid},
    {"lfm2", ModelFamily::Lfm2, false, read_lfm2},
    {"qwen3_5", ModelFamily::Qwen3_5, true, read_qwen3_5},
    {"qwen3_5_text", ModelFamily::Qwen3_5, false, read_qwen3_5},
    {"qwen3_next", ModelFamily::Qwen3Next, false, read_qwen3_next},
    {"qwen3", ModelFamily::Qwen3, false, read_qwen3},
    {"llama", ModelFamily::Llama, false, read_llama},
};

// What the runtime reads, as messages about other architectures list it.
constexpr const char* kSupportedArchitectures =
    "rewind_hybrid (rewind's own layout, with 'layer_types'), lfm2 (Lfm2ForCausalLM, dense), qwen3_5 and "
    "qwen3_5_text (Qwen3_5ForConditionalGeneration / Qwen3_5ForCausalLM, dense), qwen3_next (Qwen3NextForCausalLM "
    "without experts), qwen3 (Qwen3ForCausalLM, dense), llama (LlamaForCausalLM, default or llama3 RoPE)";

// Variants of the supported families that the runtime refuses by name
// rather than misload (their tensors would not match, or worse, would).
constexpr const char* kRefusedModelTypes[] = {"qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next_moe", "lfm2_moe",
                                              "lfm2_vl",     "qwen3_vl_moe",     "qwen3_moe",      "qwen3_vl"};

const FamilyAdapter* find_family(const std::string& model_type) {
  for (const FamilyAdapter& f : kFamilies) {
    if (model_type == f.model_type) return &f;
  }
  return nullptr;
}

// The transformers class named in 'architectures' (the first name ending
// like one), or "".
std::string transformers_class(const KeyReader& top) {
  const json* a = top.find("architectures");
  if (a == nullptr || !a->is_array()) return "";
  for (const json& name : *a) {
    if (!name.is_string()) continue;
    const std::string& s = name.get_ref<const std::string&>();
    std::string hf_class;
    for (const std::string_view suffix : {"ForCausalLM", "ForConditionalGeneration", "LMHeadModel"}) {
      if (s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0) hf_class = s;
    }
    if (!hf_class.empty()) return hf_class;
  }
  return "";
}

// The adapter for config.json's model_type. A Hugging Face config of
// another family (Llama, Qwen3, Mistral, ...) would otherwise be read as
// rewind's own layout and fail on some key it lacks ('layer_types'), which
// says nothing of the real problem, so it is refused naming the supported
// list. rewind's layout is model_type rewind_hybrid, or another name with
// 'layer_types' and no transformers class in 'architectures'.
const FamilyAdapter& choose_family(const KeyReader& top, const std::string& model_type) {
  for (const char* refused : kRefusedModelTypes) {
    if (model_type == refused) {
      top.fail("model_type '" + model_type +
               "' is not supported (mixture-of-experts and vision-language variants are not implemented; "
               "supported: " +
               kSupportedArchitectures + ")");
    }
  }
  if (const FamilyAdapter* known = find_family(model_type)) return *known;
  const bool named = top.find("model_type") != nullptr;
  const std::string hf_class = transformers_class(top);
  if (!hf_class.empty() || (named && !top.doc().contains("layer_types"))) {
    top.fail((hf_class.empty() ? std::string() : "architecture '" + hf_class + "' ") +
             (named ? (hf_class.empty() ? "model_type '" + model_type + "'" : "(model_type '" + model_type + "')")
                    : std::string("(no model_type)")) +
             " is not supported; supported: " + kSupportedArchitectures);
  }
  return kFamilies[0];
}

}  // namespace

ModelConfig parse_model_config(const std::string& json_text, const std::string& source_name) {
  const json doc = parse_json(json_text, source_name);
  KeyReader top(doc, source_name);
  if (!doc.is_object()) top.fail("config is not a JSON object");

  ModelConfig c;
  if (const json* v = top.find("model_type")) {
    if (!v->is_string()) top.fail(std::string("'model_type' must be a string, got ") + json_type(*v));
    c.model_type = v->get<std::string>();
  }
  const FamilyAdapter& family = choose_family(top, c.model_type);
  c.family = family.family;
  if (c.family != ModelFamily::RewindHybrid) top.set_family(" (model_type '" + c.model_type + "')");
  const json* text_doc = &doc;
  std::string key_prefix;
  if (family.nested_text_config) {
    text_doc = top.find("text_config");
    if (text_doc == nullptr || !text_doc->is_object()) {
      top.fail("model_type '" + c.model_type + "' needs the object 'text_config' (the language model's config)");
    }
    c.weight_prefix = "model.language_model.";
    key_prefix = "text_config.";
  }
  const KeyReader text(*text_doc, source_name, key_prefix, top.family());
  family.read(ConfigKeys{top, text}, c);
  return c;
}

void apply_generation_config(ModelConfig& config, const std::string& json_text, const std::string& source_name) {
  const json doc = parse_json(json_text, source_name);
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
    case ModelFamily::Lfm2:
    case ModelFamily::Qwen3:
    case ModelFamily::Llama: return {};
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

namespace {

using ordered_json = nlohmann::ordered_json;

json layer_type_names(const ModelConfig& c) {
  json types = json::array();
  for (LayerKind k : c.layer_types) types.push_back(std::string(layer_kind_name(k)));
  return types;
}

// eos_token_id as transformers writes it: one id, or the list of several.
json eos_value(const ModelConfig& c) {
  if (c.eos_token_ids.size() == 1) return c.eos_token_ids.front();
  return c.eos_token_ids;
}

// The keys every family's layout starts with, in the order transformers
// writes them (nlohmann's ordered_json keeps the insertion order).
ordered_json family_layout_head(const ModelConfig& c) {
  ordered_json t;
  t["model_type"] = c.model_type;
  t["hidden_size"] = c.hidden_size;
  t["num_hidden_layers"] = c.num_hidden_layers;
  t["num_attention_heads"] = c.num_attention_heads;
  t["num_key_value_heads"] = c.num_key_value_heads;
  t["head_dim"] = c.head_dim;
  t["intermediate_size"] = c.intermediate_size;
  t["vocab_size"] = c.vocab_size;
  if (c.max_position_embeddings > 0) t["max_position_embeddings"] = c.max_position_embeddings;
  t["layer_types"] = layer_type_names(c);
  return t;
}

ordered_json default_rope(const ModelConfig& c) {
  ordered_json rope;
  rope["rope_type"] = "default";
  rope["rope_theta"] = c.rope_theta;
  return rope;
}

// The keys every family's layout ends with, and the file's text: Qwen3.5
// with its weights under "model.language_model." nests the language model
// in text_config.
std::string finish_family_layout(ordered_json t, const ordered_json& rope, const ModelConfig& c) {
  t["rope_parameters"] = rope;
  t["tie_word_embeddings"] = c.tie_word_embeddings;
  if (c.bos_token_id >= 0) t["bos_token_id"] = c.bos_token_id;
  if (!c.eos_token_ids.empty()) t["eos_token_id"] = eos_value(c);
  t["torch_dtype"] = torch_dtype_name(c.torch_dtype);
  if (c.weight_prefix == "model.language_model.") {
    t["model_type"] = "qwen3_5_text";
    ordered_json j;
    j["model_type"] = "qwen3_5";
    j["text_config"] = t;
    j["tie_word_embeddings"] = c.tie_word_embeddings;
    return j.dump(2) + "\n";
  }
  return t.dump(2) + "\n";
}

std::string write_lfm2(const ModelConfig& c) {
  ordered_json t = family_layout_head(c);
  t["block_auto_adjust_ff_dim"] = false;  // intermediate_size is the MLP width itself
  t["norm_eps"] = c.rms_norm_eps;
  t["conv_L_cache"] = c.conv_L_cache;
  t["conv_bias"] = false;
  return finish_family_layout(std::move(t), default_rope(c), c);
}

// Qwen3.5 and Qwen3-Next (which adds num_experts 0: a dense model).
std::string write_qwen(const ModelConfig& c) {
  ordered_json t = family_layout_head(c);
  ordered_json rope = default_rope(c);
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
  return finish_family_layout(std::move(t), rope, c);
}

// Qwen3 and Llama, as transformers >= 4.56 writes them (rope_parameters).
std::string write_dense(const ModelConfig& c) {
  ordered_json t = family_layout_head(c);
  ordered_json rope = default_rope(c);
  const ModelConfig::Llama3Rope& s = c.llama3_rope;
  if (s.factor > 0.0) {
    rope["rope_type"] = "llama3";
    rope["factor"] = s.factor;
    rope["low_freq_factor"] = s.low_freq_factor;
    rope["high_freq_factor"] = s.high_freq_factor;
    rope["original_max_position_embeddings"] = s.original_max_positions;
  }
  t["rms_norm_eps"] = c.rms_norm_eps;
  t["hidden_act"] = "silu";
  t["attention_bias"] = false;
  if (c.family == ModelFamily::Llama) {
    t["mlp_bias"] = false;
  } else {
    const bool sliding = c.has_layer_type(LayerKind::SlidingAttention);
    t["use_sliding_window"] = sliding;
    t["sliding_window"] = sliding ? json(c.sliding_window) : json(nullptr);
  }
  return finish_family_layout(std::move(t), rope, c);
}

std::string write_rewind_hybrid(const ModelConfig& c) {
  ordered_json j = family_layout_head(c);
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
  j["eos_token_id"] = eos_value(c);
  j["torch_dtype"] = torch_dtype_name(c.torch_dtype);
  return j.dump(2) + "\n";
}

}  // namespace

std::string to_json(const ModelConfig& c) {
  switch (c.family) {
    case ModelFamily::RewindHybrid: return write_rewind_hybrid(c);
    case ModelFamily::Lfm2: return write_lfm2(c);
    case ModelFamily::Qwen3_5:
    case ModelFamily::Qwen3Next: return write_qwen(c);
    case ModelFamily::Qwen3:
    case ModelFamily::Llama: return write_dense(c);
  }
  return write_rewind_hybrid(c);
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
  // A tied embedding is the output matrix: the model multiplies with it.
  w.push_back({weight_name(c, 0, WeightRole::Embed), {c.vocab_size, d}, c.tie_word_embeddings});
  w.push_back({weight_name(c, 0, WeightRole::FinalNorm), {d}});
  if (!c.tie_word_embeddings) w.push_back({weight_name(c, 0, WeightRole::LmHead), {c.vocab_size, d}, true});

  for (std::size_t li = 0; li < c.layer_types.size(); ++li) {
    const auto i = static_cast<std::int64_t>(li);
    auto add = [&](WeightRole role, std::vector<std::int64_t> shape) {
      w.push_back({weight_name(c, i, role), std::move(shape)});
    };
    auto linear = [&](WeightRole role, std::vector<std::int64_t> shape) {
      w.push_back({weight_name(c, i, role), std::move(shape), true});
    };
    add(WeightRole::InputNorm, {d});
    switch (runtime_layer_kind(c.layer_types[li], i)) {
      case RuntimeLayerKind::FullAttention:
      case RuntimeLayerKind::SlidingAttention: {
        const std::int64_t q = c.num_attention_heads * c.head_dim;
        const std::int64_t kv = c.num_key_value_heads * c.head_dim;
        linear(WeightRole::AttnQ, {c.attn_output_gate ? 2 * q : q, d});
        linear(WeightRole::AttnK, {kv, d});
        linear(WeightRole::AttnV, {kv, d});
        linear(WeightRole::AttnO, {d, q});
        if (c.qk_norm) {
          add(WeightRole::AttnQNorm, {c.head_dim});
          add(WeightRole::AttnKNorm, {c.head_dim});
        }
        break;
      }
      case RuntimeLayerKind::LinearAttention: {
        const std::int64_t lnv = c.linear_num_value_heads;
        const std::int64_t value = lnv * c.linear_value_head_dim;
        const std::int64_t conv_dim = c.linear_conv_dim();
        if (c.fused_gdn_projections) {
          linear(WeightRole::GdnQkvz, {conv_dim + value, d});
          linear(WeightRole::GdnBa, {2 * lnv, d});
        } else {
          linear(WeightRole::GdnQkv, {conv_dim, d});
          linear(WeightRole::GdnZ, {value, d});
          linear(WeightRole::GdnB, {lnv, d});
          linear(WeightRole::GdnA, {lnv, d});
        }
        add(WeightRole::GdnConv, {conv_dim, 1, c.linear_conv_kernel_dim});
        add(WeightRole::GdnDtBias, {lnv});
        add(WeightRole::GdnALog, {lnv});
        add(WeightRole::GdnNorm, {c.linear_value_head_dim});
        linear(WeightRole::GdnOut, {d, value});
        break;
      }
      case RuntimeLayerKind::Conv:
        linear(WeightRole::ConvIn, {3 * d, d});
        add(WeightRole::ConvConv, {d, 1, c.conv_L_cache});
        linear(WeightRole::ConvOut, {d, d});
        break;
    }
    add(WeightRole::PostNorm, {d});
    linear(WeightRole::MlpGate, {ff, d});
    linear(WeightRole::MlpUp, {ff, d});
    linear(WeightRole::MlpDown, {d, ff});
  }
  return w;
}

}  // namespace rwd::runtime
