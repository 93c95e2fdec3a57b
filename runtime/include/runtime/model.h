// runtime/model.h: the reference hybrid decoder.
//
// A pre-norm decoder (RMSNorm, SwiGLU MLP, byte-level vocabulary) whose
// layers follow config.layer_types: full_attention and sliding_attention
// (GQA with RoPE), linear_attention (Gated DeltaNet as in Qwen3-Next) and
// conv (LFM2-style gated short convolution). All inference state lives in a
// rwd::Cache built by make_cache(); the model touches it only through the
// public cache API, like any other user.
//
// forward() is batch invariant: the logits of a token are bit-identical
// whether it is processed alone or inside a multi-token forward, because
// every kernel keeps one reduction order per row (runtime/kernels.h). That
// is what makes speculative decoding provably lossless here.
//
// Thread safety: a Model is immutable after construction and may be shared
// by threads, each with its own Cache. forward() uses OpenMP inside.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "rewind/cache.h"
#include "runtime/kernels.h"
#include "runtime/model_config.h"
#include "runtime/weights_io.h"

namespace rwd::runtime {

class Model {
 public:
  // Takes validated weights (ModelWeights::load / random check them).
  explicit Model(ModelWeights weights);
  // Loads DIR/config.json + DIR/model.safetensors. Throws FormatError /
  // rwd::Error as ModelWeights::load does.
  static Model load(const std::string& dir);

  Model(Model&&) noexcept = default;
  Model& operator=(Model&&) noexcept = default;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return weights_.config(); }
  std::int64_t vocab_size() const { return config().vocab_size; }
  // Parameters in the model file (tied embeddings counted once).
  std::int64_t parameter_count() const { return parameter_count_; }

  // An empty cache for one sequence (batch 1) with one layer per model layer.
  Cache make_cache() const;

  // Runs `tokens` (n >= 1, each in [0, vocab)) at positions
  // [L, L + n) where L = cache.get_seq_length(), appending them to the cache.
  // Writes logits to `logits`: [n, vocab] when all_logits, else only the
  // last row [vocab]. Throws InvalidArgument for an empty span or a token
  // outside the vocabulary (nothing appended then).
  // When `cache_seconds` is given, the time spent inside cache calls
  // (update, update_conv_state, recurrent slots, mask sizes) is added to it.
  void forward(std::span<const std::int32_t> tokens, Cache& cache, std::vector<float>& logits,
               bool all_logits = true, double* cache_seconds = nullptr) const;

  // Cache memory of one sequence, from the library's retention rules
  // (Layer::retention_bytes over make_cache()'s layers): what one more
  // token costs in full-attention layers (keys + values), the bounded state
  // (sliding windows, conv inputs, recurrent states) without recording, and
  // what activate_past_recording(R) adds to the bounded state. Throws
  // InvalidArgument for R < 0 or R > 2^40, CapacityError past 2^48 bytes.
  std::size_t kv_bytes_per_token() const;
  std::size_t fixed_state_bytes() const;
  std::size_t rollback_bytes(std::int64_t R) const;
  RetentionBytes retention_bytes(std::int64_t R) const;

 private:
  // Linear weights packed for kernels::matmul (shapes [out, in] as in
  // nn.Linear); the rest point into weights_ (f32). Unused ones empty / null.
  struct LayerWeights {
    enum class Kind { Attention, Sliding, GatedDeltaNet, ShortConv } kind = Kind::Attention;
    const float* input_norm = nullptr;  // [d]
    const float* post_norm = nullptr;   // [d]
    kernels::PackedMatrix gate;        // [ff, d]
    kernels::PackedMatrix up;          // [ff, d]
    kernels::PackedMatrix down;        // [d, ff]
    // attention
    kernels::PackedMatrix wq;  // [nh*hd, d]
    kernels::PackedMatrix wk;  // [nkv*hd, d]
    kernels::PackedMatrix wv;  // [nkv*hd, d]
    kernels::PackedMatrix wo;  // [d, nh*hd]
    // Gated DeltaNet
    kernels::PackedMatrix in_qkv;  // [conv_dim, d]
    kernels::PackedMatrix in_z;    // [lnv*lvd, d]
    kernels::PackedMatrix in_b;    // [lnv, d]
    kernels::PackedMatrix in_a;    // [lnv, d]
    const float* conv = nullptr;    // [channels, K] (conv_dim for GDN, d for short conv)
    const float* dt_bias = nullptr;  // [lnv]
    const float* a_log = nullptr;    // [lnv]
    const float* out_norm = nullptr;  // [lvd]
    kernels::PackedMatrix out;       // [d, lnv*lvd] or [d, d]
    // short conv
    kernels::PackedMatrix in_bcx;  // [3d, d]
  };
  void attention_block(int layer, const LayerWeights& w, const float* h, std::int64_t n,
                       std::int64_t pos0, const kernels::RopeTable& rope, Cache& cache, float* out,
                       double* cache_seconds) const;
  void gated_deltanet_block(int layer, const LayerWeights& w, const float* h, std::int64_t n,
                            Cache& cache, float* out, double* cache_seconds) const;
  void short_conv_block(int layer, const LayerWeights& w, const float* h, std::int64_t n,
                        Cache& cache, float* out, double* cache_seconds) const;

  // Config, embedding, norms, conv and gate parameters; the linear weights
  // are released after packing (their copies live in layers_ / lm_head_).
  ModelWeights weights_;
  std::int64_t parameter_count_ = 0;
  bool has_attention_ = false;  // any full / sliding attention layer (needs RoPE)
  std::vector<LayerWeights> layers_;
  const float* embed_ = nullptr;     // [vocab, d]
  const float* final_norm_ = nullptr;  // [d]
  kernels::PackedMatrix lm_head_;  // [vocab, d] (a copy of the embedding when tied)
};

// Byte-level tokenizer: a text becomes BOS followed by its bytes.
std::vector<std::int32_t> encode_prompt(const std::string& text, const ModelConfig& config);
// Bytes of the tokens that are bytes (< 256); special tokens are skipped.
std::string decode_tokens(std::span<const std::int32_t> tokens);

}  // namespace rwd::runtime
