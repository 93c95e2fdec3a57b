#include <algorithm>
#include "runtime/weights_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>
#include <system_error>
#include <utility>

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

// An owned f32 tensor of `shape` from `n` elements of `dtype` at `src`
// (possibly unaligned: safetensors files from other writers need not be).
Tensor to_f32_tensor(const std::vector<std::int64_t>& shape, DType dtype, const std::byte* src) {
  Tensor t(DType::F32, shape.data(), static_cast<int>(shape.size()));
  float* dst = t.data<float>();
  const auto n = static_cast<std::size_t>(t.numel());
  if (dtype == DType::F32) {
    if (n > 0) std::memcpy(dst, src, n * sizeof(float));
    return t;
  }
  for (std::size_t i = 0; i < n; ++i) {
    std::uint16_t h;
    std::memcpy(&h, src + 2 * i, 2);
    dst[i] = dtype == DType::F16 ? f16_to_f32(h) : bf16_to_f32(h);
  }
  return t;
}

void write_text_file_atomically(const std::string& path, const std::string& text) {
  const std::span<const std::byte> part = std::as_bytes(std::span<const char>(text.data(), text.size()));
  write_file_atomically(path, std::span<const std::span<const std::byte>>(&part, 1));
}

}  // namespace

ModelWeights ModelWeights::load(const std::string& dir) {
  const std::string config_path = (fs::path(dir) / "config.json").string();
  const std::string weights_path = (fs::path(dir) / "model.safetensors").string();
  ModelWeights w;
  w.config_ = load_model_config(config_path);
  const SafetensorsFile file = SafetensorsFile::open(weights_path);

  const std::vector<WeightSpec> specs = expected_weights(w.config_);
  std::set<std::string_view> expected;
  for (const WeightSpec& spec : specs) {
    expected.insert(spec.name);
    const TensorEntry* e = file.find(spec.name);
    if (e == nullptr) {
      throw FormatError(weights_path + ": missing tensor '" + spec.name + "', which " +
                        config_path + " requires");
    }
    if (e->shape != spec.shape) {
      throw FormatError(weights_path + ": tensor '" + spec.name + "' has shape " +
                        shape_string(e->shape) + ", " + config_path + " implies " +
                        shape_string(spec.shape));
    }
  }
  for (const TensorEntry& e : file.entries()) {
    if (!expected.contains(e.name)) {
      throw FormatError(weights_path + ": unexpected tensor '" + e.name + "', which " +
                        config_path + " does not imply");
    }
  }
  // Converted only after every check passed: a bad file costs no copies.
  for (const WeightSpec& spec : specs) {
    const TensorEntry& e = file.get(spec.name);
    w.tensors_.emplace(spec.name, to_f32_tensor(e.shape, e.dtype, e.data));
    w.names_.push_back(spec.name);
  }
  return w;
}

ModelWeights ModelWeights::random(const ModelConfig& config, std::uint64_t seed, DType dtype) {
  ModelWeights w;
  w.config_ = config;
  w.config_.torch_dtype = dtype;
  for (const WeightSpec& spec : expected_weights(config)) {
    // Through the stored dtype and back, exactly as a load of the file would.
    const std::vector<std::byte> bytes = encode(random_values(spec, seed), dtype);
    w.tensors_.emplace(spec.name, to_f32_tensor(spec.shape, dtype, bytes.data()));
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

void write_random_model(const ModelConfig& config, const std::string& out_dir,
                        std::uint64_t seed, DType dtype) {
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
      {"format", "pt"},
      {"generator", "rewind write_random_model"},
      {"seed", std::to_string(seed)}};
  write_safetensors((fs::path(out_dir) / "model.safetensors").string(), tensors, metadata);
  write_text_file_atomically((fs::path(out_dir) / "config.json").string(), to_json(stored));
}

}  // namespace rwd::runtime
