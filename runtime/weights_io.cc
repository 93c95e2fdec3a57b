#include "runtime/weights_io.h"

#include <algorithm>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <system_error>
#include <utility>

#include <nlohmann/json.hpp>

#include "rewind/error.h"
#include "runtime/kernels.h"
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

  // The file named in errors: the index when sharded, else the one file.
  const std::string& weights_path() const { return index_path.empty() ? files.front().path() : index_path; }
  // The file that holds `name` (REQUIRES: it holds it).
  const SafetensorsFile& file_of(const std::string& name) const {
    return index_path.empty() ? files.front() : files[shard_of.at(name)];
  }
  // Where `name` is: in the index's shard (sharded) or the file; null when
  // absent. Throws FormatError when the index places it in a shard that
  // lacks it.
  const TensorEntry* locate(const std::string& name) const {
    if (index_path.empty()) return files.front().find(name);
    auto it = shard_of.find(name);
    if (it == shard_of.end()) return nullptr;
    const TensorEntry* e = files[it->second].find(name);
    if (e == nullptr) {
      throw FormatError(files[it->second].path() + ": missing tensor '" + name + "', which " + index_path +
                        " places there");
    }
    return e;
  }
  bool contains(const std::string& name) const {
    return index_path.empty() ? files.front().find(name) != nullptr : shard_of.contains(name);
  }
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

constexpr std::int64_t kQ8Block = kernels::PackedMatrix::kQ8Block;

std::int64_t q8_blocks(std::int64_t in) { return (in + kQ8Block - 1) / kQ8Block; }

// Whether the checkpoint is a Q8 one (its files' __metadata__ says so);
// refuses one this build cannot read, and shards that disagree.
bool is_q8_checkpoint(const Checkpoint& ck) {
  std::optional<bool> q8;
  for (const SafetensorsFile& f : ck.files) {
    const auto& meta = f.metadata();
    const auto format = meta.find(kQ8FormatKey);
    const bool this_q8 = format != meta.end();
    if (this_q8) {
      auto value = [&](const char* key) {
        const auto it = meta.find(key);
        return it == meta.end() ? std::string("(absent)") : "'" + it->second + "'";
      };
      if (format->second != kQ8FormatValue) {
        throw FormatError(f.path() + ": __metadata__ " + kQ8FormatKey + " is " + value(kQ8FormatKey) +
                          "; this build reads '" + kQ8FormatValue + "' only");
      }
      if (value(kQ8VersionKey) != "'" + std::string(kQ8Version) + "'") {
        throw FormatError(f.path() + ": Q8 checkpoint version " + value(kQ8VersionKey) + " (__metadata__ " +
                          kQ8VersionKey + "); this build reads version " + kQ8Version);
      }
      if (value(kQ8BlockKey) != "'" + std::to_string(kQ8Block) + "'") {
        throw FormatError(f.path() + ": Q8 block size " + value(kQ8BlockKey) + " (__metadata__ " + kQ8BlockKey +
                          "); this build reads blocks of " + std::to_string(kQ8Block) + " only");
      }
    }
    if (q8 && *q8 != this_q8) {
      throw FormatError(f.path() + ": shards disagree on " + kQ8FormatKey + " (a Q8 checkpoint is quantized in full)");
    }
    q8 = this_q8;
  }
  return q8.value_or(false);
}

// Refuses a scale the runtime never writes: negative or not finite (an
// exponent of all ones) would turn logits into NaN or flip signs.
void check_q8_scales(const std::string& path, const TensorEntry& e, std::int64_t blocks) {
  for (std::size_t i = 0; i < e.nbytes / 2; ++i) {
    std::uint16_t bits;
    std::memcpy(&bits, e.data + 2 * i, sizeof bits);
    if ((bits & 0x8000u) != 0 || (bits & 0x7F80u) == 0x7F80u) {
      const auto b = static_cast<std::int64_t>(i);
      char hex[8];
      std::snprintf(hex, sizeof hex, "0x%04x", bits);
      throw FormatError(path + ": tensor '" + e.name + "' holds an invalid scale at [" + std::to_string(b / blocks) +
                        ", " + std::to_string(b % blocks) + "] (bf16 bits " + hex +
                        "): Q8 scales are finite and non-negative; the file is corrupt");
    }
  }
}

// The Q8 weight `spec` of a Q8 checkpoint, stored as `source`.q8 (I8, the
// matrix's shape) and `source`.q8_scale (BF16 [out, blocks]), both added to
// `expected`; their scales checked. Throws FormatError naming the file and
// tensor for a missing part, a wrong dtype or shape, or a bad scale.
Q8Weight find_q8_weight(const Checkpoint& ck, const WeightSpec& spec, const std::string& source,
                        const std::string& config_path, std::set<std::string, std::less<>>& expected) {
  const std::int64_t out = spec.shape[0], in = spec.shape[1];
  const std::vector<std::int64_t> scale_shape = {out, q8_blocks(in)};
  Q8Weight q{out, in};
  for (const std::string& part : {source + ".q8", source + ".q8_scale"}) {
    expected.insert(part);
    const TensorEntry* e = ck.locate(part);
    if (e == nullptr) {
      throw FormatError(ck.weights_path() + ": missing tensor '" + part + "', which " + config_path +
                        " requires of a Q8 checkpoint");
    }
    const bool values = part.ends_with(".q8");
    const std::vector<std::int64_t>& shape = values ? spec.shape : scale_shape;
    if (e->i8 != values || (!values && e->dtype != DType::BF16) || e->shape != shape) {
      const std::string is = (e->i8 ? std::string("I8") : std::string(safetensors_dtype_name(e->dtype))) + " " +
                             shape_string(e->shape);
      throw FormatError(ck.weights_path() + ": tensor '" + part + "' is " + is + ", " + config_path + " implies " +
                        (values ? "I8 " : "BF16 ") + shape_string(shape) + " (a Q8 checkpoint, docs/quantization.md)");
    }
    (values ? q.q_entry : q.scale_entry) = e;
  }
  check_q8_scales(ck.file_of(source + ".q8_scale").path(), *q.scale_entry, scale_shape[1]);
  q.q = static_cast<const std::int8_t*>(static_cast<const void*>(q.q_entry->data));
  q.scales = q.scale_entry->data;
  return q;
}

// The float weight `spec`, stored as `source` (added to `expected`). Throws
// FormatError naming the file and tensor when it is missing, has another
// shape, or is int8 (int8 only as a Q8 checkpoint's values).
const TensorEntry* find_weight(const Checkpoint& ck, const WeightSpec& spec, const std::string& source,
                               const std::string& config_path, std::set<std::string, std::less<>>& expected) {
  expected.insert(source);
  const TensorEntry* e = ck.locate(source);
  if (e == nullptr) {
    throw FormatError(ck.weights_path() + ": missing tensor '" + spec.name + "', which " + config_path + " requires");
  }
  if (e->shape != spec.shape) {
    throw FormatError(ck.weights_path() + ": tensor '" + spec.name + "' has shape " + shape_string(e->shape) + ", " +
                      config_path + " implies " + shape_string(spec.shape));
  }
  if (e->i8) {
    throw FormatError(ck.weights_path() + ": tensor '" + spec.name +
                      "' is I8; the runtime reads int8 only as the W.q8 values of a Q8 checkpoint "
                      "(docs/quantization.md)");
  }
  return e;
}

}  // namespace

ModelWeights ModelWeights::load(const std::string& dir) { return load(dir, Matmul::kLoad); }

ModelWeights ModelWeights::load(const std::string& dir, Matmul matmul) {
  const std::string config_path = (fs::path(dir) / "config.json").string();
  const std::string generation_path = (fs::path(dir) / "generation_config.json").string();
  ModelWeights w;
  w.config_ = load_model_config(config_path);
  if (w.config_.family != ModelFamily::RewindHybrid && fs::exists(generation_path)) {
    apply_generation_config(w.config_, read_text_file(generation_path), generation_path);
  }
  Checkpoint ck = open_checkpoint(dir);
  const bool q8 = is_q8_checkpoint(ck);
  const std::vector<std::string> ignored = ignored_weight_prefixes(w.config_);

  // Tied embeddings as transformers' from_pretrained ties them: only what the
  // checkpoint allows. With both lm_head.weight and the embedding present it
  // keeps them apart (the config is wrong about the file); with lm_head.weight
  // alone the embedding is tied to it. rewind's own layout stays strict.
  // A Q8 checkpoint holds a matmul weight W as W.q8 (and W.q8_scale).
  auto holds = [&ck, q8](const std::string& name) { return ck.contains(name) || (q8 && ck.contains(name + ".q8")); };
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
  std::set<std::string, std::less<>> expected;
  std::vector<const TensorEntry*> entries;  // null for a Q8 weight
  std::vector<Q8Weight> q8_weights;         // one per null entry, in order
  for (const WeightSpec& spec : specs) {
    const bool aliased = !embed_source.empty() && spec.name == weight_name(w.config_, 0, WeightRole::Embed);
    const std::string& source = aliased ? embed_source : spec.name;
    if (q8 && spec.matmul) {
      q8_weights.push_back(find_q8_weight(ck, spec, source, config_path, expected));
      entries.push_back(nullptr);
    } else {
      entries.push_back(find_weight(ck, spec, source, config_path, expected));
    }
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
  std::size_t next_q8 = 0;
  w.matmul_omitted_ = matmul == Matmul::kCheckOnly;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    if (w.matmul_omitted_ && specs[i].matmul) {
      if (entries[i] == nullptr) ++next_q8;
      continue;
    }
    if (entries[i] == nullptr) {
      w.q8_.emplace(specs[i].name, q8_weights[next_q8++]);
      w.q8_names_.push_back(specs[i].name);
      continue;
    }
    w.tensors_.emplace(specs[i].name, to_memory_tensor(entries[i]->shape, entries[i]->dtype, entries[i]->data));
    w.names_.push_back(specs[i].name);
    for (const SafetensorsFile& file : ck.files) file.drop_pages(*entries[i]);
  }
  if (q8) {
    // Moving the files keeps the mapping, and with it every pointer taken.
    w.mapped_ = std::make_shared<const std::vector<SafetensorsFile>>(std::move(ck.files));
    w.from_q8_ = true;
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

const Q8Weight* ModelWeights::q8_weight(std::string_view name) const {
  auto it = q8_.find(name);
  return it == q8_.end() ? nullptr : &it->second;
}

void ModelWeights::release(std::string_view name) {
  if (auto q = q8_.find(name); q != q8_.end()) {
    for (const SafetensorsFile& file : *mapped_) {
      file.drop_pages(*q->second.q_entry);
      file.drop_pages(*q->second.scale_entry);
    }
    q8_.erase(q);
    q8_names_.erase(std::find(q8_names_.begin(), q8_names_.end(), name));
    if (q8_.empty()) mapped_.reset();
    return;
  }
  auto it = tensors_.find(name);
  if (it == tensors_.end()) throw InvalidArgument("ModelWeights::release: no tensor named '" + std::string(name) + "'");
  tensors_.erase(it);
  names_.erase(std::find(names_.begin(), names_.end(), name));
}

std::size_t ModelWeights::bytes() const {
  std::size_t total = 0;
  for (const auto& [name, t] : tensors_) total += t.bytes();
  for (const auto& [name, q] : q8_) total += q.q_entry->nbytes + q.scale_entry->nbytes;
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

namespace {

// quantize writes only into a new directory or an empty one; checked before
// the input is read.
void check_quantize_output(const fs::path& out, const std::string& out_dir) {
  std::error_code ec;
  const fs::file_status st = fs::status(out, ec);
  if (fs::exists(st)) {
    if (!fs::is_directory(st)) {
      throw InvalidArgument("quantize: output '" + out_dir +
                            "' exists and is not a directory; allowed: a new directory or an empty one");
    }
    if (!fs::is_empty(out, ec) || ec) {
      throw InvalidArgument("quantize: output directory '" + out_dir +
                            "' is not empty; allowed: a new directory or an empty one (nothing was written)");
    }
  }
}

// The Q8 copy of one matmul weight: W.q8 (int8) and W.q8_scale (bf16 per
// block), their bytes owned by `buffers`.
void quantize_matmul(const WeightSpec& spec, const Tensor& t, std::vector<std::vector<std::byte>>& buffers,
                     std::vector<TensorToWrite>& tensors) {
  const std::int64_t rows = spec.shape[0], in = spec.shape[1], blocks = q8_blocks(in);
  const DType dtype = t.view().dtype;
  const auto source = dtype == DType::BF16  ? kernels::PackedMatrix::Element::BF16
                      : dtype == DType::F16 ? kernels::PackedMatrix::Element::F16
                                            : kernels::PackedMatrix::Element::F32;
  std::int64_t bad = -1;
  const kernels::PackedMatrix m = kernels::PackedMatrix::from_q8(t.data<std::byte>(), source, rows, in, &bad);
  if (bad >= 0) {
    throw FormatError("quantize: tensor '" + spec.name + "' holds a non-finite value at [" + std::to_string(bad / in) +
                      ", " + std::to_string(bad % in) + "]; Q8 blocks hold finite weights only (nothing was written)");
  }
  std::vector<std::byte>& q = buffers.emplace_back(static_cast<std::size_t>(rows * in));
  std::vector<std::byte>& scales = buffers.emplace_back(static_cast<std::size_t>(rows * blocks) * 2);
  std::vector<std::uint16_t> row_scales(static_cast<std::size_t>(blocks));
  for (std::int64_t o = 0; o < rows; ++o) {
    m.q8_row(o, static_cast<std::int8_t*>(static_cast<void*>(q.data() + o * in)), row_scales.data());
    std::memcpy(scales.data() + static_cast<std::size_t>(o * blocks) * 2, row_scales.data(), row_scales.size() * 2);
  }
  tensors.push_back({spec.name + ".q8", DType::F32, spec.shape, q, /*i8=*/true});
  tensors.push_back({spec.name + ".q8_scale", DType::BF16, {rows, blocks}, scales});
}

// Writes the Q8 checkpoint into a hidden directory beside `out` and renames
// it into place: `out` appears whole or not at all. Returns the size of its
// model.safetensors.
std::uint64_t write_q8_directory(const std::string& in_dir, const fs::path& out, const std::string& out_dir,
                                 const std::vector<TensorToWrite>& tensors) {
  std::error_code ec;
  const fs::path parent = out.has_parent_path() ? out.parent_path() : fs::path(".");
  const fs::path tmp = parent / ("." + out.filename().string() + ".tmp-" + std::to_string(::getpid()));
  fs::remove_all(tmp, ec);
  if (!fs::create_directories(tmp, ec) || ec) {
    throw Error("quantize: cannot create " + tmp.string() + ": " + ec.message());
  }
  try {
    const std::map<std::string, std::string> metadata = {{"format", "pt"},
                                                         {kQ8FormatKey, kQ8FormatValue},
                                                         {kQ8VersionKey, kQ8Version},
                                                         {kQ8BlockKey, std::to_string(kQ8Block)}};
    write_safetensors((tmp / "model.safetensors").string(), tensors, metadata);
    // Everything but the weights: config.json, tokenizer files, the model card.
    for (const fs::directory_entry& e : fs::directory_iterator(in_dir)) {
      const std::string name = e.path().filename().string();
      if (!e.is_regular_file() || name.ends_with(".safetensors") || name == "model.safetensors.index.json") {
        continue;
      }
      fs::copy_file(e.path(), tmp / name);
    }
    const std::uint64_t file_bytes = fs::file_size(tmp / "model.safetensors");
    if (fs::exists(out)) fs::remove(out);  // the empty directory check_quantize_output allowed
    fs::rename(tmp, out);
    return file_bytes;
  } catch (const fs::filesystem_error& e) {
    fs::remove_all(tmp, ec);
    throw Error("quantize: cannot write " + out_dir + ": " + e.what());
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
}

}  // namespace

QuantizeResult write_q8_checkpoint(const std::string& in_dir, const std::string& out_dir,
                                   const QuantizeProgress& progress) {
  fs::path out = fs::path(out_dir).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();  // "DIR/": the directory itself
  check_quantize_output(out, out_dir);
  ModelWeights w = ModelWeights::load(in_dir);
  if (w.q8()) {
    throw InvalidArgument("quantize: '" + in_dir +
                          "' is already a Q8 checkpoint; quantize reads f32, bf16 or f16 "
                          "weights");
  }
  const ModelConfig& c = w.config();
  const std::vector<WeightSpec> specs = expected_weights(c);

  // Quantized layer by layer (a group: the global tensors, then each
  // layer), each original released once its Q8 copy is made.
  QuantizeResult result;
  std::vector<std::vector<std::byte>> buffers;  // W.q8 and W.q8_scale bytes
  buffers.reserve(2 * specs.size());
  std::vector<TensorToWrite> tensors;
  const std::int64_t groups = c.num_hidden_layers + 1;
  std::int64_t layer = -1;
  auto finish_group = [&] {
    if (progress)
      progress(layer + 2, groups, layer < 0 ? std::string("global tensors") : "layer " + std::to_string(layer));
  };
  for (const WeightSpec& spec : specs) {
    if (layer + 1 < c.num_hidden_layers && spec.name == weight_name(c, layer + 1, WeightRole::InputNorm)) {
      finish_group();
      ++layer;
    }
    const Tensor& t = w.get(spec.name);
    if (!spec.matmul) {
      tensors.push_back(
          {spec.name, t.view().dtype, spec.shape, std::span<const std::byte>(t.data<std::byte>(), t.bytes())});
      ++result.kept;
      continue;
    }
    quantize_matmul(spec, t, buffers, tensors);
    ++result.quantized;
    w.release(spec.name);
  }
  finish_group();
  result.file_bytes = write_q8_directory(in_dir, out, out_dir, tensors);
  return result;
}

}  // namespace rwd::runtime
