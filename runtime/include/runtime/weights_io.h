// runtime/weights_io.h: a model directory on disk <-> weights in memory.
//
// A model directory holds config.json (runtime/model_config.h) and
// model.safetensors (runtime/safetensors.h). ModelWeights::load checks the
// pair against each other before any tensor is used: the file must hold
// exactly the tensors expected_weights(config) lists, each with exactly the
// listed shape, no more and no fewer. Every tensor is then copied into an
// owned, contiguous rwd::Tensor in the file's dtype (F32, BF16 or F16: the
// matmul kernel widens half-precision weights exactly as it loads them,
// runtime/kernels.h), so the file can be unmapped.
//
// A Q8 checkpoint (written by write_q8_checkpoint, `rewind quantize`;
// docs/quantization.md has the layout) stores every matmul weight
// (WeightSpec::matmul) W as W.q8 (I8 [out, in]) and W.q8_scale (BF16
// [out, ceil(in / 32)]), named in the file's __metadata__; load() checks
// both against config.json and keeps them mapped (q8_weight), for Model to
// pack straight into its Q8 panels; every other tensor is copied as above.
//
// write_random_model writes such a directory with deterministic random
// weights (for tests, benchmarks and the CLI's demo model): the same config,
// seed and dtype give byte-identical files on the same platform.
//
// Thread safety: ModelWeights is immutable after construction; concurrent
// readers are fine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "rewind/dtype.h"
#include "rewind/tensor.h"
#include "runtime/model_config.h"
#include "runtime/safetensors.h"

namespace rwd::runtime {

// The __metadata__ of a Q8 checkpoint: kQ8FormatKey = kQ8FormatValue names
// the format, kQ8VersionKey its version (load() reads kQ8Version only) and
// kQ8BlockKey the inputs per scale (32, kernels::PackedMatrix::kQ8Block).
inline constexpr const char* kQ8FormatKey = "rewind.weights";
inline constexpr const char* kQ8FormatValue = "q8";
inline constexpr const char* kQ8VersionKey = "rewind.q8_version";
inline constexpr const char* kQ8Version = "1";
inline constexpr const char* kQ8BlockKey = "rewind.q8_block";

// A matmul weight of a Q8 checkpoint as its file stores it, mapped: valid
// while the ModelWeights that returned it holds it.
struct Q8Weight {
  std::int64_t out = 0, in = 0;
  const std::int8_t* q = nullptr;     // [out, in] int8, row-major
  const std::byte* scales = nullptr;  // [out, ceil(in / 32)] bf16, little-endian, maybe unaligned
  const TensorEntry* q_entry = nullptr;
  const TensorEntry* scale_entry = nullptr;
};

class ModelWeights {
 public:
  ModelWeights() = default;
  ModelWeights(ModelWeights&&) noexcept = default;
  ModelWeights& operator=(ModelWeights&&) noexcept = default;
  ModelWeights(const ModelWeights&) = delete;
  ModelWeights& operator=(const ModelWeights&) = delete;

  // Loads DIR/config.json and DIR/model.safetensors. Throws FormatError for
  // a malformed config or file, a tensor config.json requires but the file
  // lacks ("missing tensor"), a shape that differs from the one config.json
  // implies ("has shape [..], config.json implies [..]") and a tensor the
  // config does not use ("unexpected tensor"); for a Q8 checkpoint also a
  // version or block size this build does not read, a W.q8 / W.q8_scale of
  // another dtype or shape, and a scale that is negative or not finite;
  // rwd::Error when a file cannot be read. Messages name the file and the
  // tensor. Everything is checked before anything is kept.
  static ModelWeights load(const std::string& dir);
  // As load(dir), but with kCheckOnly the matmul weights (WeightSpec::matmul)
  // are checked as above and then neither copied nor kept: names() and
  // q8_names() omit them and matmul_omitted() is true (Model::load, when a
  // pack file supplies them packed, runtime/pack_file.h).
  enum class Matmul : std::uint8_t { kLoad, kCheckOnly };
  static ModelWeights load(const std::string& dir, Matmul matmul);

  // Weights from tensors already in memory (another loader, or a test
  // that alters a checkpoint): `tensors` must hold exactly
  // expected_weights(config), each F32, BF16 or F16 with the listed shape. Throws
  // FormatError naming the first tensor missing, unexpected, of another
  // dtype or shape (nothing is kept then).
  // REQUIRES: a validated config.
  static ModelWeights from_tensors(const ModelConfig& config, std::map<std::string, Tensor, std::less<>> tensors);

  // The weights write_random_model(config, dir, seed, dtype) would write,
  // built in memory: equal, value for value, to load(dir) of that directory.
  // REQUIRES: a validated config.
  static ModelWeights random(const ModelConfig& config, std::uint64_t seed, DType dtype = DType::F32);

  const ModelConfig& config() const { return config_; }
  // The tensor called `name` (shape as in expected_weights; dtype F32, or
  // BF16 when stored so), or nullptr.
  const Tensor* find(std::string_view name) const;
  // As find(), but throws InvalidArgument naming the tensor when absent.
  const Tensor& get(std::string_view name) const;
  // Frees tensor `name` for a caller that keeps its own copy (Model packs
  // the linear weights and releases the originals, so they are not held
  // twice). Afterwards find(name) is nullptr and names() omits it. For a Q8
  // weight: its mapped pages are dropped and q8_weight(name) is nullptr
  // (the file is unmapped with the last one).
  // Throws InvalidArgument naming the tensor when absent (nothing changes).
  void release(std::string_view name);
  // Names of the tensors find() returns, in expected_weights() order.
  const std::vector<std::string>& names() const { return names_; }
  std::size_t size() const { return names_.size(); }
  // Bytes held by all tensors (a Q8 checkpoint's mapped weights included).
  std::size_t bytes() const;

  // Whether the weights came from a Q8 checkpoint: then every matmul weight
  // is a q8_weight() (not in names()), the rest are tensors.
  bool q8() const { return from_q8_; }
  // The Q8 weight called `name` (its expected_weights() name), or nullptr.
  const Q8Weight* q8_weight(std::string_view name) const;
  // Names of the Q8 weights, in expected_weights() order.
  const std::vector<std::string>& q8_names() const { return q8_names_; }
  // Whether load(dir, Matmul::kCheckOnly) left the matmul weights out.
  bool matmul_omitted() const { return matmul_omitted_; }

 private:
  ModelConfig config_;
  std::vector<std::string> names_;
  std::map<std::string, Tensor, std::less<>> tensors_;
  std::vector<std::string> q8_names_;
  std::map<std::string, Q8Weight, std::less<>> q8_;
  // The mapped files of a Q8 checkpoint, until the last Q8 weight is released.
  std::shared_ptr<const std::vector<SafetensorsFile>> mapped_;
  bool from_q8_ = false;
  bool matmul_omitted_ = false;
};

// Same as ModelWeights::load(dir). A directory holds config.json, then
// either model.safetensors or model.safetensors.index.json with the shards
// its weight_map names (file names in the directory), and optionally
// generation_config.json (applied with apply_generation_config for the
// transformers families). Tensors under ignored_weight_prefixes(config)
// (vision tower, multi-token prediction) are skipped, never converted.
ModelWeights load_weights(const std::string& dir);

// Creates `out_dir` (and parents) if needed and writes config.json (the
// config with torch_dtype set to `dtype`) and model.safetensors holding
// every expected_weights(config) tensor in `dtype`, with deterministic
// random values: embeddings ~ N(0, 1); linear weights [out, in] ~
// N(0, 1/sqrt(in)) so activations stay O(1); convolution weights
// [channels, 1, K] ~ N(0, 1/sqrt(K)); norm weights 1 + N(0, 0.1);
// A_log = log(U(1, 16)); dt_bias ~ N(0, 0.1). Each tensor's values depend
// only on the seed and its name. Files appear atomically (temp + rename).
// REQUIRES: a validated config. Throws rwd::Error on IO failure.
void write_random_model(const ModelConfig& config, const std::string& out_dir, std::uint64_t seed, DType dtype);

// Progress of write_q8_checkpoint: `done` of `total` tensor groups (the
// global tensors, then each layer) written, `group` naming the last one.
using QuantizeProgress = std::function<void(std::int64_t done, std::int64_t total, const std::string& group)>;

// What write_q8_checkpoint wrote.
struct QuantizeResult {
  std::int64_t quantized = 0;  // matmul weights stored as W.q8 + W.q8_scale
  std::int64_t kept = 0;       // other tensors, stored as loaded
  std::uint64_t file_bytes = 0;
};

// Writes the Q8 checkpoint of model directory `in_dir` to `out_dir`: every
// matmul weight quantized exactly as Model quantizes it at load
// (kernels::PackedMatrix::from_q8), so that loading `out_dir` gives a
// model bit-identical to loading `in_dir` with WeightFormat::kQ8; every
// other tensor as load_weights(in_dir) holds it; config.json and every
// other file of `in_dir` but the safetensors weights copied unchanged.
// `out_dir` must not exist or be an empty directory; the checkpoint is
// written into a temporary directory beside it and renamed into place, so
// a failure leaves no `out_dir` (or the empty one) behind. Throws
// InvalidArgument for an existing non-empty `out_dir` or an `in_dir` that
// is already a Q8 checkpoint, FormatError as load_weights and for a
// non-finite matmul weight (naming it), rwd::Error on IO failure.
QuantizeResult write_q8_checkpoint(const std::string& in_dir, const std::string& out_dir,
                                   const QuantizeProgress& progress = {});

}  // namespace rwd::runtime
