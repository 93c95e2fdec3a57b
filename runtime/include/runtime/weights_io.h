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
#include <string>
#include <string_view>
#include <vector>

#include "rewind/dtype.h"
#include "rewind/tensor.h"
#include "runtime/model_config.h"

namespace rwd::runtime {

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
  // config does not use ("unexpected tensor"); rwd::Error when a file
  // cannot be read. Messages name the file.
  static ModelWeights load(const std::string& dir);

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
  // twice). Afterwards find(name) is nullptr and names() omits it.
  // Throws InvalidArgument naming the tensor when absent (nothing changes).
  void release(std::string_view name);
  // Names in expected_weights() order.
  const std::vector<std::string>& names() const { return names_; }
  std::size_t size() const { return names_.size(); }
  // Bytes held by all tensors.
  std::size_t bytes() const;

 private:
  ModelConfig config_;
  std::vector<std::string> names_;
  std::map<std::string, Tensor, std::less<>> tensors_;
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

}  // namespace rwd::runtime
