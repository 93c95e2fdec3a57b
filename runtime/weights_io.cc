#include "runtime/weights_io.h"

#include <algorithm>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <system_error>
#include <utility>

#include <nlohmann/json.hpp>

#include "rewind/error.h"
#include "runtime/safetensors.h"

namespace rwd::runtime {
namespace {

namespace fs = std::filesystem;

// splitmix64 (Steele, Lea, Flood 2014): tiny, seedable with any value, and
// fully specified, so the same seed gives the same weights everywhere.
class SplitMix64 {
 public:
  explicit SplitMix64(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1), 53 random bits.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  // Standard normal by Box-Muller; 1 - uniform() is in (0, 1], so log is finite.
  double normal() {
    const double u1 = 1.0 - uniform();
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }

 private:
  std::uint64_t state_;
};

// FNV-1a: gives every tensor its own stream, so a tensor's values do not
// depend on which other tensors the config has.
std::uint64_t hash_name(std::string_view name) {
  std::uint64_t h = 0xCBF29CE484222325ull;
  for (char ch : name) {
    h ^= static_cast<unsigned char>(ch);
    h *= 0x100000001B3ull;
  }
  return h;
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

std::int64_t numel(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

// Random values of one tensor, chosen by its role (see write_random_model).
std::vector<float> random_values(const WeightSpec& spec, std::uint64_t seed) {
  SplitMix64 rng(SplitMix64(seed).next() ^ hash_name(spec.name));
  const auto n = static_cast<std::size_t>(numel(spec.shape));
  std::vector<float> v(n);
  const std::string_view name = spec.name;
  auto fill = [&](auto draw) {
    for (float& x : v) x = static_cast<float>(draw());
  };
  if (name == "model.embed_tokens.weight") {
    fill([&] { return rng.normal(); });
  } else if (ends_with(name, "norm.weight")) {
    fill([&] { return 1.0 + 0.1 * rng.normal(); });
  } else if (ends_with(name, ".A_log")) {
    fill([&] { return std::log(1.0 + 15.0 * rng.uniform()); });
  } else if (ends_with(name, ".dt_bias")) {
    fill([&] { return 0.1 * rng.normal(); });
  } else {
    // Linear [out, in] and depthwise conv [channels, 1, K] weights: the fan-in
    // is the last extent, and 1/sqrt(fan_in) keeps outputs O(1).
    const double std_dev = 1.0 / std::sqrt(static_cast<double>(spec.shape.back()));
    fill([&] { return std_dev * rng.normal(); });
  }
  return v;
}

// Raw little-endian bytes of `values` stored as `dtype`.
std::vector<std::byte> encode(const std::vector<float>& values, DType dtype) {
  std::vector<std::byte> out(values.size() * dtype_size(dtype));
  for (std::size_t i = 0; i < values.size(); ++i) {
    store_from_f32(out.data() + i * dtype_size(dtype), dtype, values[i]);
  }
  return out;
}

// An owned tensor of `shape` from elements of `dtype` (F32, BF16 or F16) at
// `src` (possibly unaligned: safetensors files from other writers need not
// be), as the model keeps it: in the same dtype, copied byte for byte (the
// kernels widen half-precision weights exactly as they load them).
Tensor to_memory_tensor(const std::vector<std::int64_t>& shape, DType dtype, const std::byte* src) {
  Tensor t(dtype, shape.data(), static_cast<int>(shape.size()));
  if (t.numel() > 0) std::memcpy(t.data<std::byte>(), src, t.bytes());
  return t;
}

void write_text_file_atomically(const std::string& path, const std::string& text) {
  const std::span<const std::byte> part = std::as_bytes(std::span<const char>(text.data(), text.size()));
  write_file_atomically(path, std::span<const std::span<const std::byte>>(&part, 1));
}

}  // namespace

namespace {

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path + ": cannot open: " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw Error(path + ": cannot read");
  return text.str();
}

// The checkpoint's safetensors files: model.safetensors, or the shards that
// model.safetensors.index.json's weight_map names (each opened once).
struct Checkpoint {
  std::vector<SafetensorsFile> files;
  std::map<std::string, std::size_t, std::less<>> shard_of;  // tensor name -> files index (sharded only)
  std::string index_path;                                    // empty when not sharded
};

Checkpoint open_checkpoint(const std::string& dir) {
  Checkpoint ck;
  const std::string index_path = (fs::path(dir) / "model.safetensors.index.json").string();
  if (!fs::exists(index_path)) {
    ck.files.push_back(SafetensorsFile::open((fs::path(dir) / "model.safetensors").string()));
    return ck;
  }
  ck.index_path = index_path;
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(read_text_file(index_path));
  } catch (const nlohmann::json::exception& e) {
    throw FormatError(index_path + ": not valid JSON: " + e.what());
  }
  if (!doc.is_object() || !doc.contains("weight_map") || !doc["weight_map"].is_object()) {
    throw FormatError(index_path + ": missing the object 'weight_map' (tensor name -> shard file)");
  }
  std::map<std::string, std::size_t> file_index;
  for (const auto& [name, file] : doc["weight_map"].items()) {
    if (!file.is_string()) throw FormatError(index_path + ": weight_map['" + name + "'] is not a file name");
    const auto& f = file.get_ref<const std::string&>();
    // A shard lives next to the index: no directories, no way out of DIR.
    if (f.empty() || f.find('/') != std::string::npos || f.find('\\') != std::string::npos || f == "." || f == "..") {
      throw FormatError(index_path + ": weight_map['" + name + "'] is '" + f + "', not a file name in the directory");
    }
    auto it = file_index.find(f);
    if (it == file_index.end()) {
      it = file_index.emplace(f, ck.files.size()).first;
      ck.files.push_back(SafetensorsFile::open((fs::path(dir) / f).string()));
    }
    ck.shard_of.emplace(name, it->second);
  }
  return ck;
}

bool has_prefix(std::string_view s, const std::vector<std::string>& prefixes) {
  for (const auto& p : prefixes)
    if (s.substr(0, p.size()) == p) return true;
  return false;
}

// RoPE frequencies some transformers versions saved as a buffer
// (`model.rotary_emb.inv_freq`, or per layer under `self_attn.`): derived
// from config.json here, as transformers itself does when it loads them.
bool saved_rope_buffer(std::string_view name) { return name.ends_with("rotary_emb.inv_freq"); }

}  // namespace

ModelWeights ModelWeights::load(const std::string& dir) {
  const std::string config_path = (fs::path(dir) / "config.json").string();
  const std::string generation_path = (fs::path(dir) / "generation_config.json").string();
  ModelWeights w;
  w.config_ = load_model_config(config_path);
  if (w.config_.family != ModelFamily::RewindHybrid && fs::exists(generation_path)) {
    apply_generation_config(w.config_, read_text_file(generation_path), generation_path);
  }
  const Checkpoint ck = open_checkpoint(dir);
  const std::string weights_path = ck.index_path.empty() ? ck.files.front().path() : ck.index_path;
  const std::vector<std::string> ignored = ignored_weight_prefixes(w.config_);

  // Where each expected tensor is: in the index's shard (sharded) or the file.
  auto locate = [&](const std::string& name) -> const TensorEntry* {
    if (ck.index_path.empty()) return ck.files.front().find(name);
    auto it = ck.shard_of.find(name);
    if (it == ck.shard_of.end()) return nullptr;
    const TensorEntry* e = ck.files[it->second].find(name);
    if (e == nullptr) {
      throw FormatError(ck.files[it->second].path() + ": missing tensor '" + name + "', which " + ck.index_path +
                        " places there");
    }
    return e;
  };
  // Tied embeddings as transformers' from_pretrained ties them: only what the
  // checkpoint allows. With both lm_head.weight and the embedding present it
  // keeps them apart (the config is wrong about the file); with lm_head.weight
  // alone the embedding is tied to it. rewind's own layout stays strict.
  auto holds = [&ck](const std::string& name) {
    return ck.index_path.empty() ? ck.files.front().find(name) != nullptr : ck.shard_of.contains(name);
  };
  // transformers reads (and writes back) Qwen3.5 text-model weights under
  // either prefix: its conversion mapping renames ^model.language_model to
  // model for Qwen3_5ForCausalLM. The checkpoint's embedding says which.
  if (w.config_.family == ModelFamily::Qwen3_5) {
    for (const char* prefix : {"model.language_model.", "model."}) {
      if (holds(std::string(prefix) + "embed_tokens.weight")) {
        w.config_.weight_prefix = prefix;
        break;
      }
    }
  }
  std::string embed_source;
  if (w.config_.family != ModelFamily::RewindHybrid && w.config_.tie_word_embeddings) {
    const std::string head = weight_name(w.config_, 0, WeightRole::LmHead);
    const std::string embed = weight_name(w.config_, 0, WeightRole::Embed);
    const bool has_head = holds(head);
    const bool has_embed = holds(embed);
    if (has_head && has_embed) w.config_.tie_word_embeddings = false;
    if (has_head && !has_embed) embed_source = head;
  }
  const std::vector<WeightSpec> specs = expected_weights(w.config_);
  std::set<std::string_view> expected;
  std::vector<const TensorEntry*> entries;
  for (const WeightSpec& spec : specs) {
    const bool aliased = !embed_source.empty() && spec.name == weight_name(w.config_, 0, WeightRole::Embed);
    const std::string& source = aliased ? embed_source : spec.name;
    expected.insert(source);
    const TensorEntry* e = locate(source);
    if (e == nullptr) {
      throw FormatError(weights_path + ": missing tensor '" + spec.name + "', which " + config_path + " requires");
    }
    if (e->shape != spec.shape) {
      throw FormatError(weights_path + ": tensor '" + spec.name + "' has shape " + shape_string(e->shape) + ", " +
                        config_path + " implies " + shape_string(spec.shape));
    }
    entries.push_back(e);
  }
  for (const SafetensorsFile& file : ck.files) {
    for (const TensorEntry& e : file.entries()) {
      if (!expected.contains(e.name) && !has_prefix(e.name, ignored) && !saved_rope_buffer(e.name)) {
        throw FormatError(file.path() + ": unexpected tensor '" + e.name + "', which " + config_path +
                          " does not imply");
      }
    }
  }
  // Copied only after every check passed: a bad file costs no copies. The
  // mapped pages of each tensor are dropped once it is copied, so the
  // process holds the file's bytes about once, not twice, while loading.
  for (std::size_t i = 0; i < specs.size(); ++i) {
    w.tensors_.emplace(specs[i].name, to_memory_tensor(entries[i]->shape, entries[i]->dtype, entries[i]->data));
    w.names_.push_back(specs[i].name);
    for (const SafetensorsFile& file : ck.files) file.drop_pages(*entries[i]);
  }
  return w;
}

ModelWeights ModelWeights::from_tensors(const ModelConfig& config, std::map<std::string, Tensor, std::less<>> tensors) {
  const std::vector<WeightSpec> specs = expected_weights(config);
  for (const WeightSpec& spec : specs) {
    auto it = tensors.find(spec.name);
    if (it == tensors.end()) throw FormatError("ModelWeights::from_tensors: missing tensor '" + spec.name + "'");
    const TensorView v = it->second.view();
    const std::vector<std::int64_t> shape(v.shape.begin(), v.shape.begin() + v.rank);
    if ((v.dtype != DType::F32 && v.dtype != DType::BF16 && v.dtype != DType::F16) || shape != spec.shape) {
      throw FormatError("ModelWeights::from_tensors: tensor '" + spec.name + "' is " + v.describe() +
                        ", expected F32, BF16 or F16 " + shape_string(spec.shape));
    }
  }
  if (tensors.size() != specs.size()) {
    for (const auto& entry : tensors) {
      const std::string& name = entry.first;
      if (std::none_of(specs.begin(), specs.end(), [&](const WeightSpec& s) { return s.name == name; })) {
        throw FormatError("ModelWeights::from_tensors: unexpected tensor '" + name + "'");
      }
    }
  }
  ModelWeights w;
  w.config_ = config;
  for (const WeightSpec& spec : specs) w.names_.push_back(spec.name);
  w.tensors_ = std::move(tensors);
  return w;
}

ModelWeights ModelWeights::random(const ModelConfig& config, std::uint64_t seed, DType dtype) {
  ModelWeights w;
  w.config_ = config;
  w.config_.torch_dtype = dtype;
  for (const WeightSpec& spec : expected_weights(config)) {
    // Through the stored dtype and back, exactly as a load of the file would.
    const std::vector<std::byte> bytes = encode(random_values(spec, seed), dtype);
    w.tensors_.emplace(spec.name, to_memory_tensor(spec.shape, dtype, bytes.data()));
    w.names_.push_back(spec.name);
  }
  return w;
}

const Tensor* ModelWeights::find(std::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

const Tensor& ModelWeights::get(std::string_view name) const {
  const Tensor* t = find(name);
  if (t == nullptr) throw InvalidArgument("ModelWeights: no tensor named '" + std::string(name) + "'");
  return *t;
}

void ModelWeights::release(std::string_view name) {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) throw InvalidArgument("ModelWeights::release: no tensor named '" + std::string(name) + "'");
  tensors_.erase(it);
  names_.erase(std::find(names_.begin(), names_.end(), name));
}

std::size_t ModelWeights::bytes() const {
  std::size_t total = 0;
  for (const auto& [name, t] : tensors_) total += t.bytes();
  return total;
}

ModelWeights load_weights(const std::string& dir) { return ModelWeights::load(dir); }

void write_random_model(const ModelConfig& config, const std::string& out_dir, std::uint64_t seed, DType dtype) {
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) throw Error(out_dir + ": cannot create directory: " + ec.message());

  ModelConfig stored = config;
  stored.torch_dtype = dtype;

  const std::vector<WeightSpec> specs = expected_weights(stored);
  std::vector<std::vector<std::byte>> buffers;
  buffers.reserve(specs.size());
  std::vector<TensorToWrite> tensors;
  tensors.reserve(specs.size());
  for (const WeightSpec& spec : specs) {
    buffers.push_back(encode(random_values(spec, seed), dtype));
    tensors.push_back({spec.name, dtype, spec.shape, buffers.back()});
  }
  // "format": "pt" is what transformers expects of a PyTorch checkpoint.
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"}, {"generator", "rewind write_random_model"}, {"seed", std::to_string(seed)}};
  write_safetensors((fs::path(out_dir) / "model.safetensors").string(), tensors, metadata);
  write_text_file_atomically((fs::path(out_dir) / "config.json").string(), to_json(stored));
}

}  // namespace rwd::runtime
